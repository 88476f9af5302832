"""CPU: a model of a warp-specialised wgmma backward's synchronisation, ahead of its kernel (benchmarks/NOTES.md,
s17's design and s23's "Next"): a producer warpgroup copies each step's Q_i, dO_i, lse and Delta into a ring of
``stages`` slots (FULL: the producer as one arrival; EMPTY: one arrival per compute warpgroup), and two compute
warpgroups, which no longer share a block barrier at the top of a step, meet once a step at the dS^T exchange (a
named barrier of their 256 threads): each writes the half of dS^T for its 64 keys, and each warpgroup's dQ product
reads both halves.

Per step a compute warpgroup: waits for its slot; issues S^T and dP^T (they read Q_i and dO_i); writes its dS^T half
into buffer t % ``ds_buffers``; the exchange barrier; issues dQ (both halves of that buffer, and K_j) and dK/dV (Q_i,
dO_i); once they have landed it releases the slot (EMPTY) and its reads of the buffer end. The model shows what the
kernel needs: two dS^T buffers (with one, a warpgroup that runs ahead overwrites its half while the other one's dQ
still reads it: the lockstep kernel's block barrier at the top of a step is what prevents that today), and the slot
released only after dK and dV, not after S^T and dP^T. Run under many random interleavings as tests/test_ws_protocol.py
runs the forward's (its MBarrier, NamedBarrier and interleave).
"""
from __future__ import annotations

import random

import pytest

from test_ws_protocol import Block, MBarrier, NamedBarrier, interleave, wait

WARPGROUPS = 2


class BackwardBlock:
    """One key tile's block: ``steps`` query steps, a ``stages``-slot ring, ``ds_buffers`` dS^T buffers."""

    def __init__(self, steps: int, stages: int, ds_buffers: int = 2, release_early: bool = False):
        self.n, self.stages, self.nbuf, self.release_early = steps, stages, ds_buffers, release_early
        self.consumers = WARPGROUPS  # (interleave's agent count)
        self.full = [MBarrier(1) for _ in range(stages)]
        self.empty = [MBarrier(WARPGROUPS) for _ in range(stages)]
        self.exchange = NamedBarrier()
        self.slots = [None] * stages  # ("writing" | "ready", step) of each slot
        self.slot_readers = [0] * stages
        self.ds = [[None] * WARPGROUPS for _ in range(ds_buffers)]  # per buffer, per half: ("ready", step)
        self.ds_readers = [[0] * WARPGROUPS for _ in range(ds_buffers)]

    slot = Block.slot  # step t's slot and its fill's parity: the forward ring's arithmetic (self.stages)
    parity = Block.fill_parity

    def producer(self):
        for t in range(self.n):
            s = self.slot(t)
            yield from wait(self.empty[s], self.parity(t) ^ 1)
            assert self.slot_readers[s] == 0, f"Q/dO of step {t} copied into a slot still read"
            self.slots[s] = ("writing", t)
            yield  # the copies in flight
            self.slots[s] = ("ready", t)
            self.full[s].arrive()

    def consumer(self, wg: int):
        for t in range(self.n):
            s, b = self.slot(t), t % self.nbuf
            yield from wait(self.full[s], self.parity(t))
            assert self.slots[s] == ("ready", t), f"step {t}'s S^T read slot {self.slots[s]}"
            self.slot_readers[s] += 1  # S^T and dP^T issued: they read Q_i and dO_i
            yield
            self.slot_readers[s] -= 1  # landed
            if self.release_early:  # (wrong) the slot handed back once S^T and dP^T have landed
                self.empty[s].arrive()
            yield  # P^T, dS^T in registers
            assert self.ds_readers[b][wg] == 0, f"dS^T half {wg} of step {t} written while step {self.ds[b][wg]}'s dQ reads it"
            self.ds[b][wg] = ("ready", t)
            yield from self.exchange.sync()
            for half in range(WARPGROUPS):  # dQ reads both halves (and K_j)
                assert self.ds[b][half] == ("ready", t), f"step {t}'s dQ read dS^T half {half} of {self.ds[b][half]}"
                self.ds_readers[b][half] += 1
            assert self.slots[s] == ("ready", t), f"step {t}'s dK/dV read slot {self.slots[s]}"
            self.slot_readers[s] += 1  # dK and dV read Q_i and dO_i again
            yield  # dQ, dK, dV run
            for half in range(WARPGROUPS):
                self.ds_readers[b][half] -= 1
            self.slot_readers[s] -= 1
            if not self.release_early:
                self.empty[s].arrive()  # wait<0>: every product of the step has landed


def run(steps: int, stages: int, rng: random.Random, **kw) -> BackwardBlock:
    blk = BackwardBlock(steps, stages, **kw)
    interleave(blk, rng, f": steps={steps}, stages={stages}, {kw}")
    assert blk.exchange.arrived == 0, "the exchange barrier ends unbalanced"
    assert sum(blk.slot_readers) == 0 and not any(any(r) for r in blk.ds_readers)
    return blk


@pytest.mark.parametrize("stages", [2, 3])
def test_backward_protocol_ends_and_orders_every_interleaving(stages):
    """Two dS^T buffers, the slot released after dK and dV: every interleaving ends, and no copy or dS^T store lands in
    a buffer that is still read, for 0-12 steps."""
    rng = random.Random(300 + stages)
    for steps in range(0, 13):
        for _ in range(80):
            run(steps, stages, rng)


def test_one_ds_buffer_is_a_race_without_the_top_barrier():
    """With one dS^T buffer, a warpgroup that runs a step ahead writes its half while the other's dQ reads it."""
    rng = random.Random(17)
    with pytest.raises(AssertionError, match="dS\\^T half"):
        for _ in range(300):
            run(4, 2, rng, ds_buffers=1)


def test_slot_released_after_s_and_dp_is_overwritten_under_dk():
    """Handing the slot back once S^T and dP^T have landed lets the producer copy the next steps' Q_i/dO_i over it
    while dK and dV of this step still read it."""
    rng = random.Random(23)
    with pytest.raises(AssertionError, match="slot"):
        for _ in range(300):
            run(6, 2, rng, release_early=True)
