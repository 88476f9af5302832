"""Which bf16 D=64 backward configuration is fastest with dropout (issue 16)? The backward pass alone (Delta, main
kernel, dQ conversion), per candidate configuration, without and with dropout 0.1: the wgmma plan's
BackwardConfig(64, br=128) (the default), the other wgmma D=64 tiles that wgmma_backward.cu's static_asserts and
shared memory allow (deeper Q_i/dO_i rings), and the mma family's D=64 backwards (the key-major table and fallback
tiles, the 2-D layout of benchmarks/dev_mma.py). bf16, H=32, B*N = 16k: (B=8, N=2048) and (B=2, N=8192), causal and
not. o and lse come from the lockstep wgmma forward (with the same dropout); every candidate runs through its family's
entry point with an explicit ``config`` (as dev_wgmma_bwd.py), dropout_seed fixed. Before timing, each candidate's
dq/dk/dv are checked against the default's on the same inputs (OK / MISMATCH; a mismatch is not timed). Timing:
dev_ws_ab.per_call_ms (CUDA events around back-to-back calls, median of batches), two rounds, the better kept.
Kernels are compiled first in parallel processes (CuPy's disk cache).

GPU machine (H100; --quick: B=2 N=8192 only; --extra: four more key-major mma tiles no table uses):
    python benchmarks/dev_dropout_bwd_cfg.py [--quick] [--extra] [--all]
CPU (NVRTC only): registers / spills of every candidate with the dropout policies, sm_90a (wgmma), sm_80 + sm_90a
(mma), SPILLING's included; those are left out of the GPU run unless --all:
    python benchmarks/dev_dropout_bwd_cfg.py --compile [--extra]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from dev_ws_ab import per_call_ms  # noqa: E402  (CUDA events around back-to-back calls; import-safe without a GPU)

D, H, DROPOUT_P, SEED = 64, 32, 0.1, 1234
CTYPE = "__nv_bfloat16"
SHAPES = ((8, 2048), (2, 8192))  # (B, N): B*N = 16k
QUICK_SHAPES = ((2, 8192),)
CALLS, BATCHES, ROUNDS = 10, 7, 2
TOL = 2e-2  # max |g - g_default| / max |g_default|
ARCHS = {"wgmma": ("sm_90a",), "mma": ("sm_80", "sm_90a")}
#: Candidates that spill with a dropout policy (`--compile --extra`, NVRTC 13.5, CPU): left out of the GPU run
#: unless --all. The 2-D layout at D = 64: 255 registers, 124/132 B spill (sm_90a, full), 64/68 B (causal), 48/48 B
#: (sm_80). Every other candidate is spill-free (wgmma 252-255 registers, key-major mma 195-237).
SPILLING: set[str] = {"mma-2d Br128 Bc128 q4 st2 p1"}


def fwd_config():
    """The forward that makes o and lse: the lockstep wgmma kernel (wgmma_forward.cu), whose o/lse equal the
    warp-specialised default's, so that the run does not depend on the ws kernel's sources (under other edits)."""
    from cupyflash.plans import wgmma as pw

    return pw.FORWARD_CONFIGS[D]


def candidates(extra: bool = False) -> list[tuple[str, object]]:
    """(family, config): the plan's wgmma default first, then the alternatives; ``extra``: more key-major mma tiles
    that mma_bwd_keymajor.cuh's static_asserts allow but no table uses (deeper ring, more dP^T chunks, 2 blocks/SM)."""
    from dataclasses import replace

    from cupyflash.plans import mma as pm
    from cupyflash.plans import wgmma as pw

    w = pw.BACKWARD_CONFIGS[D]  # BackwardConfig(64, br=128): kWG = 2 and Br = 128 are the only tiles at D = 64
    out: list[tuple[str, object]] = [("wgmma", w)]
    out += [("wgmma", replace(w, stages=s)) for s in (3, 4)]  # 5 stages: 235 KB > 227 KB
    out += [("mma", pm.BACKWARD_CONFIGS[D]), ("mma", pm.BACKWARD_FALLBACKS[D])]
    out.append(("mma", pm.Backward2DConfig(D, br=128, bc=128, q_row_warps=4, packed_p=True)))  # dev_mma.py's
    if extra:
        km = pm.BackwardConfig
        out += [("mma", c) for c in (km(D, br=128, key_warps=8, dp_chunks=2, stages=3),
                                     km(D, br=128, key_warps=8, dp_chunks=4), km(D, br=64, key_warps=8, stages=3),
                                     km(D, br=64, key_warps=4, min_blocks=2))]  # fmt: skip
    return out


def label(family: str, c) -> str:
    if family == "wgmma":
        return f"wgmma Br{c.br} Bc{c.bc} st{c.stages}"
    if hasattr(c, "key_warps"):
        return f"mma-km Br{c.br} Bc{c.bc} kw{c.key_warps} st{c.stages} dp{c.dp_chunks} mb{c.min_blocks}"
    return f"mma-2d Br{c.br} Bc{c.bc} q{c.q_row_warps} st{c.stages} p{int(c.packed_p)}"


def is_default(family: str, c) -> bool:
    from cupyflash.plans import wgmma as pw

    return family == "wgmma" and c == pw.BACKWARD_CONFIGS[D]


def source_of(family: str) -> str:
    from cupyflash.plans import mma as pm
    from cupyflash.plans import wgmma as pw

    return pw.BACKWARD_SOURCE if family == "wgmma" else pm.BACKWARD_SOURCE


# ---- CPU: compile check ----

def _compile(program: tuple[str, str, list[str]]):
    from cupyflash.kernels.build import CompileError, nvrtc_compile_many

    source, arch, names = program
    try:
        return nvrtc_compile_many(source, names, arch)
    except CompileError as e:
        return [str(e)] * len(names)


def compile_check(cands) -> None:
    """Every candidate's main kernel with variants.DROPOUT's plain policy, non-causal and causal (the timed ones;
    no kOwnDQ at these shapes): registers and spill stores / loads per architecture."""
    from concurrent.futures import ProcessPoolExecutor

    from cupyflash.variants import Variant

    pols = [Variant(causal=c, dropout=DROPOUT_P).cpp_policy for c in (False, True)]
    jobs = [(fam, cfg, pol, arch) for fam, cfg in cands for pol in pols for arch in ARCHS[fam]]
    groups: dict[tuple[str, str], list] = {}
    for job in jobs:
        groups.setdefault((source_of(job[0]), job[3]), []).append(job)
    programs, owners = [], []
    for (source, arch), js in groups.items():
        for i in range(0, len(js), 3):  # a few names per NVRTC program: the front end runs once per program
            part = js[i: i + 3]
            programs.append((source, arch, [j[1].name(CTYPE, j[2]) for j in part]))
            owners.append(part)
    start = time.time()
    usage = {}
    with ProcessPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        for part, res in zip(owners, pool.map(_compile, programs)):
            usage.update({(label(j[0], j[1]), j[2], j[3]): r for j, r in zip(part, res)})
    print(f"# NVRTC compile of {len(jobs)} instantiations ({CTYPE}, dropout {DROPOUT_P}): {time.time() - start:.0f} s")
    print(f"{'config':42s} | {'mask':6s} | {'arch':6s} | regs | spill st/ld B | stack B")
    for fam, cfg in cands:
        spilled = False
        for pol in pols:
            for arch in ARCHS[fam]:
                u = usage[label(fam, cfg), pol, arch]
                mask = "causal" if "Causal" in pol else "full"
                if isinstance(u, str):
                    print(f"{label(fam, cfg):42s} | {mask:6s} | {arch:6s} | COMPILE ERROR {u[:200]}")
                    spilled = True
                    continue
                spilled |= u.spills
                print(f"{label(fam, cfg):42s} | {mask:6s} | {arch:6s} | {u.registers:4d} | "
                      f"{u.spill_stores:5d}/{u.spill_loads:<5d}   | {u.stack_frame}")
        print(f"  -> {label(fam, cfg)}: {'SPILLS (leave out)' if spilled else 'spill-free'}", flush=True)


# ---- GPU: precompile, check, time ----

def _build(job: tuple[str, str]) -> str | None:
    """Compile one (source, name) into CuPy's disk cache (a worker process); the error text if it fails."""
    from cupyflash.kernels import build

    try:
        build.get_function(*job)
    except Exception as e:  # noqa: BLE001  (reported, and the candidate then fails in the main process too)
        return f"{job[1]}: {type(e).__name__}: {str(e)[:300]}"
    return None


def precompile(cands, shapes) -> None:
    """Every kernel the run launches (the plan's forward, each candidate's backward launches), in parallel."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from cupyflash.plans import DeviceLimits
    from cupyflash.plans import mma as pm
    from cupyflash.plans import wgmma as pw
    from cupyflash.variants import Variant

    limits = DeviceLimits.current()
    jobs: set[tuple[str, str]] = set()
    for b, n in shapes:
        for causal in (False, True):
            for p in (0.0, DROPOUT_P):
                v = Variant(causal=causal, dropout=p)
                fwd = pw.plan_forward(b, H, n, D, CTYPE, limits, fwd_config(), variant=v).main
                jobs.add((fwd.source, fwd.name))
                for fam, cfg in cands:
                    plans = pw if fam == "wgmma" else pm
                    bp = plans.plan_backward(b, H, H, n, n, D, CTYPE, limits, cfg, v)
                    jobs.update((lp.source, lp.name) for lp in bp.launches)
    start = time.time()
    with ProcessPoolExecutor(max_workers=min(16, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
        errors = [e for e in pool.map(_build, sorted(jobs)) if e]
    print(f"# precompiled {len(jobs)} kernels in {time.time() - start:.0f} s", flush=True)
    for e in errors:
        print("# COMPILE FAILED", e, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="B=2 N=8192 only (causal and not)")
    ap.add_argument("--compile", action="store_true", help="CPU: NVRTC registers / spills per candidate, no GPU")
    ap.add_argument("--all", action="store_true", help="also the candidates that spill (SPILLING)")
    ap.add_argument("--extra", action="store_true", help="also key-major mma tiles no table uses")
    a = ap.parse_args()
    if a.compile:  # every candidate, SPILLING too: the check that fills it in
        compile_check(candidates(a.extra))
        return
    cands = [c for c in candidates(a.extra) if a.all or is_default(*c) or label(*c) not in SPILLING]
    run(cands, QUICK_SHAPES if a.quick else SHAPES)


def run(cands, shapes) -> None:
    import cupy as cp

    t0 = time.time()
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; bf16 D={D} H={H} backward only, ms per "
          f"call (per_call_ms {CALLS} calls x {BATCHES} batches, best of {ROUNDS} rounds); ratio = no-dropout / "
          f"dropout (1 = free); vs default = default dropout ms / this dropout ms (>1: faster); * = plan default",
          flush=True)  # fmt: skip
    precompile(cands, shapes)
    bf16 = cp.dtype("bfloat16")
    rng = cp.random.default_rng(0)
    for b, n in shapes:  # fresh random normal inputs per shape
        qkvdo = tuple(rng.standard_normal((b, H, n, D), dtype=cp.float32).astype(bf16) for _ in range(4))
        for causal in (False, True):
            one_case(cands, b, n, causal, *qkvdo)
        del qkvdo
        cp.get_default_memory_pool().free_all_blocks()
    print(f"# total {time.time() - t0:.0f} s", flush=True)


def one_case(cands, b, n, causal, q, k, v, do) -> None:
    """Check every candidate against the default, then time it without and with dropout; print the table."""
    import cupy as cp
    import numpy as np

    from cupyflash.kernels import mma, wgmma
    from cupyflash.validation import check_attention

    fams = {"wgmma": wgmma, "mma": mma}
    probs, outs = {}, {}
    for p in (0.0, DROPOUT_P):  # o and lse of the same dropout (see fwd_config)
        probs[p] = check_attention(q, k, v, causal=causal, dropout_p=p)
        o, lse = cp.empty_like(q), cp.empty((b, H, n), cp.float32)
        wgmma.forward(q, k, v, o, lse, probs[p], config=fwd_config(), dropout_seed=SEED)
        outs[p] = (o, lse)
    grads = tuple(cp.empty_like(x) for x in (q, k, v))

    def bwd(fam, cfg, p, dq, dk, dv):
        fams[fam].backward(do, q, k, v, *outs[p], dq, dk, dv, probs[p], config=cfg, dropout_seed=SEED)

    # Check against the default (dropout first, then without) on these inputs, into NaN-poisoned outputs.
    ref, ok = {}, {}
    for fam, cfg in cands:
        status = []
        for p in (DROPOUT_P, 0.0):
            g = tuple(cp.full(x.shape, np.nan, x.dtype) for x in (q, k, v))
            try:
                bwd(fam, cfg, p, *g)
                cp.cuda.Device().synchronize()
            except Exception as e:  # noqa: BLE001  (a config that fails is reported and not timed)
                status.append(f"p={p}: ERROR {type(e).__name__}: {str(e)[:200]}")
                continue
            g = tuple(x.astype(cp.float32) for x in g)
            if is_default(fam, cfg):
                ref[p] = g
            if p not in ref:
                status.append(f"p={p}: ERROR no reference (the default failed)")
                continue
            errs = [float(cp.abs(x - r).max() / cp.abs(r).max()) for x, r in zip(g, ref[p])]
            bad = not all(np.isfinite(errs)) or max(errs) > TOL
            status.append(f"p={p}: {'MISMATCH' if bad else 'OK'} {max(errs):.1e}")
        ok[fam, cfg] = all(s.split()[1] == "OK" for s in status)
        print(f"# check B={b} N={n} causal={int(causal)} {label(fam, cfg)}: " + "; ".join(status), flush=True)
    del ref

    # Time: rounds in alternating candidate order, the better of the rounds kept.
    ms: dict = {}
    order = [c for c in cands if ok[c]]
    for rnd in range(ROUNDS):
        for fam, cfg in order if rnd % 2 == 0 else order[::-1]:
            for p in (0.0, DROPOUT_P):
                t = per_call_ms(lambda: bwd(fam, cfg, p, *grads), CALLS, BATCHES)
                ms[fam, cfg, p] = min(t, ms.get((fam, cfg, p), float("inf")))
    dflt = next((ms[(*c, DROPOUT_P)] for c in order if is_default(*c)), float("nan"))
    print(f"\nB={b} N={n} causal={int(causal)}")
    print(f"  {'config':44s} | no-dropout ms | dropout ms | ratio | vs default")
    for fam, cfg in cands:
        name = ("* " if is_default(fam, cfg) else "  ") + label(fam, cfg)
        if not ok[fam, cfg]:
            print(f"  {name:44s} | not timed (check failed)")
            continue
        base, drop = ms[fam, cfg, 0.0], ms[fam, cfg, DROPOUT_P]
        print(f"  {name:44s} | {base:13.3f} | {drop:10.3f} | {base / drop:5.2f} | {dflt / drop:5.2f}", flush=True)
    print(flush=True)


if __name__ == "__main__":
    main()
