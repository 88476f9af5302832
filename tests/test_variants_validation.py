"""Bad variant keywords (window_size, softcap, alibi_slopes, sinks; issue 13) raise TypeError/ValueError naming the
argument, from every entry point, before anything is computed. CPU only: NumPy arrays, and a stand-in that looks
like a CuPy array to the checks."""
from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import reference, validation
from cupyflash.variants import Variant

F32 = np.float32
HQ = 4  # q (2, 4, 8, 16); k, v (2, 2, 8, 16)


def arr(shape, dtype=F32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def qkv(dtype=F32):
    return arr((2, HQ, 8, 16), dtype, 1), arr((2, 2, 8, 16), dtype, 2), arr((2, 2, 8, 16), dtype, 3)


def _boom(*args, **kwargs):
    raise AssertionError("computation started before the arguments were rejected")


@pytest.fixture
def nothing_runs(monkeypatch):
    """Every computation fails loudly, so a check that came too late shows up."""
    for name in ("attention_forward", "attention_backward", "_backward", "tiled_attention_forward",
                 "tiled_attention_backward"):  # fmt: skip
        monkeypatch.setattr(reference, name, _boom)


class FakeCupyArray:
    """Looks like a cupy.ndarray to ``validation.array_kind`` (no GPU needed)."""

    __module__ = "cupy._core.core"

    def __init__(self, x: np.ndarray):
        self.data, self.dtype, self.shape, self.ndim = x, x.dtype, x.shape, x.ndim
        self.strides, self.itemsize, self.size = x.strides, x.itemsize, x.size


def _strided(n, dtype=F32):
    return arr((2 * n,), dtype)[::2]


# ---------------------------------------------------------------------------- the bad keywords

# name: (keyword arguments, exception, message regex)
BAD = {
    # window_size
    "window-left-below-minus-1": ({"window_size": (-2, 0)}, ValueError, r"window_size left must be >= -1.*got -2"),
    "window-right-below-minus-1": ({"window_size": (3, -7)}, ValueError, r"window_size right must be >= -1.*got -7"),
    "window-bool": ({"window_size": (True, 2)}, TypeError, r"window_size left must be an int.*got True"),
    "window-np-bool": ({"window_size": (2, np.bool_(False))}, TypeError, r"window_size right must be an int"),
    "window-float": ({"window_size": (2.0, 3)}, TypeError, r"window_size left must be an int.*got 2\.0"),
    "window-float-right": ({"window_size": (2, 0.5)}, TypeError, r"window_size right must be an int.*got 0\.5"),
    "window-str-entry": ({"window_size": ("4", 4)}, TypeError, r"window_size left must be an int"),
    "window-int": ({"window_size": 4}, TypeError, r"window_size must be a pair \(left, right\).*got 4"),
    "window-one": ({"window_size": (4,)}, TypeError, r"window_size must be a pair .*got \(4,\)"),
    "window-three": ({"window_size": (1, 2, 3)}, TypeError, r"window_size must be a pair .*got \(1, 2, 3\)"),
    "window-empty": ({"window_size": ()}, TypeError, r"window_size must be a pair"),
    "window-str": ({"window_size": "ab"}, TypeError, r"window_size must be a pair"),
    "window-ndarray": ({"window_size": np.array([1, 2])}, TypeError, r"window_size must be a pair"),
    "window-set": ({"window_size": {1, 2}}, TypeError, r"window_size must be a pair"),
    # softcap
    "softcap-negative": ({"softcap": -1.0}, ValueError, r"softcap must be finite and >= 0.*got -1\.0"),
    "softcap-negative-int": ({"softcap": -30}, ValueError, r"softcap must be finite and >= 0"),
    "softcap-nan": ({"softcap": float("nan")}, ValueError, r"softcap must be finite and >= 0.*got nan"),
    "softcap-inf": ({"softcap": float("inf")}, ValueError, r"softcap must be finite and >= 0.*got inf"),
    "softcap-minus-inf": ({"softcap": -np.inf}, ValueError, r"softcap must be finite"),
    "softcap-np-nan": ({"softcap": np.float32("nan")}, ValueError, r"softcap must be finite"),
    "softcap-str": ({"softcap": "30"}, TypeError, r"softcap must be a real number; got str"),
    "softcap-none": ({"softcap": None}, TypeError, r"softcap must be a real number; got NoneType"),
    "softcap-bool": ({"softcap": True}, TypeError, r"softcap must be a real number; got bool"),
    "softcap-array": ({"softcap": np.array(30.0)}, TypeError, r"softcap must be a real number; got ndarray"),
    "softcap-complex": ({"softcap": 30j}, TypeError, r"softcap must be a real number; got complex"),
    # alibi_slopes
    "alibi-short": ({"alibi_slopes": arr((HQ - 1,))}, ValueError,
                    r"alibi_slopes must have shape \(4,\) or \(2, 4\) \(Hq = 4\); got \(3,\)"),
    "alibi-hk": ({"alibi_slopes": arr((2,))}, ValueError, r"alibi_slopes must have shape .*got \(2,\)"),
    "alibi-column": ({"alibi_slopes": arr((HQ, 1))}, ValueError, r"alibi_slopes must have shape .*got \(4, 1\)"),
    "alibi-wrong-batch": ({"alibi_slopes": arr((3, HQ))}, ValueError, r"alibi_slopes must have shape .*got \(3, 4\)"),
    "alibi-extra-dim": ({"alibi_slopes": arr((1, 2, HQ))}, ValueError, r"alibi_slopes must have shape"),
    "alibi-scalar": ({"alibi_slopes": np.float32(0.5)}, TypeError, r"alibi_slopes must be a numpy\.ndarray"),
    "alibi-0d": ({"alibi_slopes": arr(())}, ValueError, r"alibi_slopes must have shape .*got \(\)"),
    "alibi-float64": ({"alibi_slopes": arr((HQ,), np.float64)}, TypeError,
                      r"alibi_slopes\.dtype must be float32; got float64"),
    "alibi-float16": ({"alibi_slopes": arr((HQ,), np.float16)}, TypeError, r"alibi_slopes\.dtype must be float32"),
    "alibi-int": ({"alibi_slopes": np.arange(HQ)}, TypeError, r"alibi_slopes\.dtype must be float32"),
    "alibi-list": ({"alibi_slopes": [0.5] * HQ}, TypeError,
                   r"alibi_slopes must be a numpy\.ndarray or cupy\.ndarray, got list"),
    "alibi-cupy-like": ({"alibi_slopes": FakeCupyArray(arr((HQ,)))}, TypeError,
                        r"alibi_slopes must be a numpy array like q .*got a cupy array"),
    "alibi-strided": ({"alibi_slopes": _strided(HQ)}, ValueError, r"alibi_slopes must be contiguous"),
    "alibi-transposed": ({"alibi_slopes": arr((HQ, 2)).T}, ValueError, r"alibi_slopes must be contiguous"),
    "alibi-padded-rows": ({"alibi_slopes": arr((2, HQ + 3))[:, :HQ]}, ValueError, r"alibi_slopes must be contiguous"),
    # sinks
    "sinks-short": ({"sinks": arr((HQ - 1,))}, ValueError, r"sinks must have shape \(4,\) \(Hq = 4\); got \(3,\)"),
    "sinks-batched": ({"sinks": arr((2, HQ))}, ValueError, r"sinks must have shape \(4,\) \(Hq = 4\); got \(2, 4\)"),
    "sinks-hk": ({"sinks": arr((2,))}, ValueError, r"sinks must have shape"),
    "sinks-float64": ({"sinks": arr((HQ,), np.float64)}, TypeError, r"sinks\.dtype must be float32; got float64"),
    "sinks-float16": ({"sinks": arr((HQ,), np.float16)}, TypeError, r"sinks\.dtype must be float32; got float16"),
    "sinks-int": ({"sinks": np.zeros(HQ, np.int32)}, TypeError, r"sinks\.dtype must be float32; got int32"),
    "sinks-list": ({"sinks": [0.0] * HQ}, TypeError, r"sinks must be a numpy\.ndarray or cupy\.ndarray, got list"),
    "sinks-float": ({"sinks": 1.0}, TypeError, r"sinks must be a numpy\.ndarray or cupy\.ndarray, got float"),
    "sinks-cupy-like": ({"sinks": FakeCupyArray(arr((HQ,)))}, TypeError,
                        r"sinks must be a numpy array like q .*got a cupy array"),
    "sinks-strided": ({"sinks": _strided(HQ)}, ValueError, r"sinks must be contiguous"),
}  # fmt: skip


def test_check_attention_rejects_every_case():
    """The table is exercised directly on the checks too (and each case really is bad)."""
    q, k, v = qkv()
    for name, (kwargs, exc, msg) in BAD.items():
        with pytest.raises(exc, match=msg):
            validation.check_attention(q, k, v, **kwargs)


def _forward_entry_points():
    return {
        "attention_forward": cupyflash.attention_forward,
        "attention": cupyflash.attention,
        "attention_vjp": cupyflash.attention_vjp,
        "attention_forward-portable": lambda q, k, v, **kw: cupyflash.attention_forward(q, k, v, kernel="portable",
                                                                                        **kw),
        "attention_forward-causal": lambda q, k, v, **kw: cupyflash.attention_forward(q, k, v, True, 0.5, **kw),
    }  # fmt: skip


@pytest.mark.parametrize("entry", list(_forward_entry_points()))
@pytest.mark.parametrize("case", list(BAD))
def test_public_forward_rejects(nothing_runs, entry, case):
    kwargs, exc, msg = BAD[case]
    with pytest.raises(exc, match=msg):
        _forward_entry_points()[entry](*qkv(), **kwargs)


def _backward_args():
    q, k, v = qkv()
    return (arr(q.shape, seed=4), q, k, v, arr(q.shape, seed=5), arr(q.shape[:-1], seed=6))


@pytest.mark.parametrize("case", list(BAD))
def test_public_backward_rejects(nothing_runs, case):
    kwargs, exc, msg = BAD[case]
    with pytest.raises(exc, match=msg):
        cupyflash.attention_backward(*_backward_args(), **kwargs)


REFERENCE_ENTRIES = {
    "attention_forward": lambda q, k, v, **kw: reference.attention_forward(q, k, v, **kw),
    "attention": lambda q, k, v, **kw: reference.attention(q, k, v, **kw),
    "attention_vjp": lambda q, k, v, **kw: reference.attention_vjp(q, k, v, **kw),
    "tiled_attention_forward": lambda q, k, v, **kw: reference.tiled_attention_forward(q, k, v, **kw),
    "attention_backward": lambda q, k, v, **kw: reference.attention_backward(q, q, k, v, q, q[..., 0], **kw),
    "tiled_attention_backward": lambda q, k, v, **kw: reference.tiled_attention_backward(q, q, k, v, q, q[..., 0],
                                                                                         **kw),
}  # fmt: skip


@pytest.mark.parametrize("entry", list(REFERENCE_ENTRIES))
@pytest.mark.parametrize("case", list(BAD))
def test_reference_rejects(entry, case):
    """The float64 reference takes float64 q, k, v, but its variant arrays are still float32 only."""
    kwargs, exc, msg = BAD[case]
    q, k, v = qkv(np.float64)
    with pytest.raises(exc, match=msg):
        REFERENCE_ENTRIES[entry](q, k, v, **kwargs)


def test_numpy_head_vector_with_cupy_q_is_a_type_error():
    """alibi_slopes and sinks must come from q's array library (no implicit copies)."""
    q, k, v = (FakeCupyArray(x) for x in qkv())
    p = validation.check_attention(q, k, v, window_size=(2, 2))  # the checks run on the stand-in
    assert p.xp == "cupy"
    for name in ("alibi_slopes", "sinks"):
        with pytest.raises(TypeError, match=rf"{name} must be a cupy array like q .*got a numpy array"):
            validation.check_attention(q, k, v, **{name: arr((HQ,))})
        validation.check_attention(q, k, v, **{name: FakeCupyArray(arr((HQ,)))})  # the same library passes


def test_nothing_runs_fixture_is_armed(nothing_runs):
    """Good variant arguments do reach the computation, so the rejections above happened before it."""
    good = {"window_size": (2, -1), "softcap": 30.0, "alibi_slopes": arr((2, HQ)), "sinks": arr((HQ,))}
    with pytest.raises(AssertionError, match="computation started"):
        cupyflash.attention_forward(*qkv(), **good)
    with pytest.raises(AssertionError, match="computation started"):
        cupyflash.attention_backward(*_backward_args(), **good)


# ---------------------------------------------------------------------------- what passes, and its normal form


@pytest.mark.parametrize(
    "window_size,causal,expect",
    [
        (None, False, Variant()),
        (None, True, Variant(causal=True)),
        ((-1, -1), False, Variant()),
        ((None, None), False, Variant()),
        ((-1, -1), True, Variant(causal=True)),
        ((-1, 7), True, Variant(causal=True)),  # causal: right = 0
        ((3, 7), True, Variant(window=(3, 0))),
        ((-1, 0), False, Variant(window=(-1, 0))),
        ([2, 3], False, Variant(window=(2, 3))),
        ((np.int64(2), np.int32(0)), False, Variant(window=(2, 0))),
        ((0, 0), False, Variant(window=(0, 0))),
        ((None, 4), False, Variant(window=(-1, 4))),
        ((10**9, 10**9), False, Variant(window=(10**9, 10**9))),
    ],
)
def test_window_normal_form(window_size, causal, expect):
    p = validation.check_attention(*qkv(), causal=causal, window_size=window_size)
    assert p.variant == expect
    assert all(type(w) is int for w in p.variant.window or ())


@pytest.mark.parametrize("softcap,expect", [(0, 0.0), (0.0, 0.0), (30, 30.0), (np.float32(50.0), 50.0),
                                            (np.int64(7), 7.0), (1e-3, 1e-3)])  # fmt: skip
def test_softcap_accepted(softcap, expect):
    p = validation.check_attention(*qkv(), softcap=softcap)
    assert p.variant.softcap == expect and type(p.variant.softcap) is float


def test_head_vectors_accepted():
    q, k, v = qkv()
    p = validation.check_attention(q, k, v, alibi_slopes=arr((HQ,)), sinks=arr((HQ,)))
    assert p.variant.alibi and p.variant.sinks
    p = validation.check_attention(q, k, v, alibi_slopes=arr((2, HQ)))  # (*batch, Hq)
    assert p.variant.alibi and not p.variant.sinks
    # a read-only or sliced-but-contiguous vector is fine
    ro = arr((HQ,))
    ro.setflags(write=False)
    validation.check_attention(q, k, v, sinks=ro, alibi_slopes=arr((3, HQ))[1])
    # two batch dims: (*batch, Hq)
    q2, k2, v2 = arr((2, 3, HQ, 5, 8)), arr((2, 3, 1, 6, 8)), arr((2, 3, 1, 6, 8))
    validation.check_attention(q2, k2, v2, alibi_slopes=arr((2, 3, HQ)))
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(4,\) or \(2, 3, 4\)"):
        validation.check_attention(q2, k2, v2, alibi_slopes=arr((2, HQ)))
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(4,\) or \(2, 3, 4\)"):
        validation.check_attention(q2, k2, v2, alibi_slopes=arr((6, HQ)))
    # no batch dims: only (Hq,)
    q3, k3, v3 = arr((HQ, 5, 8)), arr((2, 6, 8)), arr((2, 6, 8))
    validation.check_attention(q3, k3, v3, alibi_slopes=arr((HQ,)))
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(4,\) \(Hq = 4\); got \(1, 4\)"):
        validation.check_attention(q3, k3, v3, alibi_slopes=arr((1, HQ)))


def test_backward_checks_its_usual_arguments_with_variants(nothing_runs):
    """The variant keywords do not hide the backward's own checks."""
    do, q, k, v, o, lse = _backward_args()
    good = {"window_size": (1, 1), "sinks": arr((HQ,))}
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 4, 8\)"):
        cupyflash.attention_backward(do, q, k, v, o, lse[..., :7], **good)
    with pytest.raises(TypeError, match=r"lse\.dtype must be float32; got float64"):
        cupyflash.attention_backward(do, q, k, v, o, lse.astype(np.float64), **good)


def test_public_api_rejects_variants_on_float64_only_for_q():
    """float64 inputs stay the reference's: the public API rejects them whatever the variant."""
    with pytest.raises(TypeError, match=r"q\.dtype must be one of float32, float16, bfloat16; got float64"):
        cupyflash.attention_forward(*qkv(np.float64), sinks=arr((HQ,)))


@pytest.mark.parametrize("variant, score", [
    (Variant(), "PlainScore"),
    (Variant(causal=True, alibi=True), "AlibiScore"),  # ALiBi alone: kernels without softcap code
    (Variant(window=(8, 8), alibi=True), "AlibiScore"),
    (Variant(softcap=30.0), "SoftcapScore"),  # softcap alone: kernels without ALiBi's distances
    (Variant(causal=True, softcap=30.0, alibi=True), "ModScore"),
    (Variant(alibi=True, bias="float"), "ArrayScore<cupyflash::ModScore, float, false, true>"),  # arrays: ModScore
])  # fmt: skip
def test_score_policy_names(variant, score):
    """The C++ score policy a variant's kernels are instantiated with (attention_policy.cuh)."""
    assert variant.score_name == score
    assert f"cupyflash::{score}" in variant.cpp_policy
