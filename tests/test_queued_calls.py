"""Queued calls (SchedulerConfig.queue_calls, VerifyItem.follows): the gateway sends a group's next Verify
before the last one is answered, and the verifier, answering a stream's calls in order, goes from one to
the next without waiting for the gateway's hop and host work. The real scheduler, verifier client and
chain bookkeeping over the fakes of tests/test_overlap.py (hand-worked count-up tokens, features that must
line up with the tokens), with a verifier that answers its calls one after the other, as VerifyStream
does. Hand-computed: every committed token, which rounds the verifier runs, when a finished sequence is
released, and what a draft failure under a queued call costs."""

from __future__ import annotations

import asyncio
import collections

import pytest

from common.config import SamplingConfig
from common.policy import FixedPolicy, Shape
from common.rpc import start_server
from services.clients import Verified, VerifiedRound, VerifierClient
from services.gateway.detokenize import RoundDecoder
from services.gateway.metrics import REQUEST_STAGES, Metrics
from services.gateway.scheduler import Active, Call, Said, Scheduler, SchedulerConfig
from services.gateway.sequence import Finish, Generation, GenRequest
from services.verifier.server import answers_in_order
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc
from tests.test_overlap import DRAFT, EOS, FollowingDraft, FollowingVerifier, Ids, streamed

CHAIN = FixedPolicy(Shape(1, 3))  # every round drafts a 3-token chain; the verifier accepts `accept` of it


class InOrderVerifier(FollowingVerifier):
    """Answers its Verify calls one at a time in the order they were sent, through the verifier's own
    VerifyStream loop (services.verifier.server.answers_in_order: read ahead, a `cut` request ends the call
    in flight), logging when each was sent (with its items' `follows`), when it was answered, and every
    verified outcome."""

    def __init__(self, log: list, accept: int, draft, round_s: float = 0.0) -> None:
        super().__init__(log, accept, draft)
        self.released: set[str] = set()
        self.round_s = round_s  # each round's engine time (the call's own 5 ms come on top)
        self.release_s = 0.0  # a Release's time before its slots are free
        self.prefill_s = 0.0  # a Prefill's time
        self.begun = 0  # calls begun
        self.beginning: dict[int, asyncio.Event] = {}  # call number -> set when it begins
        self.honour_cut = True  # False: a verifier that runs every call's rounds whatever comes behind it
        self._sent: asyncio.Queue = asyncio.Queue()  # (request, its caller's future), in the order sent
        self._answering: collections.deque = collections.deque()  # the futures of the requests read, in order
        self._stream: asyncio.Task | None = None

    async def _engine_verify(self, request, failed, chained):
        await asyncio.sleep(self.round_s)
        return await super()._engine_verify(request, failed, chained)

    async def _verify_call(self, request, early=None):
        ids = [it.seq_id for it in request.items]
        self.log.append(("sent", ids, [it.follows for it in request.items]))
        if self._stream is None:
            self._stream = asyncio.ensure_future(self._serve())
        answer = asyncio.get_running_loop().create_future()
        self._sent.put_nowait((request, answer, early))
        resp = await answer
        self.log.append(("answered", ids, [list(r.accepted_tokens) for r in resp.results]))
        return resp

    async def _serve(self) -> None:
        async def requests():
            while True:
                request, answer, early = await self._sent.get()
                self._answering.append((answer, early))
                yield request

        async for outcome in answers_in_order(requests(), self._answer):
            if not isinstance(outcome, BaseException) and outcome.early:  # to the call's callback, as the client
                answer, early = self._answering[0]
                self.log.append(("early", [r.seq_id for r in outcome.results]))
                if early is not None and not answer.done():
                    early(outcome)
                continue
            answer, _ = self._answering.popleft()
            if answer.done():  # its caller left
                continue
            if isinstance(outcome, BaseException):
                answer.set_exception(outcome)
            else:
                answer.set_result(outcome)

    async def _answer(self, request, cut: asyncio.Event, early):
        """One call, as the verifier's _touched_verify: the call's outcome, or the exception it raised."""
        try:
            self.begun += 1
            self.beginning.setdefault(self.begun, asyncio.Event()).set()
            self.chain.check(request)
            if any(it.chained for it in request.items):
                self.log.append(("chained", [it.seq_id for it in request.items if it.chained]))
            # as the verifier's _gone: a follows item whose sequence was released is not verified
            gone = frozenset(it.seq_id for it in request.items if it.follows and it.seq_id in self.released)
            resp = await self.chain.verify(
                request, self._engine_verify, self.room, gone, cut if self.honour_cut else None, early
            )
            self.log.append(("ran", resp.rounds_run))
            await asyncio.sleep(0.005)  # a call takes time on the GPU (the gateway's work overlaps it)
            return resp
        except Exception as e:  # noqa: BLE001 - handed to its caller, as the stream answers a failed call
            return e

    async def prefill_many(self, items, owner="", draft=""):
        await asyncio.sleep(self.prefill_s)
        return await super().prefill_many(items, owner, draft)

    async def release(self, seq_ids: list[str]) -> None:
        self.released.update(seq_ids)
        await asyncio.sleep(self.release_s)
        await super().release(seq_ids)

    def accepted(self, seq_id: str, tokens: list[int]) -> None:
        """A real verifier would have freed the slot: a verify after the release is logged, never expected."""
        super().accepted(seq_id, tokens)
        self.log.append(("accepted", seq_id, tokens))
        if seq_id in self.released:
            self.log.append(("verified-after-release", seq_id))


def _queued(
    requests: list[tuple[int, int]],
    accept: int,
    k: int = 1,
    fail_call: int = 0,
    queue: bool = True,
    stagger: float = 0.0,
    round_s: float = 0.0,
    after_call: int = 0,
    max_active: int = 4,
    release_s: float = 0.0,
    honour_cut: bool = True,
    delays: list[float] | None = None,
    prefill_s: float = 0.0,
    early: bool = True,
):
    """Requests (last prompt token, max_tokens), prompts [first - 1, first], the i-th sent after i x stagger
    seconds, or after delays[i] (after_call: the requests with a delay are sent that long after the
    verifier began that call), through the scheduler with queued calls, each verifier round taking round_s;
    returns (tokens per request, log, metrics). The log also has ("arrived", first) when a request is sent
    and ("final", first) when its last delta arrives."""

    async def run():
        log: list = []
        draft = FollowingDraft(log, fail_call)
        metrics = Metrics()
        cfg = SchedulerConfig(
            max_active=max_active,
            draft_address=DRAFT,
            rounds_per_call=k,
            queue_calls=queue,
            draft_retry_s=0.01,
            early_answers=early,
        )
        verifier = InOrderVerifier(log, accept, draft, round_s)
        verifier.release_s, verifier.honour_cut, verifier.prefill_s = release_s, honour_cut, prefill_s
        sched = Scheduler(verifier, draft, cfg, CHAIN, metrics)
        sched.start()

        async def one(first: int, max_tokens: int, delay: float) -> list[int]:
            if after_call and delay:
                await verifier.beginning.setdefault(after_call, asyncio.Event()).wait()
            await asyncio.sleep(delay)
            req = GenRequest(prompt_ids=[first - 1, first], max_tokens=max_tokens, sampling=SamplingConfig())
            gen = Generation(request=req, decoder=RoundDecoder(Ids()), eos_token_id=EOS)
            log.append(("arrived", first))
            deltas = []
            async for d in sched.generate(gen):
                deltas.append(d)
                if d.finish is not None:
                    log.append(("final", first))
            return streamed(deltas)

        waits = delays or [i * stagger for i in range(len(requests))]
        outs = await asyncio.gather(*(one(f, m, d) for (f, m), d in zip(requests, waits)))
        await sched.stop()
        assert not [e for e in log if e[0] == "verified-after-release"]
        return outs, log, metrics

    return asyncio.run(run())


def test_a_finished_requests_last_delta_goes_out_when_its_call_is_taken() -> None:
    """gw-0 (max_tokens 4, 3 of 3 accepted) finishes in call 1, taken after call 2 was sent: its last delta
    reaches its client right then, before call 3 is sent (its client's next request need not wait a call
    for it); the others' text still goes out while the next call runs."""
    outs, log, _ = _queued([(100, 4), (200, 30)], accept=3)
    assert outs == [list(range(101, 105)), list(range(201, 231))]
    sent = [i for i, e in enumerate(log) if e[0] == "sent"]
    assert sent[1] < log.index(("final", 100)) < sent[2]


@pytest.mark.parametrize("early", [True, False])
def test_a_sequence_a_round_stops_gets_its_last_tokens_before_its_call_ends(early: bool) -> None:
    """4 rounds a call, 2 of 3 drafted tokens accepted (3 committed a round). gw-0 (max_tokens 7): 101 from
    its prefill, 102-104 in round 1 and 105-107 in round 2, where its budget stops it while gw-1 runs rounds
    3 and 4. With early answers its last delta reaches its client after round 2, before call 1 is answered;
    without, after. Either way every token exact and every round counted once: gw-0 2, gw-1 10 (29 tokens
    after its first, 3 a round, the last cut to 2)."""
    outs, log, metrics = _queued([(100, 7), (200, 30)], accept=2, k=4, early=early)
    assert outs == [list(range(101, 108)), list(range(201, 231))]
    first = next(i for i, e in enumerate(log) if e[0] == "answered")
    assert log[first][2] == [list(range(102, 108)), list(range(202, 214))]  # the call's answer has both
    assert (log.index(("final", 100)) < first) == early
    assert [e[1] for e in log if e[0] == "early"] == ([["gw-0"]] if early else [])
    assert metrics.registry.get_sample_value("specdec_spec_decode_num_drafts_total") == 12


def test_an_early_answer_waits_for_the_call_before_it_to_be_taken() -> None:
    """Call 2's early answer (gw-0's 105 106) comes while call 1's answer (102-104) is not taken yet: it
    is kept, and taken right after call 1's, so the tokens stay in order; call 2's own answer then skips
    gw-0 (its rounds counted once: 1 + 1)."""

    async def run():
        sched = Scheduler(None, None, SchedulerConfig(rounds_per_call=4, queue_calls=True), CHAIN, Metrics())
        req = GenRequest(prompt_ids=[99, 100], max_tokens=6, sampling=SamplingConfig())
        a = Active("gw-0", Generation(request=req, decoder=RoundDecoder(Ids()), eos_token_id=EOS), asyncio.Queue())
        a.gen.commit([101])  # its first token, from the prefill
        a.calls, a.first_call_at = 2, 0.0
        loop = asyncio.get_running_loop()
        calls = []
        for _ in range(2):
            call = Call(loop.create_future(), [a], set(), Shape(1, 3), Shape(1, 3), 0.0, 0.0, 0.0, 4, Said())
            calls.append(call)
        sched._untaken[0] = collections.deque(calls)
        two = Verified(tokens=[105, 106], hidden=pb.TensorRef(), nodes=3, accepted=[1], round_nodes=[3])
        sched._took_early(0, calls[1].said, [("gw-0", two)])
        kept = list(a.gen.token_ids)
        one = Verified(tokens=[102, 103, 104], hidden=pb.TensorRef(), nodes=3, accepted=[2], round_nodes=[3])
        calls[0].task.set_result(VerifiedRound([one], compute_s=0.001))
        await sched._answered(0, calls[0], 0.0, True)
        after_one = list(a.gen.token_ids)
        calls[1].task.set_result(VerifiedRound([two], compute_s=0.001, rounds=1))
        await sched._answered(0, calls[1], 0.0, False)
        return kept, after_one, list(a.gen.token_ids), a.gen.finish, a.gen.stats.rounds, a.rule_stopped

    kept, after_one, tokens, finish, rounds, stopped = asyncio.run(run())
    assert kept == [101]  # not taken before call 1's answer
    assert after_one == tokens == [101, 102, 103, 104, 105, 106]
    assert (finish, rounds, stopped) == (Finish.LENGTH, 2, True)


def test_a_request_arriving_during_a_call_is_prefilled_beside_it() -> None:
    """gw-1 arrives 20 ms into gw-0's calls (5 ms each): it is admitted and its prefill call goes out before
    the call in flight is answered, not after (the loop would reach it only then); both exact."""
    outs, log, _ = _queued([(100, 60), (200, 12)], accept=2, stagger=0.02)
    assert outs == [list(range(101, 161)), list(range(201, 213))]
    arrived = log.index(("arrived", 200))
    answered = next(i for i, e in enumerate(log) if i > arrived and e[0] == "answered")
    assert arrived < log.index(("prefill-call", ["gw-1"])) < answered


@pytest.mark.parametrize("long_prompt", [False, True])
def test_a_joiners_first_tree_is_asked_for_by_its_prefill_and_waits_at_the_verifier(long_prompt, monkeypatch) -> None:
    """gw-1 arrives 20 ms into gw-0's calls, when its group's next shape is chosen: its prefill asks the
    verifier for its first tree (PrefillItem.next_nodes; the fake verifier sends the start item through
    its chain, as the real one does), so the gateway makes no propose of its own for it, and its first
    Verify names it chained. gw-0, the first request, had no shape to ask for: its first tree came from
    the gateway. A prompt longer than CHAINED_FIRST_TREE_TOKENS (here 1: the prompts have 2) gets its first
    tree from the gateway and is not chained in its first Verify. Both exact (the draft checks every feature
    row against the tokens)."""
    if long_prompt:
        monkeypatch.setattr("services.gateway.scheduler.CHAINED_FIRST_TREE_TOKENS", 1)
    outs, log, _ = _queued([(100, 60), (200, 12)], accept=2, stagger=0.02)
    assert outs == [list(range(101, 161)), list(range(201, 213))]
    assert (("first-tree", "gw-1") in log) != long_prompt and ("first-tree", "gw-0") not in log
    first_call = next(e for e in log if e[0] == "sent" and "gw-1" in e[1])
    chained = [e[1] for e in log[log.index(first_call) :] if e[0] == "chained"][:1]
    assert ("gw-1" in chained[0]) != long_prompt if chained else long_prompt


def test_a_request_that_ends_with_its_first_token_asks_for_no_first_tree() -> None:
    """gw-1 (max_tokens 1) arrives when its group's next shape is chosen, as in the test above: its first
    token ends it, so its prefill asks the draft for nothing (a pass over its prompt would be wasted, and the
    draft's other work would wait for it) and no Verify names it."""
    outs, log, _ = _queued([(100, 60), (200, 1)], accept=2, stagger=0.02)
    assert outs == [list(range(101, 161)), [201]]
    assert ("first-tree", "gw-1") not in log
    assert not [e for e in log if e[0] == "sent" and "gw-1" in e[1]]


def test_a_prompt_arriving_during_a_prefill_goes_in_when_that_prefill_is_over() -> None:
    """4 rounds a call, 30 ms a round, prefills of 10 ms: gw-1 arrives 3 ms into call 2 and is prefilled at
    once; gw-2 arrives 3 ms later, while gw-1's prefill runs. gw-2's prefill call goes out when gw-1's is
    over, before call 2 is answered (the loop would reach it only after that answer: a call later). Each
    request passes every stage of its way into the rounds once (Metrics.stage); all exact."""
    outs, log, metrics = _queued(
        [(100, 150), (200, 12), (300, 12)], accept=2, k=4, round_s=0.03, after_call=2, delays=[0, 0.003, 0.006],
        prefill_s=0.01,
    )  # fmt: skip
    assert outs == [list(range(101, 251)), list(range(201, 213)), list(range(301, 313))]
    arrived = log.index(("arrived", 300))
    answered = next(i for i, e in enumerate(log) if i > arrived and e[0] == "answered")
    assert arrived < log.index(("prefill-call", ["gw-2"])) < answered, log[arrived:answered]
    count = metrics.registry.get_sample_value
    assert [count("specdec_request_stage_seconds_count", {"stage": s}) for s in REQUEST_STAGES] == [3] * 5


@pytest.mark.parametrize("hold", [True, False])
def test_a_request_arriving_early_in_a_call_joins_the_next_call(hold: bool, monkeypatch) -> None:
    """4 rounds a call, 30 ms a round: gw-1 arrives 3 ms after the verifier began call 4. The gateway holds
    the queued call 5 until about a round before call 4's last round (scheduler._hold, from the rounds'
    mean time), so gw-1's prefill and first tree, done meanwhile, go in call 5. Without the hold (the
    margin as long as a call) call 5 went out when call 4 began, and gw-1's first call is 6. Both exact."""
    if not hold:
        monkeypatch.setattr("services.gateway.scheduler.HOLD_MARGIN_S", 1.0)
    outs, log, _ = _queued([(100, 80), (200, 12)], accept=2, k=4, stagger=0.003, round_s=0.03, after_call=4)
    assert outs == [list(range(101, 181)), list(range(201, 213))]
    sent = [e[1] for e in log if e[0] == "sent"]
    first = next(i for i, ids in enumerate(sent, 1) if "gw-1" in ids)
    assert first == (5 if hold else 6), sent


@pytest.mark.parametrize("honour_cut", [True, False])
def test_a_joiner_cuts_the_call_in_flight_short(honour_cut: bool) -> None:
    """4 rounds a call, 30 ms a round: gw-1 arrives 3 ms after the verifier began call 4 and is ready (prompt
    and first tree in) a few ms later. The gateway sends call 5 with it at once, marked `cut`: call 4 stops
    after its current round (it runs 1, 2 at the most, not 4), gw-0 goes on in call 5 (follows) and gw-1 is
    first verified there. A verifier that ignores `cut` runs call 4's 4 rounds and gw-1 waits for them. Both
    exact."""
    outs, log, _ = _queued(
        [(100, 80), (200, 12)], accept=2, k=4, stagger=0.003, round_s=0.03, after_call=4, honour_cut=honour_cut
    )
    assert outs == [list(range(101, 181)), list(range(201, 213))]
    ran = [e[1] for e in log if e[0] == "ran"]
    sent = [e for e in log if e[0] == "sent"]
    first = next(i for i, e in enumerate(sent, 1) if "gw-1" in e[1])
    assert first == 5 and sent[4][2] == [True, False], sent  # gw-0 follows call 4, gw-1 is new
    assert ran[3] <= 2 if honour_cut else ran[3] == 4, ran


def test_one_joiner_does_not_cut_a_call_that_17_sequences_go_on_in() -> None:
    """As above, but 17 sequences run when gw-17 arrives 3 ms into call 4: one joiner is not 1/16 of them
    (common.rounds.cut_pays), so call 4 runs its 4 rounds and the hold sends call 5, with gw-17, about a round
    before call 4's last round. All exact."""
    requests = [(100 * (i + 1), 80) for i in range(17)] + [(1900, 12)]
    outs, log, _ = _queued(
        requests, accept=2, k=4, round_s=0.03, after_call=4, max_active=18, delays=[0.0] * 17 + [0.003]
    )
    assert outs == [list(range(f + 1, f + 1 + m)) for f, m in requests]
    ran = [e[1] for e in log if e[0] == "ran"]
    first = next(i for i, e in enumerate((e for e in log if e[0] == "sent"), 1) if "gw-17" in e[1])
    assert first == 5 and ran[3] == 4, (first, ran)


@pytest.mark.parametrize("max_active", [2, 4])
def test_a_new_prefill_waits_for_a_release_only_when_the_slots_are_full(max_active: int) -> None:
    """gw-0 finishes in its first call and its Release takes 200 ms; gw-2 arrives 60 ms in, beside gw-1. With 4
    slots (2 running + 1 being released <= 4) its prefill goes out at once; with 2 it waits for the release
    (the verifier would refuse a third sequence). Both exact."""
    outs, log, _ = _queued(
        [(100, 4), (200, 40), (300, 4)], accept=2, stagger=0.03, max_active=max_active, release_s=0.2
    )
    assert outs == [list(range(101, 105)), list(range(201, 241)), list(range(301, 305))]
    prefill, released = log.index(("prefill-call", ["gw-2"])), log.index(("release-verifier", ["gw-0"]))
    assert (prefill < released) == (max_active == 4), log


def _in_flight(log: list) -> int:
    """The most Verify calls sent and not yet answered at one moment."""
    most = now = 0
    for e in log:
        now += {"sent": 1, "answered": -1}.get(e[0], 0)
        most = max(most, now)
    return most


@pytest.mark.parametrize("k", [1, 3])
def test_queued_calls_keep_every_token_and_the_next_call_waits_at_the_verifier(k: int) -> None:
    """Two sequences, 2 of 3 drafted tokens accepted a round (3 committed): every token exact (the features
    the draft gets line up with them, FollowingDraft), and from the second call on each Verify was sent while
    the one before was in flight, its items `follows`. Without queued calls, never two in flight."""
    outs, log, _ = _queued([(100, 30), (200, 30)], accept=2, k=k)
    assert outs == [list(range(101, 131)), list(range(201, 231))]
    sent = [e for e in log if e[0] == "sent"]
    assert _in_flight(log) == 2
    assert sent[0][2] == [False, False] and all(e[2] == [True] * len(e[1]) for e in sent[1:])
    outs, log, _ = _queued([(100, 30), (200, 30)], accept=2, k=k, queue=False)
    assert outs == [list(range(101, 131)), list(range(201, 231))]
    assert _in_flight(log) == 1 and not any(any(e[2]) for e in log if e[0] == "sent")


def test_a_sequence_its_call_stopped_is_not_verified_again_by_the_queued_one() -> None:
    """max_tokens 12, 2 tokens a round (1 of 3 accepted), 3 rounds a call. The prefill gives 101; call 1
    commits 102-107 (7 of 12). Call 2 was sent before call 1 was answered, with the budget as it was then
    (11): the verifier subtracts call 1's 6 and stops after 5 (108-112; its third round verified, cut).
    Call 3, sent before call 2 was answered, names the sequence again: the verifier answers it with
    nothing and verifies nothing. So 6 rounds verified, not 9, and 6 group rounds counted (call 3 ran none).
    Call 2's rules finished it, so it is released when call 2 is taken, before call 3 is answered (the
    verifier answers the released sequence's follows item with nothing)."""
    outs, log, metrics = _queued([(100, 12)], accept=1, k=3)
    assert outs == [list(range(101, 113))]
    assert [e[2] for e in log if e[0] == "accepted"] == [[102 + 2 * i, 103 + 2 * i] for i in range(6)]
    answered = [e for e in log if e[0] == "answered"]
    assert [e[2] for e in answered] == [[list(range(102, 108))], [list(range(108, 113))], [[]]]
    assert log.index(answered[1]) < log.index(("release-verifier", ["gw-0"])) < log.index(answered[2])
    assert metrics.registry.get_sample_value("specdec_policy_tree_nodes_count") == 6


def test_a_sequence_finishing_under_a_queued_call_leaves_the_others_their_tokens() -> None:
    """gw-0 (max_tokens 4) finishes in its first call (3 of 3 accepted and the bonus: 102-105, cut at 104);
    the queued call names it first and answers it with nothing, and gw-1's result after it is gw-1's own
    (the skipped item keeps its place); gw-1 goes on alone, exact."""
    outs, log, _ = _queued([(100, 4), (200, 13)], accept=3)
    assert outs == [list(range(101, 105)), list(range(201, 214))]
    assert [e[2] for e in log if e[0] == "accepted" and e[1] == "gw-0"] == [[102, 103, 104, 105]]
    both = [e for e in log if e[0] == "answered" and e[1] == ["gw-0", "gw-1"]]
    assert [e[2] for e in both] == [[[102, 103, 104], [202, 203, 204, 205]], [[], [206, 207, 208, 209]]]
    assert any(e[0] == "sent" and e[1] == ["gw-1"] for e in log)


def test_a_draft_failure_under_a_queued_call_is_one_failure_and_the_tokens_stay_exact() -> None:
    """The draft's 3rd call fails (the proposal chained after call 2): call 3 was sent before that, so its
    items find no tree (draft_error, no tokens) and so do those of call 4 behind it. The gateway counts the
    failure once, decodes the sequences plainly, catches the draft up (Features) and chains again; every
    token exact (the plain rounds' features too: the draft checks them)."""
    outs, log, metrics = _queued([(100, 120), (200, 120)], accept=2, fail_call=3)  # long enough to catch up
    assert outs == [list(range(101, 221)), list(range(201, 321))]
    assert metrics.registry.get_sample_value("specdec_draft_failures_total") == 1
    failed = log.index(("draft-failed", ["gw-0", "gw-1"]))
    after = log[failed:]
    assert any(e[0] == "decode" for e in after) and ("features", ["gw-0", "gw-1"]) in after
    assert any(e[0] == "chained" for e in after[after.index(("features", ["gw-0", "gw-1"])) :])


class OrderedStream(pb_grpc.VerifierServicer):
    """A VerifyStream that answers in order, as the verifier does, each answer tagged with its request's
    `rounds`; it holds its first answer until `hold` requests have arrived, and ends the stream when a
    request asks for 13 rounds."""

    def __init__(self, hold: int) -> None:
        self.hold, self.seen = hold, []
        self.arrived = asyncio.Event()

    async def VerifyStream(self, request_iterator, context):
        pending: asyncio.Queue = asyncio.Queue()

        async def take_in():
            async for req in request_iterator:
                self.seen.append(req.rounds)
                if len(self.seen) >= self.hold:
                    self.arrived.set()
                await pending.put(req)

        reader = asyncio.get_running_loop().create_task(take_in())
        try:
            await self.arrived.wait()
            while True:
                req = await pending.get()
                if req.rounds == 13:
                    return
                yield pb.VerifyResponse(rounds_run=req.rounds)
        finally:
            reader.cancel()


async def _served(servicer, test):
    server = await start_server("127.0.0.1:0", [(pb_grpc.add_VerifierServicer_to_server, servicer)], [])
    client = VerifierClient(f"127.0.0.1:{server.port}", timeout=10)
    try:
        return await test(client.streamed)
    finally:
        await client.close()
        await server.server.stop(None)


class CutStream(pb_grpc.VerifierServicer):
    """The verifier's VerifyStream loop (services.verifier.server.answers_in_order) over calls of `rounds`
    rounds of 20 ms each that end early when their cut signal is set before a round, as chain.py's do."""

    async def VerifyStream(self, request_iterator, context):
        async def answer(request: pb.VerifyRequest, cut: asyncio.Event, early) -> pb.VerifyResponse:
            ran = 0
            while ran < request.rounds and not cut.is_set():
                await asyncio.sleep(0.02)
                ran += 1
            return pb.VerifyResponse(rounds_run=ran)

        async for response in answers_in_order(request_iterator, answer):
            yield response


def test_a_call_with_cut_ends_the_call_in_flight_after_its_round_and_only_that_one() -> None:
    """On a real stream: a call of 10 rounds (20 ms each), and 30 ms later one of 3 with `cut`: the first
    ends after its second round (its first when the stream's set-up delayed its start past 10 ms, as on a
    loaded 2-core machine; its third when the cut comes in late), not its tenth; the second runs its 3. A call
    with `cut` that arrives while nothing runs cuts nothing: the next call behind it still runs all its rounds."""

    async def test(call):
        first = asyncio.ensure_future(call(pb.VerifyRequest(rounds=10)))
        await asyncio.sleep(0.03)
        second = await call(pb.VerifyRequest(rounds=3, cut=True))
        alone = await call(pb.VerifyRequest(rounds=2, cut=True))
        return (await first).rounds_run, second.rounds_run, alone.rounds_run

    first, second, alone = asyncio.run(_served(CutStream(), test))
    assert first in (1, 2, 3) and (second, alone) == (3, 2), (first, second, alone)


def test_calls_on_one_stream_overlap_and_each_gets_its_own_answer() -> None:
    """Three calls at once on the gateway's stream client: all three requests reach the service before it
    answers the first (they were written while it was pending), and each call gets its own answer."""

    async def test(call):
        answers = await asyncio.gather(*(call(pb.VerifyRequest(rounds=r)) for r in (1, 2, 3)))
        return [a.rounds_run for a in answers]

    servicer = OrderedStream(hold=3)
    assert asyncio.run(_served(servicer, test)) == [1, 2, 3]
    assert servicer.seen == [1, 2, 3]


def test_a_caller_that_leaves_does_not_take_the_next_calls_answer() -> None:
    """The first of two overlapping calls is cancelled before its answer comes: the second still gets its
    own (the late first answer is dropped), and the stream carries a third."""

    async def test(call):
        first = asyncio.ensure_future(call(pb.VerifyRequest(rounds=1)))
        second = asyncio.ensure_future(call(pb.VerifyRequest(rounds=2)))
        await asyncio.sleep(0.05)
        first.cancel()
        opened = call._stream
        got = (await second).rounds_run
        return got, (await call(pb.VerifyRequest(rounds=3))).rounds_run, call._stream is opened

    assert asyncio.run(_served(OrderedStream(hold=2), test)) == (2, 3, True)


def test_a_stream_ended_under_waiting_calls_fails_them_and_the_next_call_opens_one() -> None:
    """The service ends the stream while two calls wait (the first asked it to): both fail with
    PeerUnavailable, and the next call goes out on a new stream."""

    async def test(call):
        outs = await asyncio.gather(
            call(pb.VerifyRequest(rounds=13)), call(pb.VerifyRequest(rounds=2)), return_exceptions=True
        )
        return [type(o).__name__ for o in outs], (await call(pb.VerifyRequest(rounds=4))).rounds_run

    assert asyncio.run(_served(OrderedStream(hold=2), test)) == (["PeerUnavailable", "PeerUnavailable"], 4)


def test_the_stream_says_how_long_the_verifier_waited_for_each_call() -> None:
    """On a real stream, calls of 2 rounds of 20 ms: a call sent 80 ms after the one before was answered
    finds the verifier idle that long (idle_us >= 70 ms); a call written while the one before runs is
    queued when the loop takes it up (idle_us 0)."""

    async def test(call):
        await call(pb.VerifyRequest(rounds=2))
        await asyncio.sleep(0.08)
        late = await call(pb.VerifyRequest(rounds=2))
        first, queued = await asyncio.gather(call(pb.VerifyRequest(rounds=2)), call(pb.VerifyRequest(rounds=2)))
        return late.idle_us, queued.idle_us

    late, queued = asyncio.run(_served(CutStream(), test))
    assert late >= 70_000 and queued == 0, (late, queued)


@pytest.mark.parametrize(("idle", "starved", "rpc"), [(0.001, 0.0005, 0.0005), (0.5, 0.001, 0.00025)])
def test_the_round_breakdown_splits_the_call_wall_into_the_verifiers_work_its_idle_time_and_the_hops(
    idle: float, starved: float, rpc: float
) -> None:
    """A call of 2 rounds, by hand (seconds): sent 1 ms after its round began, of which the gateway's own
    propose took 0.5; answered 10 ms after it was sent, 0.5 of which went to streaming the call before.
    The verifier reports 8 ms in the call: 4 engine, 2 waiting for trees, so 2 its own. Idle 1 ms before
    it: per round verifier_host 1, starved 0.5, rpc (0.5 before sending + 10 - 4 - 2 - 2 - 1 - 0.5 after)
    / 2 = 0.5. Idle 500 ms (the stream had no calls for a while): only what fits between sending it and
    the verifier's taking it up (10 - 8 = 2 ms) is starved, 1 a round; rpc (0.5 + 0) / 2 = 0.25."""
    m = Metrics()
    sched = Scheduler(None, None, SchedulerConfig(), CHAIN, m)
    v = VerifiedRound([], compute_s=0.004, wait_s=0.002, rounds=2, wall_s=0.008, idle_s=idle)
    sched._time_round(0.0, 0.001, 0.011, 0.0005, v, spoke=0.0005)
    per_round = {
        p: m.registry.get_sample_value("specdec_round_seconds_sum", {"phase": p})
        / m.registry.get_sample_value("specdec_round_seconds_count", {"phase": p})
        for p in ("verify", "draft_wait", "verifier_host", "starved", "rpc")
    }
    assert per_round == pytest.approx(
        {"verify": 0.002, "draft_wait": 0.001, "verifier_host": 0.001, "starved": starved, "rpc": rpc}
    )


class EarlyStream(pb_grpc.VerifierServicer):
    """The verifier's VerifyStream loop over calls of `rounds` rounds of 10 ms, each round but the last
    answering early (as chain.py does for the items it stopped) with a result named after the round."""

    async def VerifyStream(self, request_iterator, context):
        async def answer(request: pb.VerifyRequest, cut: asyncio.Event, early) -> pb.VerifyResponse:
            for r in range(request.rounds):
                await asyncio.sleep(0.01)
                if early is not None and r < request.rounds - 1:
                    early(pb.VerifyResponse(early=True, results=[pb.VerifyResult(seq_id=f"r{r}")]))
            return pb.VerifyResponse(rounds_run=request.rounds)

        async for response in answers_in_order(request_iterator, answer):
            yield response


def test_early_answers_reach_their_own_call_on_a_real_stream() -> None:
    """Five overlapping calls on one stream: the first (2 items, 3 rounds, early) gets its two early answers,
    in order, and then its own answer; the second asks for none and gets none; the third's callback raises,
    which fails that call only; the fourth (one item: nothing to answer early, so not asked) gets none; the
    fifth (one round) is answered on the same stream."""

    async def test(call):
        got: list[list[str]] = []
        opened = []

        def boom(resp: pb.VerifyResponse) -> None:
            raise ValueError("the caller's callback failed")

        two = [pb.VerifyItem(seq_id="a"), pb.VerifyItem(seq_id="b")]
        first = asyncio.ensure_future(
            call(pb.VerifyRequest(items=two, rounds=3, early=True), lambda r: got.append([x.seq_id for x in r.results]))
        )
        second = asyncio.ensure_future(call(pb.VerifyRequest(items=two, rounds=2)))
        third = asyncio.ensure_future(call(pb.VerifyRequest(items=two, rounds=3, early=True), boom))
        one = pb.VerifyRequest(items=two[:1], rounds=3, early=True)
        fourth = asyncio.ensure_future(call(one, lambda r: got.append(["one item"])))
        fifth = asyncio.ensure_future(call(pb.VerifyRequest(rounds=1)))
        await asyncio.sleep(0)
        opened.append(call._stream)
        outs = await asyncio.gather(first, second, third, fourth, fifth, return_exceptions=True)
        kinds = [o.rounds_run if isinstance(o, pb.VerifyResponse) else type(o).__name__ for o in outs]
        return got, kinds, call._stream is opened[0]

    got, kinds, same = asyncio.run(_served(EarlyStream(), test))
    assert got == [["r0"], ["r1"]]
    assert kinds == [3, 2, "ValueError", 3, 1] and same
