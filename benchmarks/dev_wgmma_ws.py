"""Development timing of the warp-specialised Hopper forward (wgmma_flash_fwd_ws, opt-in) against the lockstep one
(wgmma_flash_fwd, the default) and torch SDPA's cuDNN and FLASH backends, in one process on an sm_90 GPU.

Rows: bf16, B = 2, H = 16, N in {1024, 4096, 16384}, D in {64, 128}, non-causal and causal. Each cell: GPU time of
the forward alone (CUDA events around one launch, median of 20 after 3 warm-ups, dev_wgmma.median_ms), TFLOP/s =
4 B H N^2 D (halved for causal) / time; then the ratios ws / lockstep, ws / cuDNN and ws / FLASH as speed-ups
(> 1: the warp-specialised forward is faster). SDPA columns are skipped without torch. Before timing, the ws
output is compared with the lockstep one on the row's inputs ("=" bit for bit, else max |diff| / max |o|) and checked
finite: a row marked BAD must not be believed.

Usage: python benchmarks/dev_wgmma_ws.py [--d 64,128] [--n 1024,4096,16384]; prints to stdout.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import cupy as cp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev_wgmma import median_ms  # noqa: E402

from cupyflash import _dtypes  # noqa: E402
from cupyflash.kernels import build, wgmma  # noqa: E402
from cupyflash.plans import wgmma as plans  # noqa: E402
from cupyflash.validation import check_attention  # noqa: E402
from cupyflash.variants import Variant  # noqa: E402

CTYPE = "__nv_bfloat16"
B, H = 2, 16


def precompile(ds: list[int]) -> float:
    """Every instantiation the rows launch, compiled in threads (NVRTC runs outside the GIL) before any timing."""
    jobs = [(cfg.source, cfg.name(CTYPE, Variant.of(causal, None, 0.0, False, False).cpp_policy))
            for d in ds for causal in (False, True) for cfg in (plans.WS_FORWARD_CONFIGS[d], plans.FORWARD_CONFIGS[d])]
    start = time.time()
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda job: build.get_function(*job), jobs))
    return time.time() - start


def sdpa_ms(q, k, v, causal: bool) -> dict[str, float | None]:
    """torch SDPA's cuDNN and FLASH backends on the same device arrays (None where torch or the backend is
    missing)."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return {"cuDNN": None, "FLASH": None}
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    out = {}
    for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("FLASH", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                out[name] = median_ms(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal))
        except RuntimeError as e:  # the backend refuses the shape or is not built
            print(f"  (SDPA {name}: {str(e).splitlines()[0][:100]})")
            out[name] = None
        torch.cuda.synchronize()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--n", default="1024,4096,16384")
    a = ap.parse_args()
    ds = [int(x) for x in a.d.split(",")]
    ns = [int(x) for x in a.n.split(",")]
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    print(f"device: {props['name'].decode()}; bf16 forward B={B} H={H}, GPU time (median of 20) and TFLOP/s")
    print(f"compiled the kernels in {precompile(ds):.0f} s", flush=True)
    rng = np.random.default_rng(0)
    for d in ds:
        ws_cfg, lock_cfg = plans.WS_FORWARD_CONFIGS[d], plans.FORWARD_CONFIGS[d]
        for n in ns:
            q, k, v = (cp.asarray(rng.standard_normal((B, H, n, d)), _dtypes.BFLOAT16) for _ in range(3))
            for causal in (False, True):
                p = check_attention(q, k, v, causal=causal)
                flops = 4 * B * H * n * n * d / (2 if causal else 1)
                outs, ms = {}, {}
                for name, cfg in (("ws", ws_cfg), ("lockstep", lock_cfg)):
                    o = cp.full(q.shape, np.nan, q.dtype)
                    lse = cp.full(q.shape[:-1], np.nan, np.float32)
                    wgmma.forward(q, k, v, o, lse, p, config=cfg)
                    outs[name] = o.astype(cp.float32)
                    ms[name] = median_ms(lambda cfg=cfg, o=o, lse=lse: wgmma.forward(q, k, v, o, lse, p, config=cfg))
                ws_o, lock_o = outs["ws"], outs["lockstep"]
                if not bool(cp.isfinite(ws_o).all()):
                    same = "BAD: non-finite"
                elif bool(cp.array_equal(ws_o, lock_o)):
                    same = "="
                else:
                    same = f"{float(cp.abs(ws_o - lock_o).max() / cp.abs(lock_o).max()):.1e}"
                ms.update(sdpa_ms(q, k, v, causal))
                cells = [f"{name} {t:7.3f} ms {flops / t / 1e9:4.0f} TF/s" for name, t in ms.items() if t]
                ratios = [f"ws/{name} {t / ms['ws']:4.2f}x" for name, t in ms.items() if t and name != "ws"]
                print(f"D={d:3d} N={n:5d} {'causal' if causal else 'full  '} | " + " | ".join(cells) + " || "
                      + " ".join(ratios) + f" (ws vs lockstep o: {same})", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
