"""The services as separate processes on loopback (three on a CPU: gateway, verifier, draft): speculative output
equals the verifier's plain greedy decoding token for token, with the shipped head, with the policy choosing,
and with the draft in the verifier's process (the oracle drafters' checks run in process: tests/test_core.py)."""

import json
import logging
from pathlib import Path
from typing import NamedTuple

import pytest

from specdec.v1 import generation_pb2 as gpb
from tests.helpers import chat, complete_many, free_port

pytestmark = pytest.mark.slow
GUARD_TOKENS = 48  # per held-out chat: the acceptance floor below was measured at this length
PLAIN_CHATS = 4  # of the 8 held-out chats, the ones also decoded plainly (the fourth stops at EOS)


class Heldout(NamedTuple):
    prompts: list  # [8] lists of token ids
    spec: list  # [8] CompleteResponse: the shipped head's 6x60 tree pinned
    plain: list  # [PLAIN_CHATS] CompleteResponse: plain decoding of the first prompts


def requests(prompts: list, max_tokens: int, **kw) -> list[gpb.GenerateRequest]:
    return [gpb.GenerateRequest(prompt_token_ids=p, max_tokens=max_tokens, **kw) for p in prompts]


@pytest.fixture(scope="module")
def heldout(stack) -> Heldout:
    """The first 8 held-out ShareGPT chats (never trained on; chat-templated token ids in tests/data), GUARD_TOKENS
    each, EOS stops: decoded with the shipped head's own tree pinned every round (6x60, whatever the policy would
    pick on this machine), and the first PLAIN_CHATS plainly."""
    rows = [json.loads(line) for line in (Path(__file__).parent / "data" / "heldout_sharegpt.jsonl").open()]
    prompts = [r["prompt_ids"] for r in rows]
    spec = complete_many(stack.gateway, requests(prompts, GUARD_TOKENS, tree=gpb.TreeShape(depth=6, nodes=60)))
    plain = complete_many(stack.gateway, requests(prompts[:PLAIN_CHATS], GUARD_TOKENS, speculative=False))
    return Heldout(prompts, spec, plain)


def test_default_head_equals_plain_greedy(heldout):
    """The shipped head's pinned trees through the three services: the held-out chats' tokens and text are plain
    greedy decoding's, cut at the same place (max_tokens, or EOS)."""
    for i, (s, r) in enumerate(zip(heldout.spec[:PLAIN_CHATS], heldout.plain, strict=True)):
        assert list(s.token_ids) == list(r.token_ids), i
        assert s.text == r.text and s.finish_reason == r.finish_reason, i
        assert s.speculation.rounds > 0 and r.speculation.rounds == 0
        assert s.usage.completion_tokens == len(s.token_ids)
    reasons = {r.finish_reason for r in heldout.plain}
    assert reasons == {gpb.FINISH_REASON_LENGTH, gpb.FINISH_REASON_EOS}, reasons  # both cuts are compared
    for r in heldout.plain:
        assert (len(r.token_ids) == GUARD_TOKENS) == (r.finish_reason == gpb.FINISH_REASON_LENGTH), r.finish_reason


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


def test_shipped_head_acceptance_guard(heldout):
    """Guard against shipping a broken head: through the three services on CPU (float32), the default head reaches a
    mean acceptance length of at least 3.75 on the held-out chats at 48 tokens each. Measured at 48 tokens
    (2026-11-28, this CPU): the shipped head (issue 11's third, session 12) 3.896; the heads before it 3.816, 3.667
    and 3.463 (in git: bc597c5, 9423083, 57765ee); the shipped head with its layers drawn at random 1.0. The floor
    passes and fails the same heads as the floor of 4.0 at 96 tokens did (4.201, 4.152, 3.989, 3.717 there)."""
    round_tokens = sum(len(r.token_ids) - 1 for r in heldout.spec)
    rounds = sum(r.speculation.rounds for r in heldout.spec)
    assert rounds > 0
    logging.getLogger(__name__).info(
        "shipped head, 8 held-out ShareGPT chats: mean acceptance length %.3f", round_tokens / rounds
    )
    assert round_tokens / rounds >= 3.75, [r.speculation.mean_acceptance_length for r in heldout.spec]


def test_the_policy_on_keeps_greedy_output(stack, heldout):
    """Unpinned speculative requests: the adaptive policy chooses every round, and the output is plain greedy
    decoding token for token. GetModelInfo says what it chose and what it estimates per batch bucket. Whether it
    tries a tree within these requests depends on this CPU's costs (a try comes due later the further a tree's
    estimate lies below plain's, and two CI workers on two cores make trees look slow): the switches themselves are
    tested with hand-computed costs (tests/test_policy.py) and shapes switching every round keep the output
    (tests/test_core.py)."""
    import grpc

    from specdec.v1 import generation_pb2_grpc as gpb_grpc

    spec = complete_many(stack.gateway, requests(heldout.prompts[:3], GUARD_TOKENS))
    for i, (a, b) in enumerate(zip(spec, heldout.plain)):
        assert list(a.token_ids) == list(b.token_ids) and a.finish_reason == b.finish_reason, i
    with grpc.insecure_channel(stack.gateway) as ch:
        info = gpb_grpc.GenerationStub(ch).GetModelInfo(gpb.ModelInfoRequest(), timeout=10)
    chosen = {(c.tree.depth, c.tree.nodes) for c in info.policy_choices if c.rounds}
    assert (0, 0) in chosen and len(chosen) > 1, chosen  # plain steps, and the fixture's pinned trees
    buckets = {e.batch for e in info.policy_estimates if e.HasField("tokens_per_s")}
    assert 1 in buckets or 2 in buckets or 4 in buckets, info.policy_estimates
    spent, calls = dict(info.engine_time), dict(info.engine_calls)
    assert calls["rounds"] >= 1 and calls["plain_calls"] >= 1 and spent["verify"] > 0 and spent["plain"] > 0, spent


def test_chunked_prefill_and_the_draft_in_the_verifiers_process_equal_plain_greedy(heldout):
    """Two processes (the draft inside the verifier's: the next trees drafted behind each verify, the device
    chain, run eagerly on a CPU) with prompts prefilled 8 tokens a step: a pinned tree's output equals plain
    greedy decoding, its own and the default stack's (the first 24 of its 48 tokens), and speculates. The gateway's
    /metrics count it: tokens, the speculation counters, accepted tokens per position, the policy's estimates."""
    import urllib.request

    from services.stack import Stack
    from tests.conftest import COMMON

    n_tokens, prompts = 24, heldout.prompts[:2]  # 63 and 47 prompt tokens: 8 and 6 prefill steps
    port = free_port()
    verifier, gateway = ["--prefill-chunk", "8"], ["--metrics-port", str(port)]
    with Stack(common_args=COMMON, verifier_args=verifier, gateway_args=gateway, colocate=True) as s:
        assert set(s.procs) == {"verifier", "gateway"}
        spec = complete_many(s.gateway, requests(prompts, n_tokens, tree=gpb.TreeShape(depth=6, nodes=60)))
        plain = complete_many(s.gateway, requests(prompts, n_tokens, speculative=False))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for i, (a, b, w) in enumerate(zip(spec, plain, heldout.plain)):
        assert list(a.token_ids) == list(b.token_ids) == list(w.token_ids[:n_tokens]), i
        assert a.speculation.rounds > 1 and a.speculation.accepted_tokens > 0
    assert _sample(text, "specdec_spec_decode_num_drafts_total") == sum(a.speculation.rounds for a in spec)
    assert _sample(text, "specdec_generation_tokens_total") == sum(len(r.token_ids) for r in spec + plain)
    assert _sample(text, 'specdec_spec_decode_num_accepted_tokens_per_pos_total{position="0"}') > 0
    assert "specdec_policy_tokens_per_second{" in text


def _sample(metrics: str, name: str) -> float:
    """A sample's value in a Prometheus exposition."""
    return float(next(line for line in metrics.splitlines() if line.startswith(name)).rsplit(" ", 1)[1])


def test_bench_accept_through_the_stack(stack, tmp_path):
    """bench.accept against the stack: the first two held-out mixed prompts (a chat and a code one), greedy and at
    temperature 0.7, 6 tokens each, the 6x60 tree pinned: every request speculates, each asked category's pooled
    acceptance lies in [1, 7] (a 6-level tree commits at most 7 tokens a round), the others have none, and the
    JSON holds every answer."""
    from bench import accept

    argv = ["--gateway", stack.gateway, "--prompts", "2", "--max-tokens", "6", "--out", str(tmp_path)]
    assert accept.main(argv) == 0
    result = json.loads((tmp_path / "accept.json").read_text())
    answers = result["answers"]
    assert [(a["category"], a["temperature"]) for a in answers] == [
        ("chat", 0),
        ("code", 0),
        ("chat", 0.7),
        ("code", 0.7),
    ]
    assert all(a["rounds"] >= 1 and 1 <= a["tokens"] <= 6 for a in answers), answers
    for figures in result["figures"].values():
        assert all(1.0 <= figures[c] <= 7.0 for c in ("chat", "code", "all")), figures
        assert all(figures[c] is None for c in ("math", "qa", "summarization", "writing")), figures
    assert "| 0.7 |" in (tmp_path / "accept.md").read_text()
