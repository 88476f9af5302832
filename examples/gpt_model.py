"""A small decoder-only transformer (GPT-2 style, pre-LN) with a hand-written backward.

Every layer is a pair of plain functions, ``*_forward`` returning ``(out, cache)`` and
``*_backward`` taking ``(dout, cache)``, written against an array module ``xp`` (NumPy or
CuPy, picked from the arrays themselves) so the same code trains on a GPU in float32 and is
checked on the CPU in float64 against finite differences (tests/test_train_gpt.py).

Read top to bottom: layers, packed documents, the two attention cores (cupyflash and a naive
one that materialises P), the model (parameters live in one flat buffer, as in llm.c, so AdamW
and gradient clipping are a handful of whole-buffer operations), AdamW, and a
finite-difference helper.

Shapes: B batch, T sequence, C = d_model, H heads, D = C / H, V vocabulary. A packed batch
(``Packing``) is one row, B = 1, of T tokens holding several documents end to end: each token
takes its position within its document, and attention stays inside each document
(``cupyflash.attention_varlen_forward``/``_backward``, no padding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

Array = Any  # numpy.ndarray or cupy.ndarray


def get_xp(x: Array) -> Any:
    """The array module of ``x`` (CuPy if it is a CuPy array, else NumPy)."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


# ---------------------------------------------------------------------------- layers


def embedding_forward(idx: Array, wte: Array, wpe: Array, positions: Array | None = None) -> tuple[Array, Any]:
    """Token plus learned position embedding: (B, T) int -> (B, T, C). Token t sits at
    position t, or at ``positions[t]`` (its place in its document, for a packed row)."""
    T = idx.shape[1]
    pos = wpe[:T] if positions is None else wpe[positions]
    return wte[idx] + pos, (idx, positions)


def _onehot_sum(index: Array, n: int, rows: Array) -> Array:
    """sum of rows (M, C) into n buckets by index (M,): a one-hot matmul. With a byte vocabulary
    (or n_pos positions) the one-hot matrix is small, and a GEMM sums repeated indices without
    atomics, so the result is the same on every run."""
    xp = get_xp(rows)
    onehot = (index.reshape(-1, 1) == xp.arange(n)).astype(rows.dtype)  # (M, n)
    return onehot.T @ rows


def embedding_backward(dout: Array, cache: Any, vocab_size: int, n_pos: int) -> tuple[Array, Array]:
    """(dwte (V, C), dwpe (n_pos, C))."""
    xp = get_xp(dout)
    idx, positions = cache
    B, T, C = dout.shape
    dwte = _onehot_sum(idx, vocab_size, dout.reshape(B * T, C))
    if positions is not None:
        return dwte, _onehot_sum(xp.broadcast_to(positions, (B, T)), n_pos, dout.reshape(B * T, C))
    dwpe = xp.zeros((n_pos, C), dtype=dout.dtype)
    dwpe[:T] = dout.sum(axis=0)
    return dwte, dwpe


def layernorm_forward(x: Array, w: Array, b: Array, eps: float = 1e-5) -> tuple[Array, Any]:
    xp = get_xp(x)
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    rstd = 1.0 / xp.sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
    xhat = xc * rstd
    return xhat * w + b, (xhat, rstd, w)


def layernorm_backward(dout: Array, cache: Any) -> tuple[Array, Array, Array]:
    xhat, rstd, w = cache
    C = dout.shape[-1]
    dw = (dout * xhat).reshape(-1, C).sum(axis=0)
    db = dout.reshape(-1, C).sum(axis=0)
    dxhat = dout * w
    # d/dx of (x - mean) * rstd: remove the mean of dxhat and its component along xhat.
    dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True) - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, dw, db


def linear_forward(x: Array, w: Array, b: Array) -> tuple[Array, Any]:
    """x (..., Cin) @ w (Cin, Cout) + b, as one 2-D GEMM."""
    cin, cout = w.shape
    out = (x.reshape(-1, cin) @ w + b).reshape(*x.shape[:-1], cout)
    return out, (x, w)


def linear_backward(dout: Array, cache: Any) -> tuple[Array, Array, Array]:
    x, w = cache
    cin, cout = w.shape
    d2 = dout.reshape(-1, cout)
    dx = (d2 @ w.T).reshape(x.shape)
    dw = x.reshape(-1, cin).T @ d2
    db = d2.sum(axis=0)
    return dx, dw, db


GELU_C = math.sqrt(2.0 / math.pi)


def gelu_forward(x: Array) -> tuple[Array, Any]:
    """GELU, tanh approximation (GPT-2). Caches only x: tanh is recomputed in the backward."""
    xp = get_xp(x)
    t = xp.tanh(GELU_C * (x + 0.044715 * x * x * x))
    return 0.5 * x * (1.0 + t), x


def gelu_backward(dout: Array, x: Array) -> Array:
    xp = get_xp(x)
    t = xp.tanh(GELU_C * (x + 0.044715 * x * x * x))
    du_dx = GELU_C * (1.0 + 3.0 * 0.044715 * x * x)
    return dout * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du_dx)


def residual_forward(x: Array, y: Array) -> Array:
    return x + y


def residual_backward(dout: Array) -> tuple[Array, Array]:
    """The sum passes its gradient unchanged to both branches."""
    return dout, dout


def cross_entropy_forward(logits: Array, targets: Array) -> tuple[Array, Any]:
    """Mean over B*T of -log softmax(logits)[target]; caches the probabilities."""
    xp = get_xp(logits)
    V = logits.shape[-1]
    z = logits.reshape(-1, V)
    z = z - z.max(axis=-1, keepdims=True)  # stable: the largest exponent is 0
    lse = xp.log(xp.exp(z).sum(axis=-1, keepdims=True))
    logp = z - lse
    t = targets.reshape(-1)
    loss = -logp[xp.arange(t.size), t].mean()
    return loss, (xp.exp(logp), t, logits.shape)


def cross_entropy_backward(cache: Any) -> Array:
    """d loss / d logits = (softmax - onehot(target)) / (B*T)."""
    probs, t, shape = cache
    xp = get_xp(probs)
    dlogits = probs.copy()
    dlogits[xp.arange(t.size), t] -= 1.0
    dlogits /= t.size
    return dlogits.reshape(shape)


# ---------------------------------------------------------------------------- packed documents


@dataclass(frozen=True)
class Packing:
    """Documents packed end to end in one row of T tokens (B = 1), FlashAttention's varlen layout:
    document b owns tokens ``cu_seqlens[b]:cu_seqlens[b + 1]``. Built on the host from the
    lengths, so ``max_seqlen`` is known without reading the device."""

    cu_seqlens: Array  # int32 (n_docs + 1,), on the model's device
    max_seqlen: int
    positions: Array  # int64 (T,): each token's position within its document
    segments: Array  # int32 (T,): each token's document (for the naive core's mask)

    @classmethod
    def from_lengths(cls, xp: Any, lengths: Any) -> "Packing":
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or lengths.size == 0 or np.any(lengths <= 0):
            raise ValueError(f"document lengths must be a non-empty list of positive ints; got {lengths}")
        cu = np.concatenate([[0], np.cumsum(lengths)])
        segments = np.repeat(np.arange(lengths.size), lengths)
        positions = np.arange(cu[-1]) - cu[segments]
        return cls(xp.asarray(cu.astype(np.int32)), int(lengths.max()), xp.asarray(positions),
                   xp.asarray(segments.astype(np.int32)))  # fmt: skip

    @property
    def total(self) -> int:
        return int(self.positions.shape[0])


def _packed(x: Array) -> Array:
    """A (1, H, T, D) view as the packed layout (T, H, D) (a view)."""
    return x[0].transpose(1, 0, 2)


def _unpacked(x: Array) -> Array:
    """(T, H, D) as a (1, H, T, D) view."""
    return x.transpose(1, 0, 2)[None]


# ---------------------------------------------------------------------------- attention cores
# Both take q, k, v of shape (B, H, T, D) (any strides with a unit last one) and apply a
# causal mask; forward returns (o, cache), backward returns (dq, dk, dv). With a Packing
# (B = 1), each token attends only to the earlier tokens of its own document.


class FlashAttention:
    """cupyflash: O(T) memory; the backward recomputes P from (o, lse) tile by tile.

    ``dtype`` is the precision the kernels run in (float32, float16 or bfloat16); inputs
    of another dtype are cast to it and results cast back. Float64 NumPy models (the CPU
    tests) use cupyflash.reference, the float64 ground truth; float64 CuPy models use the
    float32 kernels, the most precise ones cupyflash has.
    """

    name = "flash"

    def __init__(self, dtype: Any = None, kernel: str = "auto") -> None:
        if isinstance(dtype, str) and dtype == "bfloat16":
            import ml_dtypes  # NumPy has no bfloat16; ml_dtypes' is the one CuPy understands

            dtype = ml_dtypes.bfloat16
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.kernel = kernel

    def compute_dtype(self, xp: Any, dtype: np.dtype) -> np.dtype:
        if self.dtype is not None:
            return self.dtype
        if dtype == np.float64 and xp is not np:
            return np.dtype(np.float32)
        return np.dtype(dtype)

    def forward(self, q: Array, k: Array, v: Array, packing: Packing | None = None) -> tuple[Array, Any]:
        import cupyflash

        xp = get_xp(q)
        out_dtype = q.dtype
        cdt = self.compute_dtype(xp, np.dtype(q.dtype))
        if cdt != np.float64:
            q, k, v = (x if x.dtype == cdt else x.astype(cdt) for x in (q, k, v))
        if packing is not None:  # one varlen call over the whole row: no padding, no call per document
            lib = cupyflash.reference if cdt == np.float64 else cupyflash
            extra = {} if cdt == np.float64 else {"kernel": self.kernel}
            cu, m = packing.cu_seqlens, packing.max_seqlen
            o, lse = lib.attention_varlen_forward(*map(_packed, (q, k, v)), cu, cu, m, m, causal=True, **extra)
            o = _unpacked(o)
        elif cdt == np.float64:
            o, lse = cupyflash.reference.attention_forward(q, k, v, causal=True)
        else:
            o, lse = cupyflash.attention_forward(q, k, v, causal=True, kernel=self.kernel)
        return o.astype(out_dtype, copy=False), (q, k, v, o, lse, cdt, packing)

    def backward(self, do: Array, cache: Any) -> tuple[Array, Array, Array]:
        import cupyflash

        q, k, v, o, lse, cdt, packing = cache
        out_dtype = do.dtype
        if cdt != np.float64:
            do = do if do.dtype == cdt else do.astype(cdt)
        if packing is not None:
            lib = cupyflash.reference if cdt == np.float64 else cupyflash
            extra = {} if cdt == np.float64 else {"kernel": self.kernel}
            cu, m = packing.cu_seqlens, packing.max_seqlen
            grads = lib.attention_varlen_backward(*map(_packed, (do, q, k, v, o)), lse, cu, cu, m, m, causal=True,
                                                  **extra)  # fmt: skip
            grads = tuple(map(_unpacked, grads))
        elif cdt == np.float64:
            grads = cupyflash.reference.attention_backward(do, q, k, v, o, lse, causal=True)
        else:
            grads = cupyflash.attention_backward(do, q, k, v, o, lse, causal=True, kernel=self.kernel)
        return tuple(g.astype(out_dtype, copy=False) for g in grads)  # type: ignore[return-value]


class NaiveAttention:
    """The textbook computation: S = scale q k^T, causal mask, P = softmax(S), o = P v.

    It keeps P, a (B, H, T, T) array per layer, for the backward: this is the O(T^2)
    memory that FlashAttention avoids. Runs in the inputs' dtype.
    """

    name = "naive"

    def __init__(self) -> None:
        self._mask: dict[tuple[Any, int, str], Array] = {}

    def causal_bias(self, xp: Any, T: int, dtype: Any) -> Array:
        """(T, T): 0 where key j <= query i, -inf above the diagonal; made once per shape."""
        key = (xp, T, np.dtype(dtype).str)
        if key not in self._mask:
            self._mask[key] = xp.asarray(np.triu(np.full((T, T), -np.inf), k=1).astype(dtype))
        return self._mask[key]

    @staticmethod
    def packed_bias(packing: Packing, dtype: Any) -> Array:
        """(T, T): 0 where key j is in query i's document and j <= i, else -inf (block-diagonal causal)."""
        xp = get_xp(packing.segments)
        seg = packing.segments
        T = seg.shape[0]
        visible = (seg[:, None] == seg[None, :]) & (xp.arange(T)[None, :] <= xp.arange(T)[:, None])
        return xp.where(visible, 0.0, -np.inf).astype(dtype)

    def forward(self, q: Array, k: Array, v: Array, packing: Packing | None = None) -> tuple[Array, Any]:
        xp = get_xp(q)
        T, D = q.shape[-2], q.shape[-1]
        scale = 1.0 / math.sqrt(D)
        S = q @ k.swapaxes(-1, -2)
        S *= scale
        # In place: no second T x T array per head. Every row sees at least its own key.
        S += self.causal_bias(xp, T, S.dtype) if packing is None else self.packed_bias(packing, S.dtype)
        S -= S.max(axis=-1, keepdims=True)
        P = xp.exp(S, out=S)  # reuse S's memory: only P is kept
        P /= P.sum(axis=-1, keepdims=True)
        return P @ v, (q, k, v, P, scale)

    def backward(self, do: Array, cache: Any) -> tuple[Array, Array, Array]:
        q, k, v, P, scale = cache
        dv = P.swapaxes(-1, -2) @ do
        dP = do @ v.swapaxes(-1, -2)
        # softmax backward: dS = P * (dP - rowsum(P * dP)); masked entries have P = 0.
        dS = P * (dP - (P * dP).sum(axis=-1, keepdims=True))
        dq = (dS @ k) * scale
        dk = (dS.swapaxes(-1, -2) @ q) * scale
        return dq, dk, dv


def attention_forward(x: Array, w: Array, b: Array, proj_w: Array, proj_b: Array, n_head: int, core: Any,
                      packing: Packing | None = None):  # fmt: skip
    """Causal self-attention sub-layer: qkv projection, core attention over heads, output
    projection. q, k and v are strided (B, H, T, D) views of the qkv activation: no copy.
    With ``packing`` (B = 1) each document attends only to itself."""
    B, T, C = x.shape
    D = C // n_head
    qkv, c_qkv = linear_forward(x, w, b)
    qkv5 = qkv.reshape(B, T, 3, n_head, D)
    q, k, v = (qkv5[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    o, c_core = core.forward(q, k, v) if packing is None else core.forward(q, k, v, packing)
    y = o.transpose(0, 2, 1, 3).reshape(B, T, C)  # merge heads (a copy)
    out, c_proj = linear_forward(y, proj_w, proj_b)
    return out, (c_qkv, c_core, c_proj, core, (B, T, C, n_head, D))


def attention_backward(dout: Array, cache: Any):
    """-> (dx, dw, db, dproj_w, dproj_b)."""
    c_qkv, c_core, c_proj, core, (B, T, C, H, D) = cache
    xp = get_xp(dout)
    dy, dproj_w, dproj_b = linear_backward(dout, c_proj)
    do = dy.reshape(B, T, H, D).transpose(0, 2, 1, 3)
    dq, dk, dv = core.backward(do, c_core)
    dqkv = xp.empty((B, T, 3, H, D), dtype=dout.dtype)
    for i, g in enumerate((dq, dk, dv)):
        dqkv[:, :, i] = g.transpose(0, 2, 1, 3)
    dx, dw, db = linear_backward(dqkv.reshape(B, T, 3 * C), c_qkv)
    return dx, dw, db, dproj_w, dproj_b


# ---------------------------------------------------------------------------- model


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    seq_len: int = 512
    n_layer: int = 6
    n_head: int = 8
    d_model: int = 512

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def param_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter, in the order of the flat buffer. The output head reuses wte (tied)."""
    C, V = cfg.d_model, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"wte": (V, C), "wpe": (cfg.seq_len, C)}
    for l in range(cfg.n_layer):
        shapes |= {
            f"h{l}.ln1_w": (C,), f"h{l}.ln1_b": (C,),
            f"h{l}.attn_w": (C, 3 * C), f"h{l}.attn_b": (3 * C,),
            f"h{l}.proj_w": (C, C), f"h{l}.proj_b": (C,),
            f"h{l}.ln2_w": (C,), f"h{l}.ln2_b": (C,),
            f"h{l}.fc_w": (C, 4 * C), f"h{l}.fc_b": (4 * C,),
            f"h{l}.fcproj_w": (4 * C, C), f"h{l}.fcproj_b": (C,),
        }  # fmt: skip
    shapes |= {"lnf_w": (C,), "lnf_b": (C,)}
    return shapes


def init_params(cfg: GPTConfig, seed: int, dtype: Any = np.float32) -> np.ndarray:
    """GPT-2 initialisation on the host (so every device and attention core starts from
    the same numbers): N(0, 0.02) matrices, projections into the residual stream scaled by
    1/sqrt(2 n_layer), zero biases, unit layer-norm gains. Returns the flat buffer."""
    rng = np.random.default_rng(seed)
    chunks = []
    for name, shape in param_shapes(cfg).items():
        if name.endswith(("ln1_w", "ln2_w", "lnf_w")):
            p = np.ones(shape)
        elif len(shape) == 1:
            p = np.zeros(shape)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("proj_w", "fcproj_w")) else 0.02
            p = rng.normal(0.0, std, size=shape)
        chunks.append(p.reshape(-1))
    return np.concatenate(chunks).astype(dtype)


class ParamStore:
    """Parameters and their gradients as two flat buffers with named views into them."""

    def __init__(self, cfg: GPTConfig, flat: Array) -> None:
        xp = get_xp(flat)
        self.shapes = param_shapes(cfg)
        self.data = flat
        self.grad = xp.zeros_like(flat)
        self.params: dict[str, Array] = {}
        self.grads: dict[str, Array] = {}
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, shape in self.shapes.items():
            n = math.prod(shape)
            self.offsets[name] = offset
            self.params[name] = flat[offset : offset + n].reshape(shape)
            self.grads[name] = self.grad[offset : offset + n].reshape(shape)
            offset += n
        assert offset == flat.size, (offset, flat.size)

    def decay_mask(self) -> Array:
        """1 for entries of matrices (weights and embeddings), 0 for biases and LN gains."""
        xp = get_xp(self.data)
        mask = np.zeros(self.data.size, dtype=self.data.dtype)
        for name, shape in self.shapes.items():
            if len(shape) == 2:
                mask[self.offsets[name] : self.offsets[name] + math.prod(shape)] = 1
        return xp.asarray(mask)


class GPT:
    """Pre-LN decoder: x = emb; per block x += attn(ln1(x)); x += mlp(ln2(x)); logits = lnf(x) wte^T."""

    def __init__(self, cfg: GPTConfig, store: ParamStore, core: Any) -> None:
        self.cfg, self.store, self.core = cfg, store, core
        self.caches: list[Any] | None = None

    def forward(self, idx: Array, targets: Array | None = None, packing: Packing | None = None) -> Array:
        """Mean cross-entropy loss (a 0-d array) if targets are given, else logits (B, T, V).
        With ``packing``, idx is one row (1, T) of documents end to end (see ``Packing``)."""
        cfg, p = self.cfg, self.store.params
        if packing is not None and (idx.shape[0] != 1 or idx.shape[1] != packing.total):
            raise ValueError(f"a packed batch is one row of {packing.total} tokens; got idx of shape {idx.shape}")
        if packing is not None and packing.max_seqlen > cfg.seq_len:
            raise ValueError(f"a document of {packing.max_seqlen} tokens is longer than seq_len = {cfg.seq_len} "
                             "(the position embedding's rows)")  # fmt: skip
        caches: list[Any] = []
        x, c = embedding_forward(idx, p["wte"], p["wpe"], None if packing is None else packing.positions)
        caches.append(c)
        for l in range(cfg.n_layer):
            h, c_ln1 = layernorm_forward(x, p[f"h{l}.ln1_w"], p[f"h{l}.ln1_b"])
            a, c_attn = attention_forward(
                h, p[f"h{l}.attn_w"], p[f"h{l}.attn_b"], p[f"h{l}.proj_w"], p[f"h{l}.proj_b"], cfg.n_head, self.core,
                packing,
            )
            x = residual_forward(x, a)
            h, c_ln2 = layernorm_forward(x, p[f"h{l}.ln2_w"], p[f"h{l}.ln2_b"])
            f, c_fc = linear_forward(h, p[f"h{l}.fc_w"], p[f"h{l}.fc_b"])
            g, c_gelu = gelu_forward(f)
            m, c_fcproj = linear_forward(g, p[f"h{l}.fcproj_w"], p[f"h{l}.fcproj_b"])
            x = residual_forward(x, m)
            caches.append((c_ln1, c_attn, c_ln2, c_fc, c_gelu, c_fcproj))
        h, c_lnf = layernorm_forward(x, p["lnf_w"], p["lnf_b"])
        B, T, C = h.shape
        logits = (h.reshape(B * T, C) @ p["wte"].T).reshape(B, T, cfg.vocab_size)
        if targets is None:
            self.caches = None
            return logits
        loss, c_ce = cross_entropy_forward(logits, targets)
        caches.append((c_lnf, h, c_ce))
        self.caches = caches
        return loss

    def backward(self) -> None:
        """Writes d loss / d parameters of the last forward into ``store.grad``."""
        assert self.caches is not None, "backward needs a forward with targets"
        cfg, g = self.cfg, self.store.grads
        c_emb, *blocks, (c_lnf, h, c_ce) = self.caches
        dlogits = cross_entropy_backward(c_ce)
        B, T, V = dlogits.shape
        d2 = dlogits.reshape(B * T, V)
        dwte_head = d2.T @ h.reshape(B * T, -1)
        dx = (d2 @ self.store.params["wte"]).reshape(B, T, -1)
        dx, g["lnf_w"][...], g["lnf_b"][...] = layernorm_backward(dx, c_lnf)
        for l in reversed(range(cfg.n_layer)):
            c_ln1, c_attn, c_ln2, c_fc, c_gelu, c_fcproj = blocks[l]
            dx, dm = residual_backward(dx)
            dg, g[f"h{l}.fcproj_w"][...], g[f"h{l}.fcproj_b"][...] = linear_backward(dm, c_fcproj)
            df = gelu_backward(dg, c_gelu)
            dh, g[f"h{l}.fc_w"][...], g[f"h{l}.fc_b"][...] = linear_backward(df, c_fc)
            dh, g[f"h{l}.ln2_w"][...], g[f"h{l}.ln2_b"][...] = layernorm_backward(dh, c_ln2)
            dx = dx + dh
            dx, da = residual_backward(dx)
            dh, g[f"h{l}.attn_w"][...], g[f"h{l}.attn_b"][...], g[f"h{l}.proj_w"][...], g[f"h{l}.proj_b"][...] = (
                attention_backward(da, c_attn)
            )
            dh, g[f"h{l}.ln1_w"][...], g[f"h{l}.ln1_b"][...] = layernorm_backward(dh, c_ln1)
            dx = dx + dh
        dwte_emb, g["wpe"][...] = embedding_backward(dx, c_emb, cfg.vocab_size, cfg.seq_len)
        g["wte"][...] = dwte_head + dwte_emb  # tied: the embedding and the output head
        self.caches = None  # free the activations

    def loss_and_grad(self, idx: Array, targets: Array, packing: Packing | None = None) -> Array:
        loss = self.forward(idx, targets, packing)
        self.backward()
        return loss


def save_params(path: Any, cfg: GPTConfig, flat: Array) -> None:
    """The flat parameter buffer and the configuration in one .npz file (host copies)."""
    host = flat.get() if hasattr(flat, "get") else np.asarray(flat)
    np.savez(path, params=host, config=np.array([cfg.vocab_size, cfg.seq_len, cfg.n_layer, cfg.n_head, cfg.d_model]))


def load_params(path: Any) -> tuple[GPTConfig, np.ndarray]:
    """(config, flat host buffer) written by ``save_params``."""
    with np.load(path) as f:
        cfg = GPTConfig(*(int(x) for x in f["config"]))
        flat = f["params"]
    expected = sum(math.prod(s) for s in param_shapes(cfg).values())
    if flat.ndim != 1 or flat.size != expected:
        raise ValueError(f"{path}: {flat.size} parameters for a model that has {expected}")
    return cfg, flat


# ---------------------------------------------------------------------------- optimiser


def clip_grad_norm(store: ParamStore, max_norm: float) -> Array:
    """Scale the whole gradient so its global L2 norm is at most max_norm; returns the
    norm before clipping (a 0-d array: no host sync here)."""
    xp = get_xp(store.grad)
    norm = xp.sqrt((store.grad * store.grad).sum())
    if max_norm > 0:
        store.grad *= xp.minimum(1.0, max_norm / (norm + 1e-6)).astype(store.grad.dtype)
    return norm


class AdamW:
    """Adam with bias correction and decoupled weight decay (Loshchilov & Hutter) applied
    to matrices only, over the flat buffers: a few elementwise passes per step."""

    def __init__(
        self, store: ParamStore, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1
    ) -> None:
        xp = get_xp(store.data)
        self.store = store
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self.m = xp.zeros_like(store.data)
        self.v = xp.zeros_like(store.data)
        self.decay = store.decay_mask()
        self.t = 0

    def step(self, lr: float) -> None:
        xp = get_xp(self.store.data)
        p, g = self.store.data, self.store.grad
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        self.m *= b1
        self.m += (1 - b1) * g
        self.v *= b2
        self.v += (1 - b2) * (g * g)
        m_hat = self.m / (1 - b1**self.t)  # bias correction: m and v start at zero
        v_hat = self.v / (1 - b2**self.t)
        p -= lr * (m_hat / (xp.sqrt(v_hat) + self.eps) + self.weight_decay * self.decay * p)


# ---------------------------------------------------------------------------- checks


def finite_difference(loss_fn: Callable[[], float], data: Array, index: int, eps: float) -> float:
    """Central difference of loss_fn with respect to data.flat[index] (restored after)."""
    flat = data.reshape(-1)
    old = flat[index].item()
    flat[index] = old + eps
    up = float(loss_fn())
    flat[index] = old - eps
    down = float(loss_fn())
    flat[index] = old
    return (up - down) / (2 * eps)


def directional_difference(loss_fn: Callable[[], float], data: Array, direction: Array, eps: float) -> float:
    """Central difference of loss_fn along ``direction`` (same shape as data)."""
    old = data.copy()
    data += eps * direction
    up = float(loss_fn())
    data[...] = old - eps * direction
    down = float(loss_fn())
    data[...] = old
    return (up - down) / (2 * eps)
