"""Linear attention (TransNormerLLM-style): no softmax, no normaliser.

    o[..., h, i, :] = scale * sum_j W[h, i, j] * (q_i . k_j) * v_j

W is the product of an optional ``mask`` (any real array broadcastable to (..., Hq, Nq, Nk)),
the causal indicator ``j <= i + (Nk - Nq)`` when ``causal`` and ``decay[h] ** (i + Nk - Nq - j)``
when a per-head ``decay`` (shape (Hq,), values in (0, 1], causal only) is given. decay may be
host data (a NumPy array, list or tuple) for either backend: its values are checked on the host and
copied to the device once per value set, so a CuPy call with host rates never waits on the GPU; a
CuPy decay (CuPy inputs only) costs one small device-to-host copy, which synchronises the stream,
for that check.

The array type picks the backend: CuPy arrays run the CUDA kernels (``kernels/linear.py``) on
the current device and stream; NumPy arrays run the float64 reference and round once to the
input dtype. Everything is checked before anything is allocated or launched.
"""
from __future__ import annotations

from typing import Any, Callable

from .kernels import linear as _kernels
from .linear_validation import check_linear, check_linear_backward, dmask_dtype, host_decay


def linear_attention_forward(
    q: Any, k: Any, v: Any, causal: bool = False, mask: Any = None, decay: Any = None, scale: float = 1.0
) -> Any:
    """Linear attention output ``o`` (q's shape and dtype).

    There is no lse: without a softmax nothing needs saving for the backward but the inputs.
    Causal problems without a mask run the chunked O(N D^2) kernels (a running D x D state);
    a mask runs the tiled O(N^2 D) kernel that streams mask tiles through its strides.
    """
    key = None
    if mask is None and decay is None:  # a plain call: a signature seen before repeats its launches (issue 12)
        o, key = _kernels.plain_forward(q, k, v, causal, scale)
        if o is not None:
            return o
    decay = host_decay(decay)
    p = check_linear(q, k, v, causal=causal, mask=mask, decay=decay, scale=scale)
    if p.base.xp == "numpy":
        from . import linear_reference

        o = linear_reference.linear_attention_forward(q, k, v, causal=causal, mask=mask, decay=decay, scale=p.base.scale)
        return o.astype(p.base.dtype)
    return _kernels.forward(q, k, v, mask, decay, p, plain_key=key)


def linear_attention(
    q: Any, k: Any, v: Any, causal: bool = False, mask: Any = None, decay: Any = None, scale: float = 1.0
) -> Any:
    """``o = scale * (W o (q k^T)) v`` per head; see ``linear_attention_forward``."""
    return linear_attention_forward(q, k, v, causal, mask, decay, scale)


def linear_attention_backward(
    do: Any,
    q: Any,
    k: Any,
    v: Any,
    causal: bool = False,
    mask: Any = None,
    decay: Any = None,
    scale: float = 1.0,
    mask_grad: bool = False,
) -> tuple[Any, ...]:
    """(dq, dk, dv), or (dq, dk, dv, dmask) with ``mask_grad=True``.

    dk and dv have k's and v's shapes (summed over each GQA group). dmask has the mask's own
    shape (summed over the dims it broadcasts along) and dtype (float32 for a bool or integer
    mask). ``decay`` is treated as a constant.
    """
    decay = host_decay(decay)
    p = check_linear_backward(do, q, k, v, causal=causal, mask=mask, decay=decay, scale=scale, mask_grad=mask_grad)
    if p.base.xp == "numpy":
        from . import linear_reference

        grads = linear_reference.linear_attention_backward(
            do, q, k, v, causal=causal, mask=mask, decay=decay, scale=p.base.scale, mask_grad=mask_grad
        )
        out = [g.astype(p.base.dtype) for g in grads[:3]]
        if mask_grad:
            out.append(grads[3].astype(dmask_dtype(p.mask_dtype)))
        return tuple(out)
    return _kernels.backward(do, q, k, v, mask, decay, p, mask_grad)


def linear_attention_vjp(
    q: Any,
    k: Any,
    v: Any,
    causal: bool = False,
    mask: Any = None,
    decay: Any = None,
    scale: float = 1.0,
    mask_grad: bool = False,
) -> tuple[Any, Callable[[Any], tuple[Any, ...]]]:
    """``o`` and ``vjp(do) -> (dq, dk, dv[, dmask])`` (the backward needs only the inputs)."""
    if mask_grad and mask is None:
        raise ValueError("mask_grad=True needs a mask (there is nothing to differentiate)")
    o = linear_attention_forward(q, k, v, causal, mask, decay, scale)

    def vjp(do: Any) -> tuple[Any, ...]:
        return linear_attention_backward(do, q, k, v, causal, mask, decay, scale, mask_grad)

    return o, vjp


__all__ = [
    "linear_attention",
    "linear_attention_forward",
    "linear_attention_backward",
    "linear_attention_vjp",
]

