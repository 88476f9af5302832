"""CPU: a model of the warp-specialised forward's synchronisation (cuda_src/wgmma_forward_ws.cu's producer loop and
wgmma_fwd_steps.cuh's pipeline with WsHooks), run under many random interleavings.

Agents: the producer warpgroup and kConsumers consumer warpgroups, each a generator that yields whenever it could be
overtaken (a wait, or an asynchronous wgmma between its issue and its wait). mbarriers follow PTX's parity rule
(try_wait.parity P succeeds once the phase of parity P has completed: the current phase's parity differs from P);
named barriers count arrivals (a warpgroup is one unit of the 256 threads) and complete a generation at 2. Checked:
every interleaving ends (no deadlock); a product reads a slot only once the tile it wants has landed there and been
published; the producer never starts copies into a slot a product is still reading; every turn barrier ends
balanced. Keep it in step with the kernel when the protocol changes.
"""
from __future__ import annotations

import random

import pytest


class MBarrier:
    def __init__(self, count: int):
        self.count, self.pending, self.completed = count, 0, 0

    def arrive(self) -> None:
        self.pending += 1
        assert self.pending <= self.count
        if self.pending == self.count:
            self.completed, self.pending = self.completed + 1, 0

    def passed(self, parity: int) -> bool:
        return (self.completed & 1) != parity


class NamedBarrier:
    def __init__(self):
        self.arrived, self.generation = 0, 0

    def arrive(self) -> None:
        self.arrived += 1
        if self.arrived == 2:  # 256 threads: two warpgroups
            self.arrived, self.generation = 0, self.generation + 1

    def sync(self):
        gen = self.generation
        self.arrive()
        while self.generation == gen:
            yield


def wait(bar: MBarrier, parity: int):
    while not bar.passed(parity):
        yield


class Block:
    def __init__(self, n_tiles: int, stages: int, consumers: int):
        self.n, self.stages, self.consumers = n_tiles, stages, consumers
        self.full_k = [MBarrier(1) for _ in range(stages)]  # the producer warpgroup (128 threads) as one unit
        self.full_v = [MBarrier(1) for _ in range(stages)]
        self.empty_k = [MBarrier(consumers) for _ in range(stages)]  # 4 warps per consumer, as one unit
        self.empty_v = [MBarrier(consumers) for _ in range(stages)]
        self.turn = [NamedBarrier() for _ in range(consumers)]
        self.k = [None] * stages  # ("writing" | "ready", tile) of each slot
        self.v = [None] * stages
        self.readers_k = [0] * stages
        self.readers_v = [0] * stages

    def slot(self, t):
        return t % self.stages

    def fill_parity(self, t):
        return (t // self.stages) & 1

    def producer(self):
        for t in range(self.n):
            s = self.slot(t)
            yield from wait(self.empty_k[s], self.fill_parity(t) ^ 1)
            assert self.readers_k[s] == 0, f"K_{t} copied into a slot still read"
            self.k[s] = ("writing", t)
            yield
            if t > 0:  # publish<1>: V_{t-1} has landed
                self.v[self.slot(t - 1)] = ("ready", t - 1)
                self.full_v[self.slot(t - 1)].arrive()
            yield from wait(self.empty_v[s], self.fill_parity(t) ^ 1)
            assert self.readers_v[s] == 0, f"V_{t} copied into a slot still read"
            self.v[s] = ("writing", t)
            yield
            self.k[s] = ("ready", t)  # publish<1>: K_t (and Q_i) has landed
            self.full_k[s].arrive()
        if self.n > 0:
            self.v[self.slot(self.n - 1)] = ("ready", self.n - 1)
            self.full_v[self.slot(self.n - 1)].arrive()

    def consumer(self, c):
        first, last = c == 0, c == self.consumers - 1
        own, nxt = self.turn[c], self.turn[(c + 1) % self.consumers]

        def read_k(t):
            assert self.k[self.slot(t)] == ("ready", t), f"S_{t} read {self.k[self.slot(t)]}"
            self.readers_k[self.slot(t)] += 1

        def read_v(t):
            assert self.v[self.slot(t)] == ("ready", t), f"P V_{t} read {self.v[self.slot(t)]}"
            self.readers_v[self.slot(t)] += 1

        def done_k(t):
            self.readers_k[self.slot(t)] -= 1
            self.empty_k[self.slot(t)].arrive()

        def done_v(t):
            self.readers_v[self.slot(t)] -= 1
            self.empty_v[self.slot(t)].arrive()

        if self.n == 0:
            return
        yield from wait(self.full_k[0], self.fill_parity(0))  # tile_ready(0)
        if not first:
            yield from own.sync()  # turn_begin(true)
        read_k(0)
        nxt.arrive()  # turn_end(false)
        yield  # S_0 runs
        done_k(0)  # wait<0>, k_done(0)
        for t in range(1, self.n):
            yield from wait(self.full_k[self.slot(t)], self.fill_parity(t))  # tile_ready(t)
            yield from wait(self.full_v[self.slot(t - 1)], self.fill_parity(t - 1))  # v_ready(t - 1)
            yield from own.sync()
            read_k(t)
            read_v(t - 1)
            nxt.arrive()
            yield  # S_t and P_{t-1} V_{t-1} run
            done_k(t)  # wait<1>
            yield  # softmax; P V still runs
            done_v(t - 1)  # wait<0>
        yield from wait(self.full_v[self.slot(self.n - 1)], self.fill_parity(self.n - 1))
        yield from own.sync()
        read_v(self.n - 1)
        if not last:
            nxt.arrive()  # turn_end(true)
        yield
        done_v(self.n - 1)


def interleave(blk: Block, rng: random.Random, what: str = "") -> None:
    """Run the block's producer and consumers to the end, one random agent's next step at a time."""
    live = [blk.producer()] + [blk.consumer(c) for c in range(blk.consumers)]
    steps = 0
    while live:
        agent = rng.choice(live)
        try:
            next(agent)
        except StopIteration:
            live.remove(agent)
        steps += 1
        assert steps < 100_000, f"deadlock{what}"


def run(n_tiles: int, stages: int, consumers: int, rng: random.Random) -> None:
    blk = Block(n_tiles, stages, consumers)
    interleave(blk, rng, f": n_tiles={n_tiles}, stages={stages}, consumers={consumers}")
    assert all(b.arrived == 0 for b in blk.turn), "a turn barrier ends unbalanced"
    assert sum(blk.readers_k) == sum(blk.readers_v) == 0


@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_protocol_ends_and_orders_every_interleaving(stages, consumers):
    rng = random.Random(1000 * stages + consumers)
    for n_tiles in range(0, 12):
        for _ in range(60):
            run(n_tiles, stages, consumers, rng)


def test_model_catches_a_broken_protocol():
    """The model is not vacuous: a producer that skips its EMPTY waits overwrites slots being read."""
    class Hasty(Block):
        def producer(self):
            for t in range(self.n):
                s = self.slot(t)
                assert self.readers_k[s] == 0 and self.readers_v[s] == 0, "overwrote a slot still read"
                self.k[s] = self.v[s] = ("ready", t)
                self.full_k[s].arrive()
                self.full_v[s].arrive()
                yield

    rng = random.Random(7)
    with pytest.raises(AssertionError, match="read|overwrote"):
        for _ in range(200):
            interleave(Hasty(8, 2, 2), rng)


def test_model_finds_the_deadlock_one_stage_would_have():
    """kStages >= 2 is needed (the kernel's static_assert): with one slot the producer publishes K_1 only after V_1's
    slot is free, which the consumers free only in the step that needs K_1."""
    with pytest.raises(AssertionError, match="deadlock"):
        run(3, 1, 2, random.Random(0))
