"""Several rounds per Verify (SchedulerConfig.rounds_per_call, VerifyRequest.rounds): the real scheduler, the
gateway's verifier client and the verifier's DraftChain with its bookkeeping (services/verifier/rounds.py),
over the fake engines of tests/test_overlap.py, whose tokens are known in advance: every tree proposes the
next 3 tokens of the sequence's count-up and the fake verifier accepts 2 of them, so each round commits 3.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from common.policy import PLAIN, CyclePolicy, Shape
from services.gateway.__main__ import GatewayConfig
from services.gateway.metrics import Metrics
from services.gateway.scheduler import Scheduler, SchedulerConfig
from services.gateway.sequence import Finish
from specdec.v1 import internal_pb2 as pb
from tests.test_overlap import DRAFT, FIXED, FakeDraft, FakeVerifier, FollowingDraft, FollowingVerifier, count_up


async def _run(
    requests,
    rounds: int,
    draft=None,
    verifier=None,
    metrics=None,
    stagger=0.0,
    cfg=None,
    policy=FIXED,
    pins=(),
    arrive=None,
):
    """requests: (last prompt token, max_tokens, stop token ids, prompt length); pins: each request's pinned
    tree (GenRequest.tree; missing: none); request i starts after i x stagger seconds, or once arrive[i] (an
    asyncio.Event) is set. Returns (tokens, finish) per request and the call log."""
    log: list = []
    draft = draft or FakeDraft(log)
    draft.log = log
    verifier = verifier or FakeVerifier(log, 2, draft)
    verifier.log = log
    cfg = cfg or SchedulerConfig(max_active=4, draft_address=DRAFT, rounds_per_call=rounds)
    sched = Scheduler(verifier, draft, cfg, policy, metrics)
    sched.start()

    async def one(i: int, first: int, max_tokens: int, stops: frozenset[int], n: int):
        if arrive and i in arrive:
            await arrive[i].wait()
        else:
            await asyncio.sleep(i * stagger)
        gen = count_up(first, n, max_tokens, stop_token_ids=stops, tree=pins[i] if i < len(pins) else None)
        tokens = [t async for d in sched.generate(gen) for t in d.token_ids]
        return tokens, gen.finish, gen.stats.rounds

    outs = await asyncio.gather(*(one(i, *r) for i, r in enumerate(requests)))
    await sched.stop()
    return outs, log


def _calls(log: list) -> list[list[str]]:
    return [e[1] for e in log if e[0] == "verify"]


def test_four_rounds_a_call_and_max_tokens_mid_call() -> None:
    """gw-0 (10 tokens: the prefill's, then 3 rounds) stops at its budget in round 3 of the first call while
    gw-1 runs all 4; gw-1's second call stops it at its budget in round 3. Engine rounds: [0 1] x3, [1],
    then [1] x3; two Verify calls instead of seven; the draft gets each outcome but those of the rounds
    that finished a sequence."""
    m = Metrics()
    outs, log = asyncio.run(_run([(100, 10, frozenset(), 2), (200, 22, frozenset(), 2)], 4, metrics=m))
    assert outs[0] == (list(range(101, 111)), Finish.LENGTH, 3)
    assert outs[1] == (list(range(201, 223)), Finish.LENGTH, 7)
    both, one = ["gw-0", "gw-1"], ["gw-1"]
    assert _calls(log) == [both, both, both, one, one, one, one]
    assert [e[1] for e in log if e[0] == "chained"] == [one]  # the second call: gw-1's tree waited there
    assert [e[1] for e in log if e[0] == "propose"] == [both, both, both, one, one, one, one]
    get = m.registry.get_sample_value
    assert get("specdec_spec_decode_num_drafts_total") == 10  # every round counted, not every call
    assert get("specdec_spec_decode_num_accepted_tokens_total") == 20
    assert get("specdec_round_seconds_count", {"phase": "total"}) == 7  # per round, not per call
    assert get("specdec_verify_calls_total") == 2


def test_the_budget_cuts_a_rounds_tokens() -> None:
    """max_tokens 9: the third round accepts 3 tokens of which 2 fit; nothing past them is streamed."""
    outs, log = asyncio.run(_run([(100, 9, frozenset(), 2)], 4))
    assert outs[0] == (list(range(101, 110)), Finish.LENGTH, 3)
    assert len(_calls(log)) == 3


def test_a_stop_token_in_round_two_of_four_while_the_other_runs_on() -> None:
    """gw-0 commits its stop token 106 in round 2 (tokens after it dropped) and sits out rounds 3 and 4 of
    the call, which gw-1 runs alone."""
    outs, log = asyncio.run(_run([(100, 30, frozenset({106}), 2), (200, 13, frozenset(), 2)], 4))
    assert outs[0] == (list(range(101, 107)), Finish.STOP, 2)
    assert outs[1] == (list(range(201, 214)), Finish.LENGTH, 4)
    assert _calls(log) == [["gw-0", "gw-1"], ["gw-0", "gw-1"], ["gw-1"], ["gw-1"]]


def test_draft_failure_mid_call_commits_the_rounds_before_and_catches_up() -> None:
    """The draft's third call (after round 2) fails: the call answers rounds 1 and 2's tokens with
    draft_error, the gateway commits them, decodes plainly and catches the draft up; every token exact."""
    log: list = []
    draft = FollowingDraft(log, fail_call=3)
    verifier = FollowingVerifier(log, 2, draft)
    cfg = SchedulerConfig(max_active=4, plain_steps=2, draft_retry_s=0.003, draft_address=DRAFT, rounds_per_call=4)
    outs, log = asyncio.run(
        _run([(100, 30, frozenset(), 2), (200, 30, frozenset(), 2)], 4, draft=draft, verifier=verifier, cfg=cfg)
    )
    assert [o[0] for o in outs] == [list(range(101, 131)), list(range(201, 231))]
    failed = log.index(("draft-failed", ["gw-0", "gw-1"]))
    assert _calls(log[:failed]) == [["gw-0", "gw-1"]] * 2  # rounds 1 and 2 of the first call
    after = log[failed:]
    assert after[1][0] == "decode"  # no third round: plain decoding next
    assert after.index(("features", ["gw-0", "gw-1"])) > 0  # then the catch-up
    assert any(e[0] == "chained" for e in after)  # and chained rounds again


def test_calls_keep_their_rounds_while_a_prompt_is_prefilled() -> None:
    """A 10-token prompt arriving mid-run (as the running sequence's second Verify begins) goes in chunks of 4,
    4, 2, each beside a call of the running sequence (Scheduler._start_prefill), which keeps asking for four
    rounds a call: its rounds do not wait for the joiner's prompt, nor the prompt for them. Both outputs exact.
    (The arrival is tied to the call, not to a clock: at a fixed 50 ms, a loaded CI machine's slower rounds had it
    land in a call's last round, with one round before the next chunk.)"""
    log: list = []
    draft = FakeDraft(log)
    verifier = FakeVerifier(log, 2, draft)
    asked = counting(verifier)
    second_call = asyncio.Event()
    counted = verifier.streamed

    async def streamed(request: pb.VerifyRequest, early=None) -> pb.VerifyResponse:
        if len(asked) == 1:  # counted appends this call's rounds next: the second call begins
            second_call.set()
        return await counted(request, early)

    verifier.streamed = streamed
    cfg = SchedulerConfig(max_active=4, draft_address=DRAFT, rounds_per_call=4, prefill_chunk=4)
    reqs = [(100, 40, frozenset(), 2), (300, 10, frozenset(), 10)]
    outs, log = asyncio.run(_run(reqs, 4, draft=draft, verifier=verifier, cfg=cfg, arrive={1: second_call}))
    assert [o[0] for o in outs] == [list(range(101, 141)), list(range(301, 311))]
    chunks = [i for i, e in enumerate(log) if e[0] == "prefill" and e[1] == "gw-1"]
    assert [log[i][2:] for i in chunks] == [(4, True), (4, True), (2, False)]
    assert asked == [4] * len(asked)  # every Verify, the ones beside the chunks too
    between = [e[1] for e in log[chunks[0] : chunks[1]] if e[0] == "verify"]
    assert len(between) > 1 and all(c == ["gw-0"] for c in between)  # a call of several rounds meanwhile
    assert _calls(log[: chunks[0]]).count(["gw-0"]) >= 2  # alone before it arrived: calls of several rounds


def counting(verifier: FakeVerifier) -> list[int]:
    """The rounds each Verify call of `verifier` (any of the fakes) asks for, appended as the calls come."""
    asked: list[int] = []
    call = verifier.streamed

    async def counted(request: pb.VerifyRequest, early=None) -> pb.VerifyResponse:
        asked.append(request.rounds)
        return await call(request, early)

    verifier.streamed = counted
    return asked


def test_one_round_per_call_is_todays_protocol() -> None:
    """rounds_per_call 1: every Verify asks for one round (rounds 0 on the wire) and carries no stop rules."""
    log: list = []
    draft = FakeDraft(log)
    verifier = FakeVerifier(log, 2, draft)
    asked = counting(verifier)
    outs, log = asyncio.run(_run([(100, 10, frozenset(), 2)], 1, draft=draft, verifier=verifier))
    assert outs[0] == (list(range(101, 111)), Finish.LENGTH, 3)
    assert asked == [0, 0, 0]


def test_pinned_trees_run_several_rounds_a_call() -> None:
    """Every request pins its tree and the policy says plain (it has nobody to choose for): the pinned
    trees are drafted, so the calls still run four rounds (they ran one each before 2026-11-25: the rule
    read the policy's PLAIN as every sequence's next tree). A request of the policy's beside a pinned one
    makes the calls one round again (its next tree is plain)."""
    log: list = []
    draft = FakeDraft(log)
    verifier = FakeVerifier(log, 2, draft)
    asked = counting(verifier)
    cfg = SchedulerConfig(max_active=4, draft_address=DRAFT, rounds_per_call=4)
    pinned = CyclePolicy([PLAIN])
    outs, _ = asyncio.run(
        _run([(100, 20, frozenset(), 2)], 4, draft=draft, verifier=verifier, cfg=cfg, policy=pinned, pins=[Shape(1, 3)])
    )
    assert outs[0][0] == list(range(101, 121))
    assert asked == [4, 4]  # 1 token from the prefill, 3 a round: 4 rounds (13), then 3 (20)
    log2: list = []
    draft2 = FollowingDraft(log2)
    mixed = FollowingVerifier(log2, 2, draft2)
    asked = counting(mixed)
    reqs = [(100, 20, frozenset(), 2), (200, 20, frozenset(), 2)]
    outs, _ = asyncio.run(_run(reqs, 4, draft=draft2, verifier=mixed, cfg=cfg, policy=pinned, pins=[Shape(1, 3), None]))
    assert [o[0] for o in outs] == [list(range(101, 121)), list(range(201, 221))]
    # one round a call (0 on the wire) while the policy's request decodes plainly (1 + 8 + 8 + 3 tokens: three
    # rounds), then the pinned one alone (1 + 3 x 3 = 10 tokens so far) runs four rounds a call again
    assert asked == [0, 0, 0, 4]


@pytest.mark.parametrize(
    "kw, device, k",
    [
        ({}, "cuda:0", 4),  # auto on a GPU
        ({}, "cpu", 1),  # auto on a CPU
        ({"groups": 2}, "cuda:0", 4),  # auto with two round groups: a Verify stream each
        ({"rounds_per_call": 3, "groups": 2}, "cuda:0", 3),  # asked for: kept
        ({"rounds_per_call": 2}, "cpu", 2),
    ],
)
def test_gateway_rounds_per_call_auto(kw, device, k):
    cfg = GatewayConfig(address="127.0.0.1:0", verifier="v", draft="d", model=Path("m"), **kw)
    assert cfg.rounds_for(device) == k


def test_gateway_park_after_defaults_to_never_and_is_checked():
    """--park-after (0 = the draft follows plain rounds for ever) is a typed config value: negative is refused."""
    assert GatewayConfig(address="127.0.0.1:0", verifier="v", draft="d", model=Path("m")).park_after == 0
    with pytest.raises(ValueError, match="park_after"):
        GatewayConfig(address="127.0.0.1:0", verifier="v", draft="d", model=Path("m"), park_after=-1)
    with pytest.raises(ValueError, match="park_after"):
        SchedulerConfig(max_active=4, park_after=-1)
