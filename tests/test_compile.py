"""NVRTC compiles every kernel instantiation for each target architecture with no spills.

Needs no GPU: NVRTC and the CUDA headers come from the pip CUDA packages. The compiles run once per
session in a process pool, several instantiations of one source per NVRTC program (the C++ front end
runs once per program), with a progress line per program on stderr so a long run does not look hung.
"""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

try:
    from cupy.cuda import nvrtc

    nvrtc.getVersion()
    NVRTC_REASON = None
except Exception as e:  # pragma: no cover - depends on the machine
    NVRTC_REASON = f"NVRTC unavailable ({type(e).__name__}: {e})"

pytestmark = pytest.mark.skipif(NVRTC_REASON is not None, reason=str(NVRTC_REASON))

#: Every family must build for these; the tensor-core family also for the consumer parts.
ARCHS = {
    "portable": ("sm_80", "sm_90a"),
    "mma": ("sm_80", "sm_86", "sm_89", "sm_90a"),
    "linear": ("sm_80", "sm_90a"),
    "wgmma": ("sm_90a",),  # Hopper-only instructions
    "decode": ("sm_80", "sm_90a"),  # cp.async: sm_80+
}

#: Instantiations allowed a small spill, with why. Keys: (name prefix, arch or "*"); values: the most spill
#: bytes (stores and loads each) and stack bytes allowed. Anything else must be spill-free. Largest seen with
#: NVRTC 13.5: mma fwd D=128 116/116 B, bwd2d 28/36 B, key-major D=64 bwd 68/104 B, wgmma bwd D=64 128/172 B.
# The tensor-core kernels below sit at 255 registers. Since kernels take one AttentionParams struct instead of
# 30-40 scalar arguments, ptxas allocates them differently and keeps a few values on the stack (the old
# argument lists happened to fit exactly); the variant policies (ModScore: softcap/ALiBi, Window) add a few
# live values more. The costs measured on an H100 are in benchmarks/NOTES.md ("Variant-ready core"); every
# other instantiation (all portable, wgmma forward, and the rest of mma) is spill-free.
SPILL_ALLOWANCE: dict[tuple[str, str], int] = {
    ("mma_flash_fwd<__half, 128, 128, 64, 4,", "*"): 128,
    ("mma_flash_fwd<__nv_bfloat16, 128, 128, 64, 4,", "*"): 128,
    # (and with SoftcapScore, s24: 4/4 B on sm_90a)
    **{(f"mma_flash_fwd<{ct}, 192, 64, 32, 4, 2, 1, cupyflash::Policy<cupyflash::Window, cupyflash::{score}>", "*"): 16
       for ct in ("__half", "__nv_bfloat16") for score in ("ModScore", "SoftcapScore")},
    # 52/76 B (sm_80, Window) once varlen's per-step re-reads of cu_seqlens went through the read-only path
    # instead of volatile loads (32/56 B with those); that change took the H100's varlen backward from 0.68-0.71x
    # to 0.91-0.92x of the dense one (benchmarks/NOTES.md, "Session 2026-11-23d").
    ("mma_flash_bwd2d<", "*"): 80,
    # After the varlen, dropout and mask merges (per-step policies, turn and geometry re-reads), measured with
    # NVRTC 13.5: the D = 64 float dK/dV tile with Window + ModScore 8/8 B (sm_80) and 4/4 B (sm_90a), the wgmma
    # D = 64 backward with Window + ModScore 140/200 B (its entry below went from 192 to 256).
    ("portable_bwd_kv<float, 64, 64, 64, 8, 16, cupyflash::Policy<cupyflash::Window, cupyflash::ModScore>>", "*"): 16,
    # AlibiScore (s20, NVRTC 13.5): the same tile with Causal 8/8 B on sm_80 (Causal + ModScore has none; the
    # portable kernels run the same per-element score either way).
    ("portable_bwd_kv<float, 64, 64, 64, 8, 16, cupyflash::Policy<cupyflash::Causal, cupyflash::AlibiScore>>", "*"): 8,
    ("mma_flash_bwd<__half, 64, 128, 8, 1, 2, 1, 2,", "*"): 128,
    ("mma_flash_bwd<__nv_bfloat16, 64, 128, 8, 1, 2, 1, 2,", "*"): 128,
    ("wgmma_flash_bwd<__half, 64, 128, 2, 2, cupyflash::Policy<cupyflash::NoMask, cupyflash::ModScore>", "*"): 192,
    ("wgmma_flash_bwd<__half, 64, 128, 2, 2, cupyflash::Policy<cupyflash::Causal, cupyflash::ModScore>", "*"): 192,
    ("wgmma_flash_bwd<__half, 64, 128, 2, 2, cupyflash::Policy<cupyflash::Window, cupyflash::ModScore>", "*"): 256,
    ("wgmma_flash_bwd<__nv_bfloat16, 64, 128, 2, 2, cupyflash::Policy<cupyflash::NoMask, cupyflash::ModScore>", "*"):
        192,
    ("wgmma_flash_bwd<__nv_bfloat16, 64, 128, 2, 2, cupyflash::Policy<cupyflash::Causal, cupyflash::ModScore>", "*"):
        192,
    ("wgmma_flash_bwd<__nv_bfloat16, 64, 128, 2, 2, cupyflash::Policy<cupyflash::Window, cupyflash::ModScore>", "*"):
        256,
    # The same kernels with dropout (issue 16), measured with NVRTC 13.5 (bf16) after the 16-scores-per-draw rule:
    # causal + softcap 0 B (was 112/180), window + softcap 124/200 B (was 120/192: the strip's shuffled words).
    **{(f"wgmma_flash_bwd<{ct}, 64, 128, 2, 2, cupyflash::Policy<cupyflash::{mask}, cupyflash::ModScore, "
        "cupyflash::Dropout>", "*"): 192 if mask != "Window" else 208
       for ct in ("__half", "__nv_bfloat16") for mask in ("NoMask", "Causal", "Window")},
    # The warp-specialised D = 64 forward (160 consumer registers) with the forwards' softcap-without-ALiBi strip
    # (mma_softmax.cuh's score_strip: softcap-only forward 6% faster at D = 64): causal + ModScore 4/8 B (NVRTC 13.5;
    # fp16 or bf16, whichever ptxas happens to allocate worse); 0 B at both since the causal ALiBi strip
    # (alibi_strip_one_sided, s17), the allowance kept for ptxas's variation.
    **{(f"wgmma_flash_fwd_ws<{ct}, 64, 128, 3, 4, cupyflash::Policy<cupyflash::Causal, cupyflash::ModScore>>", "*"): 8
       for ct in ("__half", "__nv_bfloat16")},
    # The wgmma backward with dropout's keep-bit drawer (issue 16): its compute warpgroups hold 240 registers (the
    # drawer keeps 24 of the 3 x 168), where the D = 64 kernel without dropout takes 241: 12/12 B (16 B stack) at
    # D = 64, 0 B at D = 128 (NVRTC 13.5, s16; 28/28 B and 8/8 B before dS folded Z). Measured faster all the same
    # (benchmarks/NOTES.md, s14: backward with dropout 0.79-0.80x -> 0.83-0.86x of no dropout at D = 64).
    **{(f"wgmma_flash_bwd<{ct}, {d}, {br}, 2, 2, cupyflash::Policy<cupyflash::{mask}, cupyflash::PlainScore, "
        f"cupyflash::Dropout>, {own}, true>", "*"): 32 if d == 64 else 16
       for ct in ("__half", "__nv_bfloat16") for d, br in ((64, 128), (128, 64)) for mask in ("NoMask", "Causal")
       for own in ("false", "true")},
    # The float32 (3xTF32) D = 128 key-major backward with dropout, NVRTC 13.5 sm_80: 32/52 B (24 B stack) at 255
    # registers (Br = 16: 36/60 B, dp_chunks = 2: 64/116 B; not better). Every built-in policy is spill-free.
    # With SoftcapScore (softcap alone, s24), the representative's policy now: 44/72 B (32 B stack).
    **{(f"mma_flash_bwd<float, 128, 32, 8, 1, 2, 1, 1, cupyflash::Policy<cupyflash::Causal, cupyflash::{score}, "
        "cupyflash::Dropout>", "*"): 64 if score == "ModScore" else 80 for score in ("ModScore", "SoftcapScore")},
}


#: Instantiations per NVRTC program: large enough to share the front end, small enough to spread over cores.
CHUNK = 6


#: Architectures that build only the plain policies (no window, no score mod): the variant policies are
#: the same code paths, built for sm_80 and sm_90a above.
PLAIN_ONLY = ("sm_86", "sm_89")


def array_jobs() -> list[tuple[str, str, str, str]]:
    """Mask/bias policies (issue 17, ``variants.ARRAYS``): a small representative set, not the cross product
    (CI time): per family and source, the first two kernel configurations of bfloat16 (float32 for the portable
    family) with each ARRAYS policy, for one architecture per family (sm_80; sm_90a for wgmma): the built-in
    policies already cover the architectures; for wgmma, the forward and backward its plans launch at D = 64 and
    128 (staged score tiles, or not where they do not fit), with a mask or a bias alone too. 38 instantiations."""
    from cupyflash.kernels import mma, portable, wgmma
    from cupyflash.variants import ARRAYS, Variant

    from cupyflash.plans import wgmma as pw

    plain = Variant().cpp_policy
    # wgmma: the kernels its plans launch on an H100 (score tiles staged in shared memory where they fit), also
    # with a mask alone and a bias alone (the benchmark's cases; their tiles differ in size)
    staged = ARRAYS + (Variant(mask=True), Variant(bias="__nv_bfloat16"))
    jobs = [(wgmma.NAME, source, expr, ARCHS[wgmma.NAME][0]) for source, expr in pw.array_instantiations(staged)]
    for fam in (portable, mma):
        per_source: dict[tuple[str, str], list[str]] = {}
        for source, expr in fam.instantiations():
            if plain not in expr or "__half" in expr:
                continue
            kind, head_dim = (source, expr.split("<", 1)[0]), expr.split(",")[1]
            # the first configuration of each of the first two head dims (a portable forward also lists its
            # one-buffer fallback tile after the two-buffer one at the same head dim)
            seen = per_source.setdefault(kind, [])
            if len(seen) >= 2 or head_dim in seen:
                continue
            seen.append(head_dim)
            for v in ARRAYS:
                jobs.append((fam.NAME, source, expr.replace(plain, v.cpp_policy), ARCHS[fam.NAME][0]))
    return jobs


def all_jobs() -> list[tuple[str, str, str, str]]:
    from cupyflash.kernels import decode, linear, mma, portable, wgmma
    from cupyflash.variants import BUILTIN, PLAIN

    variant_policies = {v.cpp_policy for v in BUILTIN} - {v.cpp_policy for v in PLAIN}
    jobs = []
    for fam in (portable, mma, linear, wgmma, decode):
        name = getattr(fam, "NAME", fam.__name__.rsplit(".", 1)[-1])
        for source, expr in fam.instantiations():
            if expr.startswith(MMA_F32_MAIN):  # representative sets below (float32_forward_jobs, float32_jobs)
                continue
            for arch in ARCHS.get(name, ("sm_80", "sm_90a")):
                if arch in PLAIN_ONLY and any(pol in expr for pol in variant_policies):
                    continue
                jobs.append((name, source, expr, arch))
    for name, source, expr in dropout_representatives():
        for arch in ARCHS[name] if name == "wgmma" else DROPOUT_ARCHS:
            jobs.append((name, source, expr, arch))
    return jobs + array_jobs() + flex_jobs() + own_dq_jobs() + float32_forward_jobs() + float32_jobs()


#: The mma family's float32 main kernels (3xTF32), which CI compiles as representative sets.
MMA_F32_MAIN = ("mma_flash_fwd<float,", "mma_flash_bwd<float,")


def float32_forward_jobs() -> list[tuple[str, str, str, str]]:
    """The mma family's float32 forwards (3xTF32, cuda_src/mma_tf32.cuh; 30 with the built-in policies, which would
    add about 5 CPU-minutes of NVRTC over four architectures) as a representative eleven: the D = 64 tile with Window +
    softcap/ALiBi for sm_80 and sm_90a and Causal + softcap for sm_90a, the D = 128 fallback (99 KB parts) plain for
    sm_86, D = 96 with causal, softcap and dropout for sm_89, D = 32 with a mask and a float bias for sm_80, and the
    small-grid tile (plans.mma.small_grid, D = 64) causal for sm_90a and plain for sm_80, and three with staged
    mask/bias tiles (D = 64 and 128, sm_80 and sm_90a). Every
    float32 forward is listed by ``mma.instantiations()``; this is the subset built here (about 35 CPU-seconds)."""
    from cupyflash.plans import H100
    from cupyflash.plans import mma as pm
    from cupyflash.variants import ARRAYS, Variant

    cfg = {**pm.FORWARD_CONFIGS_F32, "128fb": pm.FORWARD_FALLBACKS_F32[128][0],
           "64sg": pm.SMALL_GRID_FORWARD_F32[64]}
    window_mod = Variant(window=(8, 8), softcap=30.0).cpp_policy
    cases = ((64, window_mod, "sm_80"), (64, window_mod, "sm_90a"),
             (64, Variant(causal=True, softcap=30.0).cpp_policy, "sm_90a"), ("128fb", Variant().cpp_policy, "sm_86"),
             (96, Variant(causal=True, softcap=30.0, dropout=0.1).cpp_policy, "sm_89"),
             (32, Variant(causal=True, mask=True, bias="float").cpp_policy, "sm_80"),
             ("64sg", Variant(causal=True).cpp_policy, "sm_90a"), ("64sg", Variant().cpp_policy, "sm_80"))  # fmt: skip
    jobs = [("mma", pm.FORWARD_SOURCE, cfg[d].name("float", pol), arch) for d, pol, arch in cases]
    # mask/bias tiles staged in shared memory (the plan's kernels on an H100): both arrays at D = 64 and 128
    staged = ((64, ARRAYS[1], "sm_80"), (128, ARRAYS[1], "sm_90a"), (128, ARRAYS[0], "sm_80"))
    return jobs + [("mma", pm.FORWARD_SOURCE, pm.plan_forward(4, 16, 2048, d, "float", H100, variant=v).main.name,
                    arch) for d, v, arch in staged]  # fmt: skip


def float32_jobs() -> list[tuple[str, str, str, str]]:
    """The mma family's float32 backward (3xTF32, cuda_src/mma_bwd_tf32.cuh), a representative twelve of its
    9 configurations x policies x architectures (about 40 CPU-seconds): the D = 64 table tile causal on sm_80 and
    sm_90a, and owning dQ (sm_80); a float bias (dbias, issue 17) at D = 64; D = 128 with a mask, a float bias,
    a window and softcap/ALiBi (sm_90a), and with causal + softcap + dropout (sm_80); the 99 KB parts' D = 128
    fallback (sm_86); the small-grid tiles (plans.mma.small_grid) at D = 64 causal (sm_80) and D = 128 (sm_90a);
    staged mask/bias tiles (the plan's kernels on an H100): a float32 bias and a mask with a bfloat16 bias at D = 64,
    a mask at D = 128."""
    from cupyflash.plans import H100
    from cupyflash.plans import mma as pm
    from cupyflash.variants import ARRAYS, BUILTIN, DROPOUT, Variant

    src = pm.BACKWARD_SOURCE
    t64, t128 = pm.BACKWARD_CONFIGS_F32[64], pm.BACKWARD_CONFIGS_F32[128]
    plain, causal = BUILTIN[0].cpp_policy, BUILTIN[1].cpp_policy
    return [("mma", src, t64.name("float", causal), "sm_80"), ("mma", src, t64.name("float", causal), "sm_90a"),
            ("mma", src, t64.name("float", causal, own_dq=True), "sm_80"),
            ("mma", src, t64.name("float", Variant(bias="float").cpp_policy), "sm_80"),
            ("mma", src, t128.name("float", ARRAYS[1].cpp_policy), "sm_90a"),
            ("mma", src, t128.name("float", DROPOUT[1].cpp_policy), "sm_80"),
            ("mma", src, pm.BACKWARD_FALLBACKS_F32[128][-1].name("float", plain), "sm_86"),
            *(("mma", src, pm.SMALL_GRID_BACKWARD_F32[d].name("float", pol), arch)
              for d, pol, arch in ((64, causal, "sm_80"), (128, plain, "sm_90a"))),
            *(("mma", src, pm.plan_backward(4, 16, 16, 2048, 2048, d, "float", H100, variant=v).main.name, arch)
              for d, v, arch in ((64, Variant(bias="float"), "sm_80"), (64, ARRAYS[0], "sm_90a"),
                                 (128, Variant(mask=True), "sm_80")))]


def own_dq_jobs() -> list[tuple[str, str, str, str]]:
    """The main backward kernels that own dQ (kOwnDQ, cuda_src/dq_own.cuh; one launch when a key tile covers
    Nk), a representative four: each backward kernel (mma key-major D = 64, mma 2-D D = 128, wgmma D = 64 and
    128) once, causal or not, bfloat16 or float16; 6 jobs with the architectures."""
    from cupyflash.plans import mma as pm
    from cupyflash.plans import wgmma as pw
    from cupyflash.variants import PLAIN

    plain, causal = (v.cpp_policy for v in PLAIN)
    jobs = []
    for ct, d, pol in (("__nv_bfloat16", 64, causal), ("__half", 128, plain)):
        for arch in ("sm_80", "sm_90a"):
            jobs.append(("mma", pm.BACKWARD_SOURCE, pm.BACKWARD_CONFIGS[d].name(ct, pol, own_dq=True), arch))
        jobs.append(("wgmma", pw.BACKWARD_SOURCE, pw.BACKWARD_CONFIGS[d].name(ct, pol, own_dq=True), "sm_90a"))
    return jobs


def flex_spec():
    """The representative user snippets (issue 17 part 3): a mask and a score reading aux arrays and a scalar."""
    from cupyflash import flex

    return flex.FlexSpec(
        mask_mod="doc(b, q_idx) == doc(b, kv_idx)", score_mod="score + slope * tab(h, min(abs(q_idx - kv_idx), 31))",
        score_mod_grad="1.f",
        aux=(flex.AuxSlot("doc", "int", 2), flex.AuxSlot("tab", "float", 2), flex.AuxSlot("slope", "float", 0)))


def flex_mask_spec():
    """A mask alone (the document mask of ``--suite flex``): with a block mask, FlexMask on the built-in score rule."""
    from cupyflash import flex

    return flex.FlexSpec(mask_mod="doc(b, q_idx) == doc(b, kv_idx)", aux=(flex.AuxSlot("doc", "int", 2),))


def flex_specs() -> dict:
    """The representative snippet sets by their generated sources' key."""
    return {spec.key: spec for spec in (flex_spec(), flex_mask_spec())}


def flex_jobs() -> list[tuple[str, str, str, str]]:
    """User-snippet policies (issue 17 part 3): per family and kernel, its first bfloat16 configuration (float32 for
    the portable family) with one of two policies, alternating: Causal narrowed by a block mask with the snippets
    on plain scores (FlexMask + FlexScore<ScoreFns>), and Window with the snippets on softcap/ALiBi; then a mask alone
    with a block mask in three kernels, without and with its bits (the ws forward copying by cp.async or TMA), and
    the wgmma D=64 backward with them (lockstep and with the loader, copying by cp.async or TMA). 19 instantiations
    (about 130 CPU-seconds of NVRTC), for sm_80
    (sm_90a for wgmma). Their sources are generated (``_compile`` registers them per process)."""
    from cupyflash import flex
    from cupyflash.kernels import mma, portable, wgmma
    from cupyflash.plans import mma as mma_plans
    from cupyflash.plans import wgmma as wgmma_plans
    from cupyflash.variants import Variant

    spec = flex_spec()
    policies = (Variant(causal=True, flex=spec, block_mask=(("bm_size", 64),), block_bits=True).cpp_policy,
                Variant(window=(8, 8), softcap=30.0, flex=spec).cpp_policy)  # fmt: skip
    plain = Variant().cpp_policy
    jobs = []
    for fam in (portable, mma, wgmma):
        seen = set()
        for source, expr in fam.instantiations():
            kind = (source, expr.split("<", 1)[0])
            if plain not in expr or "__half" in expr or kind in seen or source == wgmma_plans.FORWARD_WS_SOURCE:
                continue  # (the warp-specialised forward runs a mask_mod with a block mask alone: below)
            seen.add(kind)
            generated = f"{source}#flex-{spec.key}"
            jobs.append((fam.NAME, generated, expr.replace(plain, policies[len(jobs) % 2]), ARCHS[fam.NAME][0]))
    # The mask alone with a block mask (FlexMask, PlainScore: the speed case) in the kernels where its registers
    # are tightest: the wgmma D=64 forwards (the lockstep kernel's 128-register budget, the warp-specialised one's
    # 160-register consumers) and the mma D=64 key-major backward.
    # With the block mask's bits (FlexMask<..., true>, the default where they fit: partial tiles read bits), also
    # the wgmma D=64 backward (255 registers).
    mask_only = flex_mask_spec()
    for bits in (False, True):
        causal = Variant(causal=True, flex=mask_only, block_mask=(("bm_size", 64),), block_bits=bits).cpp_policy
        configs = [(wgmma, wgmma_plans.FORWARD_CONFIGS[64]), (wgmma, wgmma_plans.WS_FORWARD_CONFIGS[64]),
                   (mma, mma_plans.BACKWARD_CONFIGS[64])] + [(wgmma, wgmma_plans.BACKWARD_CONFIGS[64])] * bits
        for fam, config in configs:
            source = (mma_plans.BACKWARD_SOURCE if fam is mma else wgmma_plans.BACKWARD_SOURCE
                      if isinstance(config, wgmma_plans.BackwardConfig) else config.source)  # fmt: skip
            names = [config.name("__nv_bfloat16", causal)]
            if isinstance(config, wgmma_plans.BackwardConfig):  # and with the loader warpgroup, as the plans launch it
                names += [config.name("__nv_bfloat16", causal, loader=True, tma=tma) for tma in (False, True)]
            elif isinstance(config, wgmma_plans.ForwardConfig) and config.ws:  # and by TMA (kTma), as on dense calls
                names.append(config.name("__nv_bfloat16", causal, tma=True))
            jobs += [(fam.NAME, f"{source}#flex-{mask_only.key}", name, ARCHS[fam.NAME][0]) for name in names]
    return jobs


#: The dropout representatives build for the two architectures the families' register budgets differ most on.
DROPOUT_ARCHS = ("sm_80", "sm_90a")


def dropout_representatives() -> list[tuple[str, str, str]]:
    """(family, source, name) of a small representative set of the dropout policies' kernels (variants.DROPOUT;
    issue 16): compiling every policy again with dropout would double CI's time. Plain dropout: portable
    float32 D = 64, mma bfloat16 D = 64 (key-major backward); causal + softcap + dropout: portable float32
    D = 128, mma float16 D = 128 (the 2-D backward): forward and every backward kernel: 34 jobs, about
    4 CPU-minutes of NVRTC (measured: 48 such jobs took 196 s on 2 busy cores), most of it the 8 mma ones.
    The warp-specialised wgmma forward (sm_90a only; its consumers draw the keep bits unrolled): both dropout
    policies at D = 64 and 128, bfloat16, copying by cp.async and by TMA: 8 jobs. The wgmma backward as an H100's
    plans pick it (plain dropout with the keep-bit drawer, softcap's without): 4 jobs."""
    from cupyflash.plans import mma as pm
    from cupyflash.plans import portable as pp
    from cupyflash.plans import H100
    from cupyflash.plans import wgmma as pw
    from cupyflash.variants import DROPOUT

    plain, mixed = (v.cpp_policy for v in DROPOUT)
    out = []
    for source, expr in pp.instantiations(DROPOUT):
        if (plain in expr and "<float, 64," in expr) or (mixed in expr and "<float, 128," in expr):
            out.append(("portable", source, expr))
    for ct, d, pol in (("__nv_bfloat16", 64, plain), ("__half", 128, mixed)):
        out.append(("mma", pm.FORWARD_SOURCE, pm.FORWARD_CONFIGS[d].name(ct, pol)))
        out.append(("mma", pm.BACKWARD_SOURCE, pm.BACKWARD_CONFIGS[d].name(ct, pol)))
    for cfg in pw.WS_FORWARD_CONFIGS.values():  # copying by cp.async and by TMA (kTma, the plans' default)
        out += [("wgmma", cfg.source, cfg.name("__nv_bfloat16", pol, tma)) for pol in (plain, mixed)
                for tma in (False, True)]
    for d in pw.BACKWARD_CONFIGS:  # the backward as the plans pick it: plain dropout with the keep-bit drawer
        for v in DROPOUT:
            out.append(("wgmma", pw.BACKWARD_SOURCE, pw.plan_backward(1, 1, 1, 4096, 4096, d, "__nv_bfloat16", H100,
                                                                      variant=v).main.name))
    return out


def _programs(jobs: list[tuple[str, str, str, str]]) -> list[list[tuple[str, str, str, str]]]:
    by_key: dict[tuple[str, str], list] = {}
    for job in jobs:
        by_key.setdefault((job[1], job[3]), []).append(job)
    out = []
    for group in by_key.values():
        out += [group[i : i + CHUNK] for i in range(0, len(group), CHUNK)]
    return out


def _compile(program):
    from cupyflash.kernels.build import CompileError, base_source, generated_source, nvrtc_compile_many

    _, source, _, arch = program[0]
    if "#flex-" in source:  # a generated source: register it in this (worker) process
        from cupyflash.flex import source_of

        spec = flex_specs()[source.rpartition("#flex-")[2]]
        source = generated_source(base_source(source), spec.key, source_of(spec, base_source(source)))
    try:
        return nvrtc_compile_many(source, [job[2] for job in program], arch)
    except CompileError as e:
        return [str(e)] * len(program)


@pytest.fixture(scope="session")
def compiled(request, pytestconfig) -> dict:
    # only the selected tests' jobs: -k narrows the compiles too
    selected = {item.callspec.params["job"] for item in request.session.items
                if hasattr(item, "callspec") and "job" in item.callspec.params}  # fmt: skip
    programs = _programs([job for job in all_jobs() if job in selected])
    out: dict = {}
    start = time.time()
    # pytest captures stdout and stderr at the file-descriptor level; progress goes around the capture.
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with ProcessPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        for i, (program, results) in enumerate(zip(programs, pool.map(_compile, programs)), 1):
            out.update(zip(program, results))
            if i % 10 == 0 or i == len(programs):
                with capture.global_and_fixture_disabled():
                    print(f"\n[test_compile] {i}/{len(programs)} NVRTC programs, {time.time() - start:.0f} s",
                          file=sys.stderr, flush=True)  # fmt: skip
    return out


#: Mask/bias policies (issue 17, ``ArrayScore``): spill and stack bytes allowed per kernel, the largest measured
#: with NVRTC 13.5 on the representative set (``array_jobs``) rounded up. Why: ``log2_score`` loads a mask byte
#: and a bias element per score (and the backward's softcap derivative reloads the bias, ``add_dbias`` adds an
#: atomic per pair) in kernels that already sit at 255 registers (168 for the portable D=64 forward's 3 blocks).
#: Spill-free there: the portable backward, the mma D=32 kernels and the wgmma D=128 forward. The heaviest is the
#: wgmma D=64 backward with Window + softcap (848 B). Their speed is not yet measured (benchmarks/NOTES.md).
ARRAY_SPILL_ALLOWANCE: dict[str, int] = {
    "portable_fwd<": 128,
    "portable_bwd_kv<": 64,  # 20-48 B at sm_80 (float, D = 64) once the varlen hook re-reads the sequence per tile
    "mma_flash_fwd<": 64,
    "mma_flash_bwd<": 320,
    "mma_flash_bwd2d<": 448,
    "wgmma_flash_fwd<": 128,  # 100/108 B for Window + ArrayScore<ModScore> after the merges (was 88 B)
    "wgmma_flash_bwd<": 864,
}


#: User-snippet policies (issue 17 part 3, ``flex_jobs``): spill and stack bytes allowed per kernel, the largest
#: measured with NVRTC 13.5 rounded up. Why: as ArrayScore, per score the snippets' aux loads and index arithmetic
#: (and the FlexScore's b, h) in tensor-core kernels already at 255 registers (the wgmma forward at its 128-register
#: consumer budget); the portable kernels, the mma forward and the key-major mma backward are spill-free.
#: Measured: mma bwd2d 128/144 B (block mask + causal), wgmma fwd 104/164 B, wgmma bwd 184/156 B on the flex branch,
#: 304/252 B (D=64 Window + FlexScore<ModScore>) after merging with the session's dropout and mask changes. Speed of
#: these instantiations is not measured.
#: With a block mask, mask_mod moved into the mask policy (FlexMask, issue 17 speed; measured on branch flex3):
#: the wgmma D=64 forward with a mask and a score_mod 172/224 B (the score_mod in score_strip, mask_mod in
#: mask_strip: two per-element passes at its 128-register budget; 104/164 B before, when both ran in one), the mask
#: alone 44/60 B (48/88 B before); the mma D=64 key-major backward with the mask alone 8/12 B (0 before).
FLEX_SPILL_ALLOWANCE: dict[str, int] = {
    "mma_flash_bwd<": 32,  # 8/12 B: D=64 FlexMask<Causal> on plain scores (flex3)
    "mma_flash_bwd2d<": 192,
    "wgmma_flash_fwd<": 256,  # 172/224 B: D=64 FlexMask<Causal> + FlexScore<PlainScore, ScoreFns> (flex3)
    # 20/24 B: D=64 FlexMask<Causal> on plain scores (s21), the one snippet policy plans.wgmma.lockstep_by_default
    # lets it run (with a score_mod, Window + FlexScore<ModScore> spilled 840/588 B at its 160-register consumers)
    # 52/56 B with the block mask's bits (FlexMask<Causal, ..., true>, s23); prefix-LM's NoMask base 0 B. The plan
    # gives this kernel D = 64 masks whose rows visit >= 2048 keys (WS_MIN_BLOCK_KEYS_D64), which few tiles split.
    "wgmma_flash_fwd_ws<": 64,
    "wgmma_flash_bwd<": 480,  # 460/424 B: D=64 Window + FlexScore<ModScore> (snippets on softcap/ALiBi), NVRTC 13.5
}


#: The wgmma backward with its loader warpgroup (kLoader, plans.wgmma.uses_loader; s24), NVRTC 13.5: 20/28 B (24 B
#: stack) at D = 128 with every built-in score, all in the loader's 24 registers (its tile coordinates and row
#: pointers); 8/8 B (8 B stack) at D = 64 on plain scores.
#: With ALiBi at D = 64 (AlibiScore, plans.wgmma.LOADER_SCORES_D64) 68/84 B (64 B stack) in the compute warpgroups'
#: 240 registers: measured 1.07x the lockstep kernel, which has none; 8/8 B since the slope folds into the scale (s29;
#: 0 B with NVRTC 13.0).
#: With the loader's Q_i/dO_i by TMA (kTma, plans.wgmma.uses_tma) the loader spills nothing (NVRTC 13.5 and 13.0, every
#: built-in score at both head dims); ALiBi at D = 64 keeps its compute warpgroups' spill (48/64 B, 76/100 B with 13.0;
#: 32/40 B and 28/32 B since s29).
LOADER_SPILL_ALLOWANCE = 32
LOADER_ALIBI_D64_ALLOWANCE = 96
LOADER_SUFFIX = ", false, false, true>"  # kOwnDQ, kDrawer, kLoader
TMA_SUFFIX = ", false, false, true, true>"  # ... and kTma


#: The ws forward with its producer's copies by TMA (kTma, plans.wgmma.uses_tma_forward; TmaParams, 128-byte aligned):
#: spill-free but D = 64 Causal + ModScore (softcap and ALiBi at the 160-register consumers), 8/8 B (8 B stack) with
#: NVRTC 13.5 and 13.0 where its cp.async form has none: the consumers' 64-bit head index, stored once before the key
#: loop and reloaded for the epilogue (SASS: one STL.64, one LDL.64 an item; ptxas allocates the 128-byte aligned
#: parameter's reads differently).
WS_TMA_ALLOWANCE = {f"wgmma_flash_fwd_ws<{ct}, 64, 128, 3, 4, cupyflash::Policy<cupyflash::Causal, cupyflash::ModScore>"
                    ", false, true>": 8 for ct in ("__half", "__nv_bfloat16")}  # fmt: skip


def allowance(name: str, arch: str) -> int:
    if name in WS_TMA_ALLOWANCE:
        return WS_TMA_ALLOWANCE[name]
    loader = 0
    if name.endswith((LOADER_SUFFIX, TMA_SUFFIX)):
        alibi_d64 = ", 64, 128, 2, 2," in name and "AlibiScore>" in name
        loader = LOADER_ALIBI_D64_ALLOWANCE if alibi_d64 else 0 if name.endswith(TMA_SUFFIX) else LOADER_SPILL_ALLOWANCE
    return max(loader, _policy_allowance(name, arch))


def _policy_allowance(name: str, arch: str) -> int:
    if "FlexScore<" in name or "FlexMask<" in name:
        return max((n for prefix, n in FLEX_SPILL_ALLOWANCE.items() if name.startswith(prefix)), default=0)
    if "ArrayScore<" in name:
        return max((n for prefix, n in ARRAY_SPILL_ALLOWANCE.items() if name.startswith(prefix)), default=0)
    for (prefix, a), nbytes in SPILL_ALLOWANCE.items():
        if name.startswith(prefix) and a in ("*", arch):
            return nbytes
    return 0


#: Instantiations known to have their wgmma serialised by ptxas (none: a new one fails test_compiles_without_spills).
WGMMA_SERIALIZED_KNOWN: frozenset = frozenset()


def test_every_family_has_instantiations():
    names = {job[0] for job in all_jobs()}
    assert {"portable", "mma", "linear", "wgmma", "decode"} <= names


@pytest.mark.parametrize("job", all_jobs(), ids=lambda j: f"{j[2]}@{j[3]}")
def test_compiles_without_spills(job, compiled):
    usage = compiled[job]
    assert not isinstance(usage, str), usage
    print(usage.line())
    allowed = allowance(job[2], job[3])
    assert usage.spill_stores <= allowed and usage.spill_loads <= allowed, usage.line()
    assert usage.stack_frame <= allowed, usage.line()
    assert 0 < usage.registers <= 255, usage.line()
    # A kernel whose wgmma ptxas serialised (C7512) still runs, without its products' overlap: the bwd-dk-overlap
    # branch (s25) kept its spills but lost it, which only the log showed.
    assert not usage.wgmma_serialized or job in WGMMA_SERIALIZED_KNOWN, usage.line()
