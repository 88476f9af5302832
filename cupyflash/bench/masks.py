"""``--suite masks``: issue 17's speed questions for ``bias`` and ``mask``.

bf16 and fp32, B*N = 16k, H*D = 2048, D = 64/128, N = 1k..8k, not causal. The bias and the mask are
``(1, H, N, N)`` (one per head, broadcast over the batch: a learned relative-position bias or attention
pattern); the bias is in q's dtype (SDPA wants that), the mask keeps each key with probability 0.9 (random, so
no tile is skippable: the dense cost). Against PyTorch SDPA's EFFICIENT backend with the same tensor as
``attn_mask`` (a float mask is added to the scores, a bool mask's True = attend, our convention) when a
torch comparison is on (the default with torch):

- "bias" (fwd): forward with the bias; "bias_grad" (fwd+bwd): ``attention_vjp(..., bias_grad=True)`` and
  its backward (dq, dk, dv, dbias) against SDPA with an ``attn_mask`` that requires grad. The issue asks
  >= 1.5x (SDPA time / ours >= 1.5).
- "mask" (fwd, fwd+bwd): the bool mask; the issue asks >= 1.0x.

The ``mask_mod`` / ``block_mask`` rows (document mask, prefix-LM against compiled ``flex_attention``) and the
first-call compile time of a snippet are ``--suite flex`` (bench/flex.py).
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

from .impls import Unavailable
from .paired import Ready, Row, attention_inputs, cupy_clock, no_context, refused, torch_clock
from .shapes import Shape

KEEP = 0.9  # the bool mask's density
NAMES = {"sdpa-efficient": "SDPA EFFICIENT"}


def plan_rows(shapes: Sequence[Shape], passes: Sequence[str], kernel: str, sdpa: bool) -> list[Row]:
    """Per shape: the bias rows ("bias" fwd, "bias_grad" fwd+bwd), then the mask rows (each pass)."""
    impls = ("cupyflash",) + (("sdpa-efficient",) if sdpa else ())
    rows = []
    for s in shapes:
        rows += [Row("masks", "bias" if p == "fwd" else "bias_grad", s, p, impls, kernel=kernel) for p in passes]
        rows += [Row("masks", "mask", s, p, impls, kernel=kernel) for p in passes]
    return rows


def inputs(shape: Shape, seed: int) -> dict[str, Any]:
    import cupy

    rng, x = attention_inputs(shape, seed)
    scores = (1, shape.h, shape.n, shape.n)
    x["bias"] = rng.standard_normal(scores, dtype=cupy.float32).astype(x["q"].dtype)
    x["mask"] = rng.random(scores, dtype=cupy.float32) < KEEP
    return x


def make(row: Row, impl: str, x: dict[str, Any]) -> Ready:
    import cupyflash as cf

    q, k, v, do = x["q"], x["k"], x["v"], x["do"]
    extra = {"mask": x["mask"]} if row.case == "mask" else {"bias": x["bias"]}
    if impl == "sdpa-efficient":
        return _sdpa_efficient(row, x)
    with refused():  # a --kernel family that cannot run the call (fp32 on mma, say): n/a
        cf.attention_forward(q, k, v, False, kernel=row.kernel, **extra)
    if row.pass_ == "fwd":
        return lambda: cf.attention_forward(q, k, v, False, kernel=row.kernel, **extra), no_context, cupy_clock
    grads = {"bias_grad": True} if row.case == "bias_grad" else {}

    def call() -> None:
        _, vjp = cf.attention_vjp(q, k, v, False, kernel=row.kernel, **extra, **grads)
        vjp(do)

    return call, no_context, cupy_clock


def _sdpa_efficient(row: Row, x: dict[str, Any]) -> Ready:
    try:
        import torch
    except ImportError as e:
        raise Unavailable(f"torch is not importable ({e})") from e
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .device import to_torch

    qkv = [to_torch(x[n]) for n in ("q", "k", "v")]
    attn_mask = _torch_mask(x["mask"]) if row.case == "mask" else to_torch(x["bias"])

    def backend() -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION))
        if row.pass_ == "fwd":
            stack.enter_context(torch.no_grad())
        return stack

    if row.pass_ == "fwd":
        return lambda: F.scaled_dot_product_attention(*qkv, attn_mask=attn_mask), backend, torch_clock
    leaves = [t.detach().requires_grad_() for t in qkv]
    if row.case == "bias_grad":  # the float mask is a leaf too: its gradient is dbias
        attn_mask = attn_mask.detach().requires_grad_()
        leaves.append(attn_mask)
    tdo = to_torch(x["do"])

    def call() -> None:
        out = F.scaled_dot_product_attention(*leaves[:3], attn_mask=attn_mask)
        torch.autograd.grad(out, leaves, tdo)

    return call, backend, torch_clock


def _torch_mask(mask: Any) -> Any:
    """The bool mask as a torch tensor: shared through DLPack, or a bool copy of its bytes where this DLPack
    pairing has no bool (made once, outside the timed calls)."""
    from .device import to_torch

    try:
        return to_torch(mask)
    except Exception:
        import cupy

        return to_torch(mask.view(cupy.uint8)).bool()
