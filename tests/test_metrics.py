"""The gateway's metrics from the verifier's columnar news: speculation counters per step, accepted tokens per
position from GenerateOut.accepted_at, and the policy's estimates from its Info."""

from __future__ import annotations

from services.gateway.metrics import Metrics
from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import internal_pb2 as pb

PER_POS = "specdec_spec_decode_num_accepted_tokens_per_pos_total"


def test_speculation_counters_and_positions() -> None:
    """Rounds accepting 3, 1 and 0 drafted tokens (60-node trees): 3 drafts, 180 nodes, 4 accepted tokens;
    accepted_at [2, 1, 1]: position 0 reached by 2 rounds, positions 1 and 2 by 1, no position 3."""
    m = Metrics()
    m.verified(3, 180, 4)
    m.accepted_at([2, 1, 1])
    get = m.registry.get_sample_value
    assert get("specdec_spec_decode_num_drafts_total") == 3
    assert get("specdec_spec_decode_num_draft_tokens_total") == 180
    assert get("specdec_spec_decode_num_accepted_tokens_total") == 4
    assert [get(PER_POS, {"position": str(p)}) for p in range(4)] == [2, 1, 1, None]
    m.accepted_at([1])  # later steps add to the same children
    assert get(PER_POS, {"position": "0"}) == 3


def test_the_policys_estimates_become_gauges() -> None:
    m = Metrics()
    info = pb.InfoResponse(speculation_degraded=True)
    info.policy_estimates.add(batch=16, tree=gpb.TreeShape(depth=3, nodes=8), tokens_per_s=9000.0, band="greedy")
    info.policy_estimates.add(batch=16, tree=gpb.TreeShape(), band="greedy")  # no cost yet: no sample
    info.policy_choices.add(tree=gpb.TreeShape(), rounds=7)
    info.engine_time["verify"], info.engine_calls["rounds"] = 1.25, 40
    m.policy(info)
    get = m.registry.get_sample_value
    assert get("specdec_policy_tokens_per_second", {"batch": "16", "tree": "3x8", "band": "greedy"}) == 9000.0
    assert get("specdec_policy_tokens_per_second", {"batch": "16", "tree": "plain", "band": "greedy"}) is None
    assert get("specdec_policy_rounds", {"tree": "plain"}) == 7
    assert get("specdec_engine_seconds", {"phase": "verify"}) == 1.25
    assert get("specdec_engine_calls", {"kind": "rounds"}) == 40
    assert get("specdec_speculation_degraded") == 1
