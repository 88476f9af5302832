"""Float64 reference for linear attention: W and the N x N scores materialised, short enough
to check by eye. Same signatures as ``cupyflash.linear_api``; results are float64 (the
public API rounds them once to the input dtype).

    A = scale * W o (Q K^T)          (..., Hq, Nq, Nk)
    O = A V
    dA = dO V^T
    dV = A^T dO,  dQ = (scale W o dA) K,  dK = (scale W o dA)^T Q   (dK, dV summed per GQA group)
    dmask = scale * (Q K^T) o dA o W_cd, summed to the mask's shape (W_cd: causal and decay only)
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .linear_validation import LinearProblem, check_linear, check_linear_backward


def _f64(x: Any) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"the linear-attention reference takes NumPy arrays; got {type(x).__name__}")
    return x.astype(np.float64)


def _kv(x: Any, p: LinearProblem) -> np.ndarray:
    """k or v repeated to one copy per query head (query head h reads kv head h // group)."""
    return np.repeat(_f64(x), p.base.group, axis=-3)


def _group_sum(x: np.ndarray, p: LinearProblem) -> np.ndarray:
    b = p.base
    return x.reshape(*b.batch, b.hk, b.group, *x.shape[-2:]).sum(axis=-3)


def causal_decay_weights(p: LinearProblem, decay: Any) -> np.ndarray:
    """W_cd, shape (Hq, Nq, Nk): causal indicator times decay[h] ** (i + Nk - Nq - j)."""
    b = p.base
    pos = np.arange(b.nq)[:, None] + (b.nk - b.nq)  # key position each query row sits at
    dist = pos - np.arange(b.nk)[None, :]
    w = np.ones((b.hq, b.nq, b.nk))
    if b.causal:
        w = w * (dist >= 0)
    if decay is not None:
        lam = _f64(decay)[:, None, None]
        w = w * lam ** np.maximum(dist, 0)
    return w


def _weights(p: LinearProblem, mask: Any, decay: Any) -> tuple[np.ndarray, np.ndarray]:
    """(W, W_cd): the full weight (..., Hq, Nq, Nk) and its causal/decay factor (Hq, Nq, Nk)."""
    wcd = causal_decay_weights(p, decay)
    w = np.broadcast_to(wcd, p.full_shape)
    if mask is not None:
        w = w * np.broadcast_to(_f64(mask), p.full_shape)
    return w, wcd


def sum_to_shape(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Undo a broadcast: sum x over the leading dims shape lacks and the dims where shape has 1."""
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead))) if lead else x
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def linear_attention_forward(
    q: Any, k: Any, v: Any, causal: bool = False, mask: Any = None, decay: Any = None, scale: float = 1.0
) -> np.ndarray:
    """o in float64 (no lse: linear attention has no normaliser)."""
    p = check_linear(q, k, v, causal=causal, mask=mask, decay=decay, scale=scale, allow_float64=True)
    w, _ = _weights(p, mask, decay)
    s = _f64(q) @ np.swapaxes(_kv(k, p), -1, -2)
    return (p.base.scale * w * s) @ _kv(v, p)


def linear_attention(
    q: Any, k: Any, v: Any, causal: bool = False, mask: Any = None, decay: Any = None, scale: float = 1.0
) -> np.ndarray:
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
) -> tuple[np.ndarray, ...]:
    """(dq, dk, dv[, dmask]) in float64; dmask summed to the mask's own shape."""
    p = check_linear_backward(
        do, q, k, v, causal=causal, mask=mask, decay=decay, scale=scale, mask_grad=mask_grad, allow_float64=True
    )
    sc = p.base.scale
    w, wcd = _weights(p, mask, decay)
    q64, k64, v64, do64 = _f64(q), _kv(k, p), _kv(v, p), _f64(do)
    s = q64 @ np.swapaxes(k64, -1, -2)
    da = do64 @ np.swapaxes(v64, -1, -2)
    ds = sc * w * da
    dq = ds @ k64
    dk = _group_sum(np.swapaxes(ds, -1, -2) @ q64, p)
    dv = _group_sum(np.swapaxes(sc * w * s, -1, -2) @ do64, p)
    if not mask_grad:
        return dq, dk, dv
    dmask = sum_to_shape(sc * s * da * wcd, p.mask_shape)  # type: ignore[arg-type]
    return dq, dk, dv, dmask


def linear_attention_vjp(
    q: Any,
    k: Any,
    v: Any,
    causal: bool = False,
    mask: Any = None,
    decay: Any = None,
    scale: float = 1.0,
    mask_grad: bool = False,
) -> tuple[np.ndarray, Callable[[Any], tuple[np.ndarray, ...]]]:
    """o (float64) and vjp(do) -> (dq, dk, dv[, dmask]) in float64."""
    if mask_grad and mask is None:
        raise ValueError("mask_grad=True needs a mask (there is nothing to differentiate)")
    o = linear_attention_forward(q, k, v, causal, mask, decay, scale)

    def vjp(do: Any) -> tuple[np.ndarray, ...]:
        return linear_attention_backward(do, q, k, v, causal, mask, decay, scale, mask_grad)

    return o, vjp


# ---------------------------------------------------------------------------- chunked mirror
#
# The chunked algorithm of cuda_src/linear_chunked.cu written as loops over chunks, with the
# kernels' index conventions (chunks of key positions, query row = position - (Nk - Nq), the
# three scan modes, the reverse state of Q^T dO). Small enough to follow the kernels side by
# side, and checked against the plain formulas above, so a kernel bug can be narrowed to one step.


def _per_head(x: Any, heads: int) -> np.ndarray:
    """(..., H, N, D) -> (B*H, N, D) float64."""
    x = _f64(x)
    return x.reshape(-1, heads, *x.shape[-2:]).reshape(-1, *x.shape[-2:])


def _lam(p: LinearProblem, decay: Any) -> np.ndarray:
    """lambda per query head (1 without decay)."""
    return np.ones(p.base.hq) if decay is None else _f64(decay)


def _chunk_state(x: np.ndarray, y: np.ndarray, lam: float, nrows: int, row_off: int, nch: int, rev: bool,
                 causal: bool, c_len: int) -> np.ndarray:
    """U_c = sum_r a_r x_r y_r^T per chunk (linear_chunk_state)."""
    d = x.shape[-1]
    u = np.zeros((nch, d, y.shape[-1]))
    for c in range(nch):
        for r in range(c_len):
            row = c * c_len + r - row_off
            if 0 <= row < nrows:
                a = lam ** ((r + 1) if rev else (c_len - r)) if causal else 1.0
                u[c] += a * np.outer(x[row], y[row])
    return u


def _scan(u: np.ndarray, lam: float, mode: str, c_len: int) -> np.ndarray:
    """linear_state_scan: exclusive forward/reverse prefix with lambda^C per chunk, or the total."""
    out = np.zeros_like(u)
    f = lam**c_len
    run = np.zeros_like(u[0])
    if mode == "total":
        out[0] = u.sum(axis=0)
        return out
    order = range(len(u)) if mode == "forward" else range(len(u) - 1, -1, -1)
    for c in order:
        out[c] = run
        run = f * run + u[c]
    return out


def _chunk_out(x, ys, zs, states, lams, nx, nyz, nch, off, causal, rev, scale, c_len, s_trans):
    """linear_chunk_out for one output head: x (nx, D); ys, zs, states, lams per summed query head."""
    o = np.zeros((nx, zs[0].shape[-1]))
    xoff = off if (causal and not rev) else 0
    yoff = off if (causal and rev) else 0
    for y, z, st, lam in zip(ys, zs, states, lams):
        for c in range(nch):
            xr = np.arange(c * c_len, (c + 1) * c_len) - xoff
            yr = np.arange(c * c_len, (c + 1) * c_len) - yoff
            xv = (xr >= 0) & (xr < nx)
            yv = (yr >= 0) & (yr < nyz)
            xc = np.where(xv[:, None], x[np.clip(xr, 0, nx - 1)], 0.0)
            acc = np.zeros((c_len, o.shape[-1]))
            if causal:
                yc = np.where(yv[:, None], y[np.clip(yr, 0, nyz - 1)], 0.0)
                zc = np.where(yv[:, None], z[np.clip(yr, 0, nyz - 1)], 0.0)
                r = np.arange(c_len)
                dist = (r[None, :] - r[:, None]) if rev else (r[:, None] - r[None, :])
                w = np.where(dist >= 0, lam ** np.maximum(dist, 0), 0.0)
                acc += (scale * w * (xc @ yc.T)) @ zc
            sc = st[c] if causal else st[0]
            sc = sc.T if s_trans else sc
            b = (lam ** ((c_len - 1 - np.arange(c_len)) if rev else np.arange(c_len))) if causal else np.ones(c_len)
            acc += (scale * b[:, None] * xc) @ sc
            o[xr[xv]] += acc[xv]
    return o


def chunked_forward(q: Any, k: Any, v: Any, causal: bool = False, decay: Any = None, scale: float = 1.0,
                    chunk: int = 64) -> np.ndarray:
    """o by the chunked state-form algorithm (no mask), float64, mirroring the kernels."""
    p = check_linear(q, k, v, causal=causal, decay=decay, scale=scale, allow_float64=True)
    b = p.base
    off = b.nk - b.nq
    qh, kh, vh = _per_head(q, b.hq), _per_head(k, b.hk), _per_head(v, b.hk)
    lam = _lam(p, decay)
    nst = -(-b.nk // chunk)
    nout = nst if causal else -(-b.nq // chunk)
    mode = "forward" if causal else "total"
    o = np.zeros_like(qh[..., :1].repeat(b.d, -1))
    for bh in range(qh.shape[0]):
        h = bh % b.hq
        kv = bh // b.hq * b.hk + h // b.group
        u = _chunk_state(kh[kv], vh[kv], lam[h], b.nk, 0, nst, False, causal, chunk)
        s = _scan(u, lam[h], mode, chunk)
        o[bh] = _chunk_out(qh[bh], [kh[kv]], [vh[kv]], [s], [lam[h]], b.nq, b.nk, nout, off, causal, False,
                           b.scale, chunk, False)
    return o.reshape(q.shape)


def chunked_backward(do: Any, q: Any, k: Any, v: Any, causal: bool = False, decay: Any = None,
                     scale: float = 1.0, chunk: int = 64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dq, dk, dv) by the chunked algorithm: dq from the forward state S^T, dk and dv from the
    reverse state R of Q^T dO, mirroring the kernels' launches."""
    p = check_linear_backward(do, q, k, v, causal=causal, decay=decay, scale=scale, allow_float64=True)
    b = p.base
    off = b.nk - b.nq
    qh, kh, vh, doh = _per_head(q, b.hq), _per_head(k, b.hk), _per_head(v, b.hk), _per_head(do, b.hq)
    lam = _lam(p, decay)
    nfwd = -(-b.nk // chunk)
    nrev = nfwd if causal else -(-b.nq // chunk)
    nq_out = nfwd if causal else -(-b.nq // chunk)
    nk_out = nfwd
    states_f, states_r = {}, {}
    dq = np.zeros_like(qh)
    for bh in range(qh.shape[0]):
        h = bh % b.hq
        kv = bh // b.hq * b.hk + h // b.group
        u = _chunk_state(kh[kv], vh[kv], lam[h], b.nk, 0, nfwd, False, causal, chunk)
        states_f[bh] = _scan(u, lam[h], "forward" if causal else "total", chunk)
        u = _chunk_state(qh[bh], doh[bh], lam[h], b.nq, off if causal else 0, nrev, True, causal, chunk)
        states_r[bh] = _scan(u, lam[h], "reverse" if causal else "total", chunk)
        dq[bh] = _chunk_out(doh[bh], [vh[kv]], [kh[kv]], [states_f[bh]], [lam[h]], b.nq, b.nk, nq_out, off, causal,
                            False, b.scale, chunk, True)
    dk = np.zeros_like(kh)
    dv = np.zeros_like(vh)
    for bk in range(kh.shape[0]):
        bi, hk = divmod(bk, b.hk)
        heads = [bi * b.hq + hk * b.group + g for g in range(b.group)]
        lams = [lam[bh % b.hq] for bh in heads]
        rs = [states_r[bh] for bh in heads]
        dk[bk] = _chunk_out(vh[bk], [doh[bh] for bh in heads], [qh[bh] for bh in heads], rs, lams, b.nk, b.nq,
                            nk_out, off, causal, True, b.scale, chunk, True)
        dv[bk] = _chunk_out(kh[bk], [qh[bh] for bh in heads], [doh[bh] for bh in heads], rs, lams, b.nk, b.nq,
                            nk_out, off, causal, True, b.scale, chunk, False)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


__all__ = [
    "causal_decay_weights",
    "chunked_backward",
    "chunked_forward",
    "linear_attention",
    "linear_attention_forward",
    "linear_attention_backward",
    "linear_attention_vjp",
    "sum_to_shape",
]
