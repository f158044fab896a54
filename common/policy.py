"""Speculation policy: each round, the tree shape to draft and verify, or none (plain decoding), picked
to maximise expected committed tokens per second. Plain bookkeeping, no torch, no gRPC.

A round of shape s = (depth, nodes) over a batch of B sequences commits, per sequence, the bonus token
plus the accepted drafted tokens:

    tokens(s) = 1 + E[accepted | s],   E[accepted | s] = sum_{k=1..depth} prod_{i=1..k} alpha_i(s)

alpha_i(s) is the chance that level i of the tree accepts given that level i - 1 did, counted online per
shape (AcceptanceStats) and scaled per sequence by how that sequence accepts against the average. A
plain round commits `steps` tokens per sequence (one verifier call decodes several). The cost of a round
is the seconds it takes for the batch's bucket and the shape (CostModel): the engines' own step times,
measured once at start-up from their captured graphs and refreshed from every call's reported engine time,
plus the RPC and orchestration overhead learned from the rounds' wall time. The policy picks

    argmax over the menu and plain of   B * tokens(s) / seconds(B, s)

and now and then (explore) a close runner-up, so that the statistics of every competitive shape stay
fresh. Worked example (test_policy.py): decode 10 ms, verify of 2 / 5 rows 11 / 14 ms, draft of depth
1 / 4 1 / 4 ms, no overhead, alpha = 0.6 at every level: plain 1 / 10 ms = 100 tok/s; 1x1: (1 + 0.6) / 12
ms = 133; 4x4 (a chain): (1 + .6 + .36 + .216 + .13) / 18 ms = 128: the policy picks 1x1.
"""

from __future__ import annotations

import random
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


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
DEFAULT_MENU = (Shape(1, 1), Shape(2, 4), Shape(3, 8), Shape(4, 16), Shape(6, 32), Shape(6, 60))


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n, or the largest one.  (1, 2, 4, 8): 3 -> 4, 9 -> 8"""
    i = bisect_left(buckets, n)
    return buckets[min(i, len(buckets) - 1)]


@dataclass(frozen=True)
class StepCost:
    """One engine step's measured time: kind 'decode' (size 1), 'verify' (size = tree rows incl. the
    root, a tree bucket) or 'propose' (size = draft depth), at a batch bucket."""

    kind: str
    batch: int
    size: int
    seconds: float

    def __post_init__(self) -> None:
        if self.kind not in ("decode", "verify", "propose"):
            raise ValueError(f"step kind must be decode, verify or propose, got {self.kind!r}")
        if self.batch < 1 or self.size < 1 or not self.seconds >= 0:
            raise ValueError(f"step cost needs batch, size >= 1 and seconds >= 0, got {self}")


class Ema:
    """Moving average: the mean of the first samples, then exponential with `weight` for the newest.
    A start value counts as one sample: [prior 10, then 20, 20] -> 15, 16.7 (weight 0.1: 1/2, 1/3 > 0.1)."""

    def __init__(self, weight: float, value: float | None = None) -> None:
        self.weight, self.value = weight, value
        self.count = 0 if value is None else 1

    def add(self, x: float) -> None:
        self.count += 1
        w = max(self.weight, 1 / self.count)
        self.value = x if self.value is None else self.value + w * (x - self.value)


class CostModel:
    """Seconds per round for a batch size and a shape.

    engine: per (kind, batch bucket, size) the step time, from calibration and refreshed online.
    overhead: per round kind ('spec', 'plain') the wall time beyond the engines (RPC, orchestration).
    A batch or size beyond the largest measured is extrapolated linearly from it; one between measured
    ones takes the next larger measured one (that is the graph that runs)."""

    def __init__(self, costs: Iterable[StepCost] = (), weight: float = 0.1) -> None:
        self.weight = weight
        self.engine: dict[tuple[str, int, int], Ema] = {}
        self._grid: dict[str, dict[int, list[int]]] = {}  # kind -> batch bucket -> sizes (sorted); see _index
        self._indexed = -1  # keys in _grid
        self.overhead = {"spec": Ema(weight), "plain": Ema(weight)}
        for c in costs:
            self.engine[(c.kind, c.batch, c.size)] = Ema(weight, c.seconds)

    def _index(self) -> dict[str, dict[int, list[int]]]:
        """The measured grid, rebuilt when a key was added (the policy asks it several times a round)."""
        if self._indexed != len(self.engine):  # keys are only ever added
            self._indexed = len(self.engine)
            grid: dict[str, dict[int, list[int]]] = {}
            for k, b, sz in self.engine:
                grid.setdefault(k, {}).setdefault(b, []).append(sz)
            self._grid = {k: {b: sorted(v) for b, v in sorted(g.items())} for k, g in grid.items()}
        return self._grid

    def step(self, kind: str, batch: int, size: int) -> float | None:
        """Estimated seconds of one engine step, or None when nothing of that kind was measured."""
        grid = self._index().get(kind)
        if not grid:
            return None
        bb = bucket(batch, list(grid))
        sizes = grid[bb]
        sb = bucket(size, sizes)
        t = self.engine[(kind, bb, sb)].value
        return t * max(batch / bb, 1.0) * max(size / sb, 1.0)

    def observe_step(self, kind: str, batch: int, size: int, seconds: float) -> None:
        """An engine call's reported time, counted at the measured bucket it ran in (the smallest >= its
        batch and size: the graph that ran); past every measured bucket it starts a bucket of its own."""
        grid = self._index().get(kind, {})
        batches = list(grid)
        bb = bucket(batch, batches) if batches and batch <= batches[-1] else batch
        sizes = grid.get(bb, [])
        sb = bucket(size, sizes) if sizes and size <= sizes[-1] else size
        key = (kind, bb, sb)
        if key in self.engine:
            self.engine[key].add(seconds)
        else:
            self.engine[key] = Ema(self.weight, seconds)

    def round_seconds(self, batch: int, shape: Shape, steps: int = 1) -> float | None:
        """Wall seconds of a round: for a plain one, `steps` decoding steps in one call."""
        if shape.plain:
            t = self.step("decode", batch, 1)
            return None if t is None else max(steps * t + self._overhead("plain"), 1e-6)
        draft = self.step("propose", batch, shape.depth)
        verify = self.step("verify", batch, shape.nodes + 1)
        if draft is None or verify is None:
            return None
        return max(draft + verify + self._overhead("spec"), verify, 1e-6)

    def _overhead(self, kind: str) -> float:
        return self.overhead[kind].value or 0.0

    def observe_round(self, batch: int, shape: Shape, wall: float, steps: int = 1) -> None:
        """A round's wall time: what the engines do not explain is overhead."""
        engine = self.round_seconds(batch, shape, steps)
        if engine is None:
            return
        kind = "plain" if shape.plain else "spec"
        self.overhead[kind].add(wall - (engine - self._overhead(kind)))


class AcceptanceStats:
    """Per shape and tree level: how often a round reached the level, and how often it accepted there.
    Counts decay (half-life `half_life` rounds) so that the estimate follows the text. An unseen level
    borrows the pooled rate of that level over every shape, and `prior` before anything is seen.

    Example: shape 3x8 with accepted lengths 2 then 0 -> level 1 reached 2 passed 1, level 2 reached 1
    passed 1, level 3 reached 1 passed 0 -> alpha = (0.5, 1.0, 0.0) (prior weight 0)."""

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, half_life: float = 200.0) -> None:
        if not 0 < prior < 1 or prior_weight < 0 or half_life <= 0:
            raise ValueError("prior must be in (0, 1), prior_weight >= 0, half_life > 0")
        self.prior, self.prior_weight = prior, prior_weight
        self.decay = 0.5 ** (1 / half_life)
        self.reached: dict[Shape, list[float]] = {}  # shape -> [depth] decayed rounds that reached level i + 1
        self.passed: dict[Shape, list[float]] = {}  # shape -> [depth] ... that accepted at level i + 1

    def observe(self, shape: Shape, accepted: int) -> None:
        if shape.plain:
            return
        reached = self.reached.setdefault(shape, [0.0] * shape.depth)
        passed = self.passed.setdefault(shape, [0.0] * shape.depth)
        for i in range(shape.depth):
            reached[i] *= self.decay
            passed[i] *= self.decay
        for i in range(min(accepted + 1, shape.depth)):
            reached[i] += 1
            passed[i] += accepted > i

    def pooled(self, level: int) -> float:
        """Level `level` (1-based) over every shape deep enough, with the prior."""
        r = sum(v[level - 1] for s, v in self.reached.items() if s.depth >= level)
        p = sum(v[level - 1] for s, v in self.passed.items() if s.depth >= level)
        return self._rate(p, r, self.prior)

    def alpha(self, shape: Shape, level: int) -> float:
        prior = self.pooled(level)
        r = self.reached.get(shape, [0.0] * shape.depth)[level - 1]
        p = self.passed.get(shape, [0.0] * shape.depth)[level - 1]
        return self._rate(p, r, prior)

    def _rate(self, passed: float, reached: float, prior: float) -> float:
        w = self.prior_weight
        return (passed + prior * w) / (reached + w) if reached + w > 0 else prior

    def expected(self, shape: Shape) -> float:
        """E[accepted drafted tokens] for one round of `shape`."""
        total, reach = 0.0, 1.0
        for level in range(1, shape.depth + 1):
            reach *= self.alpha(shape, level)
            total += reach
        return total


@dataclass
class SequenceFactor:
    """How a sequence accepts against the average: accepted / expected, smoothed over its rounds."""

    accepted: Ema = field(default_factory=lambda: Ema(0.2, 1.0))
    expected: Ema = field(default_factory=lambda: Ema(0.2, 1.0))

    @property
    def value(self) -> float:
        return min(max(self.accepted.value / max(self.expected.value, 1e-6), 0.0), 3.0)


@dataclass(frozen=True)
class Choice:
    shape: Shape
    explored: bool = False  # not the best estimate: tried to keep its statistics fresh


class Policy(Protocol):
    """Chooses the shape of a group's round and learns from what happened."""

    name: str

    def choose(self, seq_ids: Sequence[str], steps: int) -> Choice: ...
    def observe(self, seq_id: str, shape: Shape, accepted: int) -> None: ...
    def observe_round(self, batch: int, shape: Shape, wall: float, steps: int) -> None: ...
    def observe_step(self, kind: str, batch: int, size: int, seconds: float) -> None: ...
    def forget(self, seq_id: str) -> None: ...


@dataclass(frozen=True)
class PolicyConfig:
    menu: tuple[Shape, ...] = DEFAULT_MENU  # shapes the policy may choose, besides plain
    explore: float = 0.05  # share of rounds that try a runner-up
    explore_within: float = 0.75  # runner-ups must be estimated at >= this share of the best rate
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.menu or any(s.plain for s in self.menu):
            raise ValueError("the policy's menu needs at least one tree shape (plain is always an option)")
        if not 0 <= self.explore < 1 or not 0 < self.explore_within <= 1:
            raise ValueError("explore must be in [0, 1) and explore_within in (0, 1]")


class AdaptivePolicy:
    """Expected tokens per second, maximised per round (see the module docstring)."""

    name = "adaptive"

    def __init__(self, cfg: PolicyConfig, costs: CostModel, stats: AcceptanceStats | None = None) -> None:
        self.cfg, self.costs = cfg, costs
        self.stats = stats or AcceptanceStats()
        self.seqs: dict[str, SequenceFactor] = {}
        self.rng = random.Random(cfg.seed)

    def rates(self, seq_ids: Sequence[str], steps: int) -> dict[Shape, float]:
        """Expected committed tokens per second of the batch for plain and every shape the costs cover."""
        b = len(seq_ids)
        out: dict[Shape, float] = {}
        plain = self.costs.round_seconds(b, PLAIN, steps)
        if plain is not None:
            out[PLAIN] = b * steps / plain
        factors = [self.seqs[s].value if s in self.seqs else 1.0 for s in seq_ids]
        total, top = sum(factors), max(factors, default=0.0)
        for shape in self.cfg.menu:
            seconds = self.costs.round_seconds(b, shape)
            if seconds is None:
                continue
            e = self.stats.expected(shape)
            # sum of 1 + min(f * e, depth) over the sequences; no cap bites when the largest factor's doesn't
            accepted = e * total if top * e <= shape.depth else sum(min(f * e, shape.depth) for f in factors)
            out[shape] = (b + accepted) / seconds
        return out

    def choose(self, seq_ids: Sequence[str], steps: int) -> Choice:
        rates = self.rates(seq_ids, steps)
        if all(s.plain for s in rates):  # the draft's costs are unknown: speculate until they come in
            return Choice(self.cfg.menu[-1])
        best = max(rates, key=lambda s: (rates[s], -s.nodes))
        if self.rng.random() < self.cfg.explore:
            close = [s for s, r in rates.items() if s != best and r >= self.cfg.explore_within * rates[best]]
            if close:
                pick = self.rng.choice(sorted(close))
                return Choice(pick, explored=True)
        return Choice(best)

    def observe(self, seq_id: str, shape: Shape, accepted: int) -> None:
        if shape.plain:
            return
        f = self.seqs.setdefault(seq_id, SequenceFactor())
        f.expected.add(self.stats.expected(shape))
        f.accepted.add(accepted)
        self.stats.observe(shape, accepted)

    def observe_round(self, batch: int, shape: Shape, wall: float, steps: int) -> None:
        self.costs.observe_round(batch, shape, wall, steps)

    def observe_step(self, kind: str, batch: int, size: int, seconds: float) -> None:
        self.costs.observe_step(kind, batch, size, seconds)

    def forget(self, seq_id: str) -> None:
        self.seqs.pop(seq_id, None)


class _Stateless:
    """Learns nothing: the fixed policies."""

    def observe(self, seq_id: str, shape: Shape, accepted: int) -> None:
        pass

    def observe_round(self, batch: int, shape: Shape, wall: float, steps: int) -> None:
        pass

    def observe_step(self, kind: str, batch: int, size: int, seconds: float) -> None:
        pass

    def forget(self, seq_id: str) -> None:
        pass


class FixedPolicy(_Stateless):
    """The same shape every round (the policy off)."""

    name = "fixed"

    def __init__(self, shape: Shape) -> None:
        self.shape = shape

    def choose(self, seq_ids: Sequence[str], steps: int) -> Choice:
        return Choice(self.shape)


class CyclePolicy(_Stateless):
    """The next shape of a list every round, plain included: for tests that switch shapes every round."""

    name = "cycle"

    def __init__(self, shapes: Sequence[Shape]) -> None:
        if not shapes:
            raise ValueError("the cycle policy needs at least one shape")
        self.shapes, self.i = tuple(shapes), -1

    def choose(self, seq_ids: Sequence[str], steps: int) -> Choice:
        self.i = (self.i + 1) % len(self.shapes)
        return Choice(self.shapes[self.i])
