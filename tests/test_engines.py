"""Engines in-process: multi-token acceptance and KV compaction, checked against a fresh prefill."""

import numpy as np
import pytest
import torch

from common.config import SamplingConfig
from common.engine.base import PrefillInput, ProposeInput, VerifyInput, finish
from common.engine.oracle import GreedyOracleDrafter, WrongOracleDrafter
from common.engine.verifier import Verifier, VerifierConfig
from common.errors import CapacityExhausted, InvalidRequest, UnknownSequence
from common.tree import Tree

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


def test_sampling_runs_on_the_device_and_a_seed_reproduces_it(verifier):
    """Sampling rows draw on the device from their seed and position. Twins (one seed, one prompt) commit the
    same tokens through the prefill, a verify of a tree of no nodes (one token: what a decode step draws,
    which the other twin makes), a verify of the same tree, and decoding of several steps in one call (a
    batch with sampling rows no longer falls back to one step). The verify calls `then` for a batch with
    sampling rows, and the greedy row beside them commits its greedy tokens (a greedy sequence decoding
    alone commits the same)."""
    hot = SamplingConfig(temperature=0.9, top_p=0.9, seed=5)
    firsts = [verifier.prefill(PrefillInput(s, PROMPT, c)).next_token for s, c in (("s1", hot), ("s2", hot))]
    greedy = [verifier.prefill(PrefillInput("g", PROMPT, SamplingConfig())).next_token]
    assert firsts[0] == firsts[1]
    empty = Tree(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))
    called = []
    out = finish(verifier.verify_steps([VerifyInput("s1", empty), VerifyInput("g", empty)], called.append))
    assert len(called) == 1 and [len(o.tokens) for o in out] == [1, 1]
    assert called[0].result[:, 0].tolist() == [0, 0]
    assert verifier.decode(["s2"]) == out[0].tokens  # a tree of no nodes is a decode step
    greedy += out[1].tokens
    tree = Tree(np.array([198, 504, 1, 6376]), np.array([-1, 0, 0, -1]), np.ones(4, np.float32))
    out = verifier.verify([VerifyInput(s, tree) for s in ("s1", "s2", "g")])
    assert out[0].tokens == out[1].tokens
    greedy += out[2].tokens
    dec = verifier.decode_many(["s1", "s2", "g"], 5)
    assert [len(t) for t in dec.tokens] == [5, 5, 5] and dec.tokens[0] == dec.tokens[1]
    greedy += dec.tokens[2]
    verifier.release(["s1", "s2"])
    verifier.prefill(PrefillInput("s3", PROMPT, SamplingConfig(temperature=0.9, top_p=0.9, seed=6)))
    other = verifier.decode_many(["s3"], 8).tokens[0]  # another seed: another sequence
    assert other != [firsts[0], *out[0].tokens, *dec.tokens[0]][: len(other)]
    assert greedy == plain(verifier, "g2", len(greedy))
    verifier.release(["g", "g2", "s3"])


def test_the_decode_probes_verify_blocks_run_as_the_engines(verifier):
    """bench.decode_probe times verify graphs on blocks it packs the way verify_rounds_steps does: for a greedy
    batch and one with a sampling row it gets the engine's graph keys (("verify", B, T, shallow), the sampled one
    with its variant after), and each step runs on its block, its result one row a sequence."""
    from bench.decode_probe import _verify_inputs

    hot = SamplingConfig(temperature=0.7, top_p=0.9, seed=1)
    for s, c in (("p1", SamplingConfig()), ("p2", hot)):
        verifier.prefill(PrefillInput(s, PROMPT, c))
    tree = Tree(np.array([198, 504, 1, 6376]), np.array([-1, 0, 0, -1]), np.ones(4, np.float32))
    for ids in (["p1"], ["p1", "p2"]):
        key, step, block = _verify_inputs(verifier, [VerifyInput(s, tree) for s in ids], len(ids), 8)
        assert key[:4] == ("verify", len(ids), 8, True) and (len(key) == 4) == (ids == ["p1"])  # sampled: + variant
        out = step(packed=block)
        assert out.result.shape[0] == len(ids)
    verifier.release(["p1", "p2"])
