"""The three services as separate processes on loopback: speculative output equals the verifier's
plain greedy decoding token for token, with the shipped head and with both oracle drafters."""

import logging
import re

import pytest

from tests.conftest import CHAT_PROMPTS
from tests.helpers import chat, complete_many, free_port

pytestmark = pytest.mark.slow
N_TOKENS = 64


def speculative_vs_plain(addr, prompts, n_tokens, tree=None):
    """tree: (depth, nodes) pinned for the speculative requests (the policy off), or None."""
    spec = [chat(p, max_tokens=n_tokens, ignore_eos=True) for p in prompts]
    for r in spec if tree else []:
        r.tree.depth, r.tree.nodes = tree
    spec = complete_many(addr, spec)
    plain = complete_many(addr, [chat(p, max_tokens=n_tokens, ignore_eos=True, speculative=False) for p in prompts])
    return spec, plain


def test_default_head_equals_plain_greedy(stack):
    spec, plain = speculative_vs_plain(stack.gateway, CHAT_PROMPTS, N_TOKENS, tree=(6, 60))
    for p, s, r in zip(CHAT_PROMPTS, spec, plain):
        assert len(s.token_ids) == N_TOKENS, p
        assert list(s.token_ids) == list(r.token_ids), p
        assert s.text == r.text
        assert s.speculation.rounds > 0 and r.speculation.rounds == 0
        assert s.usage.completion_tokens == N_TOKENS


def test_greedy_oracle_accepts_whole_chains(greedy_oracle_stack):
    prompts = CHAT_PROMPTS[:3]
    spec, plain = speculative_vs_plain(greedy_oracle_stack.gateway, prompts, 48)
    for s, r in zip(spec, plain):
        assert list(s.token_ids) == list(r.token_ids)
        # 6 drafted levels + bonus = 7 tokens a round, except a last round cut by max_tokens
        assert s.speculation.rounds == -(-47 // 7)
        assert s.speculation.mean_acceptance_length > 6.0


def test_wrong_oracle_gets_one_token_per_round(wrong_oracle_stack):
    prompts = CHAT_PROMPTS[3:5]
    spec, plain = speculative_vs_plain(wrong_oracle_stack.gateway, prompts, 16)
    for s, r in zip(spec, plain):
        assert list(s.token_ids) == list(r.token_ids)
        assert s.speculation.accepted_tokens == 0
        assert s.speculation.rounds == 15  # the first token comes from prefill


def test_sampling_is_reproducible_with_a_seed(stack):
    """A seed reproduces a sampled output on the same speculation path: a pinned tree, or plain decoding
    (the adaptive policy's shapes depend on the load: see GenerateRequest.seed)."""
    pinned = chat("Tell me a story about a cat.", max_tokens=24, temperature=0.8, top_p=0.9, seed=7)
    pinned.tree.depth, pinned.tree.nodes = 4, 16
    plain = chat("Tell me a story about a cat.", max_tokens=24, temperature=0.8, top_p=0.9, seed=7, speculative=False)
    a, b, c, d = complete_many(stack.gateway, [pinned, pinned, plain, plain])
    assert list(a.token_ids) == list(b.token_ids) and len(a.token_ids) > 0 and a.speculation.rounds > 0
    assert list(c.token_ids) == list(d.token_ids) and len(c.token_ids) > 0


def test_stop_string_and_stream(stack):
    import grpc

    from specdec.v1 import generation_pb2_grpc as gpb_grpc

    base = complete_many(stack.gateway, [chat("Why is the sky blue?", max_tokens=32)])[0]
    word = base.text.split()[5]
    with grpc.insecure_channel(stack.gateway) as ch:
        msgs = list(gpb_grpc.GenerationStub(ch).Generate(chat("Why is the sky blue?", max_tokens=32, stop=[word])))
    text = "".join(m.text for m in msgs)
    assert word not in text and base.text.startswith(text)
    assert msgs[-1].finish_reason == 1  # STOP


def test_shipped_head_acceptance_guard(stack):
    """Guard against shipping a broken head: through the three services on CPU (float32), the default
    head reaches a mean acceptance length of at least 4.0 on the first 8 held-out ShareGPT chats
    (never trained on; chat-templated token ids in tests/data). Measured when shipped (issue 11's third
    head, session 12): 4.201; the heads before it measured 4.152, 3.989 and 3.72 here."""
    import json
    from pathlib import Path

    from specdec.v1 import generation_pb2 as gpb

    rows = [json.loads(line) for line in (Path(__file__).parent / "data" / "heldout_sharegpt.jsonl").open()]
    reqs = [gpb.GenerateRequest(prompt_token_ids=r["prompt_ids"], max_tokens=96) for r in rows]
    for r in reqs:  # the head's own tree every round, whatever the policy would pick on this machine
        r.tree.depth, r.tree.nodes = 6, 60
    out = complete_many(stack.gateway, reqs)
    round_tokens = sum(len(r.token_ids) - 1 for r in out)
    rounds = sum(r.speculation.rounds for r in out)
    assert rounds > 0
    logging.getLogger(__name__).info(
        "shipped head, 8 held-out ShareGPT chats: mean acceptance length %.3f", round_tokens / rounds
    )
    assert round_tokens / rounds >= 4.0, [r.speculation.mean_acceptance_length for r in out]


def test_two_round_groups_and_chunked_prefill_equal_plain_greedy(stack):
    """--round-groups 2: two groups of sequences whose rounds run concurrently (one verified while the
    other drafts), and --prefill-chunk 8: every prompt (30-odd tokens) prefilled in chunks between rounds.
    Every output, speculative and plain, equals plain greedy decoding of the whole prompts (the default
    stack's), and both groups speculate."""
    from services.stack import Stack
    from tests.conftest import COMMON

    prompts = CHAT_PROMPTS[:4]
    args = ["--round-groups", "2", "--policy", "fixed", "--prefill-chunk", "8"]
    with Stack(common_args=COMMON, gateway_args=args) as s:
        spec, plain = speculative_vs_plain(s.gateway, prompts, 24)
    whole = complete_many(stack.gateway, [chat(p, max_tokens=24, ignore_eos=True, speculative=False) for p in prompts])
    for p, a, b, w in zip(prompts, spec, plain, whole):
        assert list(a.token_ids) == list(b.token_ids) == list(w.token_ids), p
        assert a.speculation.rounds > 0


def test_policy_switching_shapes_every_round_equals_plain_greedy():
    """--policy cycle: each round of a group has the next shape of plain, 1x1, 2x4, 3x8 and 6x60, so the
    draft's depth, the verified tree and plain decoding (whose features keep the draft in step) change
    every round; every output still equals plain greedy decoding, through the three processes."""
    import grpc

    from services.stack import Stack
    from specdec.v1 import generation_pb2 as gpb
    from specdec.v1 import generation_pb2_grpc as gpb_grpc
    from tests.conftest import COMMON

    prompts = CHAT_PROMPTS[:3]
    args = ["--policy", "cycle", "--policy-menu", "1x1,2x4,3x8", "--plain-steps", "3"]
    with Stack(common_args=COMMON, gateway_args=args) as s:
        spec, plain = speculative_vs_plain(s.gateway, prompts, 40)
        with grpc.insecure_channel(s.gateway) as ch:
            info = gpb_grpc.GenerationStub(ch).GetModelInfo(gpb.ModelInfoRequest(), timeout=10)
    for p, a, b in zip(prompts, spec, plain):
        assert list(a.token_ids) == list(b.token_ids), p
        assert a.speculation.rounds > 0
    assert info.speculation_policy == "cycle"
    chosen = {(c.tree.depth, c.tree.nodes): c.rounds for c in info.policy_choices}
    assert {(0, 0), (1, 1), (2, 4), (3, 8), (6, 60)} <= set(chosen), chosen


def test_draft_in_the_verifiers_process_equals_plain_greedy(stack):
    """--draft-here (Stack(colocate=True)): two processes, the draft service served on the verifier's port
    and the chained proposals called in process, four rounds per Verify (the verifier's rounds take each
    next tree from its own draft, the outcomes handed over as tensors, services/draft/here.py). Speculative
    output (a pinned 6x60 tree, every round chained after the first) equals plain greedy decoding of the
    default three-process stack, and the draft is as good as there: it accepts at least 90% as many tokens
    as the three processes' (whose draft reads the same features from bytes; the two need not match
    exactly, since batches form differently; features lost or misplaced in the hand-over accept far fewer)."""
    import grpc

    from services.stack import Stack
    from specdec.v1 import internal_pb2 as pb
    from specdec.v1 import internal_pb2_grpc as pb_grpc
    from tests.conftest import COMMON

    prompts = CHAT_PROMPTS[:3]
    args = ["--policy", "fixed", "--rounds-per-call", "4"]
    with Stack(common_args=COMMON, gateway_args=args, colocate=True) as s:
        assert set(s.procs) == {"verifier", "gateway"} and s.ports["draft"] == s.ports["verifier"]
        with grpc.insecure_channel(s.address("draft")) as ch:
            info = pb_grpc.DraftStub(ch).Info(pb.InfoRequest(), timeout=10)
        spec, plain = speculative_vs_plain(s.gateway, prompts, 32, tree=(6, 60))
        gateway_log = (s.log_dir / "gateway.log").read_text()
    verifier_log = (s.log_dir / "verifier.log").read_text()
    assert "draft failed" not in gateway_log  # every chained tree came from the verifier's own draft
    # the device chain: the verifier's rounds launched the draft's next trees behind their verification
    # (Drafter.launch_after, eagerly on a CPU), read without the draft engine's lock (draft.server's read_here)
    launches = re.search(r"services\.draft INFO (\d+) engine calls without the engine's lock", verifier_log)
    assert launches and int(launches.group(1)) >= 8, verifier_log[-2000:]
    assert "rounds per Verify: 4" in gateway_log
    whole = complete_many(stack.gateway, [chat(p, max_tokens=32, ignore_eos=True, speculative=False) for p in prompts])
    apart, _ = speculative_vs_plain(stack.gateway, prompts, 32, tree=(6, 60))
    assert info.drafter and info.verify_tree_size == 60
    here_accepted = sum(a.speculation.accepted_tokens for a in spec)
    apart_accepted = sum(a.speculation.accepted_tokens for a in apart)
    assert here_accepted >= 0.9 * apart_accepted, (here_accepted, apart_accepted)
    for p, a, b, w in zip(prompts, spec, plain, whole):
        assert list(a.token_ids) == list(b.token_ids) == list(w.token_ids), p
        assert a.speculation.rounds > 1 and a.speculation.accepted_tokens > 0


def test_four_rounds_per_verify_equal_plain_greedy(stack):
    """--rounds-per-call 4: the verifier runs up to four rounds per Verify, taking each next tree from the
    draft itself. Greedy output equals plain decoding token for token, for requests whose max_tokens (29)
    ends inside a call, for one that ends at a stop string (tokens past it discarded), and for one (7 tokens)
    that stops in an early round of a call the other (29) runs on in (answered early: --early-answers on,
    VerifyRequest.early); the gateway made
    fewer Verify calls than batched rounds ran. A seeded sampled request on a pinned tree commits the same
    tokens as on the default stack (one round per Verify on a CPU): each round draws from the sequence's
    own generators exactly as a Verify of its own would."""
    import urllib.request

    from services.stack import Stack
    from specdec.v1 import generation_pb2 as gpb
    from tests.conftest import COMMON

    prompts = CHAT_PROMPTS[:2]
    port = free_port()
    args = ["--rounds-per-call", "4", "--policy", "fixed", "--metrics-port", str(port), "--early-answers", "on"]
    with Stack(common_args=COMMON, gateway_args=args) as s:
        spec, plain = speculative_vs_plain(s.gateway, prompts, 29)
        short = complete_many(
            s.gateway,
            [chat(prompts[0], max_tokens=7, ignore_eos=True), chat(prompts[1], max_tokens=29, ignore_eos=True)],
        )
        word = plain[0].text.split()[6]
        stop = complete_many(s.gateway, [chat(prompts[0], max_tokens=29, ignore_eos=True, stop=[word])])[0]
        sampled = chat(prompts[1], max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9, seed=11)
        sampled.tree.depth, sampled.tree.nodes = 4, 16
        four = complete_many(s.gateway, [sampled])[0]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for p, a, b in zip(prompts, spec, plain):
        assert list(a.token_ids) == list(b.token_ids) and len(a.token_ids) == 29, p
        assert a.text == b.text and a.finish_reason == gpb.FINISH_REASON_LENGTH
    assert list(short[0].token_ids) == list(plain[0].token_ids[:7]) and plain[0].text.startswith(short[0].text)
    assert list(short[1].token_ids) == list(plain[1].token_ids)
    assert word not in stop.text and plain[0].text.startswith(stop.text)
    assert stop.finish_reason == gpb.FINISH_REASON_STOP
    assert list(plain[0].token_ids[: len(stop.token_ids)]) == list(stop.token_ids)
    one = complete_many(stack.gateway, [sampled])[0]
    assert list(four.token_ids) == list(one.token_ids) and four.speculation.rounds > 1
    verify_calls = _sample(metrics, "specdec_verify_calls_total")
    rounds = _sample(metrics, 'specdec_round_seconds_count{phase="total"}')  # batched rounds, each counted once
    assert 0 < verify_calls < rounds, (verify_calls, rounds)
    # each Prefill call's time: the engine's inside the verifier's inside the gateway's
    engine, verifier, call = (
        _sample(metrics, f'specdec_prefill_call_seconds_sum{{part="{p}"}}') for p in ("engine", "verifier", "call")
    )
    assert 0 < engine <= verifier <= call, (engine, verifier, call)
    # each of its 8 requests (2 speculative, 2 plain, the 7 and 29, the stop, the sampled) was prefilled once
    assert _sample(metrics, 'specdec_request_stage_seconds_count{stage="prefill"}') == 8


def _sample(metrics: str, name: str) -> float:
    """A sample's value in a Prometheus exposition."""
    return float(next(line for line in metrics.splitlines() if line.startswith(name)).rsplit(" ", 1)[1])
