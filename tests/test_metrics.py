"""The gateway's speculation counters, updated once a round (Metrics.verified) rather than once a sequence
and a token: the exported values are those of counting each sequence's verification on its own."""

from __future__ import annotations

import random

from services.gateway.metrics import Metrics

PER_POS = "specdec_spec_decode_num_accepted_tokens_per_pos_total"


def values(m: Metrics) -> dict[tuple[str, tuple], float]:
    """Every exported sample but the creation times: {(name, labels): value}."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in m.registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


def one_at_a_time(m: Metrics, accepted: list[int], nodes: list[int]) -> None:
    """The rule, one sequence's verification at a time: a draft, its nodes, its accepted tokens, and one at
    each position it reached (up to max_depth)."""
    for n, d in zip(accepted, nodes):
        m.drafts.inc()
        m.draft_tokens.inc(d)
        m.accepted_tokens.inc(n)
        for pos in range(min(n, m.max_depth)):
            m.accepted_per_pos.labels(position=str(pos)).inc()


def test_a_round_counted_at_once() -> None:
    """Three sequences of 60-node trees accepting 3, 1 and 0 drafted tokens: 3 drafts, 180 nodes, 4
    accepted tokens; position 0 reached by 2 of them, positions 1 and 2 by 1; no position 3."""
    m = Metrics()
    m.verified([3, 1, 0], 180)
    get = m.registry.get_sample_value
    assert get("specdec_spec_decode_num_drafts_total") == 3
    assert get("specdec_spec_decode_num_draft_tokens_total") == 180
    assert get("specdec_spec_decode_num_accepted_tokens_total") == 4
    assert [get(PER_POS, {"position": str(p)}) for p in range(4)] == [2, 1, 1, None]
    m.verified([], 0)  # a round whose every tree was lost counts nothing
    assert get("specdec_spec_decode_num_drafts_total") == 3


def test_positions_stop_at_max_depth() -> None:
    """max_depth 2: accepting 5 and 2 reaches positions 0 and 1 only, twice each."""
    m = Metrics(max_depth=2)
    m.verified([5, 2], 20)
    get = m.registry.get_sample_value
    assert [get(PER_POS, {"position": str(p)}) for p in range(3)] == [2, 2, None]
    assert get("specdec_spec_decode_num_accepted_tokens_total") == 7


def test_counted_at_once_equals_one_at_a_time() -> None:
    """Random rounds (1 to 64 sequences, 0 to 8 accepted tokens each, max_depth 6): the same samples,
    label children included, as counting each sequence on its own."""
    rng = random.Random(0)
    at_once, each = Metrics(max_depth=6), Metrics(max_depth=6)
    for _ in range(200):
        accepted = [rng.randint(0, 8) for _ in range(rng.randint(1, 64))]
        nodes = [rng.choice((16, 60)) for _ in accepted]
        at_once.verified(accepted, sum(nodes))
        one_at_a_time(each, accepted, nodes)
        assert values(at_once) == values(each)
