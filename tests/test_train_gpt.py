"""examples/train_gpt.py and examples/gpt_model.py: every layer's backward and the whole
model's gradient against central finite differences (NumPy float64, always run), AdamW,
the command line on the CPU, and on a GPU a few training steps with cupyflash attention,
its gradients, and agreement with the naive attention."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import rel_err, requires_gpu

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import gpt_model as gm  # noqa: E402
import train_gpt as tg  # noqa: E402

# Central differences in float64 with this step are accurate to ~1e-9 relative here.
EPS = 1e-6
TOL = 1e-6


def numerical_grad(f, x: np.ndarray, eps: float = EPS) -> np.ndarray:
    """d f / d x for every entry of x (changed in place and restored)."""
    g = np.zeros_like(x)
    for i in range(x.size):
        g.flat[i] = gm.finite_difference(f, x, i, eps)
    return g


def check_vjp(forward, inputs: list[np.ndarray], dout: np.ndarray, analytic: list[np.ndarray]) -> None:
    """``analytic`` must be the gradients of L = sum(forward(*inputs) * dout)."""
    f = lambda: float((forward(*inputs) * dout).sum())  # noqa: E731
    for i, (x, g) in enumerate(zip(inputs, analytic)):
        assert g.shape == x.shape, (i, g.shape, x.shape)
        err = rel_err(g, numerical_grad(f, x))
        assert err < TOL, f"input {i}: relative error {err:.2e}"


# ---------------------------------------------------------------------------- layers


def test_linear_backward(rng):
    x, w, b = rng.standard_normal((2, 3, 5)), rng.standard_normal((5, 4)), rng.standard_normal(4)
    dout = rng.standard_normal((2, 3, 4))
    out, cache = gm.linear_forward(x, w, b)
    np.testing.assert_allclose(out, np.einsum("btc,cd->btd", x, w) + b, rtol=1e-12)
    check_vjp(lambda *a: gm.linear_forward(*a)[0], [x, w, b], dout, list(gm.linear_backward(dout, cache)))


def test_layernorm_backward(rng):
    x = rng.standard_normal((2, 3, 6)) * 2.0 + 0.7
    w, b = 1.0 + 0.3 * rng.standard_normal(6), rng.standard_normal(6)
    dout = rng.standard_normal((2, 3, 6))
    out, cache = gm.layernorm_forward(x, w, b)
    xhat = (out - b) / w
    np.testing.assert_allclose(xhat.mean(-1), 0.0, atol=1e-12)
    np.testing.assert_allclose(xhat.var(-1), 1.0, rtol=1e-4)  # eps = 1e-5 in the variance
    check_vjp(lambda *a: gm.layernorm_forward(*a)[0], [x, w, b], dout, list(gm.layernorm_backward(dout, cache)))


def test_gelu_backward(rng):
    x = rng.uniform(-4.0, 4.0, (3, 7))
    dout = rng.standard_normal((3, 7))
    out, cache = gm.gelu_forward(x)
    np.testing.assert_allclose(gm.gelu_forward(np.array([0.0, 10.0, -10.0]))[0], [0.0, 10.0, 0.0], atol=1e-12)
    check_vjp(lambda a: gm.gelu_forward(a)[0], [x], dout, [gm.gelu_backward(dout, cache)])


def test_residual_backward(rng):
    x, y, dout = (rng.standard_normal((2, 3, 4)) for _ in range(3))
    check_vjp(gm.residual_forward, [x, y], dout, list(gm.residual_backward(dout)))


def test_embedding_backward(rng):
    V, n_pos, B, T, C = 11, 7, 2, 5, 3
    idx = rng.integers(0, V, (B, T))
    idx[1, 2] = idx[0, 0] = idx[0, 4]  # repeated tokens must add up
    wte, wpe = rng.standard_normal((V, C)), rng.standard_normal((n_pos, C))
    dout = rng.standard_normal((B, T, C))
    out, cache = gm.embedding_forward(idx, wte, wpe)
    dwte, dwpe = gm.embedding_backward(dout, cache, V, n_pos)
    assert np.all(dwpe[T:] == 0)
    check_vjp(lambda a, b: gm.embedding_forward(idx, a, b)[0], [wte, wpe], dout, [dwte, dwpe])


def test_cross_entropy_backward(rng):
    logits = rng.standard_normal((2, 4, 9)) * 3.0
    targets = rng.integers(0, 9, (2, 4))
    loss, cache = gm.cross_entropy_forward(logits, targets)
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, targets[..., None], -1).mean()
    assert abs(float(loss) - want) < 1e-12
    dlogits = gm.cross_entropy_backward(cache)
    f = lambda: float(gm.cross_entropy_forward(logits, targets)[0])  # noqa: E731
    assert rel_err(dlogits, numerical_grad(f, logits)) < TOL


@pytest.mark.parametrize("core", [gm.NaiveAttention(), gm.FlashAttention()], ids=["naive", "flash-reference"])
def test_attention_core_backward(rng, core):
    # Strided (B, H, T, D) views of a (B, T, 3, H, D) buffer, as the model passes them.
    B, T, H, D = 2, 5, 2, 4
    qkv = rng.standard_normal((B, T, 3, H, D))
    q, k, v = (np.ascontiguousarray(qkv[:, :, i].transpose(0, 2, 1, 3)) for i in range(3))
    do = rng.standard_normal((B, H, T, D))
    o, cache = core.forward(q, k, v)
    # Causal: query 0 sees only key 0, so its output is v's first row.
    np.testing.assert_allclose(o[:, :, 0], v[:, :, 0], rtol=1e-12)
    check_vjp(lambda *a: core.forward(*a)[0], [q, k, v], do, list(core.backward(do, cache)))


def test_packing_positions_and_segments():
    pk = gm.Packing.from_lengths(np, [3, 1, 4])
    assert pk.cu_seqlens.dtype == np.int32 and pk.cu_seqlens.tolist() == [0, 3, 4, 8]
    assert pk.positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert pk.segments.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert pk.max_seqlen == 4 and pk.total == 8
    for bad in ([], [3, 0], [[1, 2]]):
        with pytest.raises(ValueError, match="document lengths"):
            gm.Packing.from_lengths(np, bad)


@pytest.mark.parametrize("core", [gm.NaiveAttention(), gm.FlashAttention()], ids=["naive", "flash-reference"])
def test_packed_attention_core_backward(rng, core):
    # One row of three documents: finite differences through the varlen path, and each document's
    # output equal to its own causal attention (nothing leaks across a document's boundary).
    lengths, H, D = [4, 1, 3], 2, 4
    T = sum(lengths)
    qkv = rng.standard_normal((1, T, 3, H, D))
    q, k, v = (np.ascontiguousarray(qkv[:, :, i].transpose(0, 2, 1, 3)) for i in range(3))
    do = rng.standard_normal((1, H, T, D))
    pk = gm.Packing.from_lengths(np, lengths)
    o, cache = core.forward(q, k, v, pk)
    cu = pk.cu_seqlens.tolist()
    for a, b in zip(cu, cu[1:]):
        alone, _ = gm.NaiveAttention().forward(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
        np.testing.assert_allclose(o[:, :, a:b], alone, rtol=1e-12, atol=1e-14)
    check_vjp(lambda *a: core.forward(*a, pk)[0], [q, k, v], do, list(core.backward(do, cache)))


def test_naive_attention_matches_cupyflash_reference(rng):
    import cupyflash

    q, k, v, do = (rng.standard_normal((2, 3, 9, 8)) for _ in range(4))
    o_ref, lse = cupyflash.reference.attention_forward(q, k, v, causal=True)
    o, cache = gm.NaiveAttention().forward(q, k, v)
    assert rel_err(o, o_ref) < 1e-13
    ref = cupyflash.reference.attention_backward(do, q, k, v, o_ref, lse, causal=True)
    for g, r in zip(gm.NaiveAttention().backward(do, cache), ref):
        assert rel_err(g, r) < 1e-12


def test_attention_sublayer_backward(rng):
    B, T, C, H = 2, 6, 8, 2
    x = rng.standard_normal((B, T, C))
    w, b = rng.standard_normal((C, 3 * C)) * 0.5, rng.standard_normal(3 * C) * 0.1
    pw, pb = rng.standard_normal((C, C)) * 0.5, rng.standard_normal(C) * 0.1
    dout = rng.standard_normal((B, T, C))
    core = gm.NaiveAttention()
    out, cache = gm.attention_forward(x, w, b, pw, pb, H, core)
    grads = list(gm.attention_backward(dout, cache))
    check_vjp(lambda *a: gm.attention_forward(*a, H, core)[0], [x, w, b, pw, pb], dout, grads)


# ---------------------------------------------------------------------------- whole model

TINY = gm.GPTConfig(vocab_size=256, seq_len=8, n_layer=2, n_head=2, d_model=16)


def tiny_model(rng, core, cfg=TINY):
    flat = gm.init_params(cfg, seed=int(rng.integers(1 << 30)), dtype=np.float64)
    flat += rng.normal(0.0, 0.05, flat.size)  # every parameter away from its special initial value
    return gm.GPT(cfg, gm.ParamStore(cfg, flat), core)


@pytest.mark.parametrize("core", [gm.NaiveAttention(), gm.FlashAttention()], ids=["naive", "flash-reference"])
def test_model_gradient_matches_finite_differences(rng, core):
    model = tiny_model(rng, core)
    x = rng.integers(0, TINY.vocab_size, (2, TINY.seq_len))
    y = rng.integers(0, TINY.vocab_size, (2, TINY.seq_len))
    loss = float(model.loss_and_grad(x, y))
    assert math.isfinite(loss) and loss > 0
    store = model.store
    f = lambda: model.forward(x, y)  # noqa: E731
    for name, p in store.params.items():
        g = store.grads[name].reshape(-1)
        assert np.any(g != 0), f"{name}: zero gradient"
        # Small tensors in full; large ones at their largest gradients and at random entries.
        entries = range(p.size) if p.size <= 16 else sorted(
            set(np.argsort(-np.abs(g))[:6].tolist()) | set(rng.integers(0, p.size, 10).tolist())
        )  # fmt: skip
        fd = np.array([gm.finite_difference(f, p, i, EPS) for i in entries])
        err = rel_err(g[list(entries)], fd)
        assert err < TOL, f"{name}: relative error {err:.2e}"
    u = rng.standard_normal(store.data.size)
    dd = gm.directional_difference(f, store.data, u, EPS)
    assert abs(dd - float(store.grad @ u)) < TOL * abs(dd)


def test_gradients_do_not_depend_on_the_attention_core(rng):
    x = rng.integers(0, 256, (3, TINY.seq_len))
    y = rng.integers(0, 256, (3, TINY.seq_len))
    naive = tiny_model(np.random.default_rng(5), gm.NaiveAttention())
    flash = tiny_model(np.random.default_rng(5), gm.FlashAttention())
    assert abs(float(naive.loss_and_grad(x, y)) - float(flash.loss_and_grad(x, y))) < 1e-12
    assert rel_err(flash.store.grad, naive.store.grad) < 1e-12


def test_check_gradients_with_float32_attention_on_cpu():
    # The GPU's check (float64 model, float32 attention), emulated: cupyflash on float32
    # NumPy arrays rounds q, k, v and o to float32, so the loose bounds are the ones used.
    r = tg.check_gradients(np, tg.load_corpus(tg.DEFAULT_DATA), seed=3, attention="flash", flash_dtype=np.float32)
    assert r["tolerances"]["finite_difference"] > 1e-6  # the float32 branch ran
    assert r["ok"], r
    assert 0 < r["grad_vs_naive_float64_rel_err"] < 1e-6


def packed_documents(rng, lengths):
    """Random byte documents of the given token counts: each is lengths[i] + 1 bytes."""
    return [rng.integers(0, 256, n + 1) for n in lengths]


@pytest.mark.parametrize(
    "core, tol",
    [(gm.NaiveAttention(), 1e-12), (gm.FlashAttention(), 1e-12), (gm.FlashAttention(np.float32), 1e-6)],
    ids=["naive", "flash-reference", "flash-numpy-float32"],
)
def test_packed_step_equals_documents_one_at_a_time(rng, core, tol):
    # The packed row's loss is the token-weighted mean of each document's loss run alone (as its own
    # batch of one, positions from 0), and so is its gradient: packing changes nothing but the speed.
    cfg = gm.GPTConfig(vocab_size=256, seq_len=8, n_layer=2, n_head=2, d_model=16)
    model = tiny_model(rng, core, cfg)
    lengths = [5, 1, 8, 3, 8]
    docs = packed_documents(rng, lengths)
    x = np.concatenate([d[:-1] for d in docs])[None]
    y = np.concatenate([d[1:] for d in docs])[None]
    packed = float(model.loss_and_grad(x, y, gm.Packing.from_lengths(np, lengths)))
    packed_grad = model.store.grad.copy()
    alone, alone_grad = 0.0, np.zeros_like(packed_grad)
    for d, n in zip(docs, lengths):
        alone += n * float(model.loss_and_grad(d[None, :-1], d[None, 1:]))
        alone_grad += n * model.store.grad
    total = sum(lengths)
    assert abs(packed - alone / total) < tol * abs(packed)
    assert rel_err(packed_grad, alone_grad / total) < tol
    # Without the packing (one causal sequence over the row) the documents would see each other.
    head = gm.Packing.from_lengths(np, [5, 1, 2])  # the row's first 8 tokens
    assert abs(float(model.forward(x[:, :8], y[:, :8], head)) - float(model.forward(x[:, :8], y[:, :8]))) > 1e-4


def test_packed_rejects_bad_rows(rng):
    model = tiny_model(rng, gm.FlashAttention())
    x = np.zeros((1, 6), np.int64)
    with pytest.raises(ValueError, match="one row of 5 tokens"):
        model.forward(x, x, gm.Packing.from_lengths(np, [2, 3]))
    with pytest.raises(ValueError, match="longer than seq_len"):
        model.forward(np.zeros((1, 9), np.int64), None, gm.Packing.from_lengths(np, [9]))


def test_documents_and_packed_batches():
    tokens = tg.load_corpus(tg.DEFAULT_DATA)[:400_000]
    docs = tg.split_documents(tokens, np.random.default_rng(0), max_len=512, median=100)
    n = docs[:, 1] - docs[:, 0]
    assert docs[0, 0] == 0 and np.all(docs[1:, 0] == docs[:-1, 1]) and tokens.size - docs[-1, 1] < 2
    assert n.min() >= 2 and n.max() <= 513
    assert np.median(n) < n.mean() and np.percentile(n, 99) > 4 * np.median(n)  # long-tailed
    at_line_end = tokens[docs[:, 1] - 1] == ord("\n")
    assert at_line_end.mean() > 0.3
    for s, e in docs[~at_line_end][:200]:  # cut inside a line only when no line ended in reach
        assert ord("\n") not in tokens[s + 1 : e - 1]
    docs = tg.split_documents(tokens, np.random.default_rng(0), max_len=64, median=40)
    rng = np.random.default_rng(1)
    x, y, lengths = tg.get_packed_batch(tokens, docs, rng, 1000)
    assert x.shape == y.shape == (1, 1000) and sum(lengths) == 1000 and min(lengths) >= 1 and len(lengths) > 5
    # Targets are the next byte within the same document: reassemble each document from the row.
    rng = np.random.default_rng(1)
    at = 0
    for n_tok in lengths:
        s, e = docs[rng.integers(len(docs))]
        np.testing.assert_array_equal(x[0, at : at + n_tok], tokens[s : s + n_tok])
        np.testing.assert_array_equal(y[0, at : at + n_tok], tokens[s + 1 : s + 1 + n_tok])
        at += n_tok


def test_save_and_load_params(tmp_path, rng):
    cfg = gm.GPTConfig(vocab_size=256, seq_len=8, n_layer=1, n_head=2, d_model=16)
    flat = gm.init_params(cfg, 3)
    gm.save_params(tmp_path / "w.npz", cfg, flat)
    cfg2, flat2 = gm.load_params(tmp_path / "w.npz")
    assert cfg2 == cfg
    np.testing.assert_array_equal(flat2, flat)
    gm.save_params(tmp_path / "bad.npz", gm.GPTConfig(256, 8, 2, 2, 16), flat)
    with pytest.raises(ValueError, match="parameters for a model"):
        gm.load_params(tmp_path / "bad.npz")


# ---------------------------------------------------------------------------- optimiser


def test_adamw_steps_reduce_loss_on_a_repeated_batch(rng):
    model = tiny_model(rng, gm.NaiveAttention())
    opt = gm.AdamW(model.store, weight_decay=0.1)
    x = rng.integers(0, 256, (2, TINY.seq_len))
    y = rng.integers(0, 256, (2, TINY.seq_len))
    losses = []
    for _ in range(15):
        losses.append(float(model.loss_and_grad(x, y)))
        gm.clip_grad_norm(model.store, 1.0)
        opt.step(1e-2)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 2.0, losses
    assert sum(b < a for a, b in zip(losses, losses[1:])) >= 12, losses


def test_adamw_bias_correction_and_decay_on_matrices_only(rng):
    model = tiny_model(rng, gm.NaiveAttention())
    store = model.store
    # Bias correction: the first step moves each entry by lr * g / (|g| + eps), about lr.
    opt = gm.AdamW(store, weight_decay=0.0, eps=1e-8)
    store.grad[...] = rng.standard_normal(store.grad.size)
    before = store.data.copy()
    opt.step(1e-3)
    np.testing.assert_allclose(before - store.data, 1e-3 * store.grad / (np.abs(store.grad) + 1e-8), rtol=1e-9)
    # Decoupled weight decay: with zero gradient matrices shrink by (1 - lr wd), vectors stay.
    opt = gm.AdamW(store, weight_decay=0.5)
    store.grad[...] = 0.0
    before = {n: p.copy() for n, p in store.params.items()}
    opt.step(0.1)
    for name, p in store.params.items():
        want = before[name] * (0.95 if p.ndim == 2 else 1.0)
        np.testing.assert_allclose(p, want, rtol=1e-12, err_msg=name)


def test_clip_grad_norm(rng):
    store = tiny_model(rng, gm.NaiveAttention()).store
    store.grad[...] = rng.standard_normal(store.grad.size)
    norm = float(gm.clip_grad_norm(store, 1.0))
    assert norm > 10  # a few thousand unit-variance entries
    assert abs(np.linalg.norm(store.grad) - 1.0) < 1e-6
    g = store.grad.copy()
    assert abs(float(gm.clip_grad_norm(store, 5.0)) - 1.0) < 1e-6  # below the bound: untouched
    np.testing.assert_array_equal(store.grad, g)


# ---------------------------------------------------------------------------- script, CPU


def test_corpus_ships_and_is_small():
    data = tg.load_corpus(tg.DEFAULT_DATA)
    assert 1_000_000 < data.size <= 2_000_000
    assert data.max() < 128  # ASCII
    assert tg.DEFAULT_DATA.read_text().startswith("Genesis\n\n1:1 In the beginning God created")
    assert 2.5 < tg.unigram_entropy(data) < math.log(256)
    assert abs(tg.unigram_entropy(np.arange(256, dtype=np.uint8)) - math.log(256)) < 1e-12


def test_lr_schedule():
    args = tg.parse_args(["--lr", "1e-3", "--warmup", "10", "--steps", "110", "--min-lr-frac", "0.1"])
    assert tg.lr_at(0, args) == pytest.approx(1e-4)
    assert tg.lr_at(9, args) == pytest.approx(1e-3)
    assert tg.lr_at(60, args) == pytest.approx(0.55e-3)
    assert tg.lr_at(110, args) == pytest.approx(1e-4)


CPU_TINY = ["--device", "cpu", "--n-layer", "2", "--n-head", "2", "--d-model", "32", "--seq-len", "16",
            "--batch", "4", "--eval-batches", "1", "--sample-chars", "8", "--warmup", "2", "--lr", "3e-3"]  # fmt: skip


def test_script_runs_on_cpu_and_attention_paths_agree(capsys):
    runs = {a: tg.main([*CPU_TINY, "--steps", "6", "--attention", a]) for a in ("naive", "flash")}
    out = capsys.readouterr().out
    assert "unigram entropy" in out and "tok/s" in out and "first losses" in out
    for r in runs.values():
        assert r["steps"] == 6 and all(math.isfinite(v) for v in r["losses"])
        assert r["losses"][-1] < r["losses"][0]
    np.testing.assert_allclose(runs["naive"]["losses"], runs["flash"]["losses"], rtol=1e-5)


def test_packed_script_runs_on_cpu_and_attention_paths_agree(capsys, tmp_path):
    runs = {a: tg.main([*CPU_TINY, "--steps", "6", "--attention", a, "--packed", "--doc-median", "8",
                        "--log-json", str(tmp_path / f"{a}.json")]) for a in ("naive", "flash")}  # fmt: skip
    out = capsys.readouterr().out
    assert "packed:" in out and "documents a step" in out
    for a, r in runs.items():
        assert r["packed"] and r["docs_per_step"] > 2  # several documents share each 64-token row
        assert r["steps"] == 6 and all(math.isfinite(v) for v in r["losses"])
        assert r["losses"][-1] < r["losses"][0]
        assert json.loads((tmp_path / f"{a}.json").read_text())["losses"] == r["losses"]
    np.testing.assert_allclose(runs["naive"]["losses"], runs["flash"]["losses"], rtol=1e-5)


def test_save_flag_writes_loadable_weights(tmp_path):
    r = tg.main([*CPU_TINY, "--steps", "2", "--sample-chars", "0", "--save", str(tmp_path / "w.npz")])
    cfg, flat = gm.load_params(tmp_path / "w.npz")
    assert cfg == gm.GPTConfig(256, 16, 2, 2, 32) and flat.size == r["config"]["parameters"]


def test_time_limit_stops_training():
    r = tg.main([*CPU_TINY, "--steps", "1000", "--time-limit", "0.01", "--sample-chars", "0"])
    assert 1 <= r["steps"] < 1000


def test_check_grad_flag_on_cpu(capsys):
    results = tg.main(["--check-grad", "--device", "cpu"])
    assert all(r["ok"] for r in results.values()), results
    assert "gradient check PASSED" in capsys.readouterr().out


# ---------------------------------------------------------------------------- GPU

GPU_TINY = ["--device", "gpu", "--n-layer", "2", "--n-head", "2", "--d-model", "64", "--seq-len", "64",
            "--batch", "8", "--eval-batches", "1", "--sample-chars", "0", "--warmup", "5", "--lr", "3e-3"]  # fmt: skip


@requires_gpu
def test_gpu_training_with_cupyflash_reduces_loss():
    r = tg.main([*GPU_TINY, "--steps", "40"])
    losses = r["losses"]
    assert len(losses) == 40 and all(math.isfinite(v) for v in losses)
    assert np.mean(losses[-5:]) < losses[0] - 1.0, losses
    assert r["peak_pool_bytes"] > 0 and r["tokens_per_s"] > 0


@requires_gpu
def test_gpu_gradients_match_finite_differences():
    import cupy

    r = tg.check_gradients(cupy, tg.load_corpus(tg.DEFAULT_DATA), seed=0, attention="flash")
    assert r["ok"], r
    assert r["grad_vs_naive_float64_rel_err"] > 0  # float32 kernels really ran


@requires_gpu
def test_gpu_attention_core_matches_naive_float64(rng):
    import cupy

    B, T, H, D = 2, 100, 3, 64
    qkv = cupy.asarray(rng.standard_normal((B, T, 3, H, D)).astype(np.float32))
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # strided views
    do = cupy.asarray(rng.standard_normal((B, H, T, D)).astype(np.float32))
    flash, naive = gm.FlashAttention(), gm.NaiveAttention()
    o, c = flash.forward(q, k, v)
    o64, c64 = naive.forward(*(x.astype(np.float64) for x in (q, k, v)))
    assert o.dtype == np.float32 and rel_err(o.get(), o64.get()) < 1e-5
    for g, r in zip(flash.backward(do, c), naive.backward(do.astype(np.float64), c64)):
        assert g.dtype == np.float32 and rel_err(g.get(), r.get()) < 1e-4


@requires_gpu
def test_gpu_naive_and_cupyflash_losses_match():
    runs = {a: tg.main([*GPU_TINY, "--steps", "5", "--attention", a]) for a in ("naive", "flash")}
    np.testing.assert_allclose(runs["flash"]["losses"], runs["naive"]["losses"], rtol=1e-3)


@requires_gpu
def test_gpu_packed_training_reduces_loss():
    r = tg.main([*GPU_TINY, "--steps", "40", "--packed", "--doc-median", "24"])
    losses = r["losses"]
    assert r["packed"] and r["docs_per_step"] > 10
    assert len(losses) == 40 and all(math.isfinite(v) for v in losses)
    assert np.mean(losses[-5:]) < losses[0] - 1.0, losses


@requires_gpu
def test_gpu_packed_naive_and_cupyflash_losses_match():
    runs = {a: tg.main([*GPU_TINY, "--steps", "5", "--attention", a, "--packed", "--doc-median", "24"])
            for a in ("naive", "flash")}  # fmt: skip
    np.testing.assert_allclose(runs["flash"]["losses"], runs["naive"]["losses"], rtol=1e-3)


@requires_gpu
@pytest.mark.parametrize("kernel", ["portable", "mma", "wgmma"])
def test_gpu_packed_step_equals_documents_one_at_a_time(rng, kernel):
    # cupyflash's varlen kernels (float32 model, attention in float32, or bfloat16 for the tensor-core
    # families) on a row of documents of awkward lengths, against each document run alone (dense kernels).
    import cupy

    if kernel == "wgmma" and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma family needs compute capability 9.0 (sm_90a)")
    dtype = np.float32 if kernel == "portable" else "bfloat16"
    cfg = gm.GPTConfig(vocab_size=256, seq_len=128, n_layer=2, n_head=2, d_model=128)  # head dim 64
    flat = gm.init_params(cfg, 7)
    flat += rng.normal(0.0, 0.02, flat.size).astype(np.float32)
    model = gm.GPT(cfg, gm.ParamStore(cfg, cupy.asarray(flat)), gm.FlashAttention(dtype, kernel=kernel))
    lengths = [100, 1, 128, 17, 64, 3, 77]
    docs = packed_documents(rng, lengths)
    x = cupy.asarray(np.concatenate([d[:-1] for d in docs])[None])
    y = cupy.asarray(np.concatenate([d[1:] for d in docs])[None])
    packed = float(model.loss_and_grad(x, y, gm.Packing.from_lengths(cupy, lengths)))
    packed_grad = model.store.grad.get()
    alone, alone_grad = 0.0, np.zeros_like(packed_grad)
    for d, n in zip(docs, lengths):
        alone += n * float(model.loss_and_grad(cupy.asarray(d[None, :-1]), cupy.asarray(d[None, 1:])))
        alone_grad += n * model.store.grad.get()
    total = sum(lengths)
    tol = 1e-5 if dtype == np.float32 else 2e-2
    assert abs(packed - alone / total) < tol * abs(packed)
    assert rel_err(packed_grad, alone_grad / total) < (1e-4 if dtype == np.float32 else 5e-2)


@requires_gpu
def test_gpu_bfloat16_attention_trains():
    f32 = tg.main([*GPU_TINY, "--steps", "10"])
    bf16 = tg.main([*GPU_TINY, "--steps", "10", "--attn-dtype", "bfloat16"])
    assert all(math.isfinite(v) for v in bf16["losses"])
    np.testing.assert_allclose(bf16["losses"][:3], f32["losses"][:3], rtol=2e-2)
    assert bf16["losses"][-1] < bf16["losses"][0]
