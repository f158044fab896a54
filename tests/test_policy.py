"""The speculation policy against synthetic cost and acceptance tables whose optimum is worked out by hand."""

from __future__ import annotations

import pytest

from common.policy import (
    PLAIN,
    AcceptanceStats,
    AdaptivePolicy,
    CostModel,
    CyclePolicy,
    FixedPolicy,
    PolicyConfig,
    Shape,
    StepCost,
)
from services.gateway.speculation import append_plain_round
from specdec.v1 import internal_pb2 as pb

MS = 1e-3
CHAIN1, CHAIN4 = Shape(1, 1), Shape(4, 4)


def costs(batch: int = 1, decode=10, verify2=11, verify5=14, draft1=1, draft4=4) -> CostModel:
    """The module docstring's table: decode 10 ms, verify of 2 / 5 rows 11 / 14 ms, draft depth 1 / 4."""
    return CostModel(
        [
            StepCost("decode", batch, 1, decode * MS),
            StepCost("verify", batch, 2, verify2 * MS),
            StepCost("verify", batch, 5, verify5 * MS),
            StepCost("propose", batch, 1, draft1 * MS),
            StepCost("propose", batch, 4, draft4 * MS),
        ]
    )


def stats_with(alpha: float, shapes=(CHAIN1, CHAIN4), rounds: int = 2000) -> AcceptanceStats:
    """Statistics in which every level accepts with probability alpha (deterministic fractions: a
    geometric spread of accepted lengths, fed in exact proportions)."""
    st = AcceptanceStats(prior_weight=0.0, half_life=1e9)
    for shape in shapes:
        # P(accepted = a) = alpha^a (1 - alpha) for a < depth, alpha^depth for a = depth
        for a in range(shape.depth + 1):
            p = alpha**a * (1 - alpha) if a < shape.depth else alpha**shape.depth
            for _ in range(round(p * rounds)):
                st.observe(shape, a)
    return st


def policy(alpha: float, model: CostModel | None = None, menu=(CHAIN1, CHAIN4), explore=0.0) -> AdaptivePolicy:
    return AdaptivePolicy(PolicyConfig(menu=menu, explore=explore), model or costs(), stats_with(alpha, menu))


def test_worked_example_picks_the_one_token_chain():
    # plain 1/10 ms = 100 tok/s; 1x1 (1 + .6)/12 ms = 133; 4x4 (1 + .6 + .36 + .216 + .1296)/18 ms = 128
    p = policy(0.6)
    rates = p.rates(["a"], steps=1)
    assert rates[PLAIN] == pytest.approx(100, rel=1e-6)
    assert rates[CHAIN1] == pytest.approx(1.6 / 0.012, rel=0.01)
    assert rates[CHAIN4] == pytest.approx(2.3056 / 0.018, rel=0.01)
    assert p.choose(["a"], steps=1).shape == CHAIN1


def test_high_acceptance_picks_the_deep_chain():
    # 4x4: (1 + .9 + .81 + .729 + .6561)/18 ms = 227.5 tok/s against 1x1: 1.9/12 ms = 158
    assert policy(0.9).choose(["a"], steps=1).shape == CHAIN4


def test_low_acceptance_picks_plain():
    # 1x1: 1.05/12 ms = 87.5 < plain 100; 4x4: about 1.05/18 ms = 58
    assert policy(0.05).choose(["a"], steps=1).shape == PLAIN


def test_plain_steps_per_call_amortise_the_overhead():
    # plain overhead 8 ms per call: one step per call 1/18 ms = 55.6 tok/s, eight steps 8/88 ms = 90.9;
    # 1x1 with alpha .6 and spec overhead 8 ms: 1.6/20 ms = 80 -> plain wins only with 8 steps per call
    model = costs()
    model.observe_round(1, PLAIN, wall=18 * MS, steps=1)
    model.observe_round(1, CHAIN1, wall=20 * MS)
    p = policy(0.6, model, menu=(CHAIN1,))
    assert p.rates(["a"], steps=1)[PLAIN] == pytest.approx(1 / 0.018, rel=1e-6)
    assert p.choose(["a"], steps=1).shape == CHAIN1
    assert p.choose(["a"], steps=8).shape == PLAIN


def test_large_batches_turn_compute_bound_verification_into_plain():
    # batch 16: decode 12 ms; verify of 5 rows 80 tokens: 40 ms; draft 4 ms, alpha .6:
    # plain 16/12 ms = 1333 tok/s; 4x4 16 * 2.3056/44 ms = 838; 1x1: verify2 20 ms, 16 * 1.6/21 ms = 1219
    model = costs(batch=16, decode=12, verify2=20, verify5=40, draft1=1, draft4=4)
    assert policy(0.6, model).choose([str(i) for i in range(16)], steps=1).shape == PLAIN
    # a batch beyond the largest measured bucket scales linearly: batch 32 costs twice batch 16
    assert model.step("verify", 32, 5) == pytest.approx(0.080)
    assert model.step("verify", 8, 5) == pytest.approx(0.040)  # the bucket that runs: 16


def test_a_sequence_that_accepts_nothing_pulls_its_batch_to_plain():
    p = policy(0.7, menu=(CHAIN1,))
    assert p.choose(["good"], steps=1).shape == CHAIN1  # 1.7/12 ms = 142 > 100
    for _ in range(30):
        p.observe("bad", CHAIN1, 0)
    # bad's factor drops toward 0: its rounds commit 1 token for 12 ms; plain 1 per 10 ms
    assert p.choose(["bad"], steps=1).shape == PLAIN
    p.forget("bad")
    assert "bad" not in p.seqs


def test_acceptance_counts_per_level_as_in_the_docstring():
    st = AcceptanceStats(prior_weight=0.0, half_life=1e9)
    shape = Shape(3, 8)
    st.observe(shape, 2)
    st.observe(shape, 0)
    assert [st.alpha(shape, k) for k in (1, 2, 3)] == pytest.approx([0.5, 1.0, 0.0], abs=1e-6)
    assert st.expected(shape) == pytest.approx(0.5 + 0.5 * 1.0 + 0.0, abs=1e-6)


def test_acceptance_decays_toward_the_recent_text():
    st = AcceptanceStats(prior_weight=0.0, half_life=10)
    for _ in range(100):
        st.observe(CHAIN1, 1)
    for _ in range(50):
        st.observe(CHAIN1, 0)
    # after 5 half-lives of rejections the old acceptances weigh 2^-5 of themselves
    assert st.alpha(CHAIN1, 1) < 0.05


def test_unseen_shapes_borrow_the_pooled_level_rates():
    st = AcceptanceStats(prior=0.5, prior_weight=2.0, half_life=1e9)
    for _ in range(98):
        st.observe(CHAIN1, 1)
    # level 1 pooled: (98 + 1)/(98 + 2); a 4x4 never seen takes it for its level 1, the prior below
    assert st.alpha(CHAIN4, 1) == pytest.approx(99 / 100)
    assert st.alpha(CHAIN4, 2) == pytest.approx(0.5)


def test_online_overhead_is_what_the_engines_do_not_explain():
    model = costs()
    model.observe_round(1, CHAIN1, wall=15 * MS)  # engines 12 ms -> overhead 3 ms
    assert model.round_seconds(1, CHAIN1) == pytest.approx(15 * MS)
    assert model.round_seconds(1, CHAIN4) == pytest.approx(21 * MS)  # 18 + the same 3
    model.observe_step("verify", 1, 2, 21 * MS)  # measured: the mean of the start-up figure and this one
    assert model.step("verify", 1, 2) == pytest.approx(16 * MS)
    for _ in range(30):  # then an average that follows the newest samples (10% each)
        model.observe_step("verify", 1, 2, 21 * MS)
    assert model.step("verify", 1, 2) == pytest.approx(21 * MS, rel=0.01)
    model.observe_step("verify", 1, 4, 24 * MS)  # 4 rows ran in the 5-row bucket
    assert model.step("verify", 1, 5) == pytest.approx(19 * MS) and ("verify", 1, 4) not in model.engine
    model.observe_step("verify", 2, 3, 30 * MS)  # batch 2 is past the measured: a bucket of its own
    assert model.step("verify", 2, 3) == pytest.approx(30 * MS)


def test_exploration_tries_close_runner_ups_only():
    p = policy(0.6, explore=0.999)
    # rates: 1x1 133, 4x4 128 (within 75%), plain 100 (within 75%); explored picks are runner-ups
    picks = {p.choose(["a"], steps=1) for _ in range(50)}
    assert all(c.explored and c.shape in (CHAIN4, PLAIN) for c in picks)
    far = policy(0.05, explore=0.999)  # plain 100, 1x1 87.5 (close), 4x4 58 (not within 75%)
    assert {far.choose(["a"], steps=1).shape for _ in range(50)} == {CHAIN1}


def test_without_draft_costs_the_largest_tree_runs_until_measured():
    p = AdaptivePolicy(PolicyConfig(menu=(CHAIN1, CHAIN4)), CostModel([StepCost("decode", 1, 1, 0.01)]))
    assert p.choose(["a"], steps=8).shape == CHAIN4
    p.observe_step("propose", 1, 4, 0.004)  # a chained call's time: now 4x4 has a cost, 1x1 borrows it
    assert p.costs.step("propose", 1, 1) == pytest.approx(0.004)


def test_fixed_and_cycle_policies():
    assert FixedPolicy(CHAIN4).choose(["a"], 8).shape == CHAIN4
    cyc = CyclePolicy([PLAIN, CHAIN1, CHAIN4])
    assert [cyc.choose(["a"], 8).shape for _ in range(4)] == [PLAIN, CHAIN1, CHAIN4, PLAIN]


@pytest.mark.parametrize("text", ["0x3", "3x2", "x", "4-16", "-1x-1"])
def test_bad_shapes_raise(text):
    with pytest.raises(ValueError):
        Shape.parse(text)


def test_shape_text_round_trips():
    assert Shape.parse("4x16") == Shape(4, 16) and str(Shape(4, 16)) == "4x16"
    assert Shape.parse("plain") == PLAIN and str(PLAIN) == "plain"
    with pytest.raises(ValueError):
        PolicyConfig(menu=(PLAIN,))
    with pytest.raises(ValueError):
        StepCost("prefill", 1, 1, 0.1)


def _ipc(offset: int, rows: int, round_: int) -> pb.TensorRef:
    """Features [rows, 4] bf16 (8 bytes a row) at offset in buffer b."""
    ref = pb.TensorRef(shape=[rows, 4], dtype="bfloat16")
    ref.ipc.buffer_id, ref.ipc.offset_bytes, ref.ipc.round = "b", offset, round_
    return ref


def test_a_plain_rounds_features_follow_the_pending_ones() -> None:
    """Pending [5, 6] (2 rows at offset 0), a plain round's [7, 8, 9] written after them (offset 16): one
    item of 5 tokens and 5 rows, the plain round's write round; rows elsewhere are refused."""
    item = pb.ProposeItem(seq_id="s", token_ids=[5, 6], hidden=_ipc(0, 2, 3))
    append_plain_round(item, [7, 8, 9], _ipc(16, 3, 7))
    assert list(item.token_ids) == [5, 6, 7, 8, 9]
    assert list(item.hidden.shape) == [5, 4] and item.hidden.ipc.offset_bytes == 0 and item.hidden.ipc.round == 7
    with pytest.raises(ValueError, match="do not follow"):
        append_plain_round(item, [10], _ipc(48, 1, 8))  # row 5 is at 40


def test_a_plain_round_after_a_chained_one_starts_the_pending_item() -> None:
    """Chained: the draft took the last outcome from the verifier and nothing is pending here (an item of
    its id alone); the plain round's tokens and features (written from row 0) become the pending item.
    (On the GPU this was an IndexError that failed every stream of the colocated stack.)"""
    item = pb.ProposeItem(seq_id="s")
    append_plain_round(item, [7, 8], _ipc(0, 2, 4))
    assert list(item.token_ids) == [7, 8] and item.hidden == _ipc(0, 2, 4)
    append_plain_round(item, [9], _ipc(16, 1, 5))  # then as any pending item
    assert list(item.token_ids) == [7, 8, 9] and list(item.hidden.shape) == [3, 4] and item.hidden.ipc.round == 5
