"""The speculation policy against synthetic calibrations and acceptance histories whose optimum is worked out
by hand: rates per batch bucket, acceptance per temperature band, and retries that leave no absorbing state."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest

from common.policy import PLAIN, AdaptivePolicy, Choice, FixedPolicy, Member, PolicyConfig, Shape, StepCost, band
from common.policy_stats import Clock, CostModel, SequenceFactor, Window

MS = 1e-3
CHAIN1, CHAIN4 = Shape(1, 1), Shape(4, 4)


def table(batch: int = 1, decode=10, verify2=11, verify5=14, draft1=1, draft4=4) -> list[StepCost]:
    """The module docstring's calibration (ms): decode 10, verify of 2 / 5 rows 11 / 14, draft depth 1 / 4:
    engine time of plain 10 ms a step, 1x1 12 ms, 4x4 18 ms a round."""
    return [
        StepCost("decode", batch, 1, decode * MS),
        StepCost("verify", batch, 2, verify2 * MS),
        StepCost("verify", batch, 5, verify5 * MS),
        StepCost("propose", batch, 1, draft1 * MS),
        StepCost("propose", batch, 4, draft4 * MS),
    ]


def members(n: int, band_: str = "greedy", prefix: str = "s") -> list[Member]:
    return [Member(f"{prefix}{i}", band_) for i in range(n)]


def feed(p: AdaptivePolicy, alpha: float, band_: str = "greedy", shapes=(CHAIN1, CHAIN4), rounds=10_000) -> None:
    """Acceptance where every level accepts with probability alpha, fed in exact proportions (P(accepted = a)
    = alpha^a (1 - alpha) below the depth, alpha^depth at it) under sequence ids no test decides for, the
    outcomes interleaved evenly (each next one the most behind its share), so that the pooled counts, which
    decay by verifications, see the same proportions throughout. No choose runs in between, so a shape's own
    counts do not decay."""
    for shape in shapes:
        q = [alpha**a * (1 - alpha) if a < shape.depth else alpha**shape.depth for a in range(shape.depth + 1)]
        seen = [0] * len(q)
        for n in range(1, rounds + 1):
            a = max(range(len(q)), key=lambda i: q[i] * n - seen[i])
            seen[a] += 1
            p.observe(f"feed-{band_}", band_, shape, a)


class Core:
    """The engine core's side of the policy, over n greedy sequences: a round costs its calibration plus
    its kind's overhead and is reported steady unless it is a tree right after a plain round (catch-up,
    when catch_up); every sequence of a tree round accepts min(accepted(round), depth)."""

    def __init__(self, policy: AdaptivePolicy) -> None:
        self.policy, self.last = policy, PLAIN  # last: the shape of the previous round

    def run(
        self,
        n: int,
        rounds: int,
        accepted: Callable[[int], int],
        spec_overhead: float = 0.0,
        plain_overhead: float = 0.0,
        plain_steps: int = 1,
        catch_up: bool = True,
    ) -> list[Choice]:
        p, seqs, out = self.policy, members(n), []
        for r in range(rounds):
            choice = p.choose(seqs, plain_steps)
            shape, cal = choice.shape, p.costs.calibration(n, choice.shape)
            if shape.plain:
                p.observe_round(n, PLAIN, plain_steps * cal + plain_overhead, plain_steps)
            else:
                if not (catch_up and self.last.plain):
                    p.observe_round(n, shape, cal + spec_overhead)
                for m in seqs:
                    p.observe(m.seq_id, m.band, shape, min(accepted(r), shape.depth))
            self.last = shape
            out.append(choice)
        return out


def drive(p: AdaptivePolicy, n: int, rounds: int, accepted: Callable[[int], int], **kw) -> list[Choice]:
    """A fresh Core's rounds (its previous round plain)."""
    return Core(p).run(n, rounds, accepted, **kw)


def test_the_docstring_example() -> None:
    """The module docstring's worked example, every figure by hand."""
    p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1, CHAIN4), prior=0.6, margin=0.0, leave=0.0, stay=0.0), table())
    a = members(1)
    # plain 1 / 10 ms; 1x1 (1 + .6) / (1 + 11 ms); 4x4 (1 + .6 + .36 + .216 + .1296) / (4 + 14 ms)
    assert p.rates(a, 1) == pytest.approx({PLAIN: 100, CHAIN1: 1.6 / 0.012, CHAIN4: 2.3056 / 0.018})
    assert p.choose(a, 1) == Choice(CHAIN1)
    # steady 1x1 rounds of 15 ms: the first at bucket 1 a warm-up (no sample: every rate as before), then bucket 1's
    # tree overhead 3 ms; 1x1 its own 15 ms, 4x4 18 + 3 ms
    p.observe_round(1, CHAIN1, 15 * MS)
    assert p.rates(a, 1) == pytest.approx({PLAIN: 100, CHAIN1: 1.6 / 0.012, CHAIN4: 2.3056 / 0.018})
    p.observe_round(1, CHAIN1, 15 * MS)
    assert p.rates(a, 1) == pytest.approx({PLAIN: 100, CHAIN1: 1.6 / 0.015, CHAIN4: 2.3056 / 0.021})
    assert p.choose(a, 1) == Choice(CHAIN4)
    # batch 8 (bucket 8, never observed): calibration scaled from batch 1 (x8) plus bucket 1's 3 ms
    eight = members(8)
    assert p.rates(eight, 1) == pytest.approx({PLAIN: 8 / 0.080, CHAIN1: 8 * 1.6 / 0.099, CHAIN4: 8 * 2.3056 / 0.147})
    # plain calls of 8 steps in 88 ms: a plain overhead of 8 ms a call at bucket 1
    p.observe_round(1, PLAIN, 88 * MS, steps=8)
    assert p.rates(a, 8)[PLAIN] == pytest.approx(8 / 0.080)  # the warm-up
    p.observe_round(1, PLAIN, 88 * MS, steps=8)
    assert p.rates(a, 8)[PLAIN] == pytest.approx(8 / 0.088)
    assert p.rates(a, 1)[PLAIN] == pytest.approx(1 / 0.018)


def test_high_acceptance_picks_the_deep_tree_and_low_acceptance_plain() -> None:
    """Observed acceptance, no prior left (prior weight ~0): 0.9 -> 4x4 (1 + .9 + .81 + .729 + .6561) / 18 ms
    = 227.5 tok/s over 1x1 1.9 / 12 ms = 158.3 and plain 100; 0.05 -> 1x1 1.05 / 12 ms = 87.5 < plain 100."""
    cfg = PolicyConfig(menu=(CHAIN1, CHAIN4), prior_weight=1e-9)
    high = AdaptivePolicy(cfg, table())
    feed(high, 0.9)
    assert high.rates(members(1), 1) == pytest.approx({PLAIN: 100, CHAIN1: 1.9 / 0.012, CHAIN4: 4.0951 / 0.018}, 1e-3)
    assert high.choose(members(1), 1) == Choice(CHAIN4)
    low = AdaptivePolicy(cfg, table())
    feed(low, 0.05)
    assert low.rates(members(1), 1)[CHAIN1] == pytest.approx(1.05 / 0.012, 1e-3)
    assert low.choose(members(1), 1) == Choice(PLAIN)


def test_plain_steps_per_call_amortise_the_plain_overhead() -> None:
    """Overheads of 8 ms a plain call and 8 ms a tree round, alpha .6 (the prior): one plain step a call
    1 / 18 ms = 55.6 tok/s, eight 8 / 88 ms = 90.9; 1x1 1.6 / 20 ms = 80 -> plain wins only with 8 steps."""
    p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1,), prior=0.6), table())
    for _ in range(2):  # each shape's first call at the bucket its warm-up
        p.observe_round(1, PLAIN, 18 * MS, steps=1)
        p.observe_round(1, CHAIN1, 20 * MS)
    assert p.rates(members(1), 1) == pytest.approx({PLAIN: 1 / 0.018, CHAIN1: 80})
    assert p.choose(members(1), 1) == Choice(CHAIN1)
    assert p.rates(members(1), 8)[PLAIN] == pytest.approx(8 / 0.088)
    assert p.choose(members(1), 8) == Choice(PLAIN)


def test_batch_64_history_is_not_charged_to_batch_1() -> None:
    """Issue 32. Batch 64 (calibrated: decode 12, 4x4 4 + 20 ms) with 60 ms of tree overhead: plain 64 / 13 ms
    = 4,923 tok/s against 4x4 at most 64 * 5 / 84 ms = 3,810 (every draft accepted): plain there once a tree
    round was reported (round 2; round 1, 1x1's, is a catch-up). A shape's first confirm (2) runs judged not the
    best keep its wait at retry_base (16); from the third, the wait grows by its lag behind the best (2 x wait x
    lag^2). 1x1 (judged after round 1) is due at 17: a catch-up and a steady round (17-18), and 4x4 (judged after
    round 2) at once behind that tree round (19: no catch-up); again 16 rounds after the last try began: 35-36,
    37. Judged a third time against plain's measured 4,923 (5,415 with a margin of 10%: the bucket on plain, tries
    do not move it): 1x1 at 64 * 2 / 75 ms = 1,707 (lag 3.17) waits 2 x 16 x 3.17^2 = 322 rounds (359-360), 4x4
    at 64 * 5 / 84 ms = 3,810 (lag 1.42) 2 x 16 x 1.42^2 = 65 (102-103), then 2 x 65 x 1.42^2 = 262, held to 16
    rounds after 1x1's try began: 375-376. Batch 1 has no rounds
    yet: it borrows bucket 64's overheads (60 ms tree, 1 ms plain): 4x4 at most 5 / 78 ms = 64 against plain
    1 / 11 ms = 91 is its best estimate; but its trees never ran there on a borrowed cost, so they are due at
    once: 4x4 (the better tree) runs rounds 1 (a catch-up: bucket 64's last rounds were plain) and 2; bucket 1
    now has its own 0 ms overhead: 4x4 is the best from then on (5 / 18 ms = 277.8); plain, never run at bucket
    1 and borrowed, is tried at once after that tree round (3), then at 19 and 35 (its confirm runs), then 2 x 16
    x (277.8 / 91)^2 = 298 rounds later (past 200); 1x1 (2 / 12 ms = 166.7, never run: its wait 16 x (277.8 /
    166.7)^2 = 44.4) at 45, 61 and 77, then 2 x 16 x 2.78 = 89 rounds later, at 166. Bound: 0 rounds of plain but
    its tries."""
    costs = table(1) + table(64, decode=12, verify2=14, verify5=20)
    # the tries' figures: margin 10%, no stay, leave, warm-up
    cfg = PolicyConfig(menu=(CHAIN1, CHAIN4), margin=0.1, stay=0.0, leave=0.0, warm_up=0)
    p = AdaptivePolicy(cfg, costs)
    core = Core(p)
    at64 = core.run(64, 500, lambda r: 4, spec_overhead=60 * MS, plain_overhead=1 * MS)
    assert all(c.shape.plain for c in at64[2:] if not c.explored)
    tries = [(i + 1, c.shape) for i, c in enumerate(at64[2:], 2) if c.explored]
    assert tries == [
        *[(17, CHAIN1), (18, CHAIN1), (19, CHAIN4), (35, CHAIN1), (36, CHAIN1), (37, CHAIN4)],
        *[(102, CHAIN4), (103, CHAIN4), (359, CHAIN1), (360, CHAIN1), (375, CHAIN4), (376, CHAIN4)],
    ]
    at1 = core.run(1, 200, lambda r: 4, plain_overhead=1 * MS)
    assert [(i + 1, c) for i, c in enumerate(at1) if c.explored] == [
        (1, Choice(CHAIN4, True)),
        (2, Choice(CHAIN4, True)),
        *[(r, Choice(PLAIN, True)) for r in (3, 19, 35)],
        *[(r, Choice(CHAIN1, True)) for r in (45, 61, 77, 166)],
    ]
    assert all(c.shape == CHAIN4 for c in at1 if not c.explored)
    by_bucket = {(e.batch, e.shape): e for e in p.estimates()}
    assert by_bucket[1, CHAIN4].source == "measured"
    assert by_bucket[64, CHAIN4].tokens_per_s < by_bucket[64, PLAIN].tokens_per_s


def test_a_bucket_with_its_own_history_switches_back_at_once() -> None:
    """As above, but batch 1 ran first: 130 rounds, 1x1 at first (prior .5: 1.5 / 12 ms = 125 against 4x4 107.6,
    then 2 / 12 ms = 166.7 as it accepts every draft), 4x4 never run and a little behind (2.875 / 18 ms = 159.7
    with levels 2-4 at the prior: lag 1.04, its wait 16 x 1.09 = 18), tried at 19 and the best from then on
    (5 / 18 ms = 277.8); 1x1, the best when judged at 19, is due 16 rounds after its last (34), judged not the
    best there and at 50 (its confirm runs: 16 rounds each), then 2 x 16 x (277.8 / 166.7)^2 = 89 rounds after
    66; plain, never run, waits 16 x (277.8 / 100)^2 = 124 (the bucket on
    trees: plain's rate without the margin). Bucket 1 has its own costs: after the 500 rounds at 64 its very
    first round is a tree again. Bound: 0 rounds."""
    costs = table(1) + table(64, decode=12, verify2=14, verify5=20)
    # the tries' figures: no stay, leave, warm-up
    cfg = PolicyConfig(menu=(CHAIN1, CHAIN4), stay=0.0, leave=0.0, warm_up=0)
    p = AdaptivePolicy(cfg, costs)
    core = Core(p)
    before = core.run(1, 130, lambda r: 4)
    tries = [(i + 1, c.shape) for i, c in enumerate(before) if c.explored]
    assert tries == [(19, CHAIN4), (34, CHAIN1), (50, CHAIN1), (66, CHAIN1), (124, PLAIN)]
    core.run(64, 500, lambda r: 4, spec_overhead=60 * MS, plain_overhead=1 * MS)
    after = core.run(1, 100, lambda r: 4)
    assert not after[0].explored and not after[0].shape.plain
    assert all(not c.shape.plain for c in after if not c.explored)


def test_a_text_whose_acceptance_drops_and_recovers_moves_the_choice_both_ways() -> None:
    """One sequence, menu 4x4, the docstring's calibration: 4x4 pays when 1 + f * E > 1.8 (18 ms against
    10). Rounds 1-100 accept 4 of 4, 101-300 none, then 4 of 4 again; retry_cap 64.
    Down: the sequence's factor f = (n * r + c) / (n + c) (c = seq_prior 4) falls to 4 / (6.29 + 4) = .39 at most
    (n -> 1 / (1 - .841) = 6.29 weighted verifications, r -> 0), where 4x4 still pays while E > .8 / .39 = 2.05:
    it is the shape's acceptance that must fall. Zero rounds add reached counts at level 1 alone, so E is about
    4 * a1 with a1 = P / (P + k) after k of them, P the weight of the first 100 rounds (<= 100); E < 2.05 needs
    a1 < .513, k > .95 P. Bound: plain by round 100 + 95.
    No absorbing state: every plain round relaxes the factor toward 1 (counts halving in seq_relax 8 rounds), so
    4x4 runs again, a round at a time, while each zero round lowers E further: about 1 round in 3 is a tree over
    rounds 251-300 (at most 2 in 5), and at least one.
    Up: a 4 of 4 round at f about .6 lifts a1 and f at once; 4x4 is the best again within 4 rounds and stays."""
    p = AdaptivePolicy(PolicyConfig(menu=(CHAIN4,), retry_cap=64, margin=0.0, leave=0.0), table())
    choices = drive(p, 1, 400, lambda r: 4 if r < 100 or r >= 300 else 0)
    best = [c.shape for c in choices if not c.explored]
    rounds = [i + 1 for i, c in enumerate(choices) if not c.explored]  # 1-based
    assert all(s == CHAIN4 for s, r in zip(best, rounds) if r <= 100)
    went_plain = next(r for s, r in zip(best, rounds) if r > 100 and s.plain)
    assert went_plain <= 100 + 95
    late = [c.shape for c in choices[250:300]]
    assert 1 <= sum(not s.plain for s in late) <= 2 * len(late) // 5
    back = next(r for s, r in zip(best, rounds) if r > 300 and s == CHAIN4)
    assert back <= 300 + 4
    assert all(s == CHAIN4 for s, r in zip(best, rounds) if r >= back)


def test_a_due_shape_waits_longer_the_further_below_the_best_it_came_out() -> None:
    """Far: 1x1 at verify 30 ms, alpha .01 and accepting nothing: 1.0046 / 31 ms = 32.4 tok/s against plain's
    100 (110 with a margin of 10%: lag 3.40). It never ran at bucket 1 and its cost is calibration, so it is due at
    the bucket's round 16 x 3.38^2 = 183 (retry_base x lag^2 for a cell never run: 1.01 / 31 ms before any
    round); its first two runs judged not the best (confirm) keep the wait at 16: 199, 215; then it grows to
    2 x 16 x 3.41^2 = 372 (its acceptance a little lower after three rounds of nothing) -> round 587, then to the
    cap, 1024 -> 1611. With catch-up rounds unreported each try lasts 2 rounds (183-184) and the wait counts from
    its last: 200-201, 217-218, 218 + 372 = 590 (590-591), 591 + 1024 = 1615 (1615-1616).
    Near: 1x1 at verify 11 ms, margin 0, alpha .15 (fed): 1.15 / 12 ms = 95.8 against 100 (lag 1.044: first due
    at 16 x 1.09 = 18), then at 34 and 50 (confirm); its rounds accept nothing, so the sequence's factor is below
    1 when judged: about 1.12 / 12 ms = 93.3, lag 1.07, wait 2 x 16 x 1.15 = 38 -> round 88, then 2 x 38 x 1.15
    ~ 88 (the factor back near 1) -> 176."""
    cfg = PolicyConfig(menu=(CHAIN1,), prior=0.01, margin=0.1, warm_up=0)  # each try's first call measured
    p = AdaptivePolicy(cfg, table(verify2=30))
    assert p.rates(members(1), 1)[CHAIN1] == pytest.approx(1.01 / 0.031)
    choices = drive(p, 1, 1700, lambda r: 0, catch_up=False)
    assert [i + 1 for i, c in enumerate(choices) if c.explored] == [183, 199, 215, 587, 1611]
    assert all(c.shape == CHAIN1 for c in choices if c.explored)
    p = AdaptivePolicy(cfg, table(verify2=30))
    choices = drive(p, 1, 1700, lambda r: 0)
    assert [i + 1 for i, c in enumerate(choices) if c.explored] == [183, 184, 200, 201, 217, 218, 590, 591, 1615, 1616]
    p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1,), margin=0.0, leave=0.0, warm_up=0), table(verify2=11))
    feed(p, 0.15, shapes=(CHAIN1,))
    assert p.rates(members(1), 1)[CHAIN1] == pytest.approx(1.15 / 0.012, rel=1e-3)
    choices = drive(p, 1, 300, lambda r: 0, catch_up=False)
    assert [i + 1 for i, c in enumerate(choices) if c.explored] == [18, 34, 50, 88, 176]


def test_a_one_off_cost_sample_does_not_hold_a_shape_off() -> None:
    """A shape's first call at a bucket can hold a one-off (a kernel loaded at its first call there): at batch 1 (the
    docstring's calibration, every draft accepted) 4x4's first round reports 360 ms against its 18 ms. Were it a
    sample it would price 4x4 at 5 / 360 ms = 13.9 tok/s against 1x1's 2 / 12 ms = 166.7 (lag 12). It is the
    shape's warm-up at the bucket (warm_up 1): no sample. 4x4 is tried at 19 (lag 1.04 behind 1x1 while levels 2-4
    sit at the prior, as in test_a_bucket_with_its_own_history_switches_back_at_once); that round accepts all 4,
    which lifts it to 277.8 tok/s on its calibration plus the bucket's overhead (0): the best from round 20 on, where
    its 18 ms rounds are its samples. With warm_up 0 the one-off is its only sample: 4x4 stays behind 1x1 until its
    confirm runs (35, 51) outvote it: the best from round 52."""
    for warm_up, want, settled in ((1, [19, 20, 21], 19), (0, [19, 35, 51], 51)):  # settled: 4x4 the best from it
        p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1, CHAIN4), warm_up=warm_up), table())
        seqs, choices, first = members(1), [], True
        for _ in range(200):
            c = p.choose(seqs, 1)
            seconds = p.costs.calibration(1, c.shape)
            if c.shape == CHAIN4 and first:
                seconds, first = 360 * MS, False
            p.observe_round(1, c.shape, seconds)
            if not c.shape.plain:
                p.observe(seqs[0].seq_id, "greedy", c.shape, c.shape.depth)
            choices.append(c)
        assert [i + 1 for i, c in enumerate(choices) if c.shape == CHAIN4][:3] == want
        assert all(c.explored for c in choices[:settled] if c.shape == CHAIN4)
        assert all(c.shape == CHAIN4 for c in choices[settled:] if not c.explored)
        assert p.rates(seqs, 1)[CHAIN4] == pytest.approx(5 / 0.018, rel=1e-3)


def test_a_pinned_shape_off_the_menu_warms_up_too() -> None:
    """A pinned 2x2 (off the menu (1x1, 4x4)) at batch 1: calibration propose(2) 4 ms (depth 4's, the next larger) +
    verify(3 rows) 14 ms (5 rows', the next larger) = 18 ms. Its first call, 500 ms, is its warm-up: bucket 1 keeps
    no tree overhead (4x4 from calibration, 18 ms). Its second, 21 ms, gives the bucket 3 ms: 4x4 21 ms."""
    p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1, CHAIN4)), table())
    p.choose(members(1), 1)

    def four_by_four() -> tuple[str, float]:
        e = next(e for e in p.estimates() if e.batch == 1 and e.shape == CHAIN4)
        return e.source, e.seconds

    p.observe_round(1, Shape(2, 2), 500 * MS)
    assert four_by_four() == ("calibration", pytest.approx(0.018))
    p.observe_round(1, Shape(2, 2), 21 * MS)
    assert four_by_four() == ("bucket", pytest.approx(0.021))


def test_exploration_stays_a_small_share_of_rounds() -> None:
    """Default menu, batch 64 calibrated at every graph bucket, trees 50 ms over calibration: plain is the
    best once a tree round was measured (round 3: round 1 was a catch-up, round 2 the tree's warm-up) and every
    tree is retried on its doubling wait. The share of retry rounds over rounds 2,001-6,000 is under 2% (6 shapes
    of at most 2 rounds each per up to 1024 rounds), and under 5% overall."""
    p = AdaptivePolicy(PolicyConfig(), graph_costs())
    choices = drive(p, 64, 6000, lambda r: 1, spec_overhead=50 * MS, plain_overhead=1 * MS, plain_steps=8)
    assert all(c.shape.plain for c in choices[3:] if not c.explored)
    assert sum(c.explored for c in choices[2000:]) / 4000 < 0.02
    assert sum(c.explored for c in choices) / 6000 < 0.05


def test_estimates_report_per_bucket_what_choose_maximised() -> None:
    """estimates() gives, per bucket, the rates choose compares for that many fresh sequences (plain per
    decoding step), with where each cost comes from: calibration alone, then the shape's own rounds
    ('measured'), calibration plus the bucket's overhead ('bucket') or another bucket's ('nearest')."""
    p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1, CHAIN4), prior=0.6), table(1) + table(4, decode=11))
    four = members(4)
    assert p.choose(four, 2) == Choice(CHAIN1)
    est = [e for e in p.estimates() if e.batch == 4]
    assert [e.shape for e in est] == [PLAIN, CHAIN1, CHAIN4] and {e.band for e in est} == {"greedy"}
    assert {e.shape: e.tokens_per_s for e in est} == pytest.approx(p.rates(four, 2))
    # plain (2 steps a call): 1 token in 11 ms a step; 1x1 1.6 tokens in 12 ms; 4x4 2.3056 in 18 ms
    assert [e.seconds for e in est] == pytest.approx([0.011, 0.012, 0.018])
    assert [e.tokens for e in est] == pytest.approx([1, 1.6, 2.3056])
    assert [e.source for e in est] == ["calibration"] * 3
    assert [e.stale_rounds for e in est] == [None, 0, None]
    p.observe_round(4, CHAIN1, 99 * MS)  # its warm-up at bucket 4: no sample
    assert [e.source for e in p.estimates() if e.batch == 4] == ["calibration"] * 3
    p.observe_round(4, CHAIN1, 14 * MS)  # 2 ms over its calibration at bucket 4
    p.choose(four, 1)
    by = {(e.batch, e.shape): e for e in p.estimates()}
    assert (by[4, CHAIN1].source, by[4, CHAIN1].samples, by[4, CHAIN1].seconds) == ("measured", 1, pytest.approx(0.014))
    assert (by[4, CHAIN4].source, by[4, CHAIN4].seconds) == ("bucket", pytest.approx(0.020))
    assert (by[1, CHAIN4].source, by[1, CHAIN4].seconds) == ("nearest", pytest.approx(0.020))
    assert by[1, PLAIN].source == "calibration" and 8 not in {e.batch for e in p.estimates()}
    assert {k[1]: e.tokens_per_s for k, e in by.items() if k[0] == 4} == pytest.approx(p.rates(four, 1))


def test_temperature_bands_keep_their_own_acceptance() -> None:
    """Greedy accepts .9 a level, the mid band .3; calibration with verify of 2 rows 14 ms.
    Greedy: 4x4 4.0951 / 18 ms = 227.5, 1x1 1.9 / 15 ms = 126.7, plain 100 -> 4x4.
    Mid: 4x4 (1 + .3 + .09 + .027 + .0081) / 18 ms = 79.2, 1x1 1.3 / 15 ms = 86.7, plain 100 -> plain.
    A batch of one of each (batch 2: calibration x2): 4x4 (4.0951 + 1.4251) / 36 ms = 153.3 against plain
    2 / 20 ms = 100 -> 4x4. The low band, never observed, takes the greedy band's pooled figures."""
    p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1, CHAIN4), prior_weight=1e-9), table(verify2=14))
    feed(p, 0.9, "greedy")
    feed(p, 0.3, "mid")
    greedy, mid = [Member("g", "greedy")], [Member("m", "mid")]
    assert p.rates(mid, 1) == pytest.approx({PLAIN: 100, CHAIN1: 1.3 / 0.015, CHAIN4: 1.4251 / 0.018}, 1e-3)
    assert p.choose(greedy, 1) == Choice(CHAIN4)
    assert p.choose(mid, 1) == Choice(PLAIN)
    assert p.rates(greedy + mid, 1)[CHAIN4] == pytest.approx(5.5202 / 0.036, 1e-3)
    assert p.choose(greedy + mid, 1) == Choice(CHAIN4)
    assert p.acceptance.pooled("low") == pytest.approx(p.acceptance.pooled("greedy"))  # it leans on greedy's
    assert p.bands() == ["greedy", "mid"]
    mid_rates = {e.shape: e.tokens_per_s for e in p.estimates(["mid"]) if e.batch == 1}
    assert mid_rates == pytest.approx(p.rates(mid, 1))


def test_a_sequence_that_accepts_nothing_pulls_its_batch_to_plain_relaxes_and_forget_drops_it() -> None:
    """Menu 4x4, its band accepting .7 a level (other sequences): E = .7 + .49 + .343 + .24 = 1.773, 4x4 pays when
    1 + f * E > 1.8 (18 ms against 10; margin 0): f > .451. Sequence 'bad' accepts nothing: its factor after one
    round is (1 * 0 + 4) / (1 + 4) = .8 (seq_prior 4: one round moves it little); after 31,
    n = (1 - .841^31) / (1 - .841) = 6.26 and f = 4 / 10.26 = .39 -> plain for it alone, 4x4 for a fresh sequence.
    Plain rounds relax it (seq_relax 4: n halves in 4 of them, x .841 each): the first choose that finds it
    unverified since its last one relaxes it to n 5.26, f .432 (plain), the next to n 4.43, f .475: 4x4 again
    (its 31 zeros leave E about 1.767: 1 + .475 * 1.767 = 1.84). forget() drops the factor."""
    p = AdaptivePolicy(PolicyConfig(menu=(CHAIN4,), margin=0.0, leave=0.0, seq_relax=4.0), table())
    feed(p, 0.7, shapes=(CHAIN4,))
    p.observe("bad", "greedy", CHAIN4, 0)
    assert p.factor("bad") == pytest.approx(0.8)
    for _ in range(30):
        p.observe("bad", "greedy", CHAIN4, 0)
    assert p.factor("bad") == pytest.approx(4 / 10.26, abs=0.005)
    bad = [Member("bad", "greedy")]
    assert p.choose(bad, 1) == Choice(PLAIN)  # verified since the last choose: not relaxed
    assert p.choose([Member("good", "greedy")], 1) == Choice(CHAIN4)
    assert p.choose(bad, 1) == Choice(PLAIN)
    assert p.factor("bad") == pytest.approx(4 / 9.26, abs=0.005)
    assert p.choose(bad, 1) == Choice(CHAIN4)
    assert p.factor("bad") == pytest.approx(4 / 8.43, abs=0.005)
    p.forget("bad")
    assert p.factor("bad") == 1.0 and "bad" not in p.seqs


def test_unobserved_acceptance_relaxes_toward_the_pooled_figure() -> None:
    """4x4 observed accepting nothing, 1x1 accepting everything (1,000 each, prior weight 2): 4x4's level 1
    is (0 + 2 * pool) / (1000 + 2) ~ 0. Half-life 64 rounds: after 640 rounds without observations its
    counts weigh 1000 / 1024 ~ 1 against the prior weight 2, so level 1 is within a third of the pooled
    figure (which does not decay by rounds)."""
    p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1, CHAIN4), half_life=64), table())
    for _ in range(1000):
        p.observe("x", "greedy", CHAIN4, 0)
        p.observe("x", "greedy", CHAIN1, 1)
    assert p.acceptance.alphas("greedy", CHAIN4)[0] < 0.01
    for _ in range(640):
        p.choose(members(1), 1)
    pool = p.acceptance.pooled("greedy")[0]
    assert abs(p.acceptance.alphas("greedy", CHAIN4)[0] - pool) < pool / 3


def test_acceptance_counts_per_level_as_in_the_docstrings() -> None:
    """AcceptanceTable: 3x8 accepting 2 then 0 (one by one, or in one round) -> level 1 reached 2 passed 1,
    level 2 reached 1 passed 1, level 3 reached 1 passed 0: alpha (.5, 1, 0), E = .5 + .5 * 1 + 0 = 1 (prior
    weight ~0, no round in between). Clock, half-life 1: 1 added at round 0 and 1 at round 1 are worth 1.5 at round 1.
    SequenceFactor (seq_prior 1, seq_memory 1): E .7 accepting 0 -> .5; then E .6 accepting 1 -> 1.03."""
    shape = Shape(3, 8)
    p = AdaptivePolicy(PolicyConfig(menu=(shape,), prior_weight=1e-9, seq_memory=1), table())
    p.observe("x", "greedy", shape, 2)
    p.observe("x", "greedy", shape, 0)
    assert p.acceptance.alphas("greedy", shape) == pytest.approx([0.5, 1.0, 0.0])
    assert p.acceptance.expected("greedy") == pytest.approx([1.0])
    one_round = AdaptivePolicy(PolicyConfig(menu=(shape,), prior_weight=1e-9, seq_memory=1), table())
    one_round.observe_verified([("x", "greedy", shape, 2), ("y", "greedy", shape, 0)])  # the same counts
    assert one_round.acceptance.alphas("greedy", shape) == pytest.approx([0.5, 1.0, 0.0])
    clock, total = Clock(1), 0.0
    for now in (0, 1):
        clock.advance(now)
        total += 1 / clock.scale
    assert total * clock.scale == pytest.approx(1.5)
    f = SequenceFactor()
    f.add(0, 0.7, keep=0.5, c=1.0)
    assert f.value == pytest.approx(0.5)
    f.add(1, 0.6, keep=0.5, c=1.0)
    assert f.value == pytest.approx((1.5 / 0.95 + 1) / 2.5)


def test_choices_are_deterministic_given_the_seed() -> None:
    """No wall clock, no unseeded draws: the same history gives the same choices."""
    runs = [drive(AdaptivePolicy(PolicyConfig(seed=7), graph_costs()), 8, 300, lambda r: r % 4) for _ in range(2)]
    assert runs[0] == runs[1]


def test_choose_takes_under_0_2_ms_for_64_members() -> None:
    """choose runs every engine iteration: 64 members, the default menu, calibration at every graph bucket,
    some history. The best of 5 means over 500 calls is under 0.2 ms (about 0.05 ms on the dev machine)."""
    p = AdaptivePolicy(PolicyConfig(), graph_costs())
    drive(p, 64, 50, lambda r: 2, plain_steps=8)
    seqs = members(64)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(500):
            p.choose(seqs, 8)
        best = min(best, (time.perf_counter() - t0) / 500)
    assert best < 0.2 * MS


def test_calibration_lookup_and_the_cost_window() -> None:
    """Step times: the next larger calibrated size (the graph that runs), linear past the largest; the same
    for batches. Window: the weighted median of the last samples, the older ones dropped after a gap."""
    model = CostModel(PolicyConfig(), table())
    assert model.step("verify", 1, 4) == pytest.approx(14 * MS)
    assert model.step("verify", 1, 10) == pytest.approx(28 * MS)
    assert model.step("decode", 3, 1) == pytest.approx(30 * MS)
    assert model.calibration(1, Shape(4, 4)) == pytest.approx(18 * MS)
    w = Window(3, memory=10)
    for r, x in ((0, 5.0), (1, 9.0), (2, 6.0)):
        w.add(r, x)
    assert w.median == 6.0
    w.add(20, 4.0)
    assert w.median == 4.0 and len(w.samples) == 1
    w.add(21, 2.0, weight=3)  # weight 3 of 4 at 2: 2; then 5 weighing 1: 1 + 3 = 4 of 5 at 2 or below -> 2
    assert w.median == 2.0
    w.add(22, 5.0)
    assert w.median == 2.0
    # a call of 32 rounds at 1.4 ms among short ones at 1.8 (3 of 4 rounds): 32 of 44 rounds at 1.4 -> 1.4, where
    # the unweighted median of the four calls is 1.8
    w = Window(8, memory=100)
    for r, (x, n) in enumerate(((1.8, 4), (1.4, 32), (1.8, 4), (1.8, 4))):
        w.add(r, x, n)
    assert w.median == 1.4
    w = Window(8, memory=100)
    for r, (x, n) in enumerate(((1.0, 2), (3.0, 2))):  # an exact half: the mean of the two
        w.add(r, x, n)
    assert w.median == 2.0
    with pytest.raises(ValueError):
        w.add(3, 1.0, 0)


def test_fixed_policy() -> None:
    p = FixedPolicy(CHAIN4)
    assert p.choose(members(3), 8) == Choice(CHAIN4)
    p.observe_round(3, CHAIN4, 0.01)
    p.observe_verified([("s0", "greedy", CHAIN4, 2)])
    p.forget("s0")
    assert p.estimates() == [] and p.rates(members(3), 8) == {}


def test_temperature_bands() -> None:
    assert [band(t) for t in (0, 0.3, 0.5, 0.7, 1.0, 1.5)] == ["greedy", "low", "low", "mid", "mid", "high"]
    with pytest.raises(ValueError):
        band(-0.1)
    with pytest.raises(ValueError):
        band(float("nan"))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"menu": ()},
        {"menu": (PLAIN,)},
        {"menu": (CHAIN1, CHAIN1)},
        {"buckets": (0, 4)},
        {"prior": 1.0},
        {"prior_weight": 0.0},
        {"half_life": 0.0},
        {"seq_memory": -1.0},
        {"cost_window": 0},
        {"retry_base": 0},
        {"retry_base": 64, "retry_cap": 32},
        {"try_rounds": 0},
    ],
)
def test_bad_configs_raise(kwargs) -> None:
    with pytest.raises(ValueError):
        PolicyConfig(**kwargs)


def test_bad_inputs_raise() -> None:
    p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1,)), table())
    with pytest.raises(ValueError):
        Member("a", "lukewarm")
    with pytest.raises(ValueError):
        p.observe("a", "greedy", CHAIN1, 2)  # more than the depth
    with pytest.raises(ValueError):  # a round with one bad row changes nothing
        p.observe_verified([("b", "greedy", CHAIN1, 0), ("a", "greedy", CHAIN1, 2)])
    assert p.factor("b") == 1.0 and "greedy" not in p.acceptance.reached_sum
    with pytest.raises(ValueError):
        p.observe_round(1, CHAIN1, float("nan"))
    with pytest.raises(ValueError):
        p.choose(members(1), 0)
    with pytest.raises(ValueError):
        StepCost("prefill", 1, 1, 0.1)


@pytest.mark.parametrize("text", ["0x3", "3x2", "x", "4-16", "-1x-1"])
def test_bad_shapes_raise(text) -> None:
    with pytest.raises(ValueError):
        Shape.parse(text)


def test_shape_text_round_trips() -> None:
    assert Shape.parse("4x16") == Shape(4, 16) and str(Shape(4, 16)) == "4x16"
    assert Shape.parse("plain") == PLAIN and str(PLAIN) == "plain"


def graph_costs() -> list[StepCost]:
    """A calibration at the engines' default graph buckets: decode 10 ms + 0.1 ms a sequence, verify
    11 ms + 10 us a row a sequence, propose 1 ms a level."""
    out = []
    for b in (1, 2, 4, 8, 16, 24, 32, 48, 64):
        out.append(StepCost("decode", b, 1, 0.010 + b * 1e-4))
        out += [StepCost("verify", b, t, 0.011 + b * t * 1e-5) for t in (4, 8, 16, 32, 64)]
        out += [StepCost("propose", b, d, d * 1e-3) for d in (2, 4, 6)]
    return out


def test_a_long_plain_stretch_keeps_the_pooled_acceptance() -> None:
    """Rounds without verifications (plain ones) wear a shape's own counts away toward the pooled figure, but not
    the pooled figure itself: after 5,000 rounds with no tree, 4x4 is still expected to accept what the draft
    accepted (.9 a level: .9 + .81 + .729 + .6561 = 3.0951), not the prior's .5 a level (.9375)."""
    p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1, CHAIN4)), table())
    feed(p, 0.9)
    for _ in range(5000):
        p.choose([Member("g", "greedy")], 1)
    assert p.acceptance.expected_of("greedy", CHAIN4) == pytest.approx(3.0951, rel=0.02)


def test_rounds_with_sampling_rows_keep_costs_of_their_own() -> None:
    """A batch with a sampling row verifies at a higher cost (its targets and sampled acceptance): 50 steady 4x4
    rounds of such batches at 100 ms leave the greedy batches' cost of 4x4 (calibration 18 ms) as it was, and
    make the sampled variant's 4x4 cost their median."""
    p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1, CHAIN4)), table())
    feed(p, 0.9)
    before = p.rates(members(1), 1)
    for _ in range(50):
        p.observe_round(1, CHAIN4, 0.1, 1, sampled=True)
    assert p.rates(members(1), 1) == pytest.approx(before)
    assert p.rates(members(1), 1, sampled=True)[CHAIN4] == pytest.approx(before[CHAIN4] * 0.018 / 0.1, rel=1e-3)


def test_the_engines_capture_the_menus_shapes_exactly():
    """Every menu shape's tree rows (nodes + 1) and depth are graph buckets: a round of a menu shape pads no row
    and expands no level it does not keep (the drafter's steps and the largest tree are added by the engines)."""
    from common.config import DraftingConfig
    from common.engine.cuda_graphs import GraphConfig
    from common.policy import DEFAULT_MENU

    gc, drafting = GraphConfig(), DraftingConfig()
    assert {s.nodes + 1 for s in DEFAULT_MENU} <= set(gc.tree_buckets) | {drafting.verify_tree_size + 1}
    assert {s.depth for s in DEFAULT_MENU} <= set(gc.depth_buckets) | {drafting.steps}


def test_plain_keeps_the_batch_unless_a_tree_beats_it_by_the_margin() -> None:
    """Calibration table() (plain 1 / 10 ms = 100 tok/s; 1x1 12 ms), acceptance of 1x1 known exactly: 0.1 ->
    1.1 / 12 ms = 91.7 (plain); 0.25 -> 1.25 / 12 ms = 104.2, 4% above plain: plain under the default margin
    of 5% (105 to beat), 1x1 without one; 0.4 -> 1.4 / 12 ms = 116.7: 1x1 either way."""
    for accepted, with_margin, without in ((0.1, PLAIN, PLAIN), (0.25, PLAIN, CHAIN1), (0.4, CHAIN1, CHAIN1)):
        for margin, want in ((PolicyConfig().margin, with_margin), (0.0, without)):
            p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1,), prior_weight=1e-9, margin=margin), table())
            feed(p, accepted)
            assert p.rates(members(1), 1)[CHAIN1] == pytest.approx((1 + accepted) / 0.012, 1e-3)
            assert p.choose(members(1), 1).shape == want, (accepted, margin)


def test_a_bucket_keeps_the_kind_it_runs_while_the_other_is_within_its_band() -> None:
    """Hysteresis, the defaults' band. table() (plain 10 ms a step: 100 tok/s, 105 with the margin of 5%), 1x1
    accepting .25 exactly (1.25 tokens a round), its cost set by 8 steady rounds at a time (the median of
    cost_window 8): at 12 ms 104.2 tok/s, plain keeps the bucket (105 to beat); at 10 ms 125: 1x1; at 12 ms again,
    104.2: the bucket stays on 1x1 (plain's 100 does not beat it; without the hysteresis, plain); at 13 ms 96.2:
    1x1 stays with leave 5% (96.2 x 1.05 = 101.0 against 100), plain without it; at 14 ms 89.3 (93.75 with leave):
    plain; at 12 ms, plain stays."""
    for leave, want in ((0.05, CHAIN1), (0.0, PLAIN)):
        p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1,), prior_weight=1e-9, leave=leave), table())
        feed(p, 0.25, shapes=(CHAIN1,))
        for _ in range(8):
            p.observe_round(1, PLAIN, 10 * MS)
        picks = []
        for ms in (12, 10, 12, 13, 14, 12):
            for _ in range(8):
                p.observe_round(1, CHAIN1, ms * MS)
            assert p.rates(members(1), 1)[CHAIN1] == pytest.approx(1.25 / (ms * MS), 1e-3)
            choice = p.choose(members(1), 1)
            assert not choice.explored
            picks.append(choice.shape)
        assert picks == [PLAIN, CHAIN1, CHAIN1, want, PLAIN, PLAIN], leave


def noisy_batch(cfg: PolicyConfig, tree_ms: float, calls: int = 2000, seed: int = 0) -> float:
    """64 greedy sequences under `cfg` with 3x8 its one tree, calls as the core makes them: a plain call 8 steps of
    9.6 ms in all, a tree call 4 rounds of tree_ms each, every cost drawn with noise (sd 5% plain, 12% a round: run
    AR's spread of cost samples at 64), every row of a round accepting each level with probability .6; a tree call
    right after a plain one is a catch-up (no cost sample). Returns the share of the time spent in tree calls."""
    rng = random.Random(seed)
    tree = Shape(3, 8)
    cal = [
        StepCost("decode", 64, 1, 1.2 * MS),
        StepCost("verify", 64, 9, 1.6 * MS),
        StepCost("propose", 64, 3, 0.5 * MS),
    ]
    p, seqs = AdaptivePolicy(cfg, cal), members(64)
    spent, last = {True: 0.0, False: 0.0}, PLAIN
    for _ in range(calls):
        shape = p.choose(seqs, 8).shape
        if shape.plain:
            seconds = 9.6 * MS * (1 + rng.gauss(0, 0.05))
            p.observe_round(64, PLAIN, seconds, 8)
        else:
            rounds = [tree_ms * MS * (1 + rng.gauss(0, 0.12)) for _ in range(4)]
            for _ in rounds:
                p.observe_verified([(m.seq_id, m.band, tree, accepted(rng, 0.6, 3)) for m in seqs])
            seconds = sum(rounds)
            if not last.plain:
                p.observe_round(64, tree, seconds / 4, rounds=4)
        spent[shape.plain] += seconds
        last = shape
    return spent[False] / (spent[False] + spent[True])


def accepted(rng: random.Random, alpha: float, depth: int) -> int:
    """Drafted tokens a row accepts when each level passes with probability alpha, up to depth."""
    a = 0
    while a < depth and rng.random() < alpha:
        a += 1
    return a


def test_an_edge_of_a_twentieth_decides_a_noisy_batch_either_way() -> None:
    """The band centred on parity against noisy samples at 64 sequences (noisy_batch), each figure the mean share
    of time in tree calls over seeds 0-3. 3x8 commits 1 + .6 + .36 + .216 = 2.176 tokens a sequence a round: at 2.46
    ms a round 64 x 2.176 / 2.46 ms = 56,611 tok/s against plain's 64 x 8 / 9.6 ms = 53,333 (trees 6.1% ahead): the
    defaults (margin 5%, leave 5%) spend 98.6% in tree calls (tries of plain and catch-ups the rest); at 2.76 ms,
    50,458 (plain 5.7% ahead): 1.9%. Each side of the band does its part: with the margin alone (leave 0) the first
    batch spends 92.0% in tree calls, noise taking it to plain and the margin holding it there; a band of 0 to +10%
    (margin 10%, no leave) 63.2%; with no band at all (margin and leave 0) the second batch 3.6%."""
    tree = (Shape(3, 8),)

    def share(tree_ms: float, **kw) -> float:
        return sum(noisy_batch(PolicyConfig(menu=tree, **kw), tree_ms, seed=s) for s in range(4)) / 4

    assert share(2.46) >= 0.97
    assert share(2.76) <= 0.03
    assert share(2.46, leave=0.0) < 0.95
    assert share(2.46, margin=0.1, leave=0.0) < 0.8
    assert share(2.76, margin=0.0, leave=0.0) > 0.03


def test_a_bucket_on_a_tree_keeps_it_while_another_is_within_stay() -> None:
    """table(), plain far below (30 ms a step: 33 tok/s), both trees accepting .5 a level exactly: 1x1 1.5 tokens a
    round, 4x4 1 + .5 + .25 + .125 + .0625 = 1.9375; their costs set by 8 steady rounds at a time. 1x1 at 10 ms:
    150 tok/s; 4x4 at 13.5 ms 143.5 -> 1x1; 4x4 at 12.6 ms 153.8 (2.5% above) -> 1x1 stays (stay 5%; without it
    4x4); 4x4 at 12 ms 161.5 (7.6% above) -> 4x4; 1x1 at 9.6 ms 156.25 against 4x4 at 12.6 ms (1.6% above) -> 4x4
    stays (without: 1x1)."""
    steps = (((CHAIN1, 10), (CHAIN4, 13.5)), ((CHAIN4, 12.6),), ((CHAIN4, 12),), ((CHAIN4, 12.6),), ((CHAIN1, 9.6),))
    with_stay, without = [CHAIN1, CHAIN1, CHAIN4, CHAIN4, CHAIN4], [CHAIN1, CHAIN4, CHAIN4, CHAIN4, CHAIN1]
    for stay, want in ((0.05, with_stay), (0.0, without)):
        p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1, CHAIN4), prior_weight=1e-9, stay=stay), table())
        feed(p, 0.5)
        for _ in range(8):
            p.observe_round(1, PLAIN, 30 * MS)
        picks = []
        for costs in steps:
            for shape, ms in costs:
                for _ in range(8):
                    p.observe_round(1, shape, ms * MS)
            choice = p.choose(members(1), 1)
            assert not choice.explored
            picks.append(choice.shape)
        assert picks == want, stay


def test_a_tree_past_max_rows_is_off_its_buckets_menu() -> None:
    """max_rows 40, table() at batches 8 and 16, every level accepting 0.9 (E 4x4 = .9 + .81 + .729 + .6561 =
    3.0951, 1x1 .9). Batch 8: 4x4 verifies 8 x 5 = 40 rows (on the menu): 8 x 4.0951 / 18 ms = 1,820 tok/s over
    1x1's 8 x 1.9 / 12 ms = 1,267 -> 4x4. Batch 16: 4x4 would be 80 rows (off), 1x1 32: 16 x 1.9 / 12 ms = 2,533
    over plain's 1,600 (1,680 with the margin) -> 1x1, and over 300 rounds 4x4 is never chosen nor tried there,
    while estimates and rates leave it out at 16 only."""
    p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1, CHAIN4), prior_weight=1e-9, max_rows=40), table(8) + table(16))
    feed(p, 0.9)
    assert p.rates(members(8), 1)[CHAIN4] == pytest.approx(8 * 4.0951 / 0.018, 1e-3)
    assert p.choose(members(8), 1).shape == CHAIN4
    assert set(p.rates(members(16), 1)) == {PLAIN, CHAIN1}
    assert p.rates(members(16), 1)[CHAIN1] == pytest.approx(16 * 1.9 / 0.012, 1e-3)
    choices = drive(p, 16, 300, lambda r: 4)
    assert choices[0].shape == CHAIN1 and all(c.shape != CHAIN4 for c in choices)
    shapes = {(e.batch, e.shape) for e in p.estimates()}
    assert (8, CHAIN4) in shapes and (16, CHAIN4) not in shapes and (16, CHAIN1) in shapes


def test_a_rounds_verifications_share_the_expected_figure_before_it() -> None:
    """observe_verified, menu 1x1 and 4x4: a pinned 2x2 (off the menu, so E is the pooled figure: prior .5 a
    level, nothing seen -> .5 + .25 = .75) verified for b (accepting 0) then a (accepting 2) in one round: a's
    factor measures 2 against .75, (1 x 2 / .75 + 4) / 5 = 1.333 (seq_prior 4), b's 0 against it, 4 / 5 = .8. One
    by one, a would be measured against the E after b's miss (level 1: (0 + 2 x .5) / (1 + 2) = .333, E .333 +
    .167 = .5): (2 / .5 + 4) / 5 = 1.6. The acceptance counts take both: level 1 reached twice and passed once,
    level 2 reached and passed once."""
    two = Shape(2, 2)
    p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1, CHAIN4)), table())
    p.observe_verified([("b", "greedy", two, 0), ("a", "greedy", two, 2)])
    assert p.factor("a") == pytest.approx(4 / 3) and p.factor("b") == pytest.approx(0.8)
    assert p.acceptance.reached_sum["greedy"][:2] == pytest.approx([2, 1], 1e-2)
    assert p.acceptance.passed_sum["greedy"][:2] == pytest.approx([1, 1], 1e-2)
    one = AdaptivePolicy(PolicyConfig(menu=(CHAIN1, CHAIN4)), table())
    one.observe("b", "greedy", two, 0)
    one.observe("a", "greedy", two, 2)
    assert one.factor("a") == pytest.approx(1.6)
