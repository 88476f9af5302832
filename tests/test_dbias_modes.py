"""How the CUDA host path picks dbias's mode (issue 17 speed; no GPU needed): a full-shape bias's gradient is stored
pair by pair into the output in the bias's dtype (``AttentionParams.dbias_direct = 1``), a broadcast bias's is added
with atomics into a float32 accumulator; the flag comes from dbias's broadcast strides, the caller's buffer must
match the mode, and ``deterministic=True`` is refused only where atomics sum."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash.cuda_backend import (
    _check_dbias_buffer,
    _contiguous_strides,
    _extra_layout,
    _geometry,
    _stores_dbias,
    dbias_direct,
    owns_every_pair,
)
from cupyflash.kernels.family import base_params
from cupyflash.kernels.params import PARAMS
from cupyflash.validation import check_attention

B, HQ, HK, NQ, NK, D = 2, 4, 2, 13, 19, 8
FULL = (B, HQ, NQ, NK)


@pytest.mark.parametrize(
    "shape,direct",
    [
        (FULL, True),
        ((HQ, NQ, NK), False),  # broadcast over the batch
        ((B, 1, NQ, NK), False),
        ((B, HQ, NQ, 1), False),  # over the keys
        ((NK,), False),
    ],
)
def test_direct_iff_the_bias_has_the_full_shape(shape, direct):
    assert dbias_direct(shape, FULL) is direct
    # with one batch the batch dim may be left out: nothing sums over it
    assert dbias_direct((HQ, NQ, NK), (1, HQ, NQ, NK))


def test_direct_from_the_broadcast_strides():
    # a dim of extent 1 in the problem may have stride 0 (nothing sums over it); any other stride 0 sums
    assert owns_every_pair((1, HQ, NQ, NK), (0, NQ * NK, NK, 1))
    assert not owns_every_pair(FULL, (0, NQ * NK, NK, 1))
    assert not owns_every_pair(FULL, (HQ * NQ * NK, NQ * NK, NK, 0))


def _problem_and_geometry(bias_shape, dbias_itemsize):
    q = np.zeros((B, HQ, NQ, D), np.float16)
    k = np.zeros((B, HK, NK, D), np.float16)
    bias = np.zeros(bias_shape, np.float16)
    p = check_attention(q, k, k, bias=bias)

    def entry(x):
        return (x.shape, x.strides, x.itemsize, 0)

    device_like = type("A", (), {"shape": bias.shape, "strides": bias.strides, "itemsize": bias.itemsize,
                                 "data": type("P", (), {"ptr": 0})})()  # fmt: skip
    layout = {"q": entry(q), "k": entry(k), "v": entry(k)}
    layout["dbias"] = (bias.shape, _contiguous_strides(bias.shape, dbias_itemsize), dbias_itemsize, 0)
    layout.update(_extra_layout(p, {"bias": device_like}, layout))
    return p, _geometry(p, layout)


def test_params_flag_and_strides_of_a_full_shape_bias():
    """The output in the bias's dtype (2-byte elements): element strides in those units, the flag set."""
    p, g = _problem_and_geometry(FULL, 2)
    assert g.dbias_direct
    rec = np.frombuffer(base_params(p, g, True).to_bytes(), PARAMS)[0]
    assert rec["dbias_direct"] == 1
    assert tuple(rec["dbias_s"]) == (HQ * NQ * NK, NQ * NK, NK, 1)


def test_params_flag_of_a_broadcast_bias():
    p, g = _problem_and_geometry((HQ, 1, NK), 4)
    assert not g.dbias_direct
    rec = np.frombuffer(base_params(p, g, True).to_bytes(), PARAMS)[0]
    assert rec["dbias_direct"] == 0 and tuple(rec["dbias_s"]) == (0, NK, 0, 1)


@pytest.mark.parametrize(
    "shape,inner",
    [
        (FULL, False),  # stored: no sum
        ((HQ, NQ, NK), True),  # summed over the batch: its B adds meet in L2 with the batches side by side
        ((B, 1, NQ, NK), False),  # summed over heads only: one block adds a kv head's group already
        ((HQ, 1, NK), True),
    ],
)
def test_batch_inner_grid_order_iff_dbias_sums_over_the_batch(shape, inner):
    p, g = _problem_and_geometry(shape, 2 if shape == FULL else 4)
    rec = np.frombuffer(base_params(p, g, False).to_bytes(), PARAMS)[0]
    assert rec["batch_inner"] == int(inner)
    assert rec["batch"] == B and rec["hk"] == HK  # what the kernels' remap (dq_turns.cuh) divides by


def test_no_batch_inner_order_without_dbias():
    q = np.zeros((B, HQ, NQ, D), np.float16)
    k = np.zeros((B, HK, NK, D), np.float16)
    p = check_attention(q, k, k)

    def entry(x):
        return (x.shape, x.strides, x.itemsize, 0)

    g = _geometry(p, {"q": entry(q), "k": entry(k), "v": entry(k)})
    assert np.frombuffer(base_params(p, g, False).to_bytes(), PARAMS)[0]["batch_inner"] == 0


def test_callers_dbias_buffer_must_match_the_mode():
    bias = np.zeros(FULL, np.float16)
    _check_dbias_buffer(np.zeros(FULL, np.float16), bias, True)
    with pytest.raises(ValueError, match="the gradient itself"):
        _check_dbias_buffer(np.zeros(FULL, np.float32), bias, True)
    small = np.zeros((HQ, NQ, NK), np.float16)
    _check_dbias_buffer(np.zeros(small.shape, np.float32), small, False)
    with pytest.raises(ValueError, match="float32 accumulator"):
        _check_dbias_buffer(np.zeros(small.shape, np.float16), small, False)
    with pytest.raises(ValueError, match="shape"):
        _check_dbias_buffer(np.zeros((NQ, NK), np.float32), small, False)


def test_deterministic_refusal_only_where_atomics_sum():
    q = np.zeros((B, HQ, NQ, D), np.float16)
    k = np.zeros((B, HK, NK, D), np.float16)
    assert _stores_dbias(q, k, np.zeros(FULL, np.float16))
    assert not _stores_dbias(q, k, np.zeros((HQ, NQ, NK), np.float16))
    assert not _stores_dbias(q, k, None)
    assert not _stores_dbias(q[0, 0], k, np.zeros(FULL, np.float16))  # bad shapes: the checks say why later
