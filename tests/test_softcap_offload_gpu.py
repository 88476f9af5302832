"""GPU accuracy of the softcapped strips' MUFU offload (exp2_fma for one of every two n8 column tiles, and the tanh-only
score path without ALiBi; mma_softmax.cuh) in the tensor-core families, forward and backward, fp16 and bf16, D = 64
and 128, against the float64 reference with FlashAttention's criterion (tests/test_variants_gpu.py's check_case).

Scores are made large (logits x 4, scale 1) so that tanh saturates and the exponents span the whole range of the
polynomial's n; masks leave rows without keys (o = dq = 0 exactly, checked by check_case) and keys no query sees,
whose dk and dv must be exactly 0: a masked score's P from exp2_fma is +0, not a denormal."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import HAS_GPU, requires_gpu
from test_variants_gpu import _needs_hopper, check_case, make_inputs, visible_mask

import cupyflash

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy

KERNELS = ["mma", pytest.param("wgmma", marks=_needs_hopper)]

# (id, (B, Hq, Hk, Nq, Nk), spec): tanh alone (no ALiBi) and with ALiBi (the distance path), unmasked and masked.
CASES = [
    ("cap-large", (1, 2, 2, 192, 256), dict(softcap=30.0, scale=1.0)),
    ("cap-causal-nq>nk", (1, 2, 1, 300, 200), dict(softcap=50.0, causal=True, logits=4.0)),  # rows without keys
    ("cap-window-nq<nk", (2, 2, 2, 96, 320), dict(softcap=20.0, window=(7, 0), logits=4.0)),  # keys no query sees
    ("cap-alibi-window", (1, 4, 2, 160, 160), dict(softcap=30.0, alibi="head", window=(40, 3), logits=4.0)),
    ("cap-alibi-sinks-causal", (1, 2, 2, 130, 130), dict(softcap=50.0, alibi="batch", causal=True, sinks=True)),
]


def offload_params():
    """Every case at D = 64 in both dtypes; D = 128 (bf16, the masked cases) for the other tile shapes. Kept small:
    each (family, mask, D, dtype) is a fresh NVRTC compile (the offload changes every softcap instantiation)."""
    out = []
    for kernel in KERNELS:
        kname, marks = (kernel.values[0], kernel.marks) if hasattr(kernel, "values") else (kernel, ())
        for name, shape, spec in CASES:
            for dtype_name, d in [("float16", 64), ("bfloat16", 64)] + [("bfloat16", 128)] * ("window" in spec):
                out.append(pytest.param(kname, dtype_name, d, shape, spec, marks=marks,
                                        id=f"{kname}-{dtype_name}-d{d}-{name}"))  # fmt: skip
    return out


@pytest.mark.parametrize("kernel,dtype_name,d,shape,spec", offload_params())
def test_softcap_offload(kernel, dtype_name, d, shape, spec, rng):
    q, k, v, do, causal, scale, kw = make_inputs(rng, dtype_name, shape, spec, d)
    check_case(kernel, dtype_name, q, k, v, do, causal, scale, kw)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_masked_keys_get_exact_zeros(kernel, dtype_name, rng):
    """Keys that no query sees share key tiles with seen ones (their scores are masked to -inf in the strip, not
    skipped): their dk and dv are exactly 0, and so are o and dq of rows that see no key."""
    shape, spec, d = (1, 2, 2, 64, 300), dict(softcap=30.0, window=(2, 0), logits=4.0), 64
    q, k, v, do, causal, scale, kw = make_inputs(rng, dtype_name, shape, spec, d)
    kwd = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    o, lse = cupyflash.attention_forward(qd, kd, vd, causal, scale, kernel=kernel, **kwd)
    dq, dk, dv = cupyflash.attention_backward(dod, qd, kd, vd, o, lse, causal, scale, kernel=kernel, **kwd)
    seen = visible_mask(shape[3], shape[4], causal, kw["window_size"]).any(axis=0)
    assert (~seen).sum() > 128 and seen.sum() > 0  # unseen keys fill whole tiles and share one with seen keys
    dk, dv = dk.get().astype(np.float32), dv.get().astype(np.float32)
    assert np.all(dk[..., ~seen, :] == 0) and np.all(dv[..., ~seen, :] == 0)
    assert np.isfinite(dk).all() and np.isfinite(dv).all() and np.abs(dv[..., seen, :]).max() > 0
