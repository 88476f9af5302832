"""Your own mask and score functions, compiled into the kernels on first use (FlexAttention for CuPy).

    python examples/flex_masks.py

Five patterns, each checked against the float64 NumPy reference running the snippet's Python twin:

1. document masking of a packed batch (several documents per row of the batch; a block mask skips the empty tiles),
2. prefix-LM (bidirectional over a per-sequence prefix, causal after it),
3. a T5-style relative-position bias from a bucket table in ``aux`` (a function body as the snippet),
4. an AlphaFold-style pair bias with its gradient (``bias=`` and ``bias_grad=True``: a plain array, no snippet),
5. softcap written as a ``score_mod``, matching the built-in ``softcap=``.
"""
from __future__ import annotations

import sys

import numpy as np

import cupyflash as cf
from cupyflash import gpu_status, reference

if __name__ == "__main__" and (_reason := gpu_status()) is not None:
    print(f"skipped: flex_masks.py needs an NVIDIA GPU (no GPU: {_reason})")
    sys.exit(0)

import cupy as cp  # noqa: E402

B, H, N, D = 2, 4, 512, 64
rng = np.random.default_rng(0)


def inputs(dtype=np.float32, n=N):
    q, k, v, do = (rng.standard_normal((B, H, n, D)).astype(dtype) for _ in range(4))
    return (q, k, v, do), tuple(cp.asarray(x) for x in (q, k, v, do))


def rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def report(name, got, ref):
    errs = ", ".join(f"{n} {rel(cp.asnumpy(g), r):.1e}" for n, g, r in zip(("o", "dq", "dk", "dv"), got, ref))
    print(f"{name:<28} rel. error vs reference: {errs}")


def document_mask():
    # Token t of batch row b belongs to document doc[b, t]; a token sees the earlier tokens of its own document.
    cuts = [np.sort(rng.choice(np.arange(1, N), 7, replace=False)) for _ in range(B)]
    doc = np.stack([np.searchsorted(c, np.arange(N), side="right") for c in cuts]).astype(np.int32)
    (q, k, v, do), (qd, kd, vd, dod) = inputs()
    aux = {"doc": cp.asarray(doc)}
    mask_mod = "doc(b, q_idx) == doc(b, kv_idx)"  # C++; ANDed with causal=True
    twin = lambda b, h, i, j: doc[b, i] == doc[b, j]  # noqa: E731 - the same rule in NumPy, for the reference
    block_mask = cf.create_block_mask(mask_mod, B, None, N, N, aux=aux)
    print(f"document mask: {block_mask}")
    o, vjp = cf.attention_vjp(qd, kd, vd, causal=True, mask_mod=mask_mod, aux=aux, block_mask=block_mask)
    o_ref, vjp_ref = reference.attention_vjp(q, k, v, causal=True, mask_mod=twin)
    report("document mask (packed)", (o, *vjp(dod)), (o_ref, *vjp_ref(do)))


def prefix_lm():
    prefix = np.array([64, 300], np.int32)  # bidirectional prefix length per sequence
    (q, k, v, do), (qd, kd, vd, dod) = inputs()
    aux = {"prefix": cp.asarray(prefix)}
    mask_mod = "kv_idx < prefix(b) || kv_idx <= q_idx"
    twin = lambda b, h, i, j: (j < prefix[b]) | (j <= i)  # noqa: E731
    block_mask = cf.create_block_mask(mask_mod, B, None, N, N, aux=aux)
    o, vjp = cf.attention_vjp(qd, kd, vd, mask_mod=mask_mod, aux=aux, block_mask=block_mask)
    o_ref, vjp_ref = reference.attention_vjp(q, k, v, mask_mod=twin)
    report("prefix-LM", (o, *vjp(dod)), (o_ref, *vjp_ref(do)))


def t5_bias():
    # T5's bidirectional buckets: 16 per direction, exact below 8, log-spaced up to 128.
    table = rng.standard_normal((H, 32)).astype(np.float32)
    score_mod = """{
      const int rel = kv_idx - q_idx, n = abs(rel);
      const int bucket = (rel > 0 ? 16 : 0) + (n < 8 ? n : min(8 + (int)floorf(2.f * log2f(n / 8.f) + 1e-3f), 15));
      return score + table(h, bucket);
    }"""

    def twin(s, b, h, i, j):
        r = j - i
        n = np.abs(r)
        big = 8 + np.floor(2 * np.log2(np.maximum(n, 1) / 8.0) + 1e-3).astype(np.int64)
        return s + table[h, np.where(r > 0, 16, 0) + np.where(n < 8, n, np.minimum(big, 15))]

    (q, k, v, do), (qd, kd, vd, dod) = inputs()
    o, vjp = cf.attention_vjp(qd, kd, vd, causal=True, score_mod=score_mod, score_mod_grad="1",
                              aux={"table": cp.asarray(table)})  # fmt: skip
    o_ref, vjp_ref = reference.attention_vjp(q, k, v, causal=True, score_mod=twin,
                                             score_mod_grad=lambda ns, b, h, i, j: np.ones_like(ns))  # fmt: skip
    report("T5 relative bias (aux)", (o, *vjp(dod)), (o_ref, *vjp_ref(do)))


def pair_bias():
    # AlphaFold's pair representation projected to one bias per head and residue pair, learned: dbias is its
    # gradient, in the bias's own shape (here (B, H, N, N): no reduction).
    n = 256
    bias = rng.standard_normal((B, H, n, n)).astype(np.float32)
    (q, k, v, do), (qd, kd, vd, dod) = inputs(n=n)
    o, vjp = cf.attention_vjp(qd, kd, vd, bias=cp.asarray(bias), bias_grad=True)
    o_ref, vjp_ref = reference.attention_vjp(q, k, v, bias=bias, bias_grad=True)
    dq, dk, dv, dbias = vjp(dod)
    ref = vjp_ref(do)
    report("pair bias", (o, dq, dk, dv), (o_ref, *ref[:3]))
    print(f"{'':<28} dbias rel. error {rel(cp.asnumpy(dbias), ref[3]):.1e}")


def softcap_as_score_mod():
    cap = 20.0
    (q, k, v, do), (qd, kd, vd, dod) = inputs(np.float16)
    qd = qd * 4  # large logits, so the cap matters
    snippet = dict(score_mod="cap * tanhf(score / cap)", score_mod_grad="1.f - (new_score / cap) * (new_score / cap)",
                   aux={"cap": cap})  # fmt: skip
    o1, vjp1 = cf.attention_vjp(qd, kd, vd, causal=True, **snippet)
    o2, vjp2 = cf.attention_vjp(qd, kd, vd, causal=True, softcap=cap)
    g1, g2 = vjp1(dod), vjp2(dod)
    errs = ", ".join(f"{n} {rel(cp.asnumpy(a), cp.asnumpy(b)):.1e}" for n, a, b in zip(("o", "dq", "dk", "dv"),
                                                                                       (o1, *g1), (o2, *g2)))
    print(f"{'softcap as score_mod':<28} float16, vs built-in softcap: {errs}")


if __name__ == "__main__":
    document_mask()
    prefix_lm()
    t5_bias()
    pair_bias()
    softcap_as_score_mod()
