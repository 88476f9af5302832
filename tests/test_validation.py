"""Bad arguments (see cupyflash.attention_forward) raise ValueError/TypeError naming the argument and what was
seen, from every entry point, before any computation starts."""
from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import reference, validation

F32 = np.float32


def arr(shape, dtype=F32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def qkv(q_shape=(2, 4, 8, 16), kv_shape=(2, 2, 8, 16), dtype=F32):
    return arr(q_shape, dtype, 1), arr(kv_shape, dtype, 2), arr(kv_shape, dtype, 3)


def _boom(*args, **kwargs):
    raise AssertionError("computation started before the arguments were rejected")


@pytest.fixture
def nothing_runs(monkeypatch):
    """Make every computation fail loudly, so a check that came too late shows up."""
    for name in ("attention_forward", "attention_backward", "_backward", "tiled_attention_forward",
                 "tiled_attention_backward"):
        monkeypatch.setattr(reference, name, _boom)


class FakeCupyArray:
    """Looks like a cupy.ndarray to ``validation.array_kind`` (no GPU needed)."""

    __module__ = "cupy._core.core"

    def __init__(self, x: np.ndarray):
        self.data, self.dtype, self.shape, self.ndim = x, x.dtype, x.shape, x.ndim


# ---------------------------------------------------------------------------- forward checks

# (q, k, v, kwargs, exception, message regex)
FORWARD_BAD = {
    "q-ndim2": (arr((8, 16)), arr((8, 16)), arr((8, 16)), {}, ValueError,
                r"q must have shape \(\.\.\., H, N, D\) with at least 3 dims; got \(8, 16\)"),
    "k-ndim2": (arr((1, 8, 16)), arr((8, 16)), arr((8, 16)), {}, ValueError,
                r"k must have shape .* at least 3 dims; got \(8, 16\)"),
    "kv-shapes": (arr((2, 4, 8, 16)), arr((2, 2, 8, 16)), arr((2, 2, 9, 16)), {}, ValueError,
                  r"k and v must have the same shape; got k \(2, 2, 8, 16\), v \(2, 2, 9, 16\)"),
    "batch-dims": (arr((2, 4, 8, 16)), arr((3, 2, 8, 16)), arr((3, 2, 8, 16)), {}, ValueError,
                   r"batch dims of q and k must match; got q \(2, 4, 8, 16\) \(batch \(2,\)\), k \(3, 2, 8, 16\)"),
    "batch-rank": (arr((2, 4, 8, 16)), arr((2, 8, 16)), arr((2, 8, 16)), {}, ValueError,
                   r"batch dims of q and k must match"),
    "head-dims": (arr((2, 4, 8, 16)), arr((2, 2, 8, 32)), arr((2, 2, 8, 32)), {}, ValueError,
                  r"head dim of k must equal that of q; got q \(2, 4, 8, 16\), k \(2, 2, 8, 32\)"),
    "d-too-big": (arr((1, 2, 4, 264)), arr((1, 2, 4, 264)), arr((1, 2, 4, 264)), {}, ValueError,
                  r"head dim D must be in 1\.\.256; got D=264 \(q \(1, 2, 4, 264\)\)"),
    "d-zero": (arr((1, 2, 4, 0)), arr((1, 2, 4, 0)), arr((1, 2, 4, 0)), {}, ValueError,
               r"head dim D must be in 1\.\.256; got D=0"),
    "heads-not-divisible": (arr((1, 3, 4, 16)), arr((1, 2, 4, 16)), arr((1, 2, 4, 16)), {}, ValueError,
                            r"query heads must be a positive multiple of key/value heads; got Hq=3, Hk=2"),
    "kv-heads-zero": (arr((1, 2, 4, 16)), arr((1, 0, 4, 16)), arr((1, 0, 4, 16)), {}, ValueError,
                      r"got Hq=2, Hk=0"),
    "float64": (*qkv(dtype=np.float64), {}, TypeError,
                r"q\.dtype must be one of float32, float16, bfloat16; got float64"),
    "int32": (*qkv(dtype=np.int32), {}, TypeError, r"q\.dtype must be one of .*; got int32"),
    "k-dtype": (arr((2, 4, 8, 16)), arr((2, 2, 8, 16), np.float16), arr((2, 2, 8, 16)), {}, TypeError,
                r"k\.dtype must equal q\.dtype \(float32\); got float16"),
    "v-dtype": (arr((2, 4, 8, 16)), arr((2, 2, 8, 16)), arr((2, 2, 8, 16), np.float16), {}, TypeError,
                r"v\.dtype must equal q\.dtype \(float32\); got float16"),
    "q-list": (arr((1, 2, 4, 8)).tolist(), arr((1, 2, 4, 8)), arr((1, 2, 4, 8)), {}, TypeError,
               r"q must be a numpy\.ndarray or cupy\.ndarray, got list"),
    "v-scalar": (arr((1, 2, 4, 8)), arr((1, 2, 4, 8)), 3.0, {}, TypeError,
                 r"v must be a numpy\.ndarray or cupy\.ndarray, got float"),
    "scale-nan": (*qkv(), {"scale": float("nan")}, ValueError, r"scale must be finite; got nan"),
    "scale-inf": (*qkv(), {"scale": np.inf}, ValueError, r"scale must be finite; got inf"),
    "scale-str": (*qkv(), {"scale": "0.1"}, TypeError, r"scale must be a real number or None; got str"),
    "scale-bool": (*qkv(), {"scale": True}, TypeError, r"scale must be a real number or None; got bool"),
    "scale-array": (*qkv(), {"scale": np.ones(2)}, TypeError, r"scale must be a real number or None; got ndarray"),
    "causal-int": (*qkv(), {"causal": 1}, TypeError, r"causal must be a bool; got int"),
    "causal-str": (*qkv(), {"causal": "yes"}, TypeError, r"causal must be a bool; got str"),
    "causal-none": (*qkv(), {"causal": None}, TypeError, r"causal must be a bool; got NoneType"),
}  # fmt: skip


def _forward_entry_points():
    def vjp(q, k, v, **kw):
        return cupyflash.attention_vjp(q, k, v, **kw)

    return {
        "attention_forward": cupyflash.attention_forward,
        "attention": cupyflash.attention,
        "attention_vjp": vjp,
        "attention_forward-kernel": lambda q, k, v, **kw: cupyflash.attention_forward(q, k, v, kernel="portable", **kw),
        "attention-positional": lambda q, k, v, **kw: cupyflash.attention(
            q, k, v, kw.get("causal", False), kw.get("scale")
        ),
    }


@pytest.mark.parametrize("entry", list(_forward_entry_points()))
@pytest.mark.parametrize("case", list(FORWARD_BAD))
def test_public_forward_rejects(nothing_runs, entry, case):
    q, k, v, kwargs, exc, msg = FORWARD_BAD[case]
    with pytest.raises(exc, match=msg):
        _forward_entry_points()[entry](q, k, v, **kwargs)


REFERENCE_FORWARD = {
    "attention_forward": reference.attention_forward,
    "attention": reference.attention,
    "attention_vjp": reference.attention_vjp,
    "tiled_attention_forward": reference.tiled_attention_forward,
}


@pytest.mark.parametrize("entry", list(REFERENCE_FORWARD))
@pytest.mark.parametrize("case", [c for c in FORWARD_BAD if c != "float64"])
def test_reference_forward_rejects(entry, case):
    q, k, v, kwargs, exc, msg = FORWARD_BAD[case]
    if case == "int32":
        msg = r"q\.dtype must be one of float32, float16, bfloat16, float64; got int32"
    with pytest.raises(exc, match=msg):
        REFERENCE_FORWARD[entry](q, k, v, **kwargs)


def test_reference_accepts_float64_but_public_api_does_not():
    q, k, v = qkv(dtype=np.float64)
    o, lse = reference.attention_forward(q, k, v)
    assert o.dtype == np.float64 and np.isfinite(o).all()
    with pytest.raises(TypeError, match="got float64"):
        cupyflash.attention_forward(q, k, v)
    with pytest.raises(TypeError, match="got float64"):
        cupyflash.attention_backward(q, q, k, v, o, lse.astype(F32))


def test_good_arguments_pass():
    """The checks accept what §1 allows: GQA, MQA, D = 1 and 256, numpy scalars, numpy bools."""
    p = validation.check_attention(*qkv(), causal=np.bool_(True), scale=np.float32(0.5))
    assert (p.batch, p.hq, p.hk, p.nq, p.nk, p.d, p.group) == ((2,), 4, 2, 8, 8, 16, 2)
    assert p.causal is True and p.scale == 0.5 and p.xp == "numpy"
    p = validation.check_attention(*qkv((3, 8, 5, 256), (3, 1, 7, 256)), scale=2)
    assert p.group == 8 and p.scale == 2.0
    p = validation.check_attention(*qkv((4, 5, 1), (4, 6, 1)))
    assert p.d == 1 and p.scale == 1.0


def test_mixing_numpy_and_cupy_is_a_type_error(nothing_runs):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"all be NumPy or all be CuPy .*q: numpy, k: cupy, v: numpy"):
        cupyflash.attention_forward(q, FakeCupyArray(k), v)
    o, lse = np.zeros_like(q), np.zeros(q.shape[:-1], F32)
    with pytest.raises(TypeError, match=r"lse: cupy"):
        cupyflash.attention_backward(q, q, k, v, o, FakeCupyArray(lse))


@pytest.mark.parametrize("entry", ["attention_forward", "attention", "attention_backward", "attention_vjp"])
def test_unknown_kernel_is_a_value_error(nothing_runs, entry):
    q, k, v = qkv()
    o, lse = np.zeros_like(q), np.zeros(q.shape[:-1], F32)
    args = (q, q, k, v, o, lse) if entry == "attention_backward" else (q, k, v)
    with pytest.raises(ValueError, match=r"kernel must be one of \('auto', 'wgmma', 'mma', 'portable'\); got 'bogus'"):
        getattr(cupyflash, entry)(*args, kernel="bogus")


# ---------------------------------------------------------------------------- backward checks


def _backward_args():
    q, k, v = qkv()
    return {"do": arr(q.shape, seed=4), "q": q, "k": k, "v": v, "o": arr(q.shape, seed=5),
            "lse": arr(q.shape[:-1], seed=6)}  # fmt: skip


# (argument, replacement, exception, message regex)
BACKWARD_BAD = {
    "do-shape": ("do", arr((2, 4, 8, 8)), ValueError,
                 r"do must have q's shape \(2, 4, 8, 16\); got \(2, 4, 8, 8\)"),
    "do-dtype": ("do", arr((2, 4, 8, 16), np.float16), TypeError,
                 r"do\.dtype must equal q\.dtype \(float32\); got float16"),
    "do-list": ("do", arr((2, 4, 8, 16)).tolist(), TypeError,
                r"do must be a numpy\.ndarray or cupy\.ndarray, got list"),
    "o-shape": ("o", arr((2, 4, 7, 16)), ValueError,
                r"o must have q's shape \(2, 4, 8, 16\); got \(2, 4, 7, 16\)"),
    "o-dtype": ("o", arr((2, 4, 8, 16), np.float16), TypeError,
                r"o\.dtype must equal q\.dtype \(float32\); got float16"),
    "lse-dtype16": ("lse", arr((2, 4, 8), np.float16), TypeError, r"lse\.dtype must be float32; got float16"),
    "lse-shape": ("lse", arr((2, 4, 8, 1)), ValueError,
                  r"lse must have shape \(2, 4, 8\) \(q's shape without D\); got \(2, 4, 8, 1\)"),
    "lse-shape2": ("lse", arr((2, 4, 7)), ValueError, r"lse must have shape \(2, 4, 8\) .*; got \(2, 4, 7\)"),
    "q-heads": ("q", arr((2, 3, 8, 16)), ValueError, r"Hq=3, Hk=2"),
    "k-dtype": ("k", arr((2, 2, 8, 16), np.float16), TypeError, r"k\.dtype must equal q\.dtype"),
}  # fmt: skip


def _call_backward(fn, args, **kw):
    return fn(args["do"], args["q"], args["k"], args["v"], args["o"], args["lse"], **kw)


@pytest.mark.parametrize("case", list(BACKWARD_BAD))
def test_public_backward_rejects(nothing_runs, case):
    name, bad, exc, msg = BACKWARD_BAD[case]
    args = _backward_args()
    args[name] = bad
    with pytest.raises(exc, match=msg):
        _call_backward(cupyflash.attention_backward, args)


@pytest.mark.parametrize("case", list(BACKWARD_BAD))
@pytest.mark.parametrize("fn", [reference.attention_backward, reference.tiled_attention_backward],
                         ids=["plain", "tiled"])  # fmt: skip
def test_reference_backward_rejects(fn, case):
    name, bad, exc, msg = BACKWARD_BAD[case]
    args = _backward_args()
    args[name] = bad
    with pytest.raises(exc, match=msg):
        _call_backward(fn, args)


@pytest.mark.parametrize("kwargs,exc,msg", [
    ({"causal": 0}, TypeError, "causal must be a bool"),
    ({"scale": float("nan")}, ValueError, "scale must be finite"),
    ({"scale": "x"}, TypeError, "scale must be a real number"),
])  # fmt: skip
def test_backward_rejects_bad_causal_and_scale(nothing_runs, kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        _call_backward(cupyflash.attention_backward, _backward_args(), **kwargs)


def test_reference_backward_lse_may_be_float64_but_not_public():
    args = _backward_args()
    args["lse"] = args["lse"].astype(np.float64)
    grads = _call_backward(reference.attention_backward, args)
    assert all(np.isfinite(g).all() for g in grads)
    with pytest.raises(TypeError, match=r"lse\.dtype must be float32; got float64"):
        _call_backward(cupyflash.attention_backward, args)


def test_public_vjp_checks_do(monkeypatch):
    q, k, v = qkv()
    _, vjp = cupyflash.attention_vjp(q, k, v)
    monkeypatch.setattr(reference, "attention_backward", _boom)  # only the checks may run now
    with pytest.raises(ValueError, match=r"do must have q's shape \(2, 4, 8, 16\); got \(2, 4, 8, 15\)"):
        vjp(arr((2, 4, 8, 15)))
    with pytest.raises(TypeError, match=r"do\.dtype must equal q\.dtype \(float32\); got float16"):
        vjp(arr(q.shape, np.float16))


def test_nothing_runs_fixture_is_armed(nothing_runs):
    """Good arguments do reach the computation, so the rejections above happened before it."""
    q, k, v = qkv()
    with pytest.raises(AssertionError, match="computation started"):
        cupyflash.attention_forward(q, k, v)
    o, lse = np.zeros_like(q), np.zeros(q.shape[:-1], F32)
    with pytest.raises(AssertionError, match="computation started"):
        cupyflash.attention_backward(q, q, k, v, o, lse)


def test_public_backward_rejects_float64_o_that_the_reference_takes():
    args = _backward_args()
    args["o"] = args["o"].astype(np.float64)
    with pytest.raises(TypeError, match=r"o\.dtype must equal q\.dtype \(float32\); got float64"):
        cupyflash.attention_backward(**args)
    dq, dk, dv = reference.attention_backward(**args)  # exact o and dO are what the reference wants
    assert dq.dtype == np.float64 and np.all(np.isfinite(dq))
