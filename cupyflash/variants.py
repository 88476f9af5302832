"""Attention variants: the one description of which (query, key) pairs a problem scores, and how.

A ``Variant`` rides on every ``AttentionProblem``. It is the single source of truth for

- the C++ policy type every kernel is instantiated with (``cpp_policy``, matching
  ``cuda_src/attention_policy.cuh``) and its run-time arguments (``params``),
- the NumPy reference's rules (``visible``, ``scores``), which mirror the policy's,
- the work per tile that launch plans order their grids by (``longest_first``).

Order inside a score (FlashAttention's): scale -> softcap -> ALiBi -> window/causal mask -> softmax
(with the sink). Adding a variant means: a policy type in ``attention_policy.cuh``, a case here, the
reference rule, and tests (ARCHITECTURE.md, "How to add a variant").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _dtypes
from .dropout import keep_scale as dropout_keep_scale
from .dropout import threshold as dropout_threshold

LOG2E = 1.4426950408889634
#: Bytes of a bias element by its C++ type (the inverse of _dtypes.CTYPE).
_BIAS_BYTES = {ct: dt.itemsize for dt, ct in _dtypes.CTYPE.items()}


@dataclass(frozen=True)
class Variant:
    """Mask and score rule of an attention call (FlashAttention's keywords).

    causal: key j is visible to query i iff j <= i + Nk - Nq (bottom-right aligned).
    window: (left, right), -1 = unbounded: j visible iff i + Nk - Nq - left <= j <= i + Nk - Nq + right;
        None when neither side is bounded. Causal with a window is right = 0.
    softcap: s = softcap * tanh(s / softcap) on the scaled score (0: off).
    alibi: slopes are given: s -= slope[h] * |i + Nk - Nq - j|.
    sinks: one logit per query head joins every row's softmax denominator.
    mask: a bool array (True = may attend) is ANDed with the mask above (issue 17).
    bias: the C++ element type of an additive bias array (added after softcap and ALiBi), or None.
    dropout: the dropout probability p (0: off): after the softmax each P_ij is kept with probability 1 - p_eff
        (``dropout.py``'s mask; p_eff = p rounded to a multiple of 1/256) and scaled by 1 / (1 - p_eff); lse stays
        that of the undropped softmax.
    flex: user snippets (issue 17 part 3, ``flex.py``): a ``FlexSpec`` (C++: the ``FlexScore`` policy) or
        ``FlexTwins`` (the reference's Python callables); score_mod after ALiBi, mask_mod ANDed with the masks.
    flex_aux: per aux slot, (extents, element strides, scalar value): the run-time values of ``aux``.
    block_mask: a block mask's table sizes (``BlockMask.params`` items), or (). C++: ``FlexMask`` around the mask
        (mask_mod moves from the score into the mask policy, so tiles of FULL blocks skip it; ``FlexScore`` keeps
        score_mod alone, or the score is the built-in rule), ``BlockMasked`` for the reference's twins.
    block_keys: with a block mask, the mean number of keys a query row's tile loop visits under this call's masks
        (``BlockMask.keys_a_row``; 0: not known): a grid heuristic (plans.wgmma's forward kernel), no C++.
    block_bits: the block mask holds its mixed tiles' pairs as bits (``BlockMask.bits_q``): C++ ``FlexMask<...,
        true>``, whose partial tiles read them instead of running mask_mod.
    """

    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    mask: bool = False
    bias: str | None = None
    dropout: float = 0.0
    flex: Any = None
    flex_aux: tuple = ()
    block_mask: tuple = ()
    block_keys: int = 0
    block_bits: bool = False

    @classmethod
    def of(cls, causal: bool, window_size: tuple[int, int] | None, softcap: float, alibi: bool, sinks: bool,
           mask: bool = False, bias: str | None = None, dropout: float = 0.0) -> "Variant":  # fmt: skip
        """The normal form: a window that bounds nothing is no window; causal folds into the window."""
        left, right = (-1, -1) if window_size is None else window_size
        if causal:
            right = 0
        window = None if left < 0 and (right < 0 or (causal and right == 0)) else (left, right)
        return cls(causal=causal and window is None, window=window, softcap=float(softcap), alibi=alibi, sinks=sinks,
                   mask=mask, bias=bias, dropout=float(dropout))  # fmt: skip

    # ------------------------------------------------------------------ the C++ side

    @property
    def mask_name(self) -> str:
        base = "Window" if self.window is not None else "Causal" if self.causal else "NoMask"
        if self._mask_in_mask():
            # mask_mod in the mask policy: tiles of FULL blocks skip it (flex_policy.cuh's FlexMask)
            from .flex import USER

            return f"FlexMask<cupyflash::{base}, {USER}{', true' if self.block_bits else ''}>"
        return f"BlockMasked<cupyflash::{base}>" if self.block_mask else base

    def _mask_in_mask(self) -> bool:
        """Does the mask policy evaluate mask_mod (C++ snippets with a block mask), so the score does not?"""
        return bool(self.block_mask) and isinstance(getattr(self.flex, "mask_mod", None), str)

    @property
    def score_name(self) -> str:
        return self._score_name()

    @property
    def arrays(self) -> bool:
        """Does the score read mask/bias arrays (ArrayScore)?"""
        return self.flex is None and bool(self.mask or self.bias)

    def staged_policy(self, rows: int, cols: int) -> str:
        """``cpp_policy`` with the score arrays read from rows x cols tiles staged in shared memory (the Hopper
        kernels' ArrayScore<..., kRows, kCols>; ``score_tile_bytes`` is a tile's size)."""
        return self._policy(self._score_name((rows, cols)))

    def score_tile_bytes(self, rows: int, cols: int) -> int:
        """Bytes of one staged tile (cuda_src/score_tile.cuh's ScoreTile::kBytes): rows padded by 16 bytes."""
        if not self.arrays:
            return 0
        bias = rows * (cols * _BIAS_BYTES[self.bias] + 16) if self.bias else 0
        return bias + (rows * (cols + 16) if self.mask else 0)

    def _score_name(self, tile: tuple[int, int] | None = None) -> str:
        base = "ModScore" if (self.softcap > 0 or self.alibi) else "PlainScore"
        if self.flex is not None:  # user snippets ride on the built-in score rule (flex_policy.cuh)
            from .flex import USER

            if not self._mask_in_mask():
                return f"FlexScore<cupyflash::{base}, {USER}>"
            # the mask is FlexMask's: the score keeps score_mod alone, or is the built-in rule without one
            return f"FlexScore<cupyflash::{base}, cupyflash::ScoreFns<{USER}>>" if self.flex.score_mod else base
        if not (self.mask or self.bias):
            # ALiBi alone gets kernels without softcap code (attention_policy.cuh's AlibiScore): the backward's
            # one-sided distances there (benchmarks/NOTES.md, s20); softcap alone kernels without ALiBi's distances
            # (SoftcapScore: the D = 64 wgmma backward spill-free, and room for its loader warpgroup, s24)
            if base == "ModScore" and not (self.softcap and self.alibi):
                return "SoftcapScore" if self.softcap else "AlibiScore"
            return base
        # Mask and bias arrays ride on the built-in score rule (ArrayScore<Base, BiasT, kMask, kBias>); the bias's
        # type is a template argument (float when there is no bias).
        flags = ", ".join("true" if x else "false" for x in (self.mask, self.bias))
        staged = f", {tile[0]}, {tile[1]}" if tile else ""
        return f"ArrayScore<cupyflash::{base}, {self.bias or 'float'}, {flags}{staged}>"

    @property
    def cpp_policy(self) -> str:
        """The C++ ``Policy`` type the kernels of this call are instantiated with."""
        return self._policy(self.score_name)

    def _policy(self, score: str) -> str:
        if self.dropout > 0:
            return f"cupyflash::Policy<cupyflash::{self.mask_name}, cupyflash::{score}, cupyflash::Dropout>"
        return f"cupyflash::Policy<cupyflash::{self.mask_name}, cupyflash::{score}>"

    def params(self, scale: float, nq: int, nk: int) -> dict[str, Any]:
        """The policy's run-time fields of ``AttentionParams``."""
        left, right = self._bounds(nq, nk)
        cap = self.softcap
        return {
            "window_left": left,
            "window_right": right,
            "softcap_scale": scale / cap if cap > 0 else 0.0,
            "softcap_log2": cap * LOG2E if cap > 0 else 0.0,
            "softcap_inv_log2": 1.0 / (cap * LOG2E) if cap > 0 else 0.0,
            "dropout_threshold": dropout_threshold(self.dropout),
            "dropout_scale": dropout_keep_scale(self.dropout),
            **self._aux_params(),
            **dict(self.block_mask),
        }

    def _aux_params(self) -> dict[str, Any]:
        """The aux slots' strides, extents and scalar values (``AttentionParams.aux_*``), when there are any."""
        if not self.flex_aux:
            return {}
        from .flex import aux_params

        return aux_params(self.flex_aux)

    def _bounds(self, nq: int, nk: int) -> tuple[int, int]:
        """(left, right) with an unbounded side clamped to nq + nk (past every key)."""
        if self.window is None:
            return nq + nk, (0 if self.causal else nq + nk)
        far = nq + nk
        left, right = self.window
        return (far if left < 0 else min(left, far)), (far if right < 0 else min(right, far))

    @property
    def window_keys(self) -> int | None:
        """Keys a row's window spans (left + right + 1) where both its sides are bounded, else None."""
        if self.window is None or min(self.window) < 0:
            return None
        return self.window[0] + self.window[1] + 1

    @property
    def longest_first(self) -> bool:
        """Query tiles differ in work (a triangle: causal, or a window unbounded on the left only), so grids
        that start every head's longest tiles first finish sooner."""
        if self.window is None:
            return self.causal
        return self.window[0] < 0 and self.window[1] >= 0

    # ------------------------------------------------------------------ the reference's side

    def visible(self, xp: Any, rows: Any, cols: Any, nq: int, nk: int) -> Any:
        """Boolean (len(rows), len(cols)): may query ``rows[a]`` see key ``cols[b]``? The reference's
        form of the policy's ``visible`` (cols are < nk by construction)."""
        if self.window is None and not self.causal:
            return xp.ones((len(rows), len(cols)), dtype=bool)
        left, right = self._bounds(nq, nk)
        diag = rows[:, None] + (nk - nq)
        return (cols[None, :] >= diag - left) & (cols[None, :] <= diag + right)

    def keys_of(self, q0: int, q1: int, nq: int, nk: int) -> tuple[int, int]:
        """Keys [begin, end) that any query of [q0, q1) may see (the policy's ``keys_of``)."""
        last = min(q1, nq) - 1
        if last < q0:
            return 0, 0
        left, right = self._bounds(nq, nk)
        off = nk - nq
        return max(0, q0 + off - left), max(0, min(nk, last + off + right + 1))

    def queries_of(self, k0: int, k1: int, nq: int, nk: int) -> tuple[int, int]:
        """Queries [begin, end) that may see any key of [k0, k1) (the policy's ``queries_of``)."""
        left, right = self._bounds(nq, nk)
        off = nk - nq
        return min(nq, max(0, k0 - off - right)), max(0, min(nq, k1 - off + left))

    def scores(self, xp: Any, s: Any, slopes: Any, rows: Any, cols: Any, nq: int, nk: int) -> Any:
        """Scaled scores ``s`` (..., len(rows), len(cols)) after softcap and ALiBi (float64). ``slopes``
        broadcasts against s's leading dims with a trailing (1, 1), or is None."""
        if self.softcap > 0:
            s = self.softcap * xp.tanh(s / self.softcap)
        if self.alibi:
            dist = xp.abs(rows[:, None] + (nk - nq) - cols[None, :]).astype(np.float64)
            s = s - slopes * dist
        return s

    def dscore(self, xp: Any, s_scaled: Any) -> Any:
        """d(score)/d(scale * q . k) from the scaled scores before softcap (1 without softcap)."""
        if self.softcap > 0:
            return 1.0 - xp.tanh(s_scaled / self.softcap) ** 2
        return 1.0


#: Mask x score policies every kernel family is compiled for (CI compiles each instantiation with each):
#: the plain ones first; a representative Variant of each policy type.
BUILTIN: tuple[Variant, ...] = (
    Variant(),
    Variant(causal=True),
    Variant(window=(8, 8)),
    Variant(softcap=30.0),
    Variant(causal=True, softcap=30.0),
    Variant(window=(8, 8), softcap=30.0),
    Variant(causal=True, alibi=True),  # AlibiScore: ALiBi without softcap (its other masks compile on demand)
    Variant(causal=True, softcap=30.0, alibi=True),  # ModScore: both (the three softcap rows above: SoftcapScore)
)
#: Mask/bias policies (issue 17): a representative few, compiled by CI for every family (not the whole cross
#: product: each adds one instantiation per kernel configuration).
ARRAYS: tuple[Variant, ...] = (
    Variant(causal=True, mask=True, bias="__nv_bfloat16"),
    Variant(window=(8, 8), softcap=30.0, mask=True, bias="float"),
)
PLAIN: tuple[Variant, ...] = BUILTIN[:2]
#: Every built-in policy also comes with dropout (a third policy member); CI compiles these representatives of
#: them only (tests/test_compile.py), to keep its compile time in budget.
DROPOUT: tuple[Variant, ...] = (Variant(dropout=0.1), Variant(causal=True, softcap=30.0, dropout=0.1))


def check_finite_nonneg(name: str, x: Any) -> float:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number; got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{name} must be finite and >= 0 (0 = off); got {x}")
    return x
