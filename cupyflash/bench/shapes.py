"""Benchmarked shapes, the suites that list them, their FLOP counts, and the memory arithmetic
that decides how much of a naive N x N implementation fits (pure Python, tested on the CPU)."""
from __future__ import annotations

from dataclasses import dataclass

# ---------------------------------------------------------------------------- shapes

DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}

# The grid of the FlashAttention papers: a fixed token count and model width.
GRID_TOKENS = 16384  # B * N
GRID_HIDDEN = 2048  # H * D
GRID_NS = (512, 1024, 2048, 4096, 8192, 16384)
GRID_DS = (64, 128)
GRID_DTYPES = ("bfloat16", "float16")

#: Peak memory of forward + backward must stay under this many q-sized tensors (O(N)).
MEMORY_FACTOR = 16


@dataclass(frozen=True)
class Shape:
    """One benchmarked problem: q, k, v are (b, h, n, d) in ``dtype``; Nq == Nk == n."""

    b: int
    h: int
    n: int
    d: int
    causal: bool
    dtype: str
    check_memory: bool = False  # also measure peak memory of forward + backward (long suite)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def tensor_bytes(self) -> int:
        """Bytes of one (b, h, n, d) tensor."""
        return self.b * self.h * self.n * self.d * self.itemsize

    @property
    def label(self) -> str:
        return f"{self.dtype} B={self.b} H={self.h} N={self.n} D={self.d} {'causal' if self.causal else 'full'}"


def grid_shapes() -> list[Shape]:
    return [
        Shape(GRID_TOKENS // n, GRID_HIDDEN // d, n, d, causal, dtype)
        for dtype in GRID_DTYPES
        for d in GRID_DS
        for causal in (False, True)
        for n in GRID_NS
    ]


def fp32_shapes() -> list[Shape]:
    # Two wide shapes, then the llm.c FP32 attention shapes (GPT-2 124M: 12 heads of 64).
    wide = [Shape(4, 16, 4096, 128, causal, "float32") for causal in (False, True)]
    llmc = [Shape(4, 12, n, 64, True, "float32") for n in (1024, 2048, 4096)]
    return wide + llmc


def long_shapes() -> list[Shape]:
    return [Shape(1, 8, 131072, 128, True, "bfloat16", check_memory=True)]


def quick_shapes() -> list[Shape]:
    return [
        Shape(2, 4, 256, 64, False, "float16"),
        Shape(2, 4, 1000, 128, True, "bfloat16"),
        Shape(1, 2, 777, 64, True, "float32"),
        Shape(4, 8, 1024, 128, False, "bfloat16"),
    ]


def overhead_shapes() -> list[Shape]:
    """The tiny shapes of the host-overhead suite (issue 12): where the host path is the call."""
    return [Shape(1, 8, 128, 64, False, "bfloat16"), Shape(4, 12, 256, 64, False, "float32")]


def variants_shapes() -> list[Shape]:
    """The variants suite (issue 13): bf16 grid shapes at D 64, 128 and N 4k, 16k; each shape's causality
    picks its cases (bench/variants.py)."""
    return [Shape(GRID_TOKENS // n, GRID_HIDDEN // d, n, d, causal, "bfloat16")
            for d in GRID_DS for n in (4096, 16384) for causal in (False, True)]  # fmt: skip


def dropout_shapes() -> list[Shape]:
    """The dropout suite (issue 16): the bf16 DESIGN grid from N = 1k (the deterministic backward's rows;
    dropout's start at 2k, bench/dropout.py)."""
    return [Shape(GRID_TOKENS // n, GRID_HIDDEN // d, n, d, causal, "bfloat16")
            for d in GRID_DS for causal in (False, True) for n in GRID_NS if n >= 1024]  # fmt: skip


def masks_shapes() -> list[Shape]:
    """The masks suite (issue 17): bf16 and fp32, B*N = 16k, H*D = 2048, N = 1k..8k (the (1, H, N, N) bias
    and its gradient are 8 GiB each in fp32 at 8k), not causal (bench/masks.py)."""
    return [Shape(GRID_TOKENS // n, GRID_HIDDEN // d, n, d, False, dtype)
            for dtype in ("bfloat16", "float32") for d in GRID_DS for n in (1024, 2048, 4096, 8192)]  # fmt: skip
def flex_shapes() -> list[Shape]:
    """The flex suite (issue 17 part 3): one packed bf16 sequence of GRID_TOKENS tokens, H * D = GRID_HIDDEN, D 64
    and 128, causal (bench/flex.py's document and prefix-LM masks)."""
    return [Shape(1, GRID_HIDDEN // d, GRID_TOKENS, d, True, "bfloat16") for d in GRID_DS]


def varlen_shapes() -> list[Shape]:
    """The varlen suite (issue 14): one packed batch of GRID_TOKENS tokens (bench/varlen.py's documents), bf16,
    causal, H * D = GRID_HIDDEN at D 64 and 128."""
    return [Shape(1, GRID_HIDDEN // d, GRID_TOKENS, d, True, "bfloat16") for d in GRID_DS]


def linear_shapes() -> list[Shape]:
    return [Shape(4, 16, 8192, d, True, dt) for dt in GRID_DTYPES for d in GRID_DS] + [
        Shape(1, 16, 32768, 64, True, dt) for dt in GRID_DTYPES
    ]


def linear_quick_shapes() -> list[Shape]:
    return [Shape(2, 4, 1024, 64, True, "bfloat16"), Shape(1, 2, 777, 64, True, "float32")]


# ---------------------------------------------------------------------------- FLOPs


def attention_flops(b: int, h: int, nq: int, nk: int, d: int, causal: bool, pass_: str) -> float:
    """Softmax attention FLOPs as in the FlashAttention papers: forward 4*B*H*Nq*Nk*D (two
    matmuls), halved for causal when Nq == Nk; backward 2.5x forward (five matmuls, the
    recomputed S counted as half)."""
    fwd = 4.0 * b * h * nq * nk * d
    if causal:
        if nq == nk:
            fwd /= 2
        else:  # bottom-right aligned mask: row i sees min(nk, max(0, i + nk - nq + 1)) keys
            visible = sum(min(nk, max(0, i + nk - nq + 1)) for i in range(nq))
            fwd *= visible / (nq * nk)
    factor = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
    if pass_ not in factor:
        raise ValueError(f"pass must be one of {tuple(factor)}; got {pass_!r}")
    return fwd * factor[pass_]


def linear_flops(b: int, h: int, nq: int, nk: int, d: int, causal: bool, pass_: str) -> float:
    """Effective FLOPs of masked-matmul linear attention ``((q k^T) * M) v``: forward as the
    softmax count; backward four matmuls (dA = dO V^T, dQ, dK, dV), i.e. 2x forward."""
    fwd = attention_flops(b, h, nq, nk, d, causal, "fwd")
    factor = {"fwd": 1.0, "bwd": 2.0, "fwd+bwd": 3.0}
    if pass_ not in factor:
        raise ValueError(f"pass must be one of {tuple(factor)}; got {pass_!r}")
    return fwd * factor[pass_]


# ---------------------------------------------------------------------------- memory arithmetic


def naive_scores_bytes(shape: Shape) -> int:
    """Bytes of the full (B, H, N, N) score matrix in the input dtype."""
    return shape.b * shape.h * shape.n * shape.n * shape.itemsize


def naive_softmax_head_bytes(n: int, itemsize: int) -> int:
    """Peak bytes of naive softmax attention for one head: S in the input dtype, S in
    float32 (softmax works in place on it), P in the input dtype, plus a float32 temporary."""
    return n * n * (2 * itemsize + 8)


def naive_linear_head_bytes(n: int, itemsize: int, backward: bool) -> int:
    """Peak bytes of naive linear attention per head: A and its masked copy; dA too with backward."""
    return n * n * itemsize * (4 if backward else 2)


def heads_per_chunk(head_bytes: int, shared_bytes: int, budget_bytes: int) -> int:
    """How many heads the naive implementation processes at once within ``budget_bytes``
    (``shared_bytes``: the N x N mask, allocated once); 0 when a single head does not fit."""
    room = budget_bytes - shared_bytes
    return max(0, room // head_bytes) if room > 0 else 0


def linear_memory_bound(shape: Shape) -> int:
    """What O(N) memory means here: MEMORY_FACTOR tensors the size of q."""
    return MEMORY_FACTOR * shape.tensor_bytes


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
