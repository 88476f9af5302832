"""The one decision point: which kernel family runs a call, and why not the others.

Families are asked in order, fastest first; each answers ``supports(problem, limits)`` with ``None``
or a reason, and a family that needs 16-byte aligned rows is passed over for arrays that don't have
them. ``kernel="auto"`` takes the first family that can; naming a family that cannot raises with its
reason. Error messages are built from those reasons, so they stay true as families change.
"""
from __future__ import annotations

from types import ModuleType

from ..plans import DeviceLimits
from ..validation import AttentionProblem

KERNELS = ("auto", "wgmma", "mma", "portable")
_UNALIGNED = "needs 16-byte aligned rows (base pointer and every batch/head/row stride)"


def families() -> dict[str, ModuleType]:
    """Kernel families, fastest first."""
    from . import mma, portable, wgmma

    return {wgmma.NAME: wgmma, mma.NAME: mma, portable.NAME: portable}


def reason(fam: ModuleType, p: AttentionProblem, limits: DeviceLimits, aligned: bool = True) -> str | None:
    """Why ``fam`` cannot run the call, or None if it can."""
    why = fam.supports(p, limits)
    if why is None and fam.NEEDS_ALIGNED_ROWS and not aligned:
        why = _UNALIGNED
    return why


def select(p: AttentionProblem, limits: DeviceLimits, kernel: str = "auto", aligned: bool = True) -> ModuleType:
    """The family that runs the call: the first that can (``"auto"``), or the one named."""
    table = families()
    if kernel != "auto":
        if kernel not in table:
            raise ValueError(f"kernel must be one of {KERNELS}; got {kernel!r}")
        why = reason(table[kernel], p, limits, aligned)
        if why is not None:
            raise TypeError(f"kernel={kernel!r} cannot run this call ({_describe(p)}): it {why}")
        return table[kernel]
    reasons = {}
    for name, fam in table.items():
        why = reasons[name] = reason(fam, p, limits, aligned)
        if why is None:
            return fam
    detail = "; ".join(f"{name} {why}" for name, why in reasons.items())
    raise TypeError(f"no kernel family can run this call ({_describe(p)}): {detail}")


def _describe(p: AttentionProblem) -> str:
    return f"dtype {p.dtype}, D={p.d}, {p.variant.mask_name}"
