"""User-written mask and score functions compiled into the kernels (issue 17 part 3; FlexAttention's model).

A call may pass CUDA C++ snippets:

- ``mask_mod``: an expression of ``(b, h, q_idx, kv_idx)`` that is true where query ``q_idx`` may attend key
  ``kv_idx`` (ANDed with ``causal``/``window_size``), or a small function body with ``return``;
- ``score_mod``: an expression (or body) of ``(score, b, h, q_idx, kv_idx)`` giving the new score;
- ``score_mod_grad``: d(new score)/d(score) for the backward, an expression (or body) of
  ``(new_score, b, h, q_idx, kv_idx)``. The backward recomputes probabilities, not raw scores, so the score
  before ``score_mod`` is not available there: write the derivative in terms of ``new_score`` (softcap:
  ``1 - (new_score / c) * (new_score / c)``; anything additive: ``1``).

Refused before compiling (``SnippetError``): ``#``, ``asm``, string or character literals, backslashes,
``const_cast``/``reinterpret_cast``, names starting with ``cf_`` (the generated code's), unbalanced brackets, and
``;``/braces in an expression (a body needs ``return``).

Names a snippet may use: the arguments above (``b`` is the batch index with the leading dims flattened
row-major, ``h`` the query head; ints; ``score``/``new_score`` float, natural units), ``Nq`` and ``Nk`` (ints),
and each ``aux`` entry by its name: a Python bool/int/float becomes a ``const bool``/``int``/``float`` (a
run-time value: a new value does not recompile), a CuPy array of 1 to 4 dims becomes an accessor called with
one index per dim, ``name(i, j)``, returning ``float`` for float32/float16/bfloat16 arrays and the element type
for integer and bool arrays; an index outside the array reads 0. CUDA's math functions (``expf``, ``tanhf``,
``fabsf``, ``min``, ``max``, ...) are there too. Any other name is a compile error (``SnippetError``).

Order inside a score: scale -> softcap -> ALiBi -> score_mod -> causal/window AND mask_mod -> softmax (with
the sink) -> dropout. Snippets run only for pairs inside the problem (``q_idx < Nq``, ``kv_idx < Nk``).

Each set of snippets is compiled once per (snippets, aux names/kinds/dtypes/dims, dtype, family, head dim) and
cached in memory and on disk (CuPy's cache) like the built-in kernels: the generated source is a small
``struct User`` (``generate``) followed by the family's own source. Before anything is allocated or launched, a
short front-end compile of the snippets alone (``check``) turns a mistake into a ``SnippetError`` that shows
the snippet, the line NVRTC complains about and its message.

The NumPy reference cannot run C++: there the same keywords take Python callables on broadcast NumPy index
arrays (``mask_mod=lambda b, h, q_idx, kv_idx: ...``, ``score_mod=lambda score, b, h, q_idx, kv_idx: ...``,
``score_mod_grad=lambda new_score, b, h, q_idx, kv_idx: ...``), the "Python twin" of the C++ snippet.
"""
from __future__ import annotations

import functools
import hashlib
import keyword
import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import _dtypes

MAX_AUX = 8
MAX_AUX_DIMS = 4
MAX_SNIPPET = 4000
#: Names the generated functions declare (aux names may not reuse them).
RESERVED = frozenset({"score", "new_score", "b", "h", "q_idx", "kv_idx", "Nq", "Nk"})
#: The struct the kernels are instantiated with (its definition is generated per set of snippets).
USER = "cupyflash::flex::User"
SNIPPETS = ("mask_mod", "score_mod", "score_mod_grad")
_FILE = "cupyflash_flex_user"

_AUX_CTYPES: dict[np.dtype, str] = {
    _dtypes.FLOAT32: "float", _dtypes.FLOAT16: "__half", np.dtype(np.int32): "int", np.dtype(np.int64): "long long",
    np.dtype(np.int16): "short", np.dtype(np.int8): "signed char", np.dtype(np.uint8): "unsigned char",
    np.dtype(np.bool_): "bool",
}  # fmt: skip
if _dtypes.BFLOAT16 is not None:
    _AUX_CTYPES[_dtypes.BFLOAT16] = "__nv_bfloat16"
_CPP_WORDS = frozenset(
    "alignas alignof and asm auto bool break case catch char class const constexpr continue decltype default delete "
    "do double else enum explicit export extern false float for friend goto if inline int long mutable namespace "
    "new noexcept not nullptr operator or private protected public register return short signed sizeof static "
    "struct switch template this throw true try typedef typename union unsigned using virtual void volatile while "
    "xor".split()
)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: Words a snippet may not use: inline assembly, declarations outside its function, casts that would let it write
#: through the read-only arrays, and the generated code's own names (cf_*).
_FORBIDDEN = re.compile(r"\b(asm|__asm__|__asm|extern|__global__|namespace|template|goto|const_cast|reinterpret_cast|"
                        r"cf_\w*)\b")


class SnippetError(ValueError):
    """A user snippet that is refused or does not compile; the message shows the snippet and where."""


@dataclass(frozen=True)
class AuxSlot:
    """One aux entry as the generated code sees it: an array (ctype, ndim) or a scalar (ctype, ndim 0)."""

    name: str
    ctype: str
    ndim: int  # 0: a scalar


@dataclass(frozen=True)
class FlexSpec:
    """What a compiled set of snippets depends on: their text and the aux signature (not values or shapes)."""

    mask_mod: str | None = None
    score_mod: str | None = None
    score_mod_grad: str | None = None
    aux: tuple[AuxSlot, ...] = ()

    @property
    def key(self) -> str:
        """A short hash of everything the generated source depends on."""
        return hashlib.sha1(repr(self).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class FlexTwins:
    """The Python callables the NumPy reference runs in place of C++ snippets."""

    mask_mod: Callable[..., Any] | None = None
    score_mod: Callable[..., Any] | None = None
    score_mod_grad: Callable[..., Any] | None = None


# ---------------------------------------------------------------------------- checks


def check_text(kind: str, text: Any) -> str:
    """A snippet's cheap checks: a short string without preprocessor lines, inline assembly, string or character
    literals or backslashes, with balanced brackets; an expression (no ``;``/braces) unless it has ``return``."""
    if not isinstance(text, str):
        raise TypeError(f"{kind} must be a str of CUDA C++ (or, for the NumPy reference, a callable); got "
                        f"{type(text).__name__}")  # fmt: skip
    if not text.strip():
        raise SnippetError(f"{kind} is empty")
    if len(text) > MAX_SNIPPET:
        raise SnippetError(f"{kind} is longer than {MAX_SNIPPET} characters")
    for bad, why in (("#", "preprocessor directives"), ('"', "string literals"), ("'", "character literals"),
                     ("\\", "backslashes"), ("`", "backquotes")):  # fmt: skip
        if bad in text:
            raise SnippetError(_show(kind, text, f"{why} are not allowed in a snippet ({bad!r})"))
    word = _FORBIDDEN.search(text)
    if word:
        raise SnippetError(_show(kind, text, f"{word.group(1)!r} is not allowed in a snippet"))
    depth = {"(": 0, "[": 0, "{": 0}
    close = {")": "(", "]": "[", "}": "{"}
    for c in text:
        if c in depth:
            depth[c] += 1
        elif c in close:
            depth[close[c]] -= 1
            if depth[close[c]] < 0:
                raise SnippetError(_show(kind, text, f"unbalanced {c!r}"))
    if any(depth.values()):
        raise SnippetError(_show(kind, text, "unbalanced brackets: " + ", ".join(f"{n} more {o!r}" for o, n
                                                                                 in depth.items() if n)))  # fmt: skip
    if not _is_body(text) and re.search(r"[;{}]", text):
        raise SnippetError(_show(kind, text, "an expression has no ';' or braces (write a body with 'return' for "
                                             "statements)"))  # fmt: skip
    if kind == "score_mod_grad" and re.search(r"\bscore\b", text):
        raise SnippetError(_show(kind, text, "'score' is not available in score_mod_grad: the backward recomputes "
                                             "probabilities, not raw scores; write d(new)/d(score) with new_score"))
    return text


def _is_body(text: str) -> bool:
    return re.search(r"\breturn\b", text) is not None


def check_aux(aux: Any, xp: str) -> tuple[AuxSlot, ...]:
    """``aux``: a dict of at most 8 names (C++ identifiers, not reserved) to arrays of q's library (1-4 dims,
    float/int/bool dtypes) or Python scalars (bool, int in int32, float)."""
    from .validation import array_kind

    if aux is None:
        return ()
    if not isinstance(aux, dict):
        raise TypeError(f"aux must be a dict of name -> array or scalar; got {type(aux).__name__}")
    if len(aux) > MAX_AUX:
        raise ValueError(f"aux takes at most {MAX_AUX} entries; got {len(aux)}")
    slots = []
    for name, x in aux.items():
        if not isinstance(name, str) or not _IDENT.match(name) or name in _CPP_WORDS or name in RESERVED \
                or name.startswith(("cf_", "__")):  # fmt: skip
            raise ValueError(f"aux name {name!r} must be a C++ identifier other than a keyword, {sorted(RESERVED)}, "
                             "or one starting with cf_ or __")  # fmt: skip
        if isinstance(x, (bool, np.bool_)):
            slots.append(AuxSlot(name, "bool", 0))
        elif isinstance(x, (int, np.integer)):
            if not -(2**31) <= int(x) < 2**31:
                raise ValueError(f"aux[{name!r}] = {x} does not fit an int32 (pass a float or an array)")
            slots.append(AuxSlot(name, "int", 0))
        elif isinstance(x, (float, np.floating)):
            slots.append(AuxSlot(name, "float", 0))
        else:
            kind = array_kind(f"aux[{name!r}]", x)
            if kind != xp:
                raise TypeError(f"aux[{name!r}] must be a {xp} array like q (no implicit copies); got a {kind} array")
            ctype = _AUX_CTYPES.get(np.dtype(x.dtype))
            if ctype is None:
                names = ", ".join(str(d) for d in _AUX_CTYPES)
                raise TypeError(f"aux[{name!r}].dtype must be one of {names}; got {x.dtype}")
            if not 1 <= x.ndim <= MAX_AUX_DIMS:
                raise ValueError(f"aux[{name!r}] must have 1 to {MAX_AUX_DIMS} dims (a scalar: pass a Python number); "
                                 f"got shape {tuple(x.shape)}")  # fmt: skip
            if any(n >= 2**31 for n in x.shape):
                raise ValueError(f"aux[{name!r}]'s extents must be < 2**31; got {tuple(x.shape)}")
            slots.append(AuxSlot(name, ctype, x.ndim))
    return tuple(slots)


def aux_values(aux: dict[str, Any] | None) -> tuple:
    """Per slot of a checked ``aux``: (extents, element strides, scalar value) (``Variant.flex_aux``)."""
    out = []
    for v in (aux or {}).values():
        if hasattr(v, "shape") and hasattr(v, "strides") and getattr(v, "ndim", 0) > 0:
            out.append((tuple(v.shape), tuple(st // v.itemsize for st in v.strides), 0.0))
        else:
            out.append(((), (), float(v)))
    return tuple(out)


def aux_params(values: tuple) -> dict[str, Any]:
    """The ``AttentionParams.aux_*`` fields of ``aux_values``: per slot an array's extents and element strides or a
    scalar's value."""
    s = np.zeros((MAX_AUX, MAX_AUX_DIMS), np.int64)
    n = np.zeros((MAX_AUX, MAX_AUX_DIMS), np.int32)
    x = np.zeros((MAX_AUX,), np.float64)
    for i, (shape, strides, value) in enumerate(values):
        n[i, : len(shape)] = shape
        s[i, : len(strides)] = strides
        x[i] = value
    return {"aux_s": s, "aux_n": n, "aux_x": x}


def aux_arrays(aux: dict[str, Any] | None) -> dict[str, Any]:
    """The aux arrays by params pointer field (``aux0`` .. ``aux7``, the slot of each entry)."""
    return {f"aux{i}": v for i, v in enumerate((aux or {}).values()) if hasattr(v, "data") and hasattr(v, "strides")
            and getattr(v, "ndim", 0) > 0}  # fmt: skip


def spec_of(mask_mod: Any, score_mod: Any, score_mod_grad: Any, aux: Any, xp: str) -> FlexSpec | FlexTwins | None:
    """The checked snippets of a call: C++ text (``FlexSpec``) or Python twins (``FlexTwins``, the reference's),
    not mixed; None when there are none."""
    given = {n: x for n, x in zip(SNIPPETS, (mask_mod, score_mod, score_mod_grad)) if x is not None}
    slots = check_aux(aux, xp)
    if not given:
        if slots:
            raise ValueError("aux is read by mask_mod/score_mod snippets; none was given")
        return None
    if score_mod_grad is not None and score_mod is None:
        raise ValueError("score_mod_grad needs a score_mod (it is that function's derivative)")
    if all(callable(x) for x in given.values()):
        return FlexTwins(mask_mod, score_mod, score_mod_grad)
    if any(callable(x) for x in given.values()):
        raise TypeError("mask_mod/score_mod/score_mod_grad must all be C++ snippets (str, for CuPy arrays) or all "
                        "Python callables (the NumPy reference's twins)")  # fmt: skip
    for n, x in given.items():
        check_text(n, x)
    return FlexSpec(mask_mod, score_mod, score_mod_grad, slots)


# ---------------------------------------------------------------------------- generated source


def generate(spec: FlexSpec) -> str:
    """The C++ of ``struct User`` for one set of snippets (flex_policy.cuh's Fns). Each snippet is preceded by
    ``#line 1 "<its keyword>"`` so that NVRTC reports its errors at the snippet's own lines."""
    out = [
        "// Generated by cupyflash.flex from user snippets (issue 17 part 3).",
        '#include "flex_policy.cuh"',
        "namespace cupyflash {",
        "namespace flex {",
        "struct User {",
        f"  static constexpr bool kMask = {'true' if spec.mask_mod else 'false'};",
        f"  static constexpr bool kScore = {'true' if spec.score_mod else 'false'};",
    ]
    args = "const AttentionParams& cf_p, {}int b, int h, int q_idx, int kv_idx"
    fns = (("mask_mod", "bool", "mask_mod", "", spec.mask_mod or "true"),
           ("score_mod", "float", "score_mod", "float score, ", spec.score_mod or "score"),
           ("score_mod_grad", "float", "score_grad", "float new_score, ", spec.score_mod_grad or "1.f"))  # fmt: skip
    for kind, ret, fn, first, text in fns:
        out.append(f"  __device__ static __forceinline__ {ret} {fn}({args.format(first)}) {{")
        out.append("    const int Nq = cf_p.nq, Nk = cf_p.nk;")
        out.append("    (void)Nq; (void)Nk; (void)b; (void)h; (void)q_idx; (void)kv_idx;")
        for i, slot in enumerate(spec.aux):
            if slot.ndim:
                out.append(f"    const AuxArray<{slot.ctype}, {slot.ndim}> {slot.name}(&cf_p, {i}, cf_p.aux{i});")
            else:
                out.append(f"    const {slot.ctype} {slot.name} = static_cast<{slot.ctype}>(cf_p.aux_x[{i}]);")
            out.append(f"    (void){slot.name};")
        body = _is_body(text)
        out.append("    {" if body else f"    return static_cast<{ret}>(")
        out.append(f'#line 1 "{kind}"')
        out.extend(text.splitlines() or [text])
        out.append(f'#line {len(out) + 2} "{_FILE}"')
        out.append("    }" if body else "    );")
        if body:  # a body that falls off its end is a compile error, not undefined behaviour
            out.append(f"    __trap(); return {ret}();")
        out.append("  }")
    out += ["};", "}  // namespace flex", "}  // namespace cupyflash", ""]
    return "\n".join(out)


def source_of(spec: FlexSpec, base_source: str) -> str:
    """The whole generated translation unit: the user struct, then the family's source."""
    return generate(spec) + f'#include "{base_source}"\n'


def _show(kind: str, text: str, message: str, line: int | None = None) -> str:
    rows = text.splitlines() or [text]
    width = len(str(len(rows)))
    shown = []
    for i, row in enumerate(rows, 1):
        mark = ">>" if i == line else "  "
        shown.append(f"  {mark} {i:>{width}} | {row}")
    return f"{kind}: {message}\n" + "\n".join(shown)


_LOG_LINE = re.compile(r'^(?:"?)(mask_mod|score_mod|score_mod_grad)(?:"?)\((\d+)\): (?:catastrophic )?error: (.*)$')


def snippet_error(spec: FlexSpec, log: str) -> SnippetError:
    """The first error NVRTC reports in a snippet's lines, shown against the snippet; else the whole log."""
    texts = {"mask_mod": spec.mask_mod, "score_mod": spec.score_mod, "score_mod_grad": spec.score_mod_grad}
    for raw in log.splitlines():
        m = _LOG_LINE.match(raw.strip())
        if m and texts.get(m.group(1)):
            kind, line, msg = m.group(1), int(m.group(2)), m.group(3)
            return SnippetError(_show(kind, texts[kind], f"does not compile: line {line}: {msg}", line)
                                + f"\nNVRTC's log:\n{log.strip()}")  # fmt: skip
    return SnippetError(f"the snippets do not compile; NVRTC's log:\n{log.strip()}")


@functools.lru_cache(maxsize=256)
def check(spec: FlexSpec, arch: str = "compute_80") -> None:
    """Compile the snippets alone (front end to PTX, no kernel families) and raise ``SnippetError`` if NVRTC
    refuses them. Needs NVRTC, not a GPU."""
    from cupy.cuda import nvrtc

    from .kernels.build import compile_options

    code = generate(spec) + (
        "extern \"C\" __global__ void cf_check(const cupyflash::AttentionParams p, float* out) {\n"
        "  using U = cupyflash::flex::User;\n"
        "  const int i = threadIdx.x;\n"
        "  out[i] = U::mask_mod(p, 0, 0, i, i) ? U::score_mod(p, out[i], 0, 0, i, i) : U::score_grad(p, out[i], 0, "
        "0, i, i);\n}\n"
    )  # fmt: skip
    prog = nvrtc.createProgram(code, f"{_FILE}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [*compile_options(), f"-arch={arch}"])
        except nvrtc.NVRTCError:
            raise snippet_error(spec, nvrtc.getProgramLog(prog)) from None
    finally:
        nvrtc.destroyProgram(prog)


_specs: dict[str, FlexSpec] = {}  # key -> spec of every generated source (to explain its compile errors)


def snippet_error_of_source(source: str, log: str) -> SnippetError:
    """``snippet_error`` for a generated source's name (``build.generated_source``)."""
    spec = _specs.get(source.rpartition("#flex-")[2])
    return snippet_error(spec, log) if spec is not None else SnippetError(f"the snippets do not compile:\n{log}")


def uses_user_policy(name: str) -> bool:
    """Does a launch's name expression instantiate the generated policy (else it compiles from its own file)?"""
    return USER in name


def retarget(plan: Any, spec: FlexSpec) -> Any:
    """A family's ``CallPlan`` with every launch that instantiates the user policy compiled from the generated
    source (``build.generated_source``); the other launches (Delta, dQ conversion) keep their files."""
    from dataclasses import replace

    from .kernels import build

    _specs[spec.key] = spec
    launches = tuple(
        (replace(lp, source=build.generated_source(lp.source, spec.key, source_of(spec, lp.source))), params)
        if uses_user_policy(lp.name) else (lp, params)
        for lp, params in plan.launches
    )  # fmt: skip
    return replace(plan, launches=launches)


# ---------------------------------------------------------------------------- the reference's twins


def _twin_indices(xp: Any, batch: tuple[int, ...], hk: int, group: int, rows: Any, cols: Any) -> tuple:
    """(b, h, q_idx, kv_idx) as index arrays broadcasting like the reference's (..., Hk, G, rows, cols) scores: b the
    flattened batch index, h the query head."""
    nb = int(np.prod(batch)) if batch else 1
    b = xp.arange(nb).reshape(*batch, 1, 1, 1, 1) if batch else xp.zeros((1, 1, 1, 1), dtype=np.int64)
    h = xp.arange(hk * group).reshape(hk, group, 1, 1)
    return b, h, xp.asarray(rows).reshape(-1, 1), xp.asarray(cols).reshape(1, -1)


def twin_scores(twins: FlexTwins, xp: Any, S: Any, visible: Any, batch: tuple[int, ...], hk: int, group: int,
                rows: Any, cols: Any) -> tuple[Any, Any]:  # fmt: skip
    """The reference's S (..., Hk, G, rows, cols) after score_mod and ``visible`` ANDed with mask_mod, the
    twins called on broadcast index arrays."""
    idx = _twin_indices(xp, batch, hk, group, rows, cols)
    if twins.score_mod is not None:
        S = xp.broadcast_to(xp.asarray(twins.score_mod(S, *idx), dtype=np.float64), S.shape)
    if twins.mask_mod is not None:
        visible = visible & xp.asarray(twins.mask_mod(*idx), dtype=bool)
    return S, visible


def twin_dscore(twins: FlexTwins, xp: Any, new_score: Any, batch: tuple[int, ...], hk: int, group: int, rows: Any,
                cols: Any) -> Any:  # fmt: skip
    """d(new score)/d(score) from score_mod_grad's twin (1 without score_mod)."""
    if twins.score_mod is None:
        return 1.0
    idx = _twin_indices(xp, batch, hk, group, rows, cols)
    safe = xp.where(xp.isfinite(new_score), new_score, 0.0)  # masked pairs: P = 0 there, any finite factor will do
    return xp.broadcast_to(xp.asarray(twins.score_mod_grad(safe, *idx), dtype=np.float64), new_score.shape)
