"""examples/generate_gpt.py: greedy decoding with a KV cache (prefill with ``attention``, decode with
``attention_with_kvcache``) gives the logits and tokens of the same model run without a cache. On the CPU
through cupyflash's NumPy backend; on a GPU through the CUDA kernels."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import requires_gpu

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import generate_gpt as gg  # noqa: E402
import gpt_model as gm  # noqa: E402
import train_gpt as tg  # noqa: E402

CFG = gm.GPTConfig(vocab_size=256, seq_len=48, n_layer=2, n_head=2, d_model=32)


def random_model(xp, rng, cfg=CFG, attn="float32"):
    flat = gm.init_params(cfg, seed=int(rng.integers(1 << 30)))
    flat += rng.normal(0.0, 0.05, flat.size).astype(np.float32)  # away from the initial scale: sharper logits
    return gm.GPT(cfg, gm.ParamStore(cfg, xp.asarray(flat)), gm.FlashAttention(dtype=gg.attn_dtype(attn)))


def greedy_without_cache(model, xp, prompt, n):
    """The reference: n greedy steps, each running the whole sequence through GPT.forward."""
    seq = prompt.copy()
    for _ in range(n):
        logits = model.forward(xp.asarray(seq))[:, -1]
        nxt = logits.argmax(axis=-1)
        seq = np.concatenate([seq, (nxt.get() if xp is not np else nxt)[:, None]], axis=1)
    return seq[:, prompt.shape[1] :]


def test_generation_with_cache_matches_recomputation_on_cpu(rng):
    model = random_model(np, rng)
    prompt = rng.integers(0, 256, (2, 7))
    r = gg.generate(model, np, prompt, 12, np.dtype(np.float32), keep_logits=12)
    assert r["tokens"].shape == (2, 12)
    assert gg.check_against_recompute(model, np, prompt, r) < 1e-5
    np.testing.assert_array_equal(r["tokens"], greedy_without_cache(model, np, prompt, 12))
    # The cache holds exactly the prompt and the 11 decoded tokens' keys; the rest is untouched.
    cache = r["cache"]
    assert cache.length == 7 + 11 and cache.lens.tolist() == [18, 18]
    assert np.all(cache.k[0][:, :, 18:] == 0) and np.all(cache.v[1][:, :, 18:] == 0)
    assert np.all(np.abs(cache.k[1][:, :, :18]).sum(-1) > 0)


def test_cache_rejects_positions_past_seq_len(rng):
    model = random_model(np, rng)
    cache = gg.KVCache(np, CFG, 1, np.dtype(np.float32))
    with pytest.raises(ValueError, match="exceed the model's 48 positions"):
        gg.forward_cached(model, np.zeros((1, 49), np.int64), cache)


def test_script_on_cpu_with_trained_weights(tmp_path, capsys):
    tg.main(["--device", "cpu", "--n-layer", "2", "--n-head", "2", "--d-model", "32", "--seq-len", "32",
             "--batch", "4", "--steps", "3", "--eval-batches", "1", "--sample-chars", "0",
             "--save", str(tmp_path / "w.npz")])  # fmt: skip
    r = gg.main(["--device", "cpu", "--weights", str(tmp_path / "w.npz"), "--prompt", "1:1 In", "--tokens", "100",
                 "--check", "5", "--batch", "2"])  # fmt: skip
    out = capsys.readouterr().out
    assert r["n"] == 32 - 6  # capped at the model's positions
    assert r["check_rel_diff"] < 1e-5 and math.isfinite(r["tokens_per_s"])
    assert "tokens/s" in out and "max rel diff" in out and "generated:" in out
    np.testing.assert_array_equal(r["tokens"][0], r["tokens"][1])  # same prompt, same greedy result


def test_script_refuses_a_prompt_that_fills_the_model(capsys):
    with pytest.raises(SystemExit, match="--prompt must have"):
        gg.main(["--device", "cpu", "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "8",
                 "--prompt", "12345678"])  # fmt: skip


# ---------------------------------------------------------------------------- GPU


@requires_gpu
@pytest.mark.parametrize("attn, tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_gpu_generation_with_cache_matches_recomputation(rng, attn, tol):
    import cupy

    cfg = gm.GPTConfig(vocab_size=256, seq_len=256, n_layer=2, n_head=4, d_model=256)  # head dim 64
    model = random_model(cupy, rng, cfg, attn)
    prompt = rng.integers(0, 256, (3, 37))
    r = gg.generate(model, cupy, prompt, 40, model.core.dtype, keep_logits=8)
    assert gg.check_against_recompute(model, cupy, prompt, r) < tol
    if attn == "float32":  # bfloat16 rounding may flip a near tie; float32 must not
        np.testing.assert_array_equal(r["tokens"], greedy_without_cache(model, cupy, prompt, 40))
    assert int(r["cache"].lens.get()[0]) == 37 + 39


@requires_gpu
def test_gpu_script_prints_tokens_per_second(capsys):
    r = gg.main(["--device", "gpu", "--n-layer", "2", "--n-head", "4", "--d-model", "256", "--seq-len", "256",
                 "--tokens", "64", "--attn-dtype", "bfloat16", "--check", "4"])  # fmt: skip
    assert r["tokens_per_s"] > 0 and r["check_rel_diff"] < 2e-2
    assert "tokens/s" in capsys.readouterr().out
