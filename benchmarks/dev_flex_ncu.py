"""One warmed-up backward (or forward) call per case for ncu: dense causal, and --suite flex's doc8 and prefix-LM
with their block masks (bf16, B=1, N=16384, H*D = 2048), so that a profile compares the snippets' kernels with the
dense causal one (s21: the wgmma backward's main kernel, `ncu_bwd_*.txt` in benchmarks/results/h200-2026-11-28c/).
GPU machine, one case a process:
    for c in causal prefix-lm doc8; do ncu --clock-control none -k regex:wgmma_flash_bwd --launch-skip 1 \
        --launch-count 1 --section SpeedOfLight --section WarpStateStats --section InstructionStats \
        --section SourceCounters python benchmarks/dev_flex_ncu.py $c > $OUT/ncu_bwd_$c.txt; done
(--pass fwd and -k regex:wgmma_flash_fwd for the forward.)
"""
from __future__ import annotations

import argparse
import os
import sys

import cupy as cp

import cupyflash as cf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dev_bwd_ab import flex_keywords  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=("causal", "doc8", "prefix-lm"))
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="bwd")
    a = ap.parse_args()
    bf16 = cp.dtype("bfloat16")
    n, h = 16384, 2048 // a.d
    rng = cp.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, h, n, a.d), dtype=cp.float32).astype(bf16) for _ in range(4))
    kw = {} if a.case == "causal" else flex_keywords(a.case, 1, n)
    causal = a.case != "prefix-lm"
    o, lse = cf.attention_forward(q, k, v, causal, **kw)
    for _ in range(2):  # the first launch compiles and warms; ncu's --launch-skip 1 takes the second
        if a.which == "fwd":
            cf.attention_forward(q, k, v, causal, **kw)
        else:
            cf.attention_backward(do, q, k, v, o, lse, causal=causal, **kw)
    cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
