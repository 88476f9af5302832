"""Greedy generation with a KV cache on the GPT of examples/gpt_model.py.

    python examples/train_gpt.py --save gpt.npz            # train, keep the weights
    python examples/generate_gpt.py --weights gpt.npz       # prefill the prompt, decode 200 bytes
    python examples/generate_gpt.py                         # random weights (gibberish, same speed)
    python examples/generate_gpt.py --attn-dtype bfloat16 --batch 8

Prefill: the prompt's queries, keys and values of every layer go through
``cupyflash.attention(q, k, v, causal=True)`` and the keys and values are copied into per-layer
caches of shape (B, H, seq_len, D). Decode: each new byte runs the model on one token;
``cupyflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True)``
writes its key and value into the caches in place at ``lens`` and attends over ``lens + 1`` keys.
``lens`` is an int32 device array advanced on the device, and the next token is the argmax on the
device, so the decode loop never waits for the host (and a step could be captured in a CUDA graph).

``--check N`` recomputes the logits of the first N generated positions without a cache (the whole
sequence through ``GPT.forward``) and prints the largest relative difference. Generation stops at
the model's seq_len (its learned positions end there). On a machine without a GPU the same code
runs on NumPy arrays through cupyflash's NumPy backend (the tests use it).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import cupyflash
except ImportError:  # run from a checkout without installing: use the repository's package
    sys.path.insert(0, str(HERE.parent))
    import cupyflash

import gpt_model as gm  # noqa: E402
from train_gpt import VOCAB, pick_xp, synchronize  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", type=Path, default=None, help="an .npz written by train_gpt.py --save")
    ap.add_argument("--prompt", default="\n1:1 In the beginning")
    ap.add_argument("--tokens", type=int, default=200, help="bytes to generate (at most seq_len - prompt)")
    ap.add_argument("--batch", type=int, default=1, help="copies of the prompt decoded together")
    ap.add_argument("--attn-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="precision of attention and of the KV cache")  # fmt: skip
    ap.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto")
    ap.add_argument("--check", type=int, default=4, help="positions checked against a no-cache recomputation")
    ap.add_argument("--seed", type=int, default=1337, help="random weights' seed (without --weights)")
    ap.add_argument("--n-layer", type=int, default=6, help="random weights' shape (without --weights)")
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=512)
    return ap.parse_args(argv)


def attn_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # NumPy has no bfloat16; ml_dtypes' is the one CuPy understands

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class KVCache:
    """Per-layer key and value caches (B, H, S, D) in the attention dtype, and each row's length."""

    def __init__(self, xp: Any, cfg: gm.GPTConfig, batch: int, dtype: np.dtype) -> None:
        shape = (batch, cfg.n_head, cfg.seq_len, cfg.head_dim)
        self.k = [xp.zeros(shape, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [xp.zeros(shape, dtype=dtype) for _ in range(cfg.n_layer)]
        self.lens = xp.zeros(batch, dtype=np.int32)  # keys each row holds (advanced on the device)
        self.dtype = dtype
        self.length = 0  # the same for every row; known on the host, so positions need no copy back


def self_attention(h: gm.Array, model: gm.GPT, layer: int, cache: KVCache, prefill: bool) -> gm.Array:
    """The attention sub-layer of ``layer`` on new tokens h (B, T, C), through the cache."""
    cfg, p = model.cfg, model.store.params
    B, T, C = h.shape
    H, D = cfg.n_head, cfg.head_dim
    qkv, _ = gm.linear_forward(h, p[f"h{layer}.attn_w"], p[f"h{layer}.attn_b"])
    qkv5 = qkv.reshape(B, T, 3, H, D)
    q, k, v = (qkv5[:, :, i].transpose(0, 2, 1, 3).astype(cache.dtype, copy=False) for i in range(3))
    kc, vc = cache.k[layer], cache.v[layer]
    if prefill:  # every prompt token at once; the cache is filled by copy
        o = cupyflash.attention(q, k, v, causal=True)
        kc[:, :, :T] = k
        vc[:, :, :T] = v
    else:  # k and v are appended in place at cache.lens, then attention over lens + T keys
        o, _ = cupyflash.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=cache.lens, causal=True)
    y = o.astype(h.dtype, copy=False).transpose(0, 2, 1, 3).reshape(B, T, C)
    out, _ = gm.linear_forward(y, p[f"h{layer}.proj_w"], p[f"h{layer}.proj_b"])
    return out


def forward_cached(model: gm.GPT, idx: gm.Array, cache: KVCache) -> gm.Array:
    """Logits (B, V) of the last of the new tokens idx (B, T) at positions cache.length onwards: a prefill
    when the cache is empty, else a decode step. Advances the cache by T."""
    cfg, p = model.cfg, model.store.params
    T = idx.shape[1]
    start = cache.length
    if start + T > cfg.seq_len:
        raise ValueError(f"{start + T} tokens exceed the model's {cfg.seq_len} positions")
    x = p["wte"][idx] + p["wpe"][start : start + T]
    for l in range(cfg.n_layer):
        h, _ = gm.layernorm_forward(x, p[f"h{l}.ln1_w"], p[f"h{l}.ln1_b"])
        x = x + self_attention(h, model, l, cache, prefill=start == 0)
        h, _ = gm.layernorm_forward(x, p[f"h{l}.ln2_w"], p[f"h{l}.ln2_b"])
        f, _ = gm.linear_forward(h, p[f"h{l}.fc_w"], p[f"h{l}.fc_b"])
        g, _ = gm.gelu_forward(f)
        m, _ = gm.linear_forward(g, p[f"h{l}.fcproj_w"], p[f"h{l}.fcproj_b"])
        x = x + m
    h, _ = gm.layernorm_forward(x[:, -1], p["lnf_w"], p["lnf_b"])
    cache.lens += T
    cache.length += T
    return h @ p["wte"].T


def generate(model: gm.GPT, xp: Any, prompt: np.ndarray, n: int, dtype: np.dtype,
             keep_logits: int = 0) -> dict[str, Any]:  # fmt: skip
    """Greedy decoding of n tokens after ``prompt`` (B, T0): prefill, then n - 1 decode steps.

    Returns the tokens (B, n) on the host, the seconds of the prefill and of the decode loop (each closed
    by a synchronisation), and the logits of the first ``keep_logits`` generated positions."""
    B, T0 = prompt.shape
    cache = KVCache(xp, model.cfg, B, dtype)
    out = xp.empty((B, n), dtype=np.int64)
    kept: list[gm.Array] = []
    synchronize(xp)
    t0 = time.perf_counter()
    logits = forward_cached(model, xp.asarray(prompt), cache)
    synchronize(xp)
    t1 = time.perf_counter()
    for i in range(n):
        if i < keep_logits:
            kept.append(logits.copy())
        out[:, i] = logits.argmax(axis=-1)
        if i + 1 < n:
            logits = forward_cached(model, out[:, i : i + 1], cache)
    synchronize(xp)
    t2 = time.perf_counter()
    host = out.get() if xp is not np else out
    return {"tokens": host, "prefill_s": t1 - t0, "decode_s": t2 - t1, "logits": kept, "cache": cache}


def check_against_recompute(model: gm.GPT, xp: Any, prompt: np.ndarray, result: dict[str, Any]) -> float:
    """Largest relative difference between the cached logits of the first generated positions and those of
    the whole sequence run again without a cache (``GPT.forward``, the model's own attention core)."""
    seq = np.concatenate([prompt, result["tokens"]], axis=1)
    worst = 0.0
    for i, cached in enumerate(result["logits"]):
        ref = model.forward(xp.asarray(seq[:, : prompt.shape[1] + i]))[:, -1]
        diff = float(xp.abs(cached - ref).max()) / float(xp.abs(ref).max())
        worst = max(worst, diff)
    return worst


def load_model(xp: Any, args: argparse.Namespace) -> tuple[gm.GPT, str]:
    dtype = attn_dtype(args.attn_dtype)
    if args.weights is not None:
        cfg, flat = gm.load_params(args.weights)
        source = f"weights {args.weights}"
    else:
        cfg = gm.GPTConfig(VOCAB, args.seq_len, args.n_layer, args.n_head, args.d_model)
        flat = gm.init_params(cfg, args.seed)
        source = f"random weights (seed {args.seed}; --weights loads trained ones)"
    core = gm.FlashAttention(dtype=dtype)  # the no-cache check runs the same precision
    return gm.GPT(cfg, gm.ParamStore(cfg, xp.asarray(flat.astype(np.float32))), core), source


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    xp = pick_xp(args.device)
    model, source = load_model(xp, args)
    cfg = model.cfg
    prompt = np.frombuffer(args.prompt.encode("ascii", errors="replace"), dtype=np.uint8).astype(np.int64)
    if prompt.size == 0 or prompt.size >= cfg.seq_len:
        raise SystemExit(f"--prompt must have 1..{cfg.seq_len - 1} bytes; got {prompt.size}")
    n = min(args.tokens, cfg.seq_len - prompt.size)
    if n < 1:
        raise SystemExit("--tokens must be at least 1")
    prompts = np.repeat(prompt[None], args.batch, axis=0)
    device = "CPU (NumPy)"
    if xp is not np:
        device = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)["name"].decode()
    print(f"device {device} | attention and KV cache {args.attn_dtype} | {source}")
    print(f"config n_layer={cfg.n_layer} n_head={cfg.n_head} d_model={cfg.d_model} seq_len={cfg.seq_len} | "
          f"batch {args.batch}, prompt {prompt.size} bytes, {n} new")  # fmt: skip
    generate(model, xp, prompts, min(n, 2), model.core.dtype)  # warm-up: kernels compiled, plans cached
    r = generate(model, xp, prompts, n, model.core.dtype, keep_logits=min(args.check, n))
    decoded = args.batch * (n - 1)  # tokens produced by decode steps (the first comes from the prefill)
    tok_s = decoded / r["decode_s"] if n > 1 else float("nan")
    text = bytes(r["tokens"][0].astype(np.uint8)).decode("ascii", errors="replace")
    print(f"prefill {prompt.size} tokens: {r['prefill_s'] * 1e3:.1f} ms | decode {n - 1} steps: "
          f"{r['decode_s'] * 1e3:.1f} ms, {tok_s:,.0f} tokens/s ({r['decode_s'] / max(1, n - 1) * 1e3:.2f} ms/step)")
    err = check_against_recompute(model, xp, prompts, r) if args.check > 0 else float("nan")
    if args.check > 0:
        print(f"first {len(r['logits'])} positions: cached logits vs recomputed without a cache: "
              f"max rel diff {err:.2e}")
    print("generated:\n" + args.prompt + text)
    return {"tokens": r["tokens"], "text": text, "tokens_per_s": tok_s, "prefill_s": r["prefill_s"],
            "decode_s": r["decode_s"], "check_rel_diff": err, "n": n}  # fmt: skip


if __name__ == "__main__":
    main()
