"""The short host paths of plain calls (issue 12), on the CPU: CuPy's device calls faked (benchmarks/dev_host_fake.py's
``FakeDevice``; CuPy arrays over a fake address range), so these run without a GPU and launch nothing.

What they pin down: a plain call of a cached signature takes the short path (``cuda_backend.plain_forward`` /
``plain_backward``, ``kernels.linear.plain_forward``) and writes the same parameter bytes as the full path; anything
outside the cached signature (a keyword off its default, another type of an equal value, another stride, alignment
or device) misses it and runs the checks; bad input raises before anything is launched, on a first call and on
every later one; and the pointer writers write what ``Params.pointer_values`` / ``write_pointers`` write.
"""
from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.dev_host_fake import FakeDevice  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import cuda_backend  # noqa: E402
from cupyflash.kernels import family, linear  # noqa: E402
from cupyflash.kernels.params import PARAMS, POINTERS, Params, PointerPacker  # noqa: E402

BF16 = np.dtype("bfloat16")
SHAPE = (1, 8, 128, 64)
NBYTES = 8 * 128 * 64 * 2
SLOT = {n: 8 * i for i, n in enumerate(POINTERS)}


class Device(FakeDevice):
    """FakeDevice that keeps the bytes of each launch's first parameter (AttentionParams, or the whole positional
    argument buffer of a linear kernel: ``nbytes``)."""

    def __init__(self, nbytes: int = PARAMS.itemsize) -> None:
        super().__init__()
        self.nbytes = nbytes
        self.params: list[bytes] = []

    def launch(self, fn, gx, gy, gz, bx, by, bz, shared, stream, argv, extra) -> None:
        super().launch()
        first = ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p))[0]
        self.params.append(ctypes.string_at(first, self.nbytes))


@pytest.fixture
def dev():
    cuda_backend._forward_cache.clear()
    cuda_backend._backward_cache.clear()
    linear._plain_forwards.clear()
    with Device() as d:
        yield d
    cuda_backend._forward_cache.clear()
    cuda_backend._backward_cache.clear()
    linear._plain_forwards.clear()


@pytest.fixture
def spy(monkeypatch):
    """Counts of the full paths' entries: cuda_backend.forward/backward and the checks."""
    counts = {"forward": 0, "backward": 0, "check_attention": 0, "check_linear": 0}

    def counting(owner, name, key):
        real = getattr(owner, name)

        def wrapped(*a, **kw):
            counts[key] += 1
            return real(*a, **kw)

        monkeypatch.setattr(owner, name, wrapped)

    from cupyflash import api, linear_api

    counting(cuda_backend, "forward", "forward")
    counting(cuda_backend, "backward", "backward")
    counting(cuda_backend, "check_attention", "check_attention")
    counting(linear_api, "check_linear", "check_linear")
    assert api.cuda_backend is cuda_backend
    return counts


def arrays(dev, n: int = 5, shape=SHAPE, dtype=BF16, at: int = 0):
    step = -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 256) * 256
    return [dev.array(shape, dtype, at + i * step) for i in range(n)]


def pointer(params: bytes, name: str) -> int:
    return int.from_bytes(params[SLOT[name]:SLOT[name] + 8], "little")


# ---------------------------------------------------------------------------- attention forward


def test_plain_forward_takes_the_short_path_and_writes_the_full_paths_bytes(dev, spy):
    q, k, v = arrays(dev, 3)
    o1, lse1 = cupyflash.attention_forward(q, k, v)
    assert spy == {"forward": 1, "backward": 0, "check_attention": 1, "check_linear": 0}
    o2, lse2 = cupyflash.attention_forward(q, k, v)
    assert spy["forward"] == 1 and spy["check_attention"] == 1  # the short path
    assert dev.launches == 2
    full, short = dev.params
    for name, x in (("q", q), ("k", k), ("v", v), ("o", o2), ("lse", lse2)):
        assert pointer(short, name) == x.data.ptr
    assert (o1.shape, o1.dtype, lse1.shape, lse1.dtype) == (o2.shape, o2.dtype, lse2.shape, lse2.dtype)
    # Apart from the outputs' pointers the bytes are the full path's.
    patched = bytearray(short)
    for name, x in (("o", o1), ("lse", lse1)):
        patched[SLOT[name]:SLOT[name] + 8] = x.data.ptr.to_bytes(8, "little")
    assert bytes(patched) == full
    # Explicit defaults are plain calls too.
    cupyflash.attention_forward(q, k, v, False, None, softcap=0.0, dropout_p=0.0, kernel="auto")
    assert spy["forward"] == 1


@pytest.mark.parametrize("keyword", [
    {"window_size": (-1, -1)}, {"softcap": 0}, {"dropout_p": 0}, {"kernel": "wgmma"}, {"dropout_seed": 3},
    {"sinks": "cupy"}, {"aux": {}},
])  # fmt: skip
def test_a_keyword_off_its_default_takes_the_full_path(dev, spy, keyword):
    q, k, v = arrays(dev, 3)
    cupyflash.attention_forward(q, k, v)
    if keyword.get("sinks") == "cupy":
        keyword = {"sinks": dev.array((8,), np.float32, 1 << 24)}
    before = spy["forward"]
    cupyflash.attention_forward(q, k, v, **keyword)
    cupyflash.attention_forward(q, k, v, **keyword)
    assert spy["forward"] == before + 2


@pytest.mark.parametrize("cached, other, error", [
    ({"causal": True}, {"causal": 1}, "causal must be a bool"),
    ({"scale": 1}, {"scale": True}, "scale must be a real number"),
    ({"scale": 0.125}, {"scale": "0.125"}, "scale must be a real number"),
])  # fmt: skip
def test_an_equal_value_of_another_type_misses_and_is_checked(dev, spy, cached, other, error):
    """True == 1 == 1.0: a cached signature with one must not answer for the other (the checks tell them apart)."""
    q, k, v = arrays(dev, 3)
    cupyflash.attention_forward(q, k, v, **cached)
    cupyflash.attention_forward(q, k, v, **cached)
    launches = dev.launches
    for _ in range(2):
        with pytest.raises(TypeError, match=error):
            cupyflash.attention_forward(q, k, v, **other)
    assert dev.launches == launches


def test_scale_int_and_float_are_different_entries(dev, spy):
    q, k, v = arrays(dev, 3)
    cupyflash.attention_forward(q, k, v, scale=1)
    cupyflash.attention_forward(q, k, v, scale=1.0)
    assert spy["check_attention"] == 2
    cupyflash.attention_forward(q, k, v, scale=1.0)
    cupyflash.attention_forward(q, k, v, scale=1)
    assert spy["check_attention"] == 2


def test_another_stride_alignment_or_device_misses(dev, spy):
    q, k, v = arrays(dev, 3)
    cupyflash.attention_forward(q, k, v)
    n = spy["check_attention"]
    # A (B, N, H, D) array seen as (B, H, N, D): same shape, other strides.
    qt = dev.array(SHAPE, BF16, 0, strides=(NBYTES, 128, 8 * 128, 2))
    cupyflash.attention_forward(qt, k, v)
    assert spy["check_attention"] == n + 1
    # A base pointer 8 bytes off 16-byte alignment.
    q8 = dev.array(SHAPE, BF16, 8 * NBYTES + 8)
    cupyflash.attention_forward(q8, k, v)
    assert spy["check_attention"] == n + 2
    dev.device = 1
    cupyflash.attention_forward(q, k, v)
    assert spy["check_attention"] == n + 3
    dev.device = 0
    cupyflash.attention_forward(q, k, v)
    assert spy["check_attention"] == n + 3


def test_clearing_the_cache_clears_the_short_path(dev, spy):
    q, k, v = arrays(dev, 3)
    cupyflash.attention_forward(q, k, v)
    cuda_backend._forward_cache.clear()  # how benchmarks force a new plan
    cupyflash.attention_forward(q, k, v)
    assert spy["check_attention"] == 2


def test_bad_input_raises_before_any_launch_every_time(dev, spy):
    q, k, v = arrays(dev, 3)
    k16 = dev.array(SHAPE, np.float16, 3 * NBYTES)
    for _ in range(2):
        with pytest.raises(TypeError, match="k.dtype must equal q.dtype"):
            cupyflash.attention_forward(q, k16, v)
        with pytest.raises(TypeError, match="all be NumPy or all be CuPy"):
            cupyflash.attention_forward(q, np.zeros(SHAPE, BF16), v)
        with pytest.raises(ValueError, match="dropout_seed is required"):
            cupyflash.attention_forward(q, k, v, dropout_p=0.1)
    assert dev.launches == 0
    cupyflash.attention_forward(q, k, v)
    cupyflash.attention_forward(q, k, v)  # cached now; the bad calls still raise
    with pytest.raises(TypeError, match="k.dtype must equal q.dtype"):
        cupyflash.attention_forward(q, k16, v)
    assert dev.launches == 2


def test_dropout_seed_is_checked_and_written_per_call(dev):
    q, k, v = arrays(dev, 3)
    at = PARAMS.fields["dropout_seed"][1]
    for seed in (5, 7, 2**64 - 1):
        cupyflash.attention_forward(q, k, v, dropout_p=0.1, dropout_seed=seed)
        assert int.from_bytes(dev.params[-1][at:at + 8], "little") == seed
    launches = dev.launches
    for bad in (-1, 2**64, 1.0, True):
        with pytest.raises((TypeError, ValueError), match="dropout_seed"):
            cupyflash.attention_forward(q, k, v, dropout_p=0.1, dropout_seed=bad)
    assert dev.launches == launches


def test_numpy_arrays_still_take_the_numpy_backend(dev, spy):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 8, 16)).astype(BF16) for _ in range(3))
    o, lse = cupyflash.attention_forward(q, k, v)
    assert type(o) is np.ndarray and spy["forward"] == 0 and dev.launches == 0


@pytest.mark.parametrize("name", ["attention_forward", "attention_backward"])
def test_the_plain_path_is_the_api_defaults(dev, monkeypatch, name):
    """The API takes the short path only with every keyword at its default (a keyword added later and not tested
    there fails this), and those defaults are the rest of the key the full path stores plain entries for."""
    import inspect

    from cupyflash import api

    keywords = {n: p.default for n, p in inspect.signature(getattr(api, name)).parameters.items()
                if p.kind is p.KEYWORD_ONLY}  # fmt: skip
    assert keywords.pop("dropout_seed") is None and keywords.pop("kernel") == "auto"
    if name == "attention_forward":
        assert cuda_backend._forward_rest("auto", **keywords) == cuda_backend._PLAIN_FORWARD
    else:
        assert cuda_backend._backward_rest("auto", **keywords) == cuda_backend._PLAIN_BACKWARD
    short = []
    plain = "plain_forward" if name == "attention_forward" else "plain_backward"
    monkeypatch.setattr(cuda_backend, plain, lambda *a: short.append(a))
    q, k, v, o, do = arrays(dev, 5)
    lse = dev.array(SHAPE[:-1], np.float32, 5 * NBYTES)
    args = (q, k, v) if name == "attention_forward" else (do, q, k, v, o, lse)
    for keyword in [*keywords, "dropout_seed", "kernel"]:
        try:
            getattr(cupyflash, name)(*args, **{keyword: object()})
        except Exception:
            pass
    assert short == []
    getattr(cupyflash, name)(*args, **keywords)  # the stub answers None: the full path runs
    assert len(short) == 1


# ---------------------------------------------------------------------------- attention backward


def test_plain_backward_takes_the_short_path_and_writes_the_full_paths_bytes(dev, spy):
    q, k, v, o, do = arrays(dev, 5)
    lse = dev.array(SHAPE[:-1], np.float32, 5 * NBYTES)
    g1 = cupyflash.attention_backward(do, q, k, v, o, lse)
    g2 = cupyflash.attention_backward(do, q, k, v, o, lse, bias_grad=False, deterministic=False)
    assert spy["backward"] == 1 and len(g2) == 3
    full, short = dev.params
    prep = next(p for key, p in cuda_backend._backward_cache.items() if len(key) == 2)
    for name, x in (("dout", do), ("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse), ("dq", g2[0]),
                    ("dk", g2[1]), ("dv", g2[2])):  # fmt: skip
        assert pointer(short, name) == x.data.ptr
    patched = bytearray(short)
    for name, x in zip(("dq", "dk", "dv"), g1):
        patched[SLOT[name]:SLOT[name] + 8] = x.data.ptr.to_bytes(8, "little")
    if prep.scratch_at is not None:  # the scratch sits in the outputs' allocation, after them
        for s in prep.plan.scratch:
            at = dict((f, a) for f, a, _, _ in prep.plan.scratch_layout[1])[s.field]
            assert pointer(short, s.field) == g2[0].data.ptr + prep.scratch_at + at
            patched[SLOT[s.field]:SLOT[s.field] + 8] = (g1[0].data.ptr + prep.scratch_at + at).to_bytes(8, "little")
    assert bytes(patched) == full


def test_backward_keywords_off_their_defaults_take_the_full_path(dev, spy):
    q, k, v, o, do = arrays(dev, 5)
    lse = dev.array(SHAPE[:-1], np.float32, 5 * NBYTES)
    cupyflash.attention_backward(do, q, k, v, o, lse)
    cupyflash.attention_backward(do, q, k, v, o, lse, deterministic=True)
    cupyflash.attention_backward(do, q, k, v, o, lse, deterministic=True)
    assert spy["backward"] == 3
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cupyflash.attention_backward(do, q, k, v, o, lse, deterministic=0)
    with pytest.raises(ValueError, match="bias_grad=True needs a bias"):
        cupyflash.attention_backward(do, q, k, v, o, lse, bias_grad=True)
    lse16 = dev.array(SHAPE[:-1], np.float16, 5 * NBYTES)
    with pytest.raises(TypeError, match="lse.dtype must be float32"):
        cupyflash.attention_backward(do, q, k, v, o, lse16)


# ---------------------------------------------------------------------------- linear attention


def linear_slots(params: bytes, ready) -> list[int]:
    codes = ready._struct.format.lstrip("@")
    return [int.from_bytes(params[at:at + 8], "little") for at, c in zip(ready.offsets, codes) if c == "P"]


def test_plain_linear_forward_repeats_the_recorded_launches(dev, spy):
    q, k, v = arrays(dev, 3)
    o1 = cupyflash.linear_attention_forward(q, k, v, causal=True)
    assert spy["check_linear"] == 1 and len(linear._plain_forwards) == 1
    o2 = cupyflash.linear_attention_forward(q, k, v, causal=True)
    assert spy["check_linear"] == 1 and dev.launches == 2
    (plain,) = linear._plain_forwards.values()
    (ready, slots), = plain.launches
    dev.nbytes = ready._struct.size
    a, b, c = arrays(dev, 3, at=1 << 24)
    o3 = cupyflash.linear_attention_forward(a, b, c, causal=True)
    ptrs = linear_slots(dev.params[-1], ready)
    assert [a.data.ptr, b.data.ptr, c.data.ptr, o3.data.ptr] == ptrs[:4]
    assert o1.shape == o2.shape == o3.shape and o3.dtype == BF16


def test_plain_linear_forward_tells_aliased_inputs_apart(dev):
    """A first call with q is k is v records through views, so a later call of the same signature with three
    arrays writes three pointers."""
    (x,) = arrays(dev, 1)
    cupyflash.linear_attention_forward(x, x, x, causal=True)
    (plain,) = linear._plain_forwards.values()
    (ready, _), = plain.launches
    dev.nbytes = ready._struct.size
    a, b, c = arrays(dev, 3, at=1 << 24)
    o = cupyflash.linear_attention_forward(a, b, c, causal=True)
    assert linear_slots(dev.params[-1], ready)[:4] == [a.data.ptr, b.data.ptr, c.data.ptr, o.data.ptr]


def test_linear_misses_and_checks(dev, spy):
    q, k, v = arrays(dev, 3)
    cupyflash.linear_attention_forward(q, k, v, causal=True)
    launches = dev.launches
    for _ in range(2):
        with pytest.raises(TypeError):
            cupyflash.linear_attention_forward(q, k, v, causal=1)
        with pytest.raises(TypeError):
            cupyflash.linear_attention_forward(q, k, v, causal=True, scale="1")
        with pytest.raises(TypeError):
            cupyflash.linear_attention_forward(q, dev.array(SHAPE, np.float16, 3 * NBYTES), v, causal=True)
    assert dev.launches == launches
    cupyflash.linear_attention_forward(q, k, v, causal=True, scale=1)  # another type of scale: its own entry
    cupyflash.linear_attention_forward(q, k, v, causal=True, scale=1)
    assert spy["check_linear"] == 1 + 6 + 1
    for _ in range(2):  # a decay is never a plain call: its values are checked every time
        with pytest.raises(ValueError, match="decay values"):
            cupyflash.linear_attention_forward(q, k, v, causal=True, decay=np.full(8, 1.5, np.float32))
    assert spy["check_linear"] == 1 + 6 + 1 + 2
    saved = linear.FUSED_DV
    linear.FUSED_DV = 32  # a tile override is part of the signature
    try:
        cupyflash.linear_attention_forward(q, k, v, causal=True)
    finally:
        linear.FUSED_DV = saved
    assert spy["check_linear"] == 1 + 6 + 1 + 2 + 1


def test_a_hooked_linear_launch_sees_every_call(dev, monkeypatch):
    """Tests and dev scripts that replace kernels.linear._launch see every launch: no short path then."""
    q, k, v = arrays(dev, 3)
    cupyflash.linear_attention_forward(q, k, v, causal=True)  # a plain entry, stored
    seen = []
    real = linear._launch
    monkeypatch.setattr(linear, "_launch", lambda plan, args: (seen.append(plan.name), real(plan, args)))
    cupyflash.linear_attention_forward(q, k, v, causal=True)
    cupyflash.linear_attention_forward(q, k, v, causal=True)
    assert len(seen) == 2


# ---------------------------------------------------------------------------- the pointer writers


def test_pointer_packer_writes_what_pointer_values_writes():
    rng = np.random.default_rng(1)
    for _ in range(50):
        names = [n for n in POINTERS if rng.random() < 0.3]
        ptrs = {n: int(rng.integers(1, 2**63)) for n in names}
        want = bytearray(b"\xff" * PARAMS.itemsize)
        Params.write_pointers(want, Params.pointer_values(ptrs))
        got = bytearray(b"\xff" * PARAMS.itemsize)
        packer = PointerPacker(names[::-1])
        packer.pack_into(got, 0, *[ptrs[n] for n in packer.names])
        assert got == want
    with pytest.raises(ValueError, match="not pointer fields"):
        PointerPacker(["q", "qq"])


def test_runner_writes_each_sub_batch_as_before(dev, monkeypatch):
    """A batch whose dims cannot merge runs once per sub-batch: the runner adds each one's offsets, writes the
    scratch pointers and zeroes what the plan asks, as pointer_values did."""
    from cupyflash.kernels.family import Geometry, Scratch, call_plan
    from cupyflash.plans import LaunchPlan

    lp = LaunchPlan("portable.cu", "k", (1, 1, 1), (32, 1, 1), 0)
    plan = call_plan([lp, lp], Params().set(nq=3), [Scratch("delta", 100), Scratch("dq_accum", 64, zeroed=True)])
    offsets = ({"q": 0, "o": 0}, {"q": 256, "o": 512}, {"q": 1024, "o": 2048})
    g = Geometry(2, {}, offsets, True)
    memsets = []
    monkeypatch.setattr(cupy.cuda.runtime, "memsetAsync", lambda ptr, value, n, stream: memsets.append((ptr, n)))
    family.run(plan, g, {"o": 0x10000, "q": 0x20000}, dropout_seed=9)
    assert len(dev.params) == 6 and len(memsets) == 3
    delta, accum = (pointer(dev.params[0], n) for n in ("delta", "dq_accum"))
    assert accum == delta + 512 and memsets[0] == (accum, 256)
    b0_at, seed_at = PARAMS.fields["dropout_b0"][1], PARAMS.fields["dropout_seed"][1]
    for i, params in enumerate(dev.params):
        sub = offsets[i // 2]
        want = bytearray(params)
        Params.write_pointers(want, Params.pointer_values({"o": 0x10000, "q": 0x20000, "delta": delta,
                                                          "dq_accum": accum}, sub))  # fmt: skip
        assert bytes(want) == params
        assert int.from_bytes(params[b0_at:b0_at + 4], "little") == 2 * (i // 2)
        assert int.from_bytes(params[seed_at:seed_at + 8], "little") == 9


def test_the_unrolled_signatures_read_what_array_key_reads(dev):
    """The short paths' keys are written out flat for speed (a loop over the arrays cost ~0.6 us more on a
    workstation); they must hold exactly ``_array_key`` of each array, in order, so that a field added there cannot
    be missed here."""
    q, k, v, o, do = arrays(dev, 5)
    lse = dev.array(SHAPE[:-1], np.float32, 1 << 24)
    head = (bool, True, float, 0.5, 3)
    forward = cuda_backend._forward_signature(q, k, v, q.data.ptr, k.data.ptr, v.data.ptr, True, 0.5, 3)
    assert forward == (*head, *(e for x in (q, k, v) for e in cuda_backend._array_key(x)))
    ptrs = tuple(x.data.ptr for x in (q, k, v, o, lse, do))
    backward = cuda_backend._backward_signature(q, k, v, o, lse, do, ptrs, True, 0.5, 3)
    assert backward == (*head, *(e for x in (q, k, v, o, lse, do) for e in cuda_backend._array_key(x)))
    key = linear.plain_key(q, k, v, q.data.ptr, k.data.ptr, v.data.ptr, True, 0.5)
    overrides = (linear.FUSED_DV, linear.FUSED_STAGES, linear.FUSED_SEGMENTS, linear.FUSED_SUB_LEN)
    assert key == (bool, True, float, 0.5, dev.device, *overrides,
                   *(e for x in (q, k, v) for e in cuda_backend._array_key(x)))  # fmt: skip
