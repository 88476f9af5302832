"""One call of each kernel of interest, for ncu (scratch, not committed)."""
import sys
import numpy as np
import cupy
import cupyflash
import cupyflash.linear_api as cf
from cupyflash import _dtypes

bf16 = _dtypes.BFLOAT16
rng = np.random.default_rng(0)
def rnd(shape):
    x = cupy.asarray(rng.standard_normal(shape, dtype=np.float32))
    return (x / cupy.linalg.norm(x, axis=-1, keepdims=True)).astype(bf16)

what = sys.argv[1:]
if "lin" in what:
    for d in (128, 64):
        q, k, v = (rnd((4, 16, 8192, d)) for _ in range(3))
        for _ in range(2):
            cf.linear_attention(q, k, v, causal=True)
if "attn" in what:
    import torch
    q, k, v = (rnd((4, 32, 4096, 64)) for _ in range(3))
    for _ in range(2):
        cupyflash.attention(q, k, v, causal=False)
    tq, tk, tv = (torch.randn(4, 32, 4096, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    from torch.nn.attention import sdpa_kernel, SDPBackend
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(2):
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
cupy.cuda.Device().synchronize()
print("done")
