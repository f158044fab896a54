"""A multi-round Verify's bookkeeping (services/verifier/rounds.py), by hand: which items run each round,
what each commits, why each stops. Plain Python: no model, no services."""

import pytest

from common.rounds import cut_at_stop, cut_pays
from services.verifier.rounds import CallRounds, ItemRules, Stop

CHAINED = ItemRules(chained=True, rows=9)  # a 4x8 next tree: the root and 8 nodes


def run_round(call: CallRounds, outcomes: dict[int, list[int]], nodes: int = 8) -> list[int]:
    """One round as chain.py drives it: the items running, each recorded, the round closed."""
    running = call.running()
    for i in running:
        call.record(i, outcomes[i], nodes)
    call.end_round()
    return running


def test_every_item_runs_every_round_and_commits_all():
    """Hit: two chained items, no stop rule reached: both run the 3 rounds and commit every token."""
    call = CallRounds([CHAINED, CHAINED], rounds=3)
    assert run_round(call, {0: [5, 6], 1: [7]}) == [0, 1]
    assert run_round(call, {0: [8], 1: [9, 10, 11]}) == [0, 1]
    assert run_round(call, {0: [12, 13, 14], 1: [15]}) == [0, 1]
    assert call.running() == [] and call.ran == 3
    a, b = call.items
    assert a.tokens == [5, 6, 8, 12, 13, 14] and a.accepted == [1, 0, 2] and a.nodes == [8, 8, 8]
    assert b.tokens == [7, 9, 10, 11, 15] and b.accepted == [0, 2, 0]
    assert a.stop == b.stop == Stop.ROUNDS and not a.draft_error


def test_eos_in_round_two_of_four_while_the_other_runs_all_four():
    """s0's end-of-sequence (2) comes in round 2: it is cut after the 2 and sits out rounds 3 and 4, which
    s1 runs alone; round 2's acceptance counts the tokens past the cut (the engine accepted them)."""
    call = CallRounds([ItemRules(chained=True, rows=9, stop_ids=frozenset({2})), CHAINED], rounds=4)
    assert run_round(call, {0: [5, 6, 7], 1: [8, 8]}) == [0, 1]
    assert run_round(call, {0: [9, 2, 4], 1: [8, 8, 8]}) == [0, 1]
    assert call.items[0].stop == Stop.TOKEN
    assert run_round(call, {1: [8, 8]}) == [1]
    assert run_round(call, {1: [8, 8, 8, 8]}) == [1]
    a, b = call.items
    assert a.tokens == [5, 6, 7, 9, 2] and a.accepted == [2, 2]
    assert b.tokens == [8] * 11 and b.accepted == [1, 2, 1, 3] and b.stop == Stop.ROUNDS
    assert call.ran == 4


def test_stop_id_as_the_first_token_of_a_round():
    call = CallRounds([ItemRules(chained=True, stop_ids=frozenset({2, 3}))], rounds=4)
    run_round(call, {0: [5]})
    run_round(call, {0: [3, 2, 7]})
    assert call.items[0].tokens == [5, 3] and call.items[0].stop == Stop.TOKEN and call.running() == []


def test_budget_cuts_a_rounds_accepted_tokens():
    """Budget 5: round 1 commits 3, round 2 accepts 3 drafted + bonus, of which 2 fit: the item stops with
    exactly 5 tokens (LENGTH); its acceptance counts all 3."""
    call = CallRounds([ItemRules(chained=True, max_new=5), CHAINED], rounds=4)
    run_round(call, {0: [4, 4, 4], 1: [1]})
    assert call.items[0].stop is None
    run_round(call, {0: [6, 7, 8, 9], 1: [1]})
    a = call.items[0]
    assert a.tokens == [4, 4, 4, 6, 7] and a.stop == Stop.LENGTH and a.accepted == [2, 3]
    assert call.running() == [1]


def test_budget_reached_exactly_and_stop_id_past_the_budget():
    """The budget reached by a whole round stops the item; a stop id after the budget is never committed."""
    call = CallRounds(
        [ItemRules(chained=True, max_new=3), ItemRules(chained=True, max_new=2, stop_ids=frozenset({9}))], 4
    )
    run_round(call, {0: [1, 2, 3], 1: [4, 5, 9]})
    assert call.items[0].tokens == [1, 2, 3] and call.items[0].stop == Stop.LENGTH
    assert call.items[1].tokens == [4, 5] and call.items[1].stop == Stop.LENGTH


def test_draft_failure_mid_call_keeps_what_was_committed():
    """s0's tree for round 2 never came: it stops with round 1's tokens and the reason; s1 runs on."""
    call = CallRounds([CHAINED, CHAINED], rounds=3)
    run_round(call, {0: [5, 6], 1: [7]})
    call.failed(0, "the draft failed: down")
    assert call.running() == [1]
    run_round(call, {1: [8]})
    run_round(call, {1: [9]})
    a, b = call.items
    assert a.tokens == [5, 6] and a.stop == Stop.DRAFT and a.draft_error == "the draft failed: down"
    assert a.accepted == [1]
    assert b.tokens == [7, 8, 9] and b.stop == Stop.ROUNDS


def test_draft_failure_before_the_first_round_commits_nothing():
    call = CallRounds([CHAINED, CHAINED], rounds=2)
    call.failed(1, "no proposal pending")
    assert run_round(call, {0: [5]}) == [0]
    assert call.items[1].tokens == [] and call.items[1].accepted == [] and call.items[1].stop == Stop.DRAFT


def test_no_kv_room_for_the_batchs_largest_tree():
    """Before round 2: rows 61 (a 6x60 tree) and 9; rooms 100 and 40: the verify runs at 61 rows, so the
    second stops (CAPACITY) and the first runs on."""
    call = CallRounds([ItemRules(chained=True, rows=61), ItemRules(chained=True, rows=9)], rounds=3)
    run_round(call, {0: [1], 1: [2]})
    call.fit({0: 100, 1: 40})
    assert call.running() == [0] and call.items[1].stop == Stop.CAPACITY


def test_one_round_is_todays_verify():
    """k = 1, no stop rules (what a one-round Verify carries): every item runs once, commits every token
    it accepted, and stops (ROUNDS), chained or not."""
    call = CallRounds([CHAINED, ItemRules(chained=False)], rounds=1)
    assert run_round(call, {0: [3, 2, 1], 1: [2]}) == [0, 1]
    assert [it.tokens for it in call.items] == [[3, 2, 1], [2]]
    assert [it.stop for it in call.items] == [Stop.ROUNDS, Stop.ROUNDS]
    assert call.items[0].accepted == [2] and call.ran == 1


def test_an_item_that_cannot_chain_runs_one_round():
    """No next tree (next_nodes 0): it runs round 1 only, the chained one runs on."""
    call = CallRounds([ItemRules(chained=False), CHAINED], rounds=4)
    run_round(call, {0: [1], 1: [2]})
    assert call.running() == [1] and call.items[0].stop == Stop.ROUNDS


@pytest.mark.parametrize("kw", [{"rows": 0}, {"max_new": -1}])
def test_rules_refuse_bad_values(kw):
    with pytest.raises(ValueError):
        ItemRules(chained=True, **kw)


@pytest.mark.parametrize("rounds", [0, 17])
def test_rounds_out_of_range(rounds):
    with pytest.raises(ValueError):
        CallRounds([CHAINED], rounds)


@pytest.mark.parametrize(
    "tokens, room, out",
    [
        ([5, 2, 7], 3, (2, True)),  # the stop id is committed, what follows is not
        ([5, 6, 7, 8], 3, (3, False)),  # the room cuts
        ([5, 6, 2], 2, (2, False)),  # a stop id past the room does not count
        ([5], 3, (1, False)),
        ([2], 1, (1, True)),
    ],
)
def test_cut_at_stop(tokens, room, out):
    assert cut_at_stop(tokens, room, frozenset({2})) == out


def test_a_call_cuts_the_one_in_flight_when_its_new_sequences_are_a_sixteenth_of_those_going_on() -> None:
    assert cut_pays(1, 15) and cut_pays(1, 16) and not cut_pays(1, 17)
    assert cut_pays(4, 60) and cut_pays(4, 64) and not cut_pays(3, 60)
    assert not cut_pays(0, 0) and cut_pays(1, 0)
