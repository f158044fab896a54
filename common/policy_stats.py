"""The speculation policy's vocabulary and statistics (common/policy.py decides with them): tree shapes, batch
buckets, acceptance counts per band, shape and level, round costs per batch bucket and shape, and each
sequence's factor. Plain bookkeeping, no torch; the rules and a worked example are in common/policy.py."""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.policy import PolicyConfig, StepCost


@dataclass(frozen=True, order=True)
class Shape:
    """A tree shape: the draft expands `depth` levels and the best `nodes` nodes are verified.
    Shape(0, 0) is no draft at all: a plain decoding round."""

    depth: int
    nodes: int

    def __post_init__(self) -> None:
        if (self.depth == 0) != (self.nodes == 0) or self.depth < 0 or self.nodes < self.depth:
            raise ValueError(f"a tree shape needs nodes >= depth >= 1 (or both 0 for plain), got {self}")

    @property
    def plain(self) -> bool:
        return self.depth == 0

    @classmethod
    def parse(cls, text: str) -> Shape:
        """'4x16' -> Shape(4, 16); 'plain' -> PLAIN."""
        if text.strip() == "plain":
            return PLAIN
        try:
            depth, nodes = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"a tree shape is DEPTHxNODES (e.g. 4x16) or 'plain', got {text!r}") from None
        return cls(depth, nodes)

    def __str__(self) -> str:
        return "plain" if self.plain else f"{self.depth}x{self.nodes}"


PLAIN = Shape(0, 0)


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n, or the largest one.  (1, 2, 4, 8): 3 -> 4, 9 -> 8"""
    i = bisect_left(buckets, n)
    return buckets[min(i, len(buckets) - 1)]


class Clock:
    """Exponential decay without touching every sum every round: a sum is stored in units of the base
    round and is worth stored * scale now, scale = decay^(now - base). Half-life 1: an add of 1 at round 0
    and one at round 1 are stored as 1 and 2 (1 / 0.5); at round 1 they are worth 3 * 0.5 = 1.5."""

    def __init__(self, half_life: float) -> None:
        self.decay, self.base, self.scale = 0.5 ** (1 / half_life), 0, 1.0

    def advance(self, now: int) -> bool:
        """Move to round `now`; True when the owner must rebase (multiply its sums by scale, then reset)."""
        self.scale = self.decay ** (now - self.base)
        return self.scale < 1e-100

    def reset(self, now: int) -> None:
        self.base, self.scale = now, 1.0


class AcceptanceTable:
    """Per (band, menu shape, level): counts of rounds that reached the level and that accepted there, decayed
    by rounds; per (band, level) their sums over every shape (a pinned shape off the menu counts there only),
    decayed by verifications alone: the pooled figures are the draft's recent acceptance on this traffic, which a
    stretch of plain rounds does not wear away (module docstring). Lists follow the menu: [shape][level].

    Example (prior weight ~0, no decay): shape 3x8 accepting 2 then 0 -> level 1 reached 2 passed 1, level 2
    reached 1 passed 1, level 3 reached 1 passed 0 -> alpha = (0.5, 1.0, 0.0), E = .5 + .5 * 1 + 0 = 1."""

    def __init__(self, cfg: PolicyConfig, clock: Clock) -> None:
        self.menu, self.prior, self.w = cfg.menu, cfg.prior, cfg.prior_weight
        self.index = {s: i for i, s in enumerate(cfg.menu)}
        self.clock = clock  # the policy's: rounds are calls to choose
        self.levels = max(s.depth for s in cfg.menu)
        self.reached: dict[str, list[list[float]]] = {}  # band -> [menu][depth], in the clock's stored units
        self.passed: dict[str, list[list[float]]] = {}
        self.reached_sum: dict[str, list[float]] = {}  # band -> [levels]: over every shape, per verification
        self.passed_sum: dict[str, list[float]] = {}
        self.pooled_decay = 0.5 ** (1 / cfg.pooled_half_life)

    def rebase(self, s: float) -> None:
        """Multiply every stored count decayed by rounds by s (the clock's scale, before it resets)."""
        for table in (*self.reached.values(), *self.passed.values()):
            for v in table:
                v[:] = [x * s for x in v]

    def observe(self, band: str, shape: Shape, accepted: Sequence[int]) -> None:
        """A round's verifications of `shape` in `band`, the drafted tokens each accepted (each in [0, depth]). A
        level is reached up to the first rejected one and passed below it: accepted [2, 0] of 3x8 -> level 1
        reached 2 passed 1, level 2 reached 1 passed 1, level 3 reached 1 passed 0. The pooled counts decay once a
        verification, the call's taken together (they weigh alike; the policy calls once a round per band and
        shape)."""
        if not accepted:
            return
        if band not in self.reached:
            for t in (self.reached, self.passed):
                t[band] = [[0.0] * s.depth for s in self.menu]
        self.levels = max(self.levels, shape.depth)
        decay = self.pooled_decay ** len(accepted)
        for t in (self.reached_sum, self.passed_sum):
            v = t.setdefault(band, [])
            v.extend([0.0] * (self.levels - len(v)))
            v[:] = [x * decay for x in v]
        at_least = [0] * (shape.depth + 2)  # [level]: verifications that accepted level or more tokens
        for a in accepted:
            at_least[a] += 1
        for level in range(shape.depth - 1, -1, -1):
            at_least[level] += at_least[level + 1]
        rs, ps = self.reached_sum[band], self.passed_sum[band]
        i = self.index.get(shape)
        r, p = (self.reached[band][i], self.passed[band][i]) if i is not None else (None, None)
        one = 1 / self.clock.scale
        for level in range(shape.depth):  # reached: accepted >= level; passed: accepted > level
            reached, passed = at_least[level], at_least[level + 1]
            rs[level] += reached
            ps[level] += passed
            if r is not None and p is not None:  # a menu shape (both lists), not one pinned off the menu
                r[level] += reached * one
                p[level] += passed * one

    def pooled(self, band: str) -> list[float]:
        """[levels] the band's acceptance per level over every shape, leaning on the greedy band's, which
        leans on the prior."""
        w = self.w
        out = [self.prior] * self.levels
        for b in ("greedy", band) if band != "greedy" else ("greedy",):
            rs, ps = self.reached_sum.get(b), self.passed_sum.get(b)
            if rs is not None and ps is not None:
                out = [(p + w * g) / (r + w) for r, p, g in zip(rs, ps, out)] + out[len(rs) :]
        return out

    def alphas(self, band: str, shape: Shape) -> list[float]:
        """[depth] acceptance of each level of `shape` in `band` (off the menu: the pooled figures)."""
        pool, i = self.pooled(band), self.index.get(shape)
        if i is None or band not in self.reached:
            return pool[: shape.depth]
        s, w = self.clock.scale, self.w
        return [(p * s + w * g) / (r * s + w) for r, p, g in zip(self.reached[band][i], self.passed[band][i], pool)]

    def expected(self, band: str) -> list[float]:
        """[menu] E[accepted drafted tokens] of one round of each menu shape for a sequence of `band`."""
        pool = self.pooled(band)
        reached, passed = self.reached.get(band), self.passed.get(band)
        s, w = self.clock.scale, self.w
        out = []
        for i, shape in enumerate(self.menu):
            total, reach = 0.0, 1.0
            if reached is None or passed is None:
                for level in range(shape.depth):
                    reach *= pool[level]
                    total += reach
            else:
                for r, p, g in zip(reached[i], passed[i], pool):
                    reach *= (p * s + w * g) / (r * s + w)
                    total += reach
            out.append(total)
        return out

    def expected_of(self, band: str, shape: Shape) -> float:
        total, reach = 0.0, 1.0
        for a in self.alphas(band, shape):
            reach *= a
            total += reach
        return total


class Window:
    """The weighted median of the last `size` samples, none older than `memory` rounds when a newer one comes: the
    value below and above which half the samples' weight lies (the mean of the two values at an exact half). A
    tree's cost sample is a call's seconds a round, weighing its rounds: a call of 32 rounds at 1.4 ms and one of 4
    at 1.8 ms (its call's fixed work shared by fewer) price the shape at 1.4 ms, where a plain median of such calls
    swings with their mix, so that two shapes of the same device time come out apart.
    (size 3, memory 10): adds 5 @ 0, 9 @ 1, 6 @ 2 (weight 1 each) -> 6; then 4 @ 20 drops the three older -> 4;
    then 2 @ 21 weighing 3 -> 2 (weight 3 of 4 at 2)."""

    def __init__(self, size: int, memory: int) -> None:
        self.samples: deque[tuple[int, float, float]] = deque(maxlen=size)  # (round, value, weight), oldest first
        self.memory, self.median = memory, 0.0

    def add(self, now: int, x: float, weight: float = 1.0) -> None:
        if not weight > 0:
            raise ValueError(f"a sample's weight must be > 0, got {weight}")
        while self.samples and now - self.samples[0][0] > self.memory:
            self.samples.popleft()
        self.samples.append((now, x, weight))
        v = sorted((x, w) for _, x, w in self.samples)
        half, below = sum(w for _, w in v) / 2, 0.0
        for i, (x, w) in enumerate(v):
            below += w
            if below >= half:
                exact = math.isclose(below, half) and i + 1 < len(v)
                self.median = (x + v[i + 1][0]) / 2 if exact else x
                return


class Cell:
    """One (bucket, shape): its recent steady rounds (what calibration did not explain) and its retries."""

    def __init__(self, cfg: PolicyConfig, tiebreak: float) -> None:
        self.window = Window(cfg.cost_window, cfg.cost_memory)
        self.interval = cfg.retry_base  # bucket rounds it may go unrun before it is due
        self.last_run, self.has_run = 0, False  # the bucket round it last ran (0: the bucket's start)
        self.judged = 0  # its runs judged not the best (the first PolicyConfig.confirm leave its interval)
        self.tiebreak = tiebreak


class Bucket:
    """A batch bucket: per shape (lists follow CostModel.shapes: plain, then the menu) its cell, its
    calibration (tree: seconds of a round; plain: of one decode step; None: not calibrated) and whether it is
    on the bucket's menu (within the policy's max_rows: at 64 with 640 rows, 3x8 is, 4x16 is not), its tree
    overhead (plain's is its plain cell), its round count and the try under way."""

    def __init__(
        self, size: int, cells: list[Cell], cal: list[float | None], cfg: PolicyConfig, shapes: tuple[Shape, ...]
    ) -> None:
        self.size, self.cells, self.cal = size, cells, cal
        # per shape: on this bucket's menu (plain always; a tree within max_rows over the bucket's batch)
        self.on_menu = [s.plain or size * (s.nodes + 1) <= cfg.max_rows for s in shapes]
        self.overhead = Window(cfg.cost_window, cfg.cost_memory)  # tree rounds: seconds - calibration
        self.rounds = 0  # calls to choose for this bucket
        self.calls: dict[Shape, int] = {}  # steady calls per shape (pinned ones too): the first warm_up no samples
        self.nearest: list[Bucket] = []  # the other buckets, nearest first (log2 distance, then smaller)
        self.last_pick: int | None = None  # the shape (index) chosen last, judged at the next choose
        # the kind of its last pick that was not a try: plain needs `margin` to leave it, trees `leave`
        self.on_trees = False
        self.trying: int | None = None  # the shape being tried, its rounds left, whether one was steady
        self.try_left, self.try_seen = 0, False
        self.tried_at = -math.inf  # the round the last try began (tries begin retry_base rounds apart at most)


class CostModel:
    """Seconds of a round per batch bucket and shape (module docstring): calibration, per-bucket overheads
    and per-cell medians of steady rounds. A plain cell holds seconds - steps * decode (the call's
    overhead) or, without a decode calibration, seconds per step; a tree cell seconds - calibration."""

    def __init__(self, cfg: PolicyConfig, costs: Iterable[StepCost]) -> None:
        self.shapes = (PLAIN, *cfg.menu)
        self.warm_up = cfg.warm_up
        self.index = {s: i for i, s in enumerate(self.shapes)}
        self.grid: dict[str, dict[int, dict[int, float]]] = {}  # kind -> batch -> size -> seconds
        for c in costs:
            self.grid.setdefault(c.kind, {}).setdefault(c.batch, {})[c.size] = c.seconds
        self.calibrated = {b for g in self.grid.values() for b in g}
        self.sizes = sorted(set(cfg.buckets) | self.calibrated)
        rng = random.Random(cfg.seed)
        self.buckets: dict[int, Bucket] = {}
        for b in self.sizes:
            cal = [self.calibration(b, s) for s in self.shapes]
            self.buckets[b] = Bucket(b, [Cell(cfg, rng.random()) for _ in self.shapes], cal, cfg, self.shapes)
        for bk in self.buckets.values():
            others = [o for o in self.buckets.values() if o is not bk]
            bk.nearest = sorted(others, key=lambda o, b=bk.size: (abs(math.log2(o.size / b)), o.size))

    def of(self, batch: int) -> Bucket:
        return self.buckets[bucket(batch, self.sizes)]

    def step(self, kind: str, batch: int, size: int) -> float | None:
        """Calibrated seconds of one engine step: the next larger calibrated batch and size, or linear past
        the largest. (verify at batch 1 of 2 / 5 rows: 11 / 14 ms) -> 4 rows 14 ms, 10 rows 28 ms."""
        grid = self.grid.get(kind)
        if not grid:
            return None
        batches = sorted(grid)
        bb = batches[min(bisect_left(batches, batch), len(batches) - 1)]
        sizes = sorted(grid[bb])
        sb = sizes[min(bisect_left(sizes, size), len(sizes) - 1)]
        return grid[bb][sb] * max(batch / bb, 1.0) * max(size / sb, 1.0)

    def calibration(self, batch: int, shape: Shape) -> float | None:
        """Engine seconds of a tree round (draft + verify), or of one plain decode step."""
        if shape.plain:
            return self.step("decode", batch, 1)
        draft, verify = self.step("propose", batch, shape.depth), self.step("verify", batch, shape.nodes + 1)
        return None if draft is None or verify is None else draft + verify

    def overhead(self, bk: Bucket, plain: bool) -> tuple[float, str]:
        """A kind's overhead at the bucket and where it comes from: 'bucket', 'nearest' or 'calibration' (0)."""
        for src, b in (("bucket", bk), *(("nearest", o) for o in bk.nearest)):
            w = b.cells[0].window if plain else b.overhead
            if w.samples:
                return w.median, src
        return 0.0, "calibration"

    def seconds(self, bk: Bucket, i: int, steps: int, over: float) -> float | None:
        """Seconds of a round of shapes[i] (plain: a call of `steps` steps); `over`: its kind's overhead.
        A tree's overhead borrowed from other shapes never makes it cheaper than half its calibration."""
        cal, window = bk.cal[i], bk.cells[i].window
        if cal is None:
            return (steps if i == 0 else 1) * window.median if window.samples else None
        if i == 0:
            return max(steps * cal + over, 1e-9)
        return max(cal + window.median, 1e-9) if window.samples else max(cal + over, cal * 0.5, 1e-9)

    def source(self, bk: Bucket, i: int) -> str:
        """Where the cost of shapes[i] comes from: 'measured', 'bucket', 'nearest', 'calibration', 'unknown'."""
        if bk.cells[i].window.samples:
            return "measured"
        return "unknown" if bk.cal[i] is None else self.overhead(bk, i == 0)[1]

    def observe(self, bk: Bucket, shape: Shape, seconds: float, steps: int, rounds: int = 1) -> bool:
        """A steady call's cost: seconds of one round (a tree, `rounds` of them in the call: its samples' weight) or
        of `steps` plain steps. Whether it became a sample: a shape's first warm_up steady calls at a bucket (a
        pinned shape off the menu too) are its warm-up, none (PolicyConfig.warm_up)."""
        calls = bk.calls.get(shape, 0)
        if calls < self.warm_up:
            bk.calls[shape] = calls + 1
            return False
        i = self.index.get(shape)
        cal = self.calibration(bk.size, shape) if i is None else bk.cal[i]
        if shape.plain:
            x = seconds / steps if cal is None else seconds - steps * cal
        else:
            x = seconds if cal is None else seconds - cal
            if cal is not None:
                bk.overhead.add(bk.rounds, x, rounds)
        if i is not None:
            bk.cells[i].window.add(bk.rounds, x, 1 if shape.plain else rounds)
        return True


class SequenceFactor:
    """How a sequence accepts against its band: value = (n * A / X + c) / (n + c), A and X its accepted and
    expected (its band's E at the time) drafted tokens and n its verifications, each verification weighing
    the earlier ones by keep = 0.5^(1 / seq_memory); c = seq_prior pseudo-verifications at 1. A round it is
    decided for without a verification since the last one (a plain call) weighs its counts by relax =
    0.5^(1 / seq_relax), so a sequence that went plain drifts back to its band's figure and a tree runs for
    it again: no sequence is held plain by a bad stretch. (c 1, keep .5, relax .5) E .7, accepting 0: A 0,
    X .7, n 1 -> value (0 + 1) / 2 = .5; a plain round: A 0, X .35, n .5 -> 1 / 1.5 = .667; then E .6,
    accepting 1: A 1, X .175 + .6 = .775, n 1.25 -> (1.25 * 1 / .775 + 1) / 2.25 = 1.16."""

    __slots__ = ("accepted", "expected", "count", "value", "seen")

    def __init__(self) -> None:
        self.accepted, self.expected, self.count, self.value = 0.0, 0.0, 0.0, 1.0
        self.seen = True  # verified since the last round decided for it

    def add(self, accepted: int, expected: float, keep: float, c: float) -> None:
        self.accepted = self.accepted * keep + accepted
        self.expected = self.expected * keep + expected
        self.count = self.count * keep + 1
        self.seen = True
        self._update(c)

    def relax(self, relax: float, c: float) -> None:
        """A round decided for it after one without a verification of it: its counts weigh `relax` less."""
        self.accepted, self.expected, self.count = self.accepted * relax, self.expected * relax, self.count * relax
        self._update(c)

    def _update(self, c: float) -> None:
        ratio = self.accepted / self.expected if self.expected > 0 else 1.0
        self.value = (self.count * ratio + c) / (self.count + c)
