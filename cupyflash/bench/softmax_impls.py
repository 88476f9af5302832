"""Softmax attention implementations: cupyflash (per kernel family), naive CuPy, and the
PyTorch SDPA backends, each a ``prepare`` function that returns a timed ``Prepared`` call."""
from __future__ import annotations

import contextlib
import math
from typing import Any, Sequence

from .cli import Options
from .device import to_torch
from .impls import Impl, InputSet, Prepared, Unavailable, first_line, require_cupy_matmul
from .shapes import Shape, fmt_bytes, heads_per_chunk, naive_scores_bytes, naive_softmax_head_bytes


# ---------------------------------------------------------------------------- softmax impls


def cupyflash_impl(kernel: str) -> Impl:
    def prepare(shape: Shape, pass_: str, sets: Sequence[InputSet], opts: Options) -> Prepared:
        import cupyflash as cf

        c = shape.causal
        try:
            o0, lse0 = cf.attention_forward(sets[0].q, sets[0].k, sets[0].v, c, kernel=kernel)
        except TypeError as e:  # dispatch refuses the dtype/head dim/arch for this family
            raise Unavailable(str(e)) from e
        if pass_ == "fwd":
            del o0, lse0
            return Prepared(lambda i: cf.attention_forward(sets[i].q, sets[i].k, sets[i].v, c, kernel=kernel), "cupy")
        key = f"cupyflash[{kernel}]"
        for j, s in enumerate(sets):  # backward alone: o and lse come from outside the timed region
            if key not in s.derived:
                s.derived[key] = (o0, lse0) if j == 0 else cf.attention_forward(s.q, s.k, s.v, c, kernel=kernel)

        def bwd(i: int) -> Any:
            s = sets[i]
            o, lse = s.derived[key]
            return cf.attention_backward(s.do, s.q, s.k, s.v, o, lse, c, kernel=kernel)

        return Prepared(bwd, "cupy")

    return prepare


def naive_attention_forward(q: Any, k: Any, v: Any, causal: bool, scale: float, chunk: int) -> Any:
    """softmax(scale q k^T) v with the scores in the input dtype and the softmax in float32,
    ``chunk`` heads at a time so the N x N matrices fit the memory budget."""
    import cupy

    b, h, n, d = q.shape
    q3, k3, v3 = (x.reshape(b * h, n, d) for x in (q, k, v))
    out = cupy.empty_like(q3)
    bias = None
    if causal:  # bottom-right aligned, Nq == Nk here
        bias = cupy.triu(cupy.full((n, n), -cupy.inf, dtype=cupy.float32), k=1)  # -inf where j > i
    for s in range(0, b * h, chunk):
        e = min(b * h, s + chunk)
        S = cupy.matmul(q3[s:e], k3[s:e].transpose(0, 2, 1)).astype(cupy.float32, copy=False)
        S *= cupy.float32(scale)
        if bias is not None:
            S += bias
        S -= S.max(axis=-1, keepdims=True)
        cupy.exp(S, out=S)
        S /= S.sum(axis=-1, keepdims=True)
        out[s:e] = cupy.matmul(S.astype(q.dtype), v3[s:e])
        del S
    return out.reshape(b, h, n, d)


def naive_impl(shape: Shape, pass_: str, sets: Sequence[InputSet], opts: Options) -> Prepared:
    if pass_ != "fwd":
        raise Unavailable("naive is benchmarked forward only")
    require_cupy_matmul(shape.dtype)
    mask = shape.n * shape.n * 4 if shape.causal else 0
    chunk = heads_per_chunk(naive_softmax_head_bytes(shape.n, shape.itemsize), mask, opts.naive_budget_bytes)
    if chunk == 0:
        need = naive_softmax_head_bytes(shape.n, shape.itemsize) + mask
        raise Unavailable(
            f"one head's N x N scores need {fmt_bytes(need)} > budget {fmt_bytes(opts.naive_budget_bytes)} "
            f"(all heads: {fmt_bytes(naive_scores_bytes(shape))} in {shape.dtype}); raise --naive-budget-gb"
        )
    scale = 1.0 / math.sqrt(shape.d)
    return Prepared(
        lambda i: naive_attention_forward(sets[i].q, sets[i].k, sets[i].v, shape.causal, scale, chunk), "cupy"
    )


def sdpa_impl(backend: str) -> Impl:
    def prepare(shape: Shape, pass_: str, sets: Sequence[InputSet], opts: Options) -> Prepared:
        import warnings

        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        be = getattr(SDPBackend, backend)

        @contextlib.contextmanager
        def context() -> Any:
            with warnings.catch_warnings(), sdpa_kernel([be]):
                warnings.simplefilter("ignore")  # refusals also warn; the reason comes from the exception
                yield

        c = shape.causal
        # Leaves that require grad, as in training: the forward then also keeps what its
        # backward needs (as cupyflash's forward always returns lse), and the backward can run.
        leaves = [[to_torch(x).detach().requires_grad_() for x in (s.q, s.k, s.v)] for s in sets]
        grads_out = [to_torch(s.do) for s in sets]
        with context():
            try:
                F.scaled_dot_product_attention(*leaves[0], is_causal=c)
            except (RuntimeError, NotImplementedError, ValueError) as e:
                raise Unavailable(f"{backend} refuses this case: {first_line(e)}") from e
            if pass_ == "fwd":

                def fwd(i: int) -> Any:
                    return F.scaled_dot_product_attention(*leaves[i], is_causal=c)

                return Prepared(fwd, "torch", context)
            # Backward alone: each set's forward runs once here, outside the timed region.
            outs = [F.scaled_dot_product_attention(*qkv, is_causal=c) for qkv in leaves]

        def bwd(i: int) -> None:
            for x in leaves[i]:
                x.grad = None  # a fresh gradient each call, no accumulation kernel
            outs[i].backward(grads_out[i], retain_graph=True)

        torch.cuda.synchronize()
        return Prepared(bwd, "torch", context)

    return prepare
