"""The dispatch table: which kernel family runs a problem."""
from __future__ import annotations

from types import ModuleType

from .. import _dtypes
from ..plans import DeviceLimits
from ..validation import AttentionProblem


def families() -> dict[str, ModuleType]:
    """Kernel families, fastest first; "auto" takes the first that supports a problem."""
    from . import mma, portable, wgmma

    return {wgmma.NAME: wgmma, mma.NAME: mma, portable.NAME: portable}


KERNELS = ("auto", "wgmma", "mma", "portable")


def select(p: AttentionProblem, limits: DeviceLimits, kernel: str = "auto") -> ModuleType:
    table = families()
    if kernel == "auto":
        for fam in table.values():
            if fam.supports(p, limits):
                return fam
        raise TypeError(f"no kernel supports dtype {p.dtype} with D={p.d} on sm_{limits.compute_capability}")
    fam = table[kernel]
    if not fam.supports(p, limits):
        raise TypeError(
            f"kernel={kernel!r} does not support dtype {p.dtype}, D={p.d} on sm_{limits.compute_capability}"
            + (" (it needs float16/bfloat16 on sm_80+)" if kernel == "mma" and not _dtypes.is_half(p.dtype) else "")
            + (" (it needs float16/bfloat16, 32 < D <= 128, on sm_90)" if kernel == "wgmma" else "")
        )
    return fam
