"""``python -m cupyflash.bench``: cupyflash against naive CuPy and PyTorch SDPA (DESIGN.md §5).

Per shape and pass, every implementation runs on the same random inputs (shared with torch
by DLPack), timed with CUDA events (``cupyflash.bench.timing``); the table reports TFLOP/s and
the ratio of cupyflash to each comparison. A benchmark family is a ``Workload`` (its shapes,
FLOP count, passes and implementations): ``softmax`` attention is the main one, ``linear``
attention a second one, and another family is one more entry in ``WORKLOADS``.

Modules, one job each:

- ``shapes``: ``Shape``, the suites, FLOP formulas, memory arithmetic;
- ``report``: ``Record``, JSON, the table, its notes, the plot;
- ``cli``: argument parsing into ``Options``, suite expansion and filtering, the ``--list`` plan;
- ``timing``: CUDA-event measurement and its planning (shared with ``benchmarks/``);
- ``device``: the GPU, its environment record, memory release, CuPy/torch interop;
- ``impls``: input sets and the interface every implementation follows;
- ``softmax_impls``, ``linear_impls``: the implementations; ``workloads``: the families;
- ``memory``: the long suite's memory check; ``overhead``: ``--suite overhead``, host microseconds
  per tiny call against GPU time; ``variants``: ``--suite variants``; ``paired``: rows timed by several
  implementations against the first (``dropout``: ``--suite dropout``, issue 16; ``masks``: ``--suite masks``,
  issue 17; ``flex``: ``--suite flex``, issue 17's mask_mod + block_mask); ``run``: measuring and ``main``.

``shapes``, ``report``, ``cli`` and ``timing``'s planning are pure Python and tested on the CPU
(``tests/test_bench_cli.py``); ``--help`` and ``--list`` need no GPU.
"""
from .cli import Options, parse_args, torch_importable
from .device import free_device_memory, gpu_unavailable_reason
from .impls import InputSet, Unavailable
from .linear_impls import naive_linear
from .report import JSON_KEYS, Record, format_notes, format_table, plot, plot_series, records_to_json
from .run import input_sets, main, make_clock
from .shapes import (
    Shape,
    attention_flops,
    fmt_bytes,
    fp32_shapes,
    grid_shapes,
    heads_per_chunk,
    linear_flops,
    linear_memory_bound,
    long_shapes,
    naive_linear_head_bytes,
    naive_scores_bytes,
    naive_softmax_head_bytes,
    quick_shapes,
)
from .softmax_impls import naive_attention_forward
from .workloads import WORKLOADS, Workload

__all__ = [
    "JSON_KEYS", "WORKLOADS", "InputSet", "Options", "Record", "Shape", "Unavailable", "Workload",
    "attention_flops", "fmt_bytes", "format_notes", "format_table", "fp32_shapes", "free_device_memory",
    "gpu_unavailable_reason", "grid_shapes", "heads_per_chunk", "input_sets", "linear_flops",
    "linear_memory_bound", "long_shapes", "main", "make_clock", "naive_attention_forward", "naive_linear",
    "naive_linear_head_bytes", "naive_scores_bytes", "naive_softmax_head_bytes", "parse_args", "plot",
    "plot_series", "quick_shapes", "records_to_json", "torch_importable",
]  # fmt: skip
