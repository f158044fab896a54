"""Engines in-process: multi-token acceptance and KV compaction, checked against a fresh prefill."""

import pytest
import torch

from common.config import SamplingConfig
from common.engine.base import PrefillInput, ProposeInput, VerifyInput
from common.engine.oracle import GreedyOracleDrafter, WrongOracleDrafter
from common.engine.verifier import Verifier, VerifierConfig
from common.errors import CapacityExhausted, InvalidRequest, UnknownSequence

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 4093, 198, 4898, 314, 260, 6376, 4461, 47]


@pytest.fixture(scope="module")
def verifier(checkpoint):
    return Verifier(checkpoint, VerifierConfig(max_sequences=3, max_context=128, max_tree_nodes=64))


def run_spec(verifier, drafter, seq, n):
    pre = verifier.prefill(PrefillInput(seq, PROMPT, SamplingConfig()))
    out, rounds = [pre.next_token], []
    item = ProposeInput.after_prefill(seq, PROMPT, pre, 60)
    while len(out) < n:
        tree = drafter.propose([item])[0]
        r = verifier.verify([VerifyInput(seq, tree)])[0]
        assert r.hidden.shape == (len(r.tokens), 3 * verifier.model.cfg.hidden_size)
        rounds.append(len(r.tokens))
        out += r.tokens
        item = ProposeInput(seq, r.tokens, r.hidden, False, [], 60)
    return out, rounds


def plain(verifier, seq, n):
    out = [verifier.prefill(PrefillInput(seq, PROMPT, SamplingConfig())).next_token]
    while len(out) < n:
        out += verifier.decode([seq])
    return out


def test_greedy_oracle_accepts_every_level_and_compacts_kv(verifier):
    drafter = GreedyOracleDrafter(verifier.model, steps=5, device=torch.device("cpu"))
    spec, rounds = run_spec(verifier, drafter, "spec", 24)
    assert rounds[:3] == [6, 6, 6]  # 5 drafted levels accepted + bonus, every round
    ref = plain(verifier, "plain", len(spec))
    assert spec == ref
    # the compacted KV entries equal those of plain decoding of the same tokens, position by position
    s_slot, s_state = verifier.seqs.get("spec")
    p_slot, p_state = verifier.seqs.get("plain")
    assert s_state.length == p_state.length
    n = s_state.length
    assert torch.allclose(verifier.cache.k[:, s_slot, :n], verifier.cache.k[:, p_slot, :n], atol=1e-4)
    assert torch.allclose(verifier.cache.v[:, s_slot, :n], verifier.cache.v[:, p_slot, :n], atol=1e-4)
    verifier.release(["spec", "plain"])


def test_wrong_oracle_gets_only_the_bonus(verifier):
    drafter = WrongOracleDrafter(verifier.model, steps=4, device=torch.device("cpu"))
    spec, rounds = run_spec(verifier, drafter, "wrong", 10)
    assert set(rounds) == {1}
    assert spec[:10] == plain(verifier, "plain2", 10)
    verifier.release(["wrong", "plain2"])


def test_engine_rejects_bad_use(verifier):
    with pytest.raises(UnknownSequence):
        verifier.decode(["nope"])
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        verifier.prefill(PrefillInput("bad", [1, 10**6], SamplingConfig()))
    with pytest.raises(InvalidRequest, match="context holds"):
        verifier.prefill(PrefillInput("long", [1] * 200, SamplingConfig()))
    for i in range(3):
        verifier.prefill(PrefillInput(f"s{i}", PROMPT, SamplingConfig()))
    with pytest.raises(CapacityExhausted):
        verifier.prefill(PrefillInput("s3", PROMPT, SamplingConfig()))
    assert verifier.release(["s0", "s1", "s2", "missing"]) == 3
