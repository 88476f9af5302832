"""CPU: a model of the warp-specialised forward's synchronisation (cuda_src/wgmma_forward_ws.cu's producer loop and
wgmma_fwd_steps.cuh's pipeline with WsHooks), run under many random interleavings.

Agents: the producer warpgroup and kConsumers consumer warpgroups, each a generator that yields whenever it could be
overtaken (a wait, or an asynchronous wgmma between its issue and its wait). mbarriers follow PTX's parity rule
(try_wait.parity P succeeds once the phase of parity P has completed: the current phase's parity differs from P);
named barriers count arrivals (a warpgroup is one unit of the 256 threads) and complete a generation at 2. Checked:
every interleaving ends (no deadlock); a product reads a slot only once the tile it wants has landed there and been
published; the producer never starts copies into a slot a product is still reading; every turn barrier ends
balanced. Keep it in step with the kernel when the protocol changes. PersistentBlock (below) models the persistent
form (several query tiles a block; the kernel's kPersistent), TmaBlock the producer by TMA (kTma).
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
    """Run the block's producer and consumers to the end, one random agent's next step at a time (and the agents they
    start on the way, ``blk.spawned``: TMA copies in flight)."""
    live = [blk.producer()] + [blk.consumer(c) for c in range(blk.consumers)]
    steps = 0
    while live:
        agent = rng.choice(live)
        try:
            next(agent)
        except StopIteration:
            live.remove(agent)
        spawned = getattr(blk, "spawned", None)
        if spawned:
            live += spawned
            spawned.clear()
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


# ---------------------------------------------------------------------------- a persistent block (design, s22)
# benchmarks/NOTES.md, "A persistent ws forward" (s21): one block takes several items (query tiles) in turn. The
# ring's tile index runs on across items, so its slots and parities follow the running index; Q_i rides in the
# first K tile's group of its item; a Q_EMPTY mbarrier (one arrival per consumer, after its item's last S product
# has completed) lets the producer copy the next item's Q; turns continue across items (only the block's first turn
# skips consumer 0's sync and only its last skips the last consumer's arrival); items without key tiles take no
# turns and no copies anywhere. Simplest form: the item's last V published at its end (publish<0>), the next item's
# copies start after its Q_EMPTY wait. The kernel (wgmma_forward_ws.cu, kPersistent) is ChainedPersistentBlock's form.


class PersistentBlock(Block):
    chained = False  # True: ChainedPersistentBlock's publish chain across items
    late_q_release = False  # True: Q_EMPTY after the item's last P V (the wrong place; a test shows why)
    release_last_v = True  # False: an item's last V slot never released (a test shows the hang)

    def __init__(self, items: list[int], stages: int, consumers: int):
        super().__init__(sum(items), stages, consumers)
        self.items = [n for n in items if n > 0]  # an item without key tiles is skipped by every agent alike
        self.q_empty = MBarrier(consumers)
        self.q, self.q_readers = None, 0  # ("writing" | "ready", item) of the Q buffer

    def q_free(self, i: int):
        """The producer's wait before copying item i's Q: the previous item's S products have all completed."""
        if i > 0:
            yield from wait(self.q_empty, (i - 1) & 1)

    def publish_v(self, t: int) -> None:
        self.v[self.slot(t)] = ("ready", t)
        self.full_v[self.slot(t)].arrive()

    def producer(self):
        first = 0  # the running index of the item's first tile
        for i, n in enumerate(self.items):
            yield from self.q_free(i)
            assert self.q_readers == 0, f"Q_{i} copied while Q_{i - 1} is read"
            self.q = ("writing", i)
            for t in range(first, first + n):
                s = self.slot(t)
                yield from wait(self.empty_k[s], self.fill_parity(t) ^ 1)
                assert self.readers_k[s] == 0, f"K_{t} copied into a slot still read"
                self.k[s] = ("writing", t)
                yield
                if t > (0 if self.chained else first):  # publish<1>: V_{t-1} (chained: maybe the last item's)
                    self.publish_v(t - 1)
                yield from wait(self.empty_v[s], self.fill_parity(t) ^ 1)
                assert self.readers_v[s] == 0, f"V_{t} copied into a slot still read"
                self.v[s] = ("writing", t)
                yield
                if t == first:
                    self.q = ("ready", i)  # Q rides in the item's first K group
                self.k[s] = ("ready", t)
                self.full_k[s].arrive()
            first += n
            if not self.chained or i == len(self.items) - 1:  # publish<0>: the item's (chained: block's) last V
                self.publish_v(first - 1)

    def consumer(self, c):
        last_consumer = c == self.consumers - 1
        own, nxt = self.turn[c], self.turn[(c + 1) % self.consumers]
        turns = sum(n + 1 for n in self.items)  # an item: S_0, then S_t with P_{t-1} V_{t-1}, then the last P V
        taken = 0

        def turn_begin():
            if taken > 0 or c != 0:
                yield from own.sync()

        def turn_end():
            if taken < turns - 1 or not last_consumer:
                nxt.arrive()

        def read_k(t, i):
            assert self.k[self.slot(t)] == ("ready", t), f"S_{t} read {self.k[self.slot(t)]}"
            assert self.q == ("ready", i), f"S_{t} of item {i} read Q {self.q}"
            self.readers_k[self.slot(t)] += 1
            self.q_readers += 1

        def read_v(t):
            assert self.v[self.slot(t)] == ("ready", t), f"P V_{t} read {self.v[self.slot(t)]}"
            self.readers_v[self.slot(t)] += 1

        def done_k(t):
            self.readers_k[self.slot(t)] -= 1
            self.q_readers -= 1
            self.empty_k[self.slot(t)].arrive()

        def done_v(t):
            self.readers_v[self.slot(t)] -= 1
            self.empty_v[self.slot(t)].arrive()

        first = 0
        for i, n in enumerate(self.items):
            last = first + n - 1
            yield from wait(self.full_k[self.slot(first)], self.fill_parity(first))
            yield from turn_begin()
            read_k(first, i)
            turn_end()
            taken += 1
            yield
            done_k(first)
            for t in range(first + 1, first + n):
                yield from wait(self.full_k[self.slot(t)], self.fill_parity(t))
                yield from wait(self.full_v[self.slot(t - 1)], self.fill_parity(t - 1))
                yield from turn_begin()
                read_k(t, i)
                read_v(t - 1)
                turn_end()
                taken += 1
                yield
                done_k(t)
                yield
                done_v(t - 1)
            if not self.late_q_release:
                self.q_empty.arrive()  # the item's last S product has completed: Q is free
            yield from wait(self.full_v[self.slot(last)], self.fill_parity(last))
            yield from turn_begin()
            read_v(last)
            turn_end()
            taken += 1
            yield
            if self.release_last_v:
                done_v(last)  # then O and lse go out from registers (no shared memory)
            else:
                self.readers_v[self.slot(last)] -= 1
            if self.late_q_release:
                self.q_empty.arrive()
            first += n


class ChainedPersistentBlock(PersistentBlock):
    """The form that overlaps items: the producer's publish chain runs on across items as over one long item (no
    publish<0> at an item's end), so it issues the next item's Q and first K while the previous item's last V is
    still landing; Q_i joins its first K group after the Q_EMPTY wait, which the consumers pass without that V."""

    chained = True


@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_persistent_protocol_ends_and_orders_every_interleaving(stages, consumers):
    """Items of random tile counts (0 included) in one block, in both forms (an item's last V published at its end,
    or the publish chain running on across items): no deadlock, no slot or Q read before it landed or overwritten
    while read, every turn barrier balanced."""
    rng = random.Random(7000 + 10 * stages + consumers)
    for k in range(300):
        items = [rng.choice([0, 1, 1, 2, 3, 5, 8]) for _ in range(rng.randint(1, 5))]
        blk = (PersistentBlock, ChainedPersistentBlock)[k % 2](items, stages, consumers)
        interleave(blk, rng, f": items={items}, stages={stages}, consumers={consumers}")
        assert all(b.arrived == 0 for b in blk.turn), f"a turn barrier ends unbalanced: items={items}"
        assert sum(blk.readers_k) == sum(blk.readers_v) == blk.q_readers == 0


def test_persistent_model_catches_an_early_q_copy():
    """The Q_EMPTY wait is needed: a producer that copies the next item's Q without it overwrites a Q still read."""
    class Eager(ChainedPersistentBlock):
        def q_free(self, i: int):
            yield

    rng = random.Random(11)
    with pytest.raises(AssertionError, match="copied while|read Q"):
        for _ in range(300):
            interleave(Eager([3, 4, 2], 3, 2), rng)


def test_persistent_model_needs_turns_to_run_on_across_items():
    """Restarting the turns per item (the one-item kernel's skips at every item's first and last turn) breaks the
    barriers once a block has two items: consumer 0's unsynced first turn of the next item can arrive twice on a
    barrier the last consumer has not synced on yet (the model's turns alone, no copies)."""
    class PerItemTurns(PersistentBlock):
        def consumer(self, c):
            for n in self.items:  # each item's n + 1 turns with the one-item skips, on the same turn barriers
                yield from self._solo_turns(c, n)

        def _solo_turns(self, c, n):
            own, nxt = self.turn[c], self.turn[(c + 1) % self.consumers]
            for k in range(n + 1):
                if k > 0 or c != 0:
                    yield from own.sync()
                if k < n or c != self.consumers - 1:
                    nxt.arrive()
                yield

        def producer(self):
            return
            yield

    rng = random.Random(5)
    with pytest.raises(AssertionError, match="deadlock"):
        for _ in range(50):
            interleave(PerItemTurns([2, 3], 3, 2), rng)


def test_chained_persistent_protocol_needs_q_free_before_the_last_v():
    """In the chained form the producer publishes an item's last V only after the next item's Q_EMPTY wait, so the
    consumers must release Q before they wait for that V (after the last S product), not after the last P V."""
    class Late(ChainedPersistentBlock):
        late_q_release = True

    with pytest.raises(AssertionError, match="deadlock"):
        interleave(Late([2, 2], 2, 2), random.Random(3))



def test_persistent_model_needs_each_items_last_v_released():
    """A one-item block may leave its last V slot unreleased (nothing refills it), a persistent block may not: the
    ring runs on, and the next item's tile in that slot waits for the release forever. (The first persistent kernel
    hung so: wgmma_fwd_steps.cuh's pipeline ended without v_done for the last tile.)"""
    class KeepsLastV(ChainedPersistentBlock):
        release_last_v = False

    run(4, 2, 2, random.Random(1))  # one item: fine either way (the model releases it; the kernel did not)
    with pytest.raises(AssertionError, match="deadlock"):
        interleave(KeepsLastV([2, 3], 2, 2), random.Random(3))


# ---------------------------------------------------------------------------- the producer by TMA (kTma)


class TxBarrier(MBarrier):
    """An mbarrier with a transaction count: its phase completes once its arrivals are in and the bytes announced by
    expect_tx have landed (complete_tx, from the TMA unit), in either order."""

    def __init__(self, count: int):
        super().__init__(count)
        self.tx = 0

    def expect_tx(self) -> None:
        self.tx += 1

    def complete_tx(self) -> None:
        self.tx -= 1
        self._maybe_complete()

    def arrive(self) -> None:
        self.pending += 1
        assert self.pending <= self.count
        self._maybe_complete()

    def _maybe_complete(self) -> None:
        if self.pending == self.count and self.tx == 0:
            self.completed, self.pending = self.completed + 1, 0


class TmaBlock(PersistentBlock):
    """The kernel's kTma form (one item or several): one producer thread waits on EMPTY (and Q_EMPTY), announces the
    tile's bytes on FULL (expect_tx), issues its copies (agents that land whenever, then complete_tx) and arrives
    (FULL expects that one arrival); no publish chain."""

    def __init__(self, items: list[int], stages: int, consumers: int):
        super().__init__(items, stages, consumers)
        self.full_k = [TxBarrier(1) for _ in range(stages)]
        self.full_v = [TxBarrier(1) for _ in range(stages)]
        self.spawned: list = []

    def _copy(self, bar: TxBarrier, land):
        yield  # in flight
        land()
        bar.complete_tx()

    def producer(self):
        first = 0
        for i, n in enumerate(self.items):
            yield from self.q_free(i)
            assert self.q_readers == 0, f"Q_{i} copied while Q_{i - 1} is read"
            for t in range(first, first + n):
                s = self.slot(t)
                yield from wait(self.empty_k[s], self.fill_parity(t) ^ 1)
                assert self.readers_k[s] == 0, f"K_{t} copied into a slot still read"
                self.full_k[s].expect_tx()
                self.k[s] = ("writing", t)
                if t == first:  # Q_i on the item's first K's FULL
                    self.q = ("writing", i)
                    self.spawned.append(self._copy(self.full_k[s], lambda i=i: setattr(self, "q", ("ready", i))))
                    self.full_k[s].expect_tx()
                self.spawned.append(self._copy(self.full_k[s], lambda s=s, t=t: self.k.__setitem__(s, ("ready", t))))
                self.full_k[s].arrive()
                yield
                yield from wait(self.empty_v[s], self.fill_parity(t) ^ 1)
                assert self.readers_v[s] == 0, f"V_{t} copied into a slot still read"
                self.full_v[s].expect_tx()
                self.v[s] = ("writing", t)
                self.spawned.append(self._copy(self.full_v[s], lambda s=s, t=t: self.v.__setitem__(s, ("ready", t))))
                self.full_v[s].arrive()
                yield
            first += n


@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_tma_protocol_ends_and_orders_every_interleaving(stages, consumers):
    """The kTma producer (one item a block, or persistent items of random tile counts): no deadlock, nothing read
    before its bytes landed, no slot or Q overwritten while read, every turn barrier balanced."""
    rng = random.Random(9000 + 10 * stages + consumers)
    for k in range(300):
        items = [rng.randint(0, 9)] if k % 2 else [rng.choice([0, 1, 1, 2, 3, 5, 8]) for _ in range(rng.randint(1, 5))]
        blk = TmaBlock(items, stages, consumers)
        interleave(blk, rng, f": items={items}, stages={stages}, consumers={consumers}")
        assert all(b.arrived == 0 for b in blk.turn), f"a turn barrier ends unbalanced: items={items}"
        assert sum(blk.readers_k) == sum(blk.readers_v) == blk.q_readers == 0


def test_tma_model_catches_an_arrival_that_ignores_the_bytes():
    """The transaction count matters: a FULL that completed on the thread's arrival alone (no expect_tx) would let
    the consumers read tiles still in flight."""
    class NoTx(TmaBlock):
        def __init__(self, items, stages, consumers):
            super().__init__(items, stages, consumers)
            for bar in self.full_k + self.full_v:
                bar.expect_tx = lambda: None
                bar.complete_tx = lambda: None

    rng = random.Random(13)
    with pytest.raises(AssertionError, match="read"):
        for _ in range(300):
            interleave(NoTx([3, 4, 2], 3, 2), rng)


# ---------------------------------------------------------------------------- the persistent grid's item order (s25)


def rotation_items(x: int, grid: int, n_items: int) -> list[int]:
    """The items block x of a persistent grid of ``grid`` blocks takes, in order (wgmma_forward_ws.cu's
    item_of_round: round k, item k G + (x + k) mod G, those past the plain grid's end skipped)."""
    rounds = -(-n_items // grid)
    return [g for k in range(rounds) if (g := k * grid + (x + k) % grid) < n_items]


@pytest.mark.parametrize("n_items, grid", [(1, 1), (7, 7), (8, 3), (132, 132), (2816, 132), (2752, 132), (48, 5),
                                          (1000, 1), (12, 11)])  # fmt: skip
def test_persistent_rotation_takes_every_item_once(n_items, grid):
    """Every item of the plain grid goes to exactly one block, each block's items rise (round by round, so the
    grid's order, longest first under causal, is kept), and the blocks' shares differ by at most one item."""
    per_block = [rotation_items(x, grid, n_items) for x in range(grid)]
    taken = sorted(g for items in per_block for g in items)
    assert taken == list(range(n_items))
    assert all(items == sorted(items) for items in per_block)
    assert max(map(len, per_block)) - min(map(len, per_block)) <= 1


def test_persistent_rotation_spreads_a_heads_tiles_over_the_blocks():
    """The reason for the rotation: with tiles fastest (items g = head * tiles + tile) and a grid of a multiple of a
    head's tile count (132 SMs, 22 query tiles of 192 rows at N = 4096), block x of the strided order (x, x + G, ...)
    meets only tile x mod 22 of every head: a causal row's longest tiles all on a sixth of the blocks (measured 0.6x).
    Rotated, each block meets a different tile index with each of its items."""
    tiles, heads, grid = 22, 128, 132
    n_items = tiles * heads
    strided = [list(range(x, n_items, grid)) for x in range(grid)]
    assert all(len({g % tiles for g in items}) == 1 for items in strided)  # one tile index a block
    for x in range(grid):
        seen = [g % tiles for g in rotation_items(x, grid, n_items)]  # 21 or 22 items
        assert len(seen) >= tiles - 1 and len(set(seen)) == len(seen), x  # a different tile index each
