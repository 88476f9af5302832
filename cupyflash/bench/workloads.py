"""The benchmark families (``WORKLOADS``): each names its FLOP count and builds its
implementations by name. Another family is one more entry here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .cli import TORCH_BACKENDS
from .impls import Impl
from .linear_impls import cupyflash_linear_impl, find_linear, fla_linear_impl, naive_linear_impl
from .shapes import attention_flops, linear_flops
from .softmax_impls import cupyflash_impl, naive_impl, sdpa_impl


# ---------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    """A benchmark family: its FLOP count and how to build each named implementation."""

    name: str
    flops: Callable[..., float]
    impl: Callable[[str], Impl]  # impl name -> prepare function

    def available(self) -> str | None:
        """None, or why this family cannot run in this build."""
        return None


def _softmax_impl(name: str) -> Impl:
    if name == "naive":
        return naive_impl
    if name in TORCH_BACKENDS:
        return sdpa_impl(TORCH_BACKENDS[name])
    if name.startswith("cupyflash"):
        return cupyflash_impl(name[len("cupyflash["):-1] if "[" in name else "auto")
    raise KeyError(name)


def _linear_impl(name: str) -> Impl:
    if name == "naive-linear":
        return naive_linear_impl
    if name == "fla":
        return fla_linear_impl
    if name.startswith("cupyflash-linear"):
        return cupyflash_linear_impl(name[len("cupyflash-linear["):-1] if "[" in name else "auto")
    raise KeyError(name)


class LinearWorkload(Workload):
    def available(self) -> str | None:
        fwd, _ = find_linear()
        return None if fwd is not None else "cupyflash.linear_attention is not in this build yet"


WORKLOADS: dict[str, Workload] = {
    "softmax": Workload("softmax", attention_flops, _softmax_impl),
    "linear": LinearWorkload("linear", linear_flops, _linear_impl),
}
