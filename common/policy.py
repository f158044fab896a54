"""Speculation policy: each engine iteration, the tree shape to draft and verify for the batch, or none
(plain decoding), picked to maximise expected committed tokens per second. Plain bookkeeping, no torch.

Rate. A round of shape s over members m (each with a temperature band) commits per member the bonus token
plus the accepted drafted tokens; a plain iteration commits `plain_steps` tokens per member:

    rate(s)     = sum_m (1 + min(f_m * E[band_m, s], depth_s)) / seconds(bucket, s)
    rate(plain) = len(members) * plain_steps / seconds(bucket, plain, plain_steps)
    E[band, s]  = sum_{k=1..depth} prod_{i<=k} alpha(band, s, i)

A bucket that runs plain switches to a tree only when the tree's rate exceeds plain's by `margin` (5%); a bucket
that runs trees leaves them when plain's rate reaches the best tree's plus `leave` (5%): hysteresis, a band centred
on parity. A switch to trees costs what a rate leaves out (the catch-up of every row's drafting over the plain
stretch, a call cut short) and staying costs nothing: without the band, a batch whose tree and plain estimates sit
near each other switches back and forth and pays a catch-up each time, below both kinds. Centred, a batch that noise
holds in the wrong kind loses at most 5% while it lasts (docs/decisions.md has the runs behind both sides). Between
trees the same: a bucket on a tree keeps it while another's rate beats it by less than `stay` (5%; a switch ends the
device chain's call).

Acceptance (AcceptanceTable). alpha(band, s, i) = (passed + w * pool) / (reached + w): decayed counts of the
rounds of s that reached level i and accepted there, w = prior_weight pseudo-rounds of the pooled figure:
the same band's level i over every shape, which itself leans on the greedy band's level i, which leans on
`prior`. A shape's counts halve every `half_life` rounds (calls to choose) whether or not it runs, so a
shape left unobserved relaxes toward the pooled figure: no estimate is condemned forever. The pooled counts
decay by verifications only (half-life pooled_half_life), so they stay the draft's recent acceptance on this
traffic through any stretch of plain rounds (pinned trees feed them too). f_m (SequenceFactor) is how the
sequence accepts against its band: accepted / expected over its last few verifications, shrunk toward 1 by
seq_prior pseudo-verifications; rounds decided for it without a verification (plain calls) relax it toward 1
(its counts halve in seq_relax such rounds), so that a sequence is never held plain by a bad stretch.

Cost (CostModel), per batch bucket and shape: a batch maps to the smallest bucket >= it (the configured
buckets plus the calibrated batches: the engines' graphs). A shape with steady rounds at the bucket costs
the median of its recent ones (the last cost_window calls, none older than cost_memory bucket rounds, each call's
seconds a round weighing its rounds: common.policy_stats.Window); its first warm_up (1) steady calls at a bucket
are its warm-up, no samples (a first call at a new batch size can hold a one-off many times its cost). Without,
it costs its calibration (propose(depth) + verify(nodes + 1) step times; a plain call `plain_steps`
decode steps) plus the bucket's overhead: the median of what calibration did not explain in recent steady
rounds of the same kind (tree / plain) at this bucket, or, when it has none, at the nearest bucket that
has (never a figure shared by every batch size). A batch or size past the calibrated ones scales linearly
from the largest; one between takes the next larger (the graph that runs).

A bucket's menu: the shapes whose rows over the bucket's batch (batch x (nodes + 1)) stay within max_rows (640): at
64 sequences 1x1, 2x4 and 3x8, at 16 all but 6x60. A larger tree there costs the device more rows than its extra
tokens pay for, and each try of it costs a round of that price (PolicyConfig.max_rows has the figures).

Exploration without an absorbing state. Each (bucket, shape) cell has a retry interval, retry_base bucket rounds at
first. Every run of a cell is judged at its bucket's next round: still the best, the interval goes back to retry_base;
not the best, it grows to 2 x interval x lag^2 (up to retry_cap), lag the best's score over the cell's (scores: the
rates with the band's favour, so that on trees plain's lag is 5% longer and from plain a tree's 5%): a near miss is
retried about twice as late, a shape at half the best's rate eight times as late (less likely to have become the best,
and its try loses more). A cell's first `confirm` runs judged not the best keep retry_base: its cost there may rest on a
first call's one-off (a kernel's load), which the next runs outvote. A cell not run at its bucket for its interval is
due: it is tried (Choice.explored) even when its estimate is far below the best, for up to try_rounds rounds until one
is reported steady and past its warm-up (the core decides a call's successor before it runs, and a call cut short is not
reported); the core runs a try's calls as many rounds as any other. A cell that never ran at a bucket where its cost is
unknown or borrowed from another bucket is due at once; one that never ran on this bucket's own costs waits interval x
lag^2. One cell is tried at a time per bucket, the most overdue first; a try begins retry_base rounds after the last one
began, or at once after a tree round at the bucket (the drafter follows every row then: no catch-up to pay), so that the
cells due at a bucket where plain wins are tried one after another behind a single catch-up. With the default menu a
bucket's exploration share falls to about 1% as the intervals reach the cap (at most 6 shapes of at most 4 rounds each
per 1024 rounds; tests/test_policy.py measures it).

Worked example (tests/test_policy.py::test_the_docstring_example). Calibration at batch 1: decode 10 ms,
verify of 2 / 5 rows 11 / 14 ms, propose of depth 1 / 4 1 / 4 ms; menu (1x1, 4x4), prior 0.6 per level,
margin, leave and stay 0, nothing observed, one greedy sequence, plain_steps 1:
    plain 1 / 10 ms = 100 tok/s;  1x1 (1 + .6) / 12 ms = 133.3;  4x4 (1 + .6 + .36 + .216 + .1296) / 18 ms
    = 2.3056 / 18 ms = 128.1  -> 1x1.
Steady rounds of 1x1 at batch 1 then take 15 ms (acceptance not reported: still the prior): the first is its warm-up at
bucket 1 (no sample), the second gives bucket 1 a tree overhead of 15 - 12 = 3 ms. 1x1 costs its own median, 15 ms:
106.7; 4x4 its calibration plus that overhead, 21 ms: 109.8; plain 100 -> 4x4. Batch 8, never observed, charges its
trees bucket 1's 3 ms (the nearest). Plain calls of 8 steps measured at 88 ms (the first a warm-up) give bucket 1 a
plain overhead of 88 - 80 = 8 ms: plain_steps 8 -> 8 / 88 ms = 90.9, plain_steps 1 -> 1 / 18 ms = 55.6. Retries: a shape
that never ran at a bucket (its cost there from calibration) is due at the bucket's round 16; after its confirm runs (16
rounds apart), if it came out at a third of the best's rate, it waits 2 x 16 x 3^2 = 288 rounds, then the cap, 1024; at
95% of it, 2 x 16 x 1.108 = 36, then 80 (test_a_due_shape_waits_longer_the_further_below_the_best_it_came_out).

What the caller guarantees: observe_round gets steady rounds only (calls that ran every round they asked
for, no prefill, no catch-up call after plain rounds; common/engine/core.py), not a loop wall holding
other work, and choose and observe_round see the same batch (choose's `batch` when pinned sequences ride
along). estimates() tells an operator why: per bucket and shape the rate, seconds and tokens compared, and
where the cost comes from.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from common.policy_stats import (
    PLAIN,
    AcceptanceTable,
    Bucket,
    Clock,
    CostModel,
    SequenceFactor,
    Shape,
    bucket,
)

__all__ = ["PLAIN", "Shape", "bucket"]  # the policy's vocabulary, defined with its statistics

DEFAULT_MENU = (Shape(1, 1), Shape(2, 4), Shape(3, 8), Shape(4, 16), Shape(6, 32), Shape(6, 60))
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
BANDS = ("greedy", "low", "mid", "high")  # band(): temperature 0, (0, 0.5], (0.5, 1], > 1


def band(temperature: float) -> str:
    """A sequence's temperature band: 0 -> 'greedy', 0.3 -> 'low', 0.7 -> 'mid', 1.5 -> 'high'."""
    if not temperature >= 0:  # negative or NaN
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return "greedy" if temperature == 0 else "low" if temperature <= 0.5 else "mid" if temperature <= 1 else "high"


@dataclass(frozen=True)
class StepCost:
    """One engine step's calibrated time: kind 'decode' (size 1), 'verify' (size = tree rows incl. the
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


@dataclass(frozen=True)
class Member:
    """A sequence the policy decides for this round."""

    seq_id: str
    band: str  # band(temperature)

    def __post_init__(self) -> None:
        if self.band not in BANDS:
            raise ValueError(f"band must be one of {BANDS}, got {self.band!r}")


@dataclass(frozen=True)
class Choice:
    shape: Shape
    explored: bool = False  # not the best estimate: a due retry that keeps the estimates honest


@dataclass(frozen=True)
class Estimate:
    """What the policy believes of rounds of `batch` fresh sequences (factor 1) of one band."""

    batch: int  # batch bucket: rounds of up to this many sequences
    shape: Shape  # PLAIN or a menu shape
    tokens_per_s: float | None  # committed tokens/s of a round of `batch` sequences; None: no cost known
    seconds: float | None  # a round's (plain: a decoding step's, its call's overhead shared by the last plain_steps)
    tokens: float  # committed per sequence per round (plain: 1 a step)
    samples: int  # steady rounds of this shape at this bucket behind the cost (0: calibration + an overhead)
    stale_rounds: int | None  # rounds of this bucket since the shape last ran at it; None: never
    band: str = "greedy"  # the acceptance band the tokens are for
    source: str = "calibration"  # of the cost: 'measured', 'bucket' / 'nearest' (calibration + that bucket's
    # overhead), 'calibration' (no overhead known), 'unknown'


@dataclass(frozen=True)
class PolicyConfig:
    menu: tuple[Shape, ...] = DEFAULT_MENU  # shapes the policy may choose, besides plain
    buckets: tuple[int, ...] = DEFAULT_BUCKETS  # batch buckets (the calibrated batches are added)
    prior: float = 0.5  # acceptance per level before anything is observed
    prior_weight: float = 2.0  # pseudo-rounds of the pooled figure in every acceptance estimate
    half_life: float = 256.0  # rounds (calls to choose) in which a shape's acceptance counts halve
    pooled_half_life: float = 512.0  # verifications in which the pooled counts halve (they never decay by rounds)
    seq_prior: float = 4.0  # pseudo-verifications at factor 1 in a sequence's factor (one noisy round moves it little)
    seq_memory: float = 4.0  # a sequence's verifications in which its factor's counts halve
    seq_relax: float = 8.0  # rounds decided for a sequence without verifying it in which its factor's counts halve
    cost_window: int = 8  # steady calls in a cost median
    cost_memory: int = 512  # bucket rounds after which a cost sample is dropped (when a newer one comes)
    retry_base: int = 16  # bucket rounds before a shape left unrun is tried again
    retry_cap: int = 1024  # the longest retry interval (each failed try multiplies it by 2 x lag^2)
    # rounds a try lasts at most, until one is reported steady and a cost sample: from plain, a catch-up (never
    # steady), at a bucket new to the shape its warm-up call (warm_up), the call that measures it, and one more should
    # that one be cut short
    try_rounds: int = 4
    # runs of a shape at a bucket judged not the best before its wait grows: a cost sample from its first calls there
    # can hold a one-off (a kernel's first load, an allocation) far above its steady cost, which would push its next
    # try to retry_cap (docs/decisions.md); its next runs measure it again first
    confirm: int = 2
    # steady calls of a shape at a bucket that are no cost samples: a shape's first calls at a new batch size can hold
    # one-offs its later calls do not (Triton kernels specialised for the size, allocations); as a shape's only sample
    # and its bucket's only tree overhead sample, one such call prices every tree there many times over and holds the
    # bucket on plain decoding (docs/decisions.md)
    warm_up: int = 1
    seed: int = 0  # orders cells due in the same round with equal estimates
    # a bucket that runs plain switches to a tree only when its rate beats plain's by this share: what a switch costs
    # that a rate leaves out (the catch-up of every row's drafting, a call cut short); module docstring: hysteresis
    margin: float = 0.05
    # a bucket on trees leaves them when plain's rate reaches the best tree's plus this share (the band's other side):
    # at 64 sequences the rates of 3x8 and plain move by a tenth within a second, and a band of 0 to +10% held a
    # sampled batch on plain for seconds while its rates put 3x8 3-10% ahead (docs/decisions.md)
    leave: float = 0.05
    # a bucket on a tree keeps it while another tree's rate beats it by less than this share: a switch between trees
    # ends the call (its verify graph's tree bucket changes, so the device chain cannot go on: one more call's host
    # work and wait), which rates leave out; without it a bucket whose trees' estimates sit within a few percent
    # (3x8 and 2x4 at 64 sequences) switches back and forth
    stay: float = 0.05
    # tree rows a round verifies at most, over its bucket's batch (batch x (nodes + 1)): a shape past it is off that
    # bucket's menu, never chosen nor tried there. Through the gateway on an H200 at 64 sequences, a pinned 3x8
    # (576 rows) ran 1.10x plain while the default, spreading its rounds over 4x16 (1,088) and 6x32 (2,112) and
    # trying 6x60 (3,904), ran 0.93x; at 16 a pinned 6x60 (976) lost to 3x8 in every run (1.12-1.21x against
    # 1.19-1.47x). 640: every shape up to 8 sequences, 6x32 to 16, 4x16 to 32, 3x8 to 64, 2x4 to 128.
    max_rows: int = 640

    def __post_init__(self) -> None:
        if not self.menu or any(s.plain for s in self.menu) or len(set(self.menu)) != len(self.menu):
            raise ValueError("the policy's menu needs distinct tree shapes (plain is always an option)")
        if not self.buckets or any(b < 1 for b in self.buckets):
            raise ValueError(f"buckets must be batch sizes >= 1, got {self.buckets}")
        if not 0 < self.prior < 1 or not self.prior_weight > 0 or not self.seq_prior > 0:
            raise ValueError("prior must be in (0, 1), prior_weight and seq_prior > 0")
        if min(self.half_life, self.seq_memory, self.pooled_half_life, self.seq_relax) <= 0:
            raise ValueError("half_life, pooled_half_life, seq_memory and seq_relax must be > 0")
        if not all(0 <= x < 1 for x in (self.margin, self.leave, self.stay)):
            raise ValueError(f"margin, leave and stay must be in [0, 1), got {self.margin}, {self.leave}, {self.stay}")
        if self.cost_window < 1 or self.cost_memory < 1 or self.try_rounds < 1 or min(self.confirm, self.warm_up) < 0:
            raise ValueError("cost_window, cost_memory and try_rounds must be >= 1, confirm and warm_up >= 0")
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}")
        if not 1 <= self.retry_base <= self.retry_cap:
            raise ValueError(f"need 1 <= retry_base <= retry_cap, got {self.retry_base}, {self.retry_cap}")


class AdaptivePolicy:
    """Expected committed tokens per second, maximised per round, with due retries (module docstring)."""

    name = "adaptive"

    def __init__(self, cfg: PolicyConfig, costs: Iterable[StepCost] = ()) -> None:
        self.cfg = cfg
        costs = list(costs)
        # per round variant: a batch of greedy rows only, or one with a sampling row, whose verify (the target
        # distributions, the sampled acceptance) costs more; both start from the greedy calibration
        self.variants = {False: CostModel(cfg, costs), True: CostModel(cfg, costs)}
        self.costs = self.variants[False]
        self.shapes = self.costs.shapes  # plain, then the menu: the order of every per-shape list
        self.clock = Clock(cfg.half_life)  # acceptance counts decay by rounds
        self.acceptance = AcceptanceTable(cfg, self.clock)
        self.seqs: dict[str, SequenceFactor] = {}
        self.keep = 0.5 ** (1 / cfg.seq_memory)  # a factor's weight on its earlier counts per verification
        self.relax = 0.5 ** (1 / cfg.seq_relax)  # and per round without a verification
        self.round = 0  # calls to choose
        self.plain_steps = 1  # the last choose's (for estimates)
        self.round_expected: dict[str, list[float]] = {}  # band -> [menu] E, as the last choose saw it

    # ---- deciding ----
    def choose(
        self, members: Sequence[Member], plain_steps: int, batch: int | None = None, sampled: bool = False
    ) -> Choice:
        """The shape of this round for `members` (PLAIN when there are none): PLAIN or a menu shape.
        plain_steps: decode steps one plain iteration runs per host synchronisation. batch: the round's
        sequences in all, members and pinned ones, for the cost bucket; default len(members). sampled: a row
        of the round samples (its costs are that variant's)."""
        if plain_steps < 1:
            raise ValueError(f"plain_steps must be >= 1, got {plain_steps}")
        if not members:
            return Choice(PLAIN)
        self._advance(self.round + 1)
        self.plain_steps = plain_steps
        costs = self.variants[sampled]
        bk = costs.of(batch or len(members))
        bk.rounds += 1
        self._relax(members)
        rates = self._rates(members, plain_steps, bk, costs, keep=True)
        # hysteresis (module docstring): the kind the bucket runs is favoured, plain by `margin`, trees by `leave`
        favour = (1.0, 1.0 + self.cfg.leave) if bk.on_trees else (1.0 + self.cfg.margin, 1.0)  # (plain, each tree)
        scores = [None if r is None else r * favour[i > 0] for i, r in enumerate(rates)]
        best, top = None, -1.0
        for i, score in enumerate(scores):  # ties: the first of plain, *menu
            if score is not None and score > top:
                best, top = i, score
        last = bk.last_pick if bk.on_trees else None
        if best and last and best != last and scores[last] is not None and scores[last] * (1 + self.cfg.stay) >= top:
            best = last  # another tree within `stay` of the one running: a switch would cost more than it gains
        if bk.trying is not None and bk.trying != best and not bk.try_seen and bk.try_left > 0:
            bk.try_left -= 1  # the try goes on: its first round was not reported steady
            bk.cells[bk.trying].last_run = bk.rounds
            return Choice(self.shapes[bk.trying], explored=True)
        bk.trying = None
        if bk.last_pick is not None:  # judge the shape that ran last: still the best, or its wait grows
            cell = bk.cells[bk.last_pick]
            grown = _lagged(2 * cell.interval, top, scores[bk.last_pick])
            cell.judged += bk.last_pick != best
            settled = cell.judged > self.cfg.confirm  # a cost from its first runs is measured again first
            cell.interval = min(grown, self.cfg.retry_cap) if bk.last_pick != best and settled else self.cfg.retry_base
        # one try at a time, and from plain none within retry_base rounds of the last one began: at 64 sequences
        # a try from plain costs its rounds and the catching up of every row; after a tree round it costs its own
        on_trees = bk.last_pick is not None and bk.last_pick > 0
        spaced = on_trees or bk.rounds - bk.tried_at >= self.cfg.retry_base
        pick = self._due(bk, best, scores, costs) if spaced else None
        if pick is not None:
            bk.trying, bk.try_left, bk.try_seen, bk.tried_at = pick, self.cfg.try_rounds - 1, False, bk.rounds
        elif best is None:
            bk.last_pick, bk.on_trees = None, False
            return Choice(PLAIN)
        else:
            pick = best
            bk.on_trees = pick > 0
        cell = bk.cells[pick]
        cell.last_run, cell.has_run = bk.rounds, True
        bk.last_pick = pick
        return Choice(self.shapes[pick], explored=pick != best)

    def _relax(self, members: Sequence[Member]) -> None:
        """A round decided for the members: each not verified since the last one decided for it relaxes toward 1
        (SequenceFactor.relax)."""
        c = self.cfg.seq_prior
        for m in members:
            sf = self.seqs.get(m.seq_id)
            if sf is not None:
                if not sf.seen:
                    sf.relax(self.relax, c)
                sf.seen = False

    def _due(self, bk: Bucket, best: int | None, scores: list[float | None], costs: CostModel) -> int | None:
        """The cell to try, other than the best, or None: first one that never ran here and whose cost here
        is unknown or borrowed from another bucket (the best score first), then the most overdue. A cell that
        never ran here on a cost of this bucket's own waits its interval x lag^2 (lag: the best's score over
        its own), as if judged."""
        borrowed = [costs.overhead(bk, plain)[1] == "nearest" for plain in (False, True)]  # [tree, plain]
        top = scores[best] if best is not None else None
        pick, key = None, None
        for i, cell in enumerate(bk.cells):
            score = scores[i]
            late = bk.rounds - cell.last_run - (cell.interval if cell.has_run else _lagged(cell.interval, top, score))
            stale = not cell.has_run and not cell.window.samples and (score is None or borrowed[i == 0])
            if i == best or (late < 0 and not stale) or not bk.on_menu[i]:
                continue
            k = (stale, late, math.inf if score is None else score, cell.tiebreak)
            if key is None or k > key:
                pick, key = i, k
        return pick

    def rates(
        self, members: Sequence[Member], plain_steps: int, batch: int | None = None, sampled: bool = False
    ) -> dict[Shape, float]:
        """Expected committed tokens/s of the round for plain and every shape on the bucket's menu with a known
        cost: what choose maximises (this round's figures; choose moves to the next round first)."""
        if not members:
            return {}
        costs = self.variants[sampled]
        rates = self._rates(members, plain_steps, costs.of(batch or len(members)), costs, keep=False)
        return {s: r for s, r in zip(self.shapes, rates) if r is not None}

    def _rates(
        self, members: Sequence[Member], steps: int, bk: Bucket, costs: CostModel, keep: bool
    ) -> list[float | None]:
        """[plain, *menu] rates (None: no cost known, or off the bucket's menu)."""
        # members' factors by band: [a1 (greedy), b1 (mid), a2 (greedy)] -> {greedy: [f_a1, f_a2], mid: [f_b1]}
        seqs = self.seqs
        groups: dict[str, list[float]] = {}
        for m in members:
            sf = seqs.get(m.seq_id)
            f = 1.0 if sf is None else sf.value
            g = groups.get(m.band)
            if g is None:
                groups[m.band] = [f]
            else:
                g.append(f)
        n = len(members)
        expected = {b: self.acceptance.expected(b) for b in groups}
        if keep:
            self.round_expected = expected
        bands = [(expected[b], sum(fs), max(fs), fs) for b, fs in groups.items()]
        plain = costs.seconds(bk, 0, steps, costs.overhead(bk, True)[0])
        out: list[float | None] = [None if plain is None else n * steps / plain]
        over = costs.overhead(bk, False)[0]
        for i, shape in enumerate(self.cfg.menu):
            seconds = costs.seconds(bk, i + 1, 1, over) if bk.on_menu[i + 1] else None
            if seconds is None:
                out.append(None)
                continue
            tokens, depth = float(n), shape.depth
            for e_band, total, top, fs in bands:
                e = e_band[i]
                # sum of min(f * e, depth) over the band's members; no cap bites when the largest factor's doesn't
                tokens += e * total if top * e <= depth else sum(min(f * e, depth) for f in fs)
            out.append(tokens / seconds)
        return out

    # ---- learning ----
    def observe_round(
        self, batch: int, shape: Shape, seconds: float, steps: int = 1, sampled: bool = False, rounds: int = 1
    ) -> None:
        """A steady call (module docstring: what the caller guarantees). PLAIN: `steps` decode steps took
        `seconds` in all; a tree: each of its `rounds` rounds (draft, verify, host bookkeeping) took `seconds`, the
        call's time shared (the sample weighs its rounds). batch: sequences in the round; sampled: one of them
        samples (choose's variant)."""
        if batch < 1 or steps < 1 or rounds < 1 or not 0 <= seconds < math.inf:
            raise ValueError(
                f"a call needs batch, steps, rounds >= 1 and seconds in [0, inf), got {batch}, {steps}, {rounds}, "
                f"{seconds}"
            )
        costs = self.variants[sampled]
        bk = costs.of(batch)
        counted = costs.observe(bk, shape, seconds, steps, rounds)
        if counted and bk.trying is not None and self.shapes[bk.trying] == shape:
            bk.try_seen = True

    def observe(self, seq_id: str, band: str, shape: Shape, accepted: int) -> None:
        """One sequence's verification of a tree of `shape`: `accepted` drafted tokens (bonus excluded)."""
        self.observe_verified([(seq_id, band, shape, accepted)])

    def observe_verified(self, rows: Iterable[tuple[str, str, Shape, int]]) -> None:
        """A round's verifications, (seq id, band, shape, accepted drafted tokens) each: observe's, with each (band,
        shape)'s expected figure (a sequence factor's yardstick) as it stood before the round, looked up once, and
        its acceptance counted in one pass (AcceptanceTable.observe)."""
        rows = [r for r in rows if not r[2].plain]
        for _, band, shape, accepted in rows:  # all or nothing: a bad row changes no statistic
            if band not in BANDS or not 0 <= accepted <= shape.depth:
                raise ValueError(f"need a band of {BANDS} and 0 <= accepted <= {shape.depth}, got {band!r}, {accepted}")
        groups: dict[tuple[str, Shape], tuple[float, list[int]]] = {}  # (band, shape) -> its E, the round's accepted
        for seq_id, band, shape, accepted in rows:
            group = groups.get((band, shape))
            if group is None:
                i, kept = self.acceptance.index.get(shape), self.round_expected.get(band)
                e = kept[i] if kept is not None and i is not None else self.acceptance.expected_of(band, shape)
                group = groups[band, shape] = (e, [])
            sf = self.seqs.get(seq_id)
            if sf is None:
                sf = self.seqs[seq_id] = SequenceFactor()
            sf.add(accepted, group[0], self.keep, self.cfg.seq_prior)
            group[1].append(accepted)
        for (band, shape), (_, accepted_list) in groups.items():
            self.acceptance.observe(band, shape, accepted_list)

    def forget(self, seq_id: str) -> None:
        self.seqs.pop(seq_id, None)

    def factor(self, seq_id: str) -> float:
        """How the sequence accepts against its band (1: as its band, or unknown)."""
        sf = self.seqs.get(seq_id)
        return 1.0 if sf is None else sf.value

    def _advance(self, now: int) -> None:
        self.round = now
        if self.clock.advance(now):
            self.acceptance.rebase(self.clock.scale)
            self.clock.reset(now)

    # ---- reporting ----
    def bands(self) -> list[str]:
        """The bands with acceptance of their own (greedy always), in BANDS order: for estimates."""
        return [b for b in BANDS if b == "greedy" or b in self.acceptance.reached_sum]

    def estimates(self, bands: Sequence[str] = ("greedy",)) -> list[Estimate]:
        """Per bucket with calibration or rounds, per band asked for, per shape on its menu: the rate
        of a round of `batch` fresh sequences of the band as choose would see it now, sorted by (batch,
        shape, band). Plain's per-step figures share its call's overhead over the last choose's plain_steps. The
        greedy band's costs are those of greedy batches, the other bands' those of batches that sample."""
        order = sorted(range(len(self.shapes)), key=lambda i: self.shapes[i])
        steps, out = self.plain_steps, []
        for b in bands:
            expected, costs = self.acceptance.expected(b), self.variants[b != "greedy"]
            for size, bk in costs.buckets.items():
                if size not in costs.calibrated and bk.rounds == 0:
                    continue
                over = (costs.overhead(bk, True)[0], costs.overhead(bk, False)[0])
                for i in (i for i in order if bk.on_menu[i]):
                    shape, cell = self.shapes[i], bk.cells[i]
                    seconds = costs.seconds(bk, i, steps, over[i > 0])
                    if seconds is not None and i == 0:
                        seconds /= steps
                    stale = bk.rounds - cell.last_run if cell.has_run else None
                    tokens = 1.0 if i == 0 else 1 + min(expected[i - 1], shape.depth)
                    rate = None if seconds is None else size * tokens / seconds
                    n = len(cell.window.samples)
                    out.append(Estimate(size, shape, rate, seconds, tokens, n, stale, b, costs.source(bk, i)))
        out.sort(key=lambda e: (e.batch, e.shape, BANDS.index(e.band)))
        return out


def _lagged(wait: float, top: float | None, score: float | None) -> int:
    """wait x lag^2, lag = top / score (how far below the best's score a cell's is; 1 when either is unknown or
    the cell is the better): 16, 120, 60 -> 64."""
    lag = top / score if top and score else 1.0
    return math.ceil(wait * max(1.0, lag) ** 2)


class Policy(Protocol):
    """What the engine core calls once per iteration (AdaptivePolicy, FixedPolicy)."""

    name: str

    def choose(
        self, members: Sequence[Member], plain_steps: int, batch: int | None = None, sampled: bool = False
    ) -> Choice: ...
    def rates(
        self, members: Sequence[Member], plain_steps: int, batch: int | None = None, sampled: bool = False
    ) -> dict[Shape, float]: ...
    def observe_round(
        self, batch: int, shape: Shape, seconds: float, steps: int = 1, sampled: bool = False, rounds: int = 1
    ) -> None: ...
    def observe_verified(self, rows: Iterable[tuple[str, str, Shape, int]]) -> None: ...
    def forget(self, seq_id: str) -> None: ...
    def estimates(self, bands: Sequence[str] = ("greedy",)) -> list[Estimate]: ...


class FixedPolicy:
    """The same shape every round (the policy off); learns nothing."""

    name = "fixed"

    def __init__(self, shape: Shape) -> None:
        self.shape = shape

    def choose(
        self, members: Sequence[Member], plain_steps: int, batch: int | None = None, sampled: bool = False
    ) -> Choice:
        return Choice(self.shape)

    def rates(
        self, members: Sequence[Member], plain_steps: int, batch: int | None = None, sampled: bool = False
    ) -> dict[Shape, float]:
        return {}

    def observe_round(
        self, batch: int, shape: Shape, seconds: float, steps: int = 1, sampled: bool = False, rounds: int = 1
    ) -> None:
        pass

    def observe_verified(self, rows: Iterable[tuple[str, str, Shape, int]]) -> None:
        pass

    def forget(self, seq_id: str) -> None:
        pass

    def estimates(self, bands: Sequence[str] = ("greedy",)) -> list[Estimate]:
        return []
