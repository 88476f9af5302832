"""``--suite flex``: issue 17's speed questions for user snippets (mask_mod + block_mask).

bf16, one packed sequence of 16k tokens (B = 1, N = 16384), H*D = 2048, D = 64/128, causal:

- "doc8": 8 documents of random lengths in the 16k tokens, ``mask_mod="doc(b, q_idx) == doc(b, kv_idx)"`` (an aux
  int32 (1, N) array) with ``causal=True`` and the block mask of the mask_mod; columns: the same without the block
  mask, dense causal attention (the issue asks ours <= 0.35x of it when <= 25% of the tiles are visible, i.e. the
  column >= 2.86x), and torch's ``flex_attention`` compiled (``torch.compile``) with its own block mask of the same
  rule (the issue asks >= 1.0x).
- "prefix-lm": bidirectional over the first N/4 tokens (an aux int scalar), causal after, the same columns.
- "first-call" (fwd): the time of the first call of a snippet never seen before (a fresh text each run: the NVRTC
  compile of the snippet check and the forward kernel, plus the launch); the issue asks <= 2 s.

FLOPs are counted as for dense causal attention (the same number for every column, so ratios are time ratios).
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from .impls import Unavailable
from .paired import Ready, Row, attention_inputs, cupy_clock, no_context, refused, torch_clock
from .shapes import Shape

DOCS = 8
NAMES = {"cupyflash-no-block-mask": "no block mask", "cupyflash-dense-causal": "dense causal",
         "flex-attention": "flex_attention"}  # fmt: skip
DOC_MASK = "doc(b, q_idx) == doc(b, kv_idx)"
PREFIX_MASK = "kv_idx < prefix || kv_idx <= q_idx"
_fresh = itertools.count()


def plan_rows(shapes: Sequence[Shape], passes: Sequence[str], kernel: str, torch: bool) -> list[Row]:
    """Per shape: doc8 and prefix-lm per pass, then the first-call compile time (fwd)."""
    impls = ("cupyflash", "cupyflash-no-block-mask", "cupyflash-dense-causal") + (("flex-attention",) if torch else ())
    rows = []
    for s in shapes:
        for case in ("doc8", "prefix-lm"):
            rows += [Row("flex", case, s, p, impls, kernel=kernel) for p in passes]
        if "fwd" in passes:
            rows.append(Row("flex", "first-call", s, "fwd", ("cupyflash",), kernel=kernel))
    return rows


def doc_ids(n: int, docs: int = DOCS, seed: int = 0) -> Any:
    """int32 (n,): the document of each of n tokens cut into ``docs`` documents of random lengths (seed 0: the
    suite's doc8 lengths; the dev scripts' other document counts)."""
    import numpy as np

    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, n), docs - 1, replace=False))
    return np.searchsorted(cuts, np.arange(n), side="right").astype(np.int32)


def inputs(shape: Shape, seed: int) -> dict[str, Any]:
    import cupy
    import numpy as np

    _, x = attention_inputs(shape, seed)
    doc = doc_ids(shape.n, DOCS, seed)
    x["doc"] = cupy.asarray(np.broadcast_to(doc, (shape.b, shape.n)).copy())
    x["prefix"] = shape.n // 4
    return x


def _snippet(case: str, x: dict[str, Any]) -> dict[str, Any]:
    if case == "doc8":
        return {"mask_mod": DOC_MASK, "aux": {"doc": x["doc"]}}
    return {"mask_mod": PREFIX_MASK, "aux": {"prefix": x["prefix"]}}


def make(row: Row, impl: str, x: dict[str, Any]) -> Ready:
    import cupyflash as cf

    q, k, v, do = x["q"], x["k"], x["v"], x["do"]
    s = row.shape
    if impl == "flex-attention":
        return _flex_attention(row, x)
    if row.case == "first-call":

        def first() -> None:  # a text no cache has seen: the whole first-call cost
            cf.attention_forward(q, k, v, True, kernel=row.kernel, mask_mod=f"kv_idx >= {-1 - next(_fresh)}")

        return first, no_context, cupy_clock
    causal = row.case == "doc8" or impl == "cupyflash-dense-causal"
    kw: dict[str, Any] = {}
    if impl != "cupyflash-dense-causal":
        kw = _snippet(row.case, x)
        if impl == "cupyflash":
            key = ("block_mask", row.case)
            if key not in x:  # made once per shape, outside the timed calls
                x[key] = cf.create_block_mask(kw["mask_mod"], s.b, None, s.n, s.n, aux=kw["aux"])
            kw["block_mask"] = x[key]
    with refused():  # a --kernel family that cannot run the call: n/a
        cf.attention_forward(q, k, v, causal, kernel=row.kernel, **kw)
    if row.pass_ == "fwd":
        return lambda: cf.attention_forward(q, k, v, causal, kernel=row.kernel, **kw), no_context, cupy_clock

    def call() -> None:
        _, vjp = cf.attention_vjp(q, k, v, causal, kernel=row.kernel, **kw)
        vjp(do)

    return call, no_context, cupy_clock


def _flex_attention(row: Row, x: dict[str, Any]) -> Ready:
    if row.case == "first-call":
        raise Unavailable("timed for cupyflash only")
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        raise Unavailable(f"torch with flex_attention is not importable ({e})") from e

    from .device import to_torch

    s = row.shape
    qkv = [to_torch(x[n]) for n in ("q", "k", "v")]
    if row.case == "doc8":
        doc = to_torch(x["doc"])[0]

        def rule(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)
    else:
        prefix = x["prefix"]

        def rule(b, h, q_idx, kv_idx):
            return (kv_idx < prefix) | (kv_idx <= q_idx)

    key = ("torch_block_mask", row.case)
    if key not in x:
        x[key] = create_block_mask(rule, None, None, s.n, s.n, device="cuda")
    block_mask = x[key]
    compiled = x.setdefault("torch_flex", torch.compile(flex_attention))
    if row.pass_ == "fwd":

        def fwd() -> None:
            with torch.no_grad():
                compiled(*qkv, block_mask=block_mask)

        fwd()  # compile outside the timed calls
        return fwd, no_context, torch_clock
    leaves = [t.detach().requires_grad_() for t in qkv]
    tdo = to_torch(x["do"])

    def call() -> None:
        out = compiled(*leaves, block_mask=block_mask)
        torch.autograd.grad(out, leaves, tdo)

    call()
    return call, no_context, torch_clock
