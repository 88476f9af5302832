"""``--suite dropout``: issue 16's speed questions (was benchmarks/dev_dropout.py).

Pass "bwd", the deterministic backward: per kernel family (wgmma, mma, portable; --kernels narrows them), the
default backward's time over ``deterministic=True``'s, i.e. the deterministic TFLOP/s over the default's (the
issue asks >= 0.85x), on the DESIGN grid (bf16, B*N = 16k, H*D = 2048, D = 64/128, N = 1k..16k, causal and
not). The portable family also shows its separate dQ pass (the other deterministic dQ strategy,
kernels/portable.py); it runs to N = 4k only (the slow family: seconds per call beyond).

Pass "fwd+bwd", dropout 0.1: ``attention_vjp`` forward and backward with dropout, against the same without
dropout ("nodrop/base": the issue asks >= 0.8x, within 20%) and PyTorch SDPA's FLASH backend with the same
dropout (>= 1.0x) when a torch comparison is on (the default with torch); bf16, D = 64/128, N = 2k..16k.
Both quantise p to 8 bits: ours applies round(0.1 * 256) / 256 = 0.1016 (``effective_dropout_p``).
"""
from __future__ import annotations

from typing import Any, Sequence

from .impls import Unavailable
from .paired import Ready, Row, attention_inputs, cupy_clock, no_context, refused, torch_clock
from .shapes import Shape

DROPOUT_P = 0.1
DROPOUT_SEED = 1
FAMILIES = ("wgmma", "mma", "portable")
PORTABLE_MAX_N = 4096
DROPOUT_MIN_N = 2048
NAMES = {"cupyflash+deterministic": "deterministic", "cupyflash": "default", "cupyflash+separate-dq": "separate dQ",
         "cupyflash+dropout": f"dropout {DROPOUT_P:g}", "sdpa-flash": "SDPA FLASH"}  # fmt: skip


def plan_rows(shapes: Sequence[Shape], passes: Sequence[str], kernels: Sequence[str], sdpa: bool) -> list[Row]:
    """Per shape (adjacent rows share its inputs): the deterministic rows of each family ("bwd"), then the
    dropout row ("fwd+bwd", N >= 2k). ``kernels``: ("auto",) = every family; else those families for the
    deterministic rows, and the dropout row runs the first."""
    families = FAMILIES if tuple(kernels) == ("auto",) else tuple(kernels)
    rows = []
    for s in shapes:
        if "bwd" in passes:
            for f in families:
                if f == "portable" and s.n > PORTABLE_MAX_N:
                    continue
                impls = ("cupyflash+deterministic", "cupyflash")
                impls += ("cupyflash+separate-dq",) if f == "portable" else ()
                rows.append(Row("dropout", f"deterministic[{f}]", s, "bwd", impls, kernel=f))
        if "fwd+bwd" in passes and s.n >= DROPOUT_MIN_N:
            impls = ("cupyflash+dropout", "cupyflash") + (("sdpa-flash",) if sdpa else ())
            kernel = kernels[0] if len(kernels) == 1 else "auto"
            rows.append(Row("dropout", f"dropout{DROPOUT_P:g}", s, "fwd+bwd", impls, kernel=kernel))
    return rows


def inputs(shape: Shape, seed: int) -> dict[str, Any]:
    return attention_inputs(shape, seed)[1]


def make(row: Row, impl: str, x: dict[str, Any]) -> Ready:
    """The timed call of ``impl`` on ``row``; a family that cannot run it raises TypeError (a cell "n/a")."""
    import cupyflash as cf

    q, k, v, do, causal, kernel = x["q"], x["k"], x["v"], x["do"], row.shape.causal, row.kernel
    if row.pass_ == "bwd":
        with refused():
            o, lse = cf.attention_forward(q, k, v, causal, kernel=kernel)
        if impl == "cupyflash+separate-dq":
            return _separate_dq(x, o, lse, causal), no_context, cupy_clock
        det = impl == "cupyflash+deterministic"
        return (lambda: cf.attention_backward(do, q, k, v, o, lse, causal, kernel=kernel, deterministic=det),
                no_context, cupy_clock)  # fmt: skip
    if impl == "sdpa-flash":
        return _sdpa_flash(x, causal)
    p = DROPOUT_P if impl == "cupyflash+dropout" else 0.0
    seed = DROPOUT_SEED if p else None
    with refused():
        cf.attention_forward(q, k, v, causal, kernel=kernel, dropout_p=p, dropout_seed=seed)

    def call() -> None:
        _, vjp = cf.attention_vjp(q, k, v, causal, kernel=kernel, dropout_p=p, dropout_seed=seed)
        vjp(do)

    return call, no_context, cupy_clock


def _separate_dq(x: dict[str, Any], o: Any, lse: Any, causal: bool) -> Any:
    """The portable backward with its separate dQ pass (each dQ row written once), outside the API's dispatch."""
    import cupy

    from ..kernels import portable
    from ..validation import check_backward

    q, k, v, do = x["q"], x["k"], x["v"], x["do"]
    p = check_backward(do, q, k, v, o, lse, causal=causal)
    dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
    return lambda: portable.backward(do, q, k, v, o, lse, dq, dk, dv, p, dq_strategy="separate")


def _sdpa_flash(x: dict[str, Any], causal: bool) -> Ready:
    """SDPA's FLASH backend with the same dropout, forward and backward (autograd.grad: no .grad to accumulate)."""
    try:
        import torch
    except ImportError as e:
        raise Unavailable(f"torch is not importable ({e})") from e
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .device import to_torch

    leaves = [to_torch(x[n]).detach().requires_grad_() for n in ("q", "k", "v")]
    tdo = to_torch(x["do"])

    def call() -> None:
        out = F.scaled_dot_product_attention(*leaves, dropout_p=DROPOUT_P, is_causal=causal)
        torch.autograd.grad(out, leaves, tdo)

    return call, lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch_clock
