"""ALiBi forwards of whatever tree is imported (causal: the one-sided strips; full and softcap as controls), for A/B
runs of trees in alternating processes (s17). bf16, B=1, N=16384, H*D=2048; GPU ms per call (dev_ws_ab.per_call_ms)
and a hash of o and lse, which must be bitwise equal between the trees (the distance is exact both ways). GPU:
    for r in 1 2; do for t in old new; do PYTHONPATH=$PWD/<tree of $t> python benchmarks/dev_alibi_ab.py $t; done; done
"""
from __future__ import annotations

import hashlib
import os
import sys

import cupyflash as cf  # the tree on PYTHONPATH, imported before dev_ws_ab puts this checkout first

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dev_ws_ab import per_call_ms  # noqa: E402


def main() -> None:
    import cupy as cp

    tag = sys.argv[1]
    print(f"# {tag}: {cf.__file__}", flush=True)
    bf16 = cp.dtype("bfloat16")
    for d in (64, 128):
        n, h = 16384, 2048 // d
        rng = cp.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, h, n, d), dtype=cp.float32).astype(bf16) for _ in range(3))
        slopes = (2.0 ** (-8.0 * (cp.arange(h, dtype=cp.float32) + 1) / h)).astype(cp.float32)
        for name, causal, kw in (("alibi-c", True, {"alibi_slopes": slopes}), ("alibi", False, {"alibi_slopes": slopes}),
                                 ("softcap-c", True, {"softcap": 50.0}), ("plain-c", True, {})):
            o, lse = cf.attention_forward(q, k, v, causal=causal, **kw)
            digest = hashlib.sha1(o.get().tobytes() + lse.get().tobytes()).hexdigest()[:12]
            ms = per_call_ms(lambda: cf.attention_forward(q, k, v, causal=causal, **kw))
            print(f"{tag} D={d} {name:9s} fwd {ms:.3f} ms | o,lse {digest}", flush=True)


if __name__ == "__main__":
    main()
