"""The wgmma D=64 forward's configuration against dropout's cost (issue 16): per configuration (Bc, warpgroups,
stages, blocks per SM), the forward's time without and with dropout 0.1, bf16 B=2 H=32 N=8192 D=64, causal and
not, one process (CUDA events, median of 30). GPU machine:
    python benchmarks/dev_dropout_fwd_cfg.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cupyflash.bench.decode import median_ms  # noqa: E402

CONFIGS = ((64, 2, 4, 2), (128, 2, 3, 1), (64, 3, 4, 1), (128, 1, 4, 2))


def main() -> None:
    import cupy

    import cupyflash as cf
    from cupyflash import cuda_backend
    from cupyflash.plans import wgmma as pw

    rng = cupy.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 32, 8192, 64), dtype=cupy.float32).astype("bfloat16") for _ in range(3))
    for bc, wg, stages, blocks in CONFIGS:
        pw.FORWARD_CONFIGS[64] = pw.ForwardConfig(64, bc=bc, warpgroups=wg, stages=stages, min_blocks=blocks)
        cuda_backend._forward_cache.clear()
        for causal in (False, True):
            t = {}
            for label, kw in (("base", {}), ("drop", dict(dropout_p=0.1, dropout_seed=1))):
                try:
                    t[label] = median_ms(lambda: cf.attention_forward(q, k, v, causal=causal, kernel="wgmma", **kw))
                except Exception as e:  # noqa: BLE001  (a configuration that does not fit)
                    print(f"Bc={bc} WG={wg} stages={stages} blocks={blocks}: {type(e).__name__}: {str(e)[:100]}")
                    t[label] = float("nan")
            print(f"Bc={bc} WG={wg} stages={stages} blocks/SM={blocks} causal={int(causal)}: fwd {t['base']:.3f} "
                  f"-> dropout {t['drop']:.3f} ms ({t['base'] / t['drop']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
