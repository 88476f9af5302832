"""The KV-cache call's cached host path, on the CPU: CuPy's device calls faked (benchmarks/dev_host_fake.py's
``FakeDevice``; CuPy arrays over a fake address range), so these run without a GPU and launch nothing.

What they pin down: a call of a seen signature skips the checks and writes into each of its launches (rotate, append,
decode) the first call's DecodeParams bytes with only this call's pointers (and an int cache_seqlens) changed, each
pointer in its own field; calls outside the signature (NumPy arrays, a CuPy subclass, another stride) miss it; and the
pointer writer writes the same bytes whether or not its names come in struct order.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from test_host_fast_path import Device  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import kvcache  # noqa: E402
from cupyflash.kernels import decode  # noqa: E402

BF16 = np.dtype("bfloat16")
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)
B, HQ, HK, D, CAP = 2, 8, 2, 64, 256


@pytest.fixture
def dev():
    kvcache._prepared.clear()
    kvcache._workspace.clear()
    with Device(decode.DECODE_PARAMS.itemsize) as d:
        yield d
    kvcache._prepared.clear()
    kvcache._workspace.clear()


@pytest.fixture
def checks(monkeypatch):
    """How many times the KV-cache checks ran."""
    count = {"n": 0}
    real = kvcache.check_kvcache

    def counting(*a, **kw):
        count["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(kvcache, "check_kvcache", counting)
    return count


class Arrays:
    """Fresh fake-device arrays, each at its own 256-byte aligned place."""

    def __init__(self, dev) -> None:
        self.dev, self.at = dev, 0

    def __call__(self, shape, dtype):
        x = self.dev.array(shape, dtype, self.at)
        self.at += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 256) * 256
        return x


def fields(params: bytes) -> np.void:
    return np.frombuffer(params, decode.DECODE_PARAMS)[0]


def pointer(rec: np.void, name: str) -> int:
    return int(rec["attn"][name[5:]] if name.startswith("attn.") else rec[name])


def without(params: bytes, names) -> bytes:
    """The bytes with the named 8-byte fields (and seqlen_const) zeroed: what a call does not write."""
    out = bytearray(params)
    for n in (*names, "seqlen_const"):
        at = decode.field_offset(n)
        out[at:at + (4 if n == "seqlen_const" else 8)] = bytes(4 if n == "seqlen_const" else 8)
    return bytes(out)


def test_a_seen_decode_step_skips_the_checks_and_writes_only_its_pointers(dev, checks):
    new = Arrays(dev)
    k_cache, v_cache = new((B, HK, CAP, D), BF16), new((B, HK, CAP, D), BF16)
    seqlens = new((B,), I32)
    calls = [new((B, HQ, 1, D), BF16) for _ in range(2)]
    outs = [cupyflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens) for q in calls]
    assert checks["n"] == 1 and dev.launches == 2  # one decode launch a call; the second call took the cache
    first, second = (fields(p) for p in dev.params)
    for rec, q, (o, lse) in zip((first, second), calls, outs):
        assert pointer(rec, "attn.q") == q.data.ptr
        assert (pointer(rec, "attn.o"), pointer(rec, "attn.lse")) == (o.data.ptr, lse.data.ptr)
        assert (pointer(rec, "k_cache"), pointer(rec, "v_cache")) == (k_cache.data.ptr, v_cache.data.ptr)
        assert pointer(rec, "cache_seqlens") == seqlens.data.ptr
        for name in ("attn.alibi", "attn.sinks", "k_new", "v_new", "block_table", "cache_batch_idx"):
            assert pointer(rec, name) == 0, name
    names = kvcache.CALL_POINTERS + kvcache.SPLIT_POINTERS
    assert without(dev.params[1], names) == without(dev.params[0], names)


def test_append_rotary_paged_and_an_int_length(dev, checks):
    """Three launches a call (rotate q, append k/v, decode), an int cache_seqlens written per call."""
    new = Arrays(dev)
    page, pages = 16, 40
    k_cache, v_cache = new((pages, HK, page, D), BF16), new((pages, HK, page, D), BF16)
    table = new((B, CAP // page), I32)
    cos, sin = new((CAP, D // 4), F32), new((CAP, D // 4), F32)
    alibi, sinks = new((HQ,), F32), new((HQ,), F32)
    lengths = (5, 17)
    calls = [(new((B, HQ, 1, D), BF16), new((B, HK, 1, D), BF16), new((B, HK, 1, D), BF16)) for _ in lengths]
    outs = []
    for (q, k, v), n in zip(calls, lengths):
        outs.append(cupyflash.attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=n, block_table=table, causal=True, alibi_slopes=alibi,
            sinks=sinks, rotary_cos=cos, rotary_sin=sin))  # fmt: skip
    assert checks["n"] == 1 and dev.launches == 6
    names = kvcache.CALL_POINTERS + kvcache.ROTARY_POINTERS + kvcache.SPLIT_POINTERS
    for c, ((q, k, v), n, (o, lse)) in enumerate(zip(calls, lengths, outs)):
        launches = [fields(p) for p in dev.params[3 * c:3 * c + 3]]
        q_rot = pointer(launches[0], "q_rot")
        assert q_rot not in (0, q.data.ptr)
        assert pointer(launches[0], "attn.q") == q.data.ptr  # rotate reads q as given ...
        for rec in launches:
            assert pointer(rec, "q_rot") == q_rot
            assert (pointer(rec, "attn.o"), pointer(rec, "attn.lse")) == (o.data.ptr, lse.data.ptr)
            assert (pointer(rec, "k_new"), pointer(rec, "v_new")) == (k.data.ptr, v.data.ptr)
            assert (pointer(rec, "k_cache"), pointer(rec, "block_table")) == (k_cache.data.ptr, table.data.ptr)
            assert (pointer(rec, "attn.alibi"), pointer(rec, "attn.sinks")) == (alibi.data.ptr, sinks.data.ptr)
            assert (pointer(rec, "rotary_cos"), pointer(rec, "rotary_sin")) == (cos.data.ptr, sin.data.ptr)
            assert pointer(rec, "cache_seqlens") == 0 and int(rec["seqlen_const"]) == n
        assert all(pointer(rec, "attn.q") == q_rot for rec in launches[1:])  # ... append and decode its copy
    for i in range(3):  # each launch of the second call: the first call's bytes but for what a call writes
        assert without(dev.params[3 + i], names) == without(dev.params[i], names)


def test_the_signature_keeps_out_what_it_cannot_cache(dev):
    new = Arrays(dev)
    k_cache, v_cache = new((B, HK, CAP, D), BF16), new((B, HK, CAP, D), BF16)
    q = new((B, HQ, 1, D), BF16)
    scalars = (False, None, None, 0.0, False, 0, "auto")

    def key(q=q, k_cache=k_cache, seqlens=3):
        return kvcache._signature((q, k_cache, v_cache, None, None, seqlens, None, None, None, None, None, None),
                                  scalars)  # fmt: skip

    assert key() == key(seqlens=200)  # an int length enters by kind
    assert key() != key(seqlens=new((B,), I32))
    assert key(q=np.zeros((B, HQ, 1, D), np.float32)) is None  # NumPy calls are not cached

    class Sub(cupy.ndarray):
        pass

    assert key(q=q.view(Sub)) is None  # nor subclasses: they take the checked path every time
    assert key(k_cache=k_cache[:, :, ::2]) != key()  # another stride is another signature
    assert key() == key(q=new((B, HQ, 1, D), BF16))  # another base pointer of the same alignment is not


def test_pointer_writer_in_and_out_of_struct_order():
    """kvcache gives its names in struct order (each run one slice of the values); any order writes the same."""
    names = kvcache.CALL_POINTERS + kvcache.ROTARY_POINTERS + kvcache.SPLIT_POINTERS
    shuffled = tuple(np.random.default_rng(3).permutation(names))
    values = {n: 0x1000 + 8 * i for i, n in enumerate(names)}
    base, bufs = np.full((), 5, decode.DECODE_PARAMS).tobytes(), []
    for order in (names, shuffled):
        buf = bytearray(base)
        decode.PointerWriter(order).write(buf, tuple(values[n] for n in order))
        bufs.append(bytes(buf))
    assert bufs[0] == bufs[1]
    rec = fields(bufs[0])
    assert all(pointer(rec, n) == v for n, v in values.items())
    # q; o, lse; alibi, sinks; k_new .. lse_part; the rotary three; split_count: adjacent fields share a pack_into
    assert len(decode.PointerWriter(names).runs) == 6
