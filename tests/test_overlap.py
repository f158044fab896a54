"""The round protocol of services/gateway/scheduler.py and services/verifier/chain.py: the verifier sends
each round's outcome to the draft itself and keeps the next tree, so the draft proposes while the gateway
commits, streams and sends the next round. Pinned with fake draft and verifier engines (no gRPC, no model)
whose answers are worked out by hand: every tree proposes the sequence's next "true" tokens, and the
verifier accepts a fixed number of them per round, so the committed tokens are known in advance. The
scheduler, the gateway's verifier client (message conversion) and the verifier's chain bookkeeping are the
real ones; only the engines and the transport are fake.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np

from common.config import SamplingConfig
from common.policy import PLAIN, CyclePolicy, FixedPolicy, Shape
from services.clients import Batched, Prefilled, VerifierClient, start_item
from services.gateway.detokenize import RoundDecoder
from services.gateway.metrics import Metrics
from services.gateway.scheduler import Active, Scheduler, SchedulerConfig
from services.gateway.sequence import Delta, Generation, GenRequest
from services.tree_wire import draft_tree, unpack
from services.verifier.chain import DraftChain
from specdec.v1 import internal_pb2 as pb

EOS = 0
FIXED = FixedPolicy(Shape(1, 3))  # the fakes' chains: every round drafts, 3 nodes
DRAFT = "fake-draft:1"  # the draft address the scheduler names (the fake verifier's chain connects to it)


class Ids:
    """A tokenizer whose text is the token ids: "101 102 "."""

    def decode(self, ids: list[int]) -> str:
        return "".join(f"{i} " for i in ids)


def streamed(deltas: list[Delta]) -> list[int]:
    """The tokens of a request's deltas, whose text must be theirs (Ids), every round detokenized at once."""
    tokens = [t for d in deltas for t in d.token_ids]
    assert "".join(d.text for d in deltas) == Ids().decode(tokens)
    return tokens


class FakeDraft:
    """Proposes a chain: the next 3 tokens of the sequence's count-up (token t is followed by t + 1)."""

    def __init__(self, log: list) -> None:
        self.log, self.last = log, {}

    def reachable(self) -> bool:
        return True

    async def propose(self, items: list[pb.ProposeItem], owner: str = "") -> Batched:
        self.log.append(("propose", [it.seq_id for it in items]))
        await asyncio.sleep(0.01)  # the round's other work happens meanwhile
        trees = []
        for it in items:
            nxt = it.token_ids[-1] + 1
            trees.append(draft_tree([nxt, nxt + 1, nxt + 2], [-1, 0, 1]))
        self.log.append(("proposed", [it.seq_id for it in items]))
        return Batched(trees, 0.01)

    async def release(self, seq_ids: list[str]) -> None:
        self.log.append(("release-draft", list(seq_ids)))


class FakeVerifier(VerifierClient):
    """The gateway's real verifier client over a fake transport: each VerifyRequest goes through the
    verifier's real DraftChain (connected to `draft`), and the fake engine accepts the first `accept` nodes
    of each chain and adds the bonus token after them."""

    def __init__(self, log: list, accept: int, draft: FakeDraft) -> None:  # no channel: nothing is sent
        self.log, self.accept = log, accept
        self.fail_prefill = 0  # calls of several sequences that fail
        self.chain = DraftChain(lambda address: draft if address == DRAFT else None)
        self.streamed = self._verify_call

    def lane(self, i: int):  # every round group's stream: the same fake transport (`streamed`), the lane logged
        async def call(request: pb.VerifyRequest, early=None) -> pb.VerifyResponse:
            self.log.append(("lane", i, [it.seq_id for it in request.items]))
            return await self.streamed(request, early)

        return call

    def _hidden(self, tokens: list[int]) -> pb.TensorRef:
        return pb.TensorRef()

    async def prefill_many(self, items: list[pb.PrefillItem], owner: str = "", draft: str = "") -> list[Prefilled]:
        """As the verifier's Prefill: an item with next_nodes has its first tree asked for from the draft
        (a start item of its features, through the chain) and gets no features back (chained)."""
        self.log.append(("prefill-call", [it.seq_id for it in items]))
        if self.fail_prefill and len(items) > 1:
            self.fail_prefill -= 1
            raise RuntimeError("a prefill of several sequences failed")
        out, first = [], []
        for it in items:
            self.log.append(("prefill", it.seq_id, len(it.token_ids), it.more))
            pre = self._prefilled(list(it.token_ids), it.more)
            if it.next_nodes:
                tree = (it.next_depth, it.next_nodes)
                first.append(start_item(it.seq_id, list(it.token_ids), pre.next_token, pre.hidden, it.sampling, tree))
                pre = Prefilled(pre.next_token, pb.TensorRef(), chained=True)
                self.log.append(("first-tree", it.seq_id))
            out.append(pre)
        self.chain.send(draft, owner, first)
        return out

    def _prefilled(self, token_ids: list[int], more: bool) -> Prefilled:
        return Prefilled(next_token=0 if more else token_ids[-1] + 1, hidden=pb.TensorRef())

    async def _verify_call(self, request: pb.VerifyRequest, early=None) -> pb.VerifyResponse:
        """As on a stream: early answers (VerifyRequest.early) go to `early` as the chain makes them."""
        self.chain.check(request)
        if any(it.chained for it in request.items):
            self.log.append(("chained", [it.seq_id for it in request.items if it.chained]))
        return await self.chain.verify(request, self._engine_verify, self.room, early=early)

    def room(self, seq_ids: list[str]) -> list[int]:
        return [1 << 20] * len(seq_ids)  # the fakes have no KV cache to fill

    async def _engine_verify(
        self, request: pb.VerifyRequest, failed: dict[str, str], chained: dict[str, pb.DraftTree]
    ) -> tuple[pb.VerifyResponse, dict]:
        self.log.append(("verify", [it.seq_id for it in request.items]))
        resp = pb.VerifyResponse(compute_us=1000)
        for it in request.items:
            if it.seq_id in failed:
                resp.results.add(seq_id=it.seq_id, draft_error=failed[it.seq_id])
                continue
            drafted = unpack(chained.get(it.seq_id, it.tree))[0].tolist()
            acc = drafted[: self.accept]
            tokens = acc + [acc[-1] + 1 if acc else drafted[0]]
            r = resp.results.add(seq_id=it.seq_id, accepted_tokens=tokens, tree_nodes=len(drafted))
            r.hidden.CopyFrom(self._hidden(tokens))
            self.accepted(it.seq_id, tokens)
        return resp, {}  # nothing handed over: the draft is a service (a ProposeItem of each result)

    def accepted(self, seq_id: str, tokens: list[int]) -> None:
        pass

    async def decode(self, seq_ids, steps=1, follow=None):
        raise AssertionError("no plain decoding expected")

    async def release(self, seq_ids: list[str]) -> None:
        await self.chain.settle(seq_ids)
        self.log.append(("release-verifier", list(seq_ids)))


def count_up(first: int, n: int, max_tokens: int, **kw) -> Generation:
    """A greedy generation whose prompt is the n tokens counting up to `first`; kw: more GenRequest fields."""
    prompt = list(range(first - n + 1, first + 1))
    req = GenRequest(prompt_ids=prompt, max_tokens=max_tokens, sampling=SamplingConfig(), **kw)
    return Generation(request=req, decoder=RoundDecoder(Ids()), eos_token_id=EOS)


async def _run(
    prompts: list[tuple[int, int]],
    accept: int,
    stagger: float = 0.0,
    draft_address: str = DRAFT,
    prompt_len: tuple[int, ...] = (),
    prefill_chunk: int = 512,
    fail_prefill: int = 0,
    metrics: Metrics | None = None,
):
    """prompts: (last prompt token, max_tokens), the prompt counting up to it (prompt_len[i] tokens, default
    2). Returns (tokens per request, call log)."""
    log: list = []
    draft = FakeDraft(log)
    cfg = SchedulerConfig(max_active=4, draft_address=draft_address, prefill_chunk=prefill_chunk)
    verifier = FakeVerifier(log, accept, draft)
    verifier.fail_prefill = fail_prefill
    sched = Scheduler(verifier, draft, cfg, FIXED, metrics)
    sched.start()

    async def one(first: int, max_tokens: int, delay: float, n: int) -> list[int]:
        await asyncio.sleep(delay)
        return streamed([d async for d in sched.generate(count_up(first, n, max_tokens, ignore_eos=True))])

    lens = prompt_len or (2,) * len(prompts)
    outs = await asyncio.gather(*(one(f, m, i * stagger, n) for i, ((f, m), n) in enumerate(zip(prompts, lens))))
    await sched.stop()
    return outs, log


def test_chained_rounds_commit_the_right_tokens_and_propose_once_per_round() -> None:
    """Two sequences, partial acceptance (2 of 3 nodes): every round commits 3 tokens of the count-up. The
    first round's trees come from the gateway's own (start) call; every later round's from the call the
    verifier chained after the round before, and a Verify carries no tree for them."""
    outs, log = asyncio.run(_run([(100, 10), (200, 10)], accept=2))
    assert outs == [list(range(101, 111)), list(range(201, 211))]
    verifies = [e for e in log if e[0] == "verify"]
    proposes = [e for e in log if e[0] == "propose"]
    # the prefill's token, then 3 per round: 3 rounds for 10 tokens; one propose per round (the first
    # round's is the gateway's start call), plus the one chained after the last round (its trees are dropped)
    assert len(verifies) == 3 and len(proposes) == 4
    assert all(e[1] == ["gw-0", "gw-1"] for e in proposes)
    assert [e[1] for e in log if e[0] == "chained"] == [["gw-0", "gw-1"]] * 2  # rounds 2 and 3


def test_counters_after_chained_rounds() -> None:
    """The counters after the chained run above (each round's counted at once): 2 sequences x 3 rounds
    = 6 drafts of 3-node trees (18 nodes), 2 accepted each (12; positions 0 and 1 reached 6 times), 20
    tokens generated and 4 prompt tokens."""
    m = Metrics()
    asyncio.run(_run([(100, 10), (200, 10)], accept=2, metrics=m))
    get = m.registry.get_sample_value
    assert get("specdec_spec_decode_num_drafts_total") == 6
    assert get("specdec_spec_decode_num_draft_tokens_total") == 18
    assert get("specdec_spec_decode_num_accepted_tokens_total") == 12
    per_pos = "specdec_spec_decode_num_accepted_tokens_per_pos_total"
    assert [get(per_pos, {"position": str(p)}) for p in range(3)] == [6, 6, None]
    assert get("specdec_generation_tokens_total") == 20 and get("specdec_prompt_tokens_total") == 4


def test_without_a_draft_address_the_gateway_proposes_every_round() -> None:
    """draft_address "" (no chaining): the same tokens, each round's trees from a call of the gateway's."""
    outs, log = asyncio.run(_run([(100, 10), (200, 10)], accept=2, draft_address=""))
    assert outs == [list(range(101, 111)), list(range(201, 211))]
    assert len([e for e in log if e[0] == "propose"]) == len([e for e in log if e[0] == "verify"]) == 3
    assert not [e for e in log if e[0] == "chained"]


def test_sequence_finishing_mid_overlap_is_released_after_its_chained_call() -> None:
    """A sequence that finishes in a round whose outcome went to the draft: the verifier's release waits for
    the chained call naming it, the draft's copy is released after that, and the other sequence goes on with
    its chained tree."""
    outs, log = asyncio.run(_run([(100, 4), (200, 13)], accept=3))
    assert outs == [list(range(101, 105)), list(range(201, 214))]
    released = log.index(("release-verifier", ["gw-0"]))
    named = [e for e in log[:released] if e[0] in ("propose", "proposed") and "gw-0" in e[1]]
    assert len(named) == 4  # the start call and the call chained after gw-0's only round, both answered
    assert [e[0] for e in named] == ["propose", "proposed"] * 2
    assert log.index(("release-draft", ["gw-0"])) > released
    assert any(e[0] == "chained" and e[1] == ["gw-1"] for e in log[released:])  # gw-1 goes on alone


def test_joining_sequence_gets_its_own_propose_call() -> None:
    """A request arriving while others run gets its first tree from a call of the gateway's (a start call
    of its own), sent as soon as its prompt is in; the running sequence's round does not wait for that
    call (it is verified alone meanwhile), the newcomer joins the round after its tree came, and chained
    trees follow, in the same calls as the other's; both keep their exact tokens."""
    outs, log = asyncio.run(_run([(100, 30), (300, 6)], accept=1, stagger=0.05))
    assert outs == [list(range(101, 131)), list(range(301, 307))]
    early = log.index(("propose", ["gw-1"]))  # the newcomer alone: the gateway's call
    prefilled = log.index(("prefill", "gw-1", 2, False))
    assert prefilled < early and all(e[0] != "verify" for e in log[prefilled:early])  # sent once its prompt is in
    first_in = next(i for i, e in enumerate(log) if e[0] == "verify" and "gw-1" in e[1])
    assert ("verify", ["gw-0"]) in log[early:first_in]  # a round of the other without it, meanwhile
    assert log[first_in] == ("verify", ["gw-0", "gw-1"])
    assert log.index(("proposed", ["gw-1"])) < first_in
    first_both = next(i for i, e in enumerate(log) if e == ("propose", ["gw-0", "gw-1"]))
    assert first_in < first_both  # then both from one chained call


def test_a_long_prompt_is_prefilled_in_chunks_between_the_rounds_of_the_others() -> None:
    """prefill_chunk 4: a 10-token prompt arriving while another request runs goes in chunks of 4, 4 and 2,
    one between two rounds of the running request (which keeps its rounds), and joins the rounds after its
    last chunk; both outputs exact."""
    outs, log = asyncio.run(_run([(100, 30), (300, 10)], accept=1, stagger=0.05, prompt_len=(2, 10), prefill_chunk=4))
    assert outs == [list(range(101, 131)), list(range(301, 311))]
    chunks = [i for i, e in enumerate(log) if e[0] == "prefill" and e[1] == "gw-1"]
    assert [log[i][2:] for i in chunks] == [(4, True), (4, True), (2, False)]
    for a, b in zip(chunks, chunks[1:]):  # a round of gw-0 between two chunks, and none of gw-1 yet
        between = [e for e in log[a:b] if e[0] == "verify"]
        assert between and all(e[1] == ["gw-0"] for e in between)
    assert any(e[0] == "verify" and "gw-1" in e[1] for e in log[chunks[-1] :])


def test_prompts_arriving_together_share_one_prefill_call() -> None:
    """Three requests admitted together are prefilled in one verifier call; when such a call fails, each of
    its sequences starts again in a call of its own (so that one request's failure is its own), and all
    outputs are exact."""
    prompts = [(100, 7), (200, 7), (300, 7)]
    want = [list(range(f + 1, f + 8)) for f, _ in prompts]
    outs, log = asyncio.run(_run(prompts, accept=2))
    assert outs == want
    assert [e[1] for e in log if e[0] == "prefill-call"] == [["gw-0", "gw-1", "gw-2"]]
    outs, log = asyncio.run(_run(prompts, accept=2, fail_prefill=1))
    assert outs == want
    calls = [e[1] for e in log if e[0] == "prefill-call"]
    assert calls == [["gw-0", "gw-1", "gw-2"], ["gw-0"], ["gw-1"], ["gw-2"]]


def test_a_chained_call_that_fails_means_plain_decoding_and_a_catch_up() -> None:
    """The draft fails the call the verifier chained: the next Verify answers draft_error for those
    sequences (nothing verified), the round decodes them plainly, and once the draft answers again they
    catch up (Features, a start call) and speculate; every token exact."""
    cfg = SchedulerConfig(max_active=4, plain_steps=2, draft_retry_s=0.003)
    outs, log, _ = _follow(FIXED, cfg, [(100, 30, None), (200, 30, None)], fail_call=2)
    assert outs == [list(range(101, 131)), list(range(201, 231))]
    failed = log.index(("draft-failed", ["gw-0", "gw-1"]))
    after = log[failed:]
    assert after.index(("decode", ["gw-0", "gw-1"], {})) < after.index(("features", ["gw-0", "gw-1"]))
    assert any(e[0] == "chained" for e in after)  # speculating again, chained


def test_two_groups_run_their_rounds_concurrently() -> None:
    """groups=2: sequences alternate between two groups whose rounds interleave on the services (one
    group's verify happens while the other's propose is in flight: the second group's proposals start
    5 ms late here, so that the two groups' calls do not answer at the same instant, as they would not on
    real services); every token is still exact."""

    class UnevenDraft(FakeDraft):
        async def propose(self, items: list[pb.ProposeItem], owner: str = "") -> Batched:
            if items[0].seq_id in ("gw-1", "gw-3"):
                await asyncio.sleep(0.005)
            return await super().propose(items, owner)

    async def run():
        log: list = []
        draft = UnevenDraft(log)
        cfg = SchedulerConfig(max_active=4, groups=2, draft_address=DRAFT)
        sched = Scheduler(FakeVerifier(log, 2, draft), draft, cfg, FIXED)
        sched.start()

        async def one(first: int) -> list[int]:
            req = GenRequest(prompt_ids=[first - 1, first], max_tokens=10, sampling=SamplingConfig(), ignore_eos=True)
            gen = Generation(request=req, decoder=RoundDecoder(Ids()), eos_token_id=EOS)
            return streamed([d async for d in sched.generate(gen)])

        outs = await asyncio.gather(*(one(f) for f in (100, 200, 300, 400)))
        await sched.stop()
        return outs, log

    outs, log = asyncio.run(run())
    assert outs == [list(range(f + 1, f + 11)) for f in (100, 200, 300, 400)]
    verified = [set(e[1]) for e in log if e[0] == "verify"]
    assert {"gw-0", "gw-2"} in verified and {"gw-1", "gw-3"} in verified  # two groups, alternating admission
    lanes = {(e[1], s) for e in log if e[0] == "lane" for s in e[2]}  # each group's calls on its own stream
    assert lanes == {(0, "gw-0"), (0, "gw-2"), (1, "gw-1"), (1, "gw-3")}
    # a verify of one group lies between the propose and the answer of the other group's call
    interleaved = any(
        log[i][0] == "propose"
        and log[j][0] == "verify"
        and not set(log[i][1]) & set(log[j][1])
        and all(not (e[0] == "proposed" and e[1] == log[i][1]) for e in log[i + 1 : j])
        for i in range(len(log))
        for j in range(i + 1, len(log))
    )
    assert interleaved


class FollowingDraft(FakeDraft):
    """Checks every item it gets: each hidden row is the feature of the token before token_ids[i] (the
    fakes below write the fed token's id as the row's value), so pending rows and plain rounds' rows
    must line up with the tokens exactly."""

    def __init__(self, log: list, fail_call: int = 0) -> None:
        super().__init__(log)
        self.calls, self.fail_call = 0, fail_call  # fail_call: this call (1-based) fails, as a draft going down

    async def propose(self, items: list[pb.ProposeItem], owner: str = "") -> Batched:
        self.calls += 1
        if self.calls == self.fail_call:
            self.log.append(("draft-failed", [it.seq_id for it in items]))
            raise ConnectionError("the draft went away")
        for it in items:
            rows = np.frombuffer(it.hidden.inline_data, dtype=np.float32)
            assert list(it.hidden.shape) == [len(it.token_ids), 1], (it.seq_id, list(it.hidden.shape))
            assert rows.tolist() == [t - 1 for t in it.token_ids], (it.seq_id, rows.tolist(), list(it.token_ids))
            self.log.append(("tree", it.seq_id, it.max_depth, it.max_nodes))
        return await super().propose(items, owner)


def _rows(tokens: list[int]) -> pb.TensorRef:
    """Inline features [n, 1]: the id of the token fed at each row (the one before each token)."""
    data = np.asarray([t - 1 for t in tokens], dtype=np.float32)
    return pb.TensorRef(shape=[len(tokens), 1], dtype="float32", inline_data=data.tobytes())


class FollowingVerifier(FakeVerifier):
    """FakeVerifier whose prefill, verify and decode return features (_rows), and plain decoding that
    counts up from the sequence's last token."""

    def __init__(self, log: list, accept: int, draft: FakeDraft) -> None:
        super().__init__(log, accept, draft)
        self.last: dict[str, int] = {}

    def _prefilled(self, token_ids: list[int], more: bool) -> Prefilled:
        assert not more  # the following tests' prompts fit one chunk
        return Prefilled(next_token=token_ids[-1] + 1, hidden=_rows(token_ids[1:] + [token_ids[-1] + 1]))

    async def prefill_many(self, items: list[pb.PrefillItem], owner: str = "", draft: str = "") -> list[Prefilled]:
        for it in items:
            self.last[it.seq_id] = it.token_ids[-1] + 1
        return await super().prefill_many(items, owner, draft)

    def _hidden(self, tokens: list[int]) -> pb.TensorRef:
        return _rows(tokens)

    def accepted(self, seq_id: str, tokens: list[int]) -> None:
        self.last[seq_id] = tokens[-1]

    async def features(self, items: list[tuple[str, list[int]]]) -> list[pb.TensorRef]:
        """The catch-up's recompute: rows of the cached tokens (each produced the token after it)."""
        await self.chain.settle([s for s, _ in items])
        self.log.append(("features", [s for s, _ in items]))
        return [_rows(tokens[1:] + [tokens[-1] + 1]) for _, tokens in items]

    async def decode(self, seq_ids, steps=1, follow=None):
        follow = follow or {}
        await self.chain.settle(seq_ids)
        await asyncio.sleep(0.001)  # a round takes time (the draft's retry delay passes)
        self.log.append(("decode", list(seq_ids), dict(follow)))
        resp = pb.DecodeResponse(compute_us=100)
        for s in seq_ids:
            tokens = list(range(self.last[s] + 1, self.last[s] + 1 + steps))
            r = resp.results.add(seq_id=s, next_token=tokens[0], tokens=tokens)
            if s in follow:
                r.hidden.CopyFrom(_rows(tokens))
            self.last[s] = tokens[-1]
        return resp


def _follow(policy, cfg: SchedulerConfig, requests: list[tuple[int, int, Shape | None]], fail_call: int = 0):
    """Run requests (first prompt token, max_tokens, pinned tree) through a scheduler with the following
    fakes under `policy`, chained; returns (tokens per request, call log, the scheduler's shape counts)."""

    async def run():
        log: list = []
        draft = FollowingDraft(log, fail_call)
        sched = Scheduler(FollowingVerifier(log, 2, draft), draft, replace(cfg, draft_address=DRAFT), policy)
        sched.start()

        async def one(first: int, max_tokens: int, pin: Shape | None) -> list[int]:
            req = GenRequest(
                prompt_ids=[first - 1, first],
                max_tokens=max_tokens,
                sampling=SamplingConfig(),
                ignore_eos=True,
                tree=pin,
            )
            gen = Generation(request=req, decoder=RoundDecoder(Ids()), eos_token_id=EOS)
            return streamed([d async for d in sched.generate(gen)])

        outs = await asyncio.gather(*(one(*r) for r in requests))
        await sched.stop()
        return outs, log, sched.choices

    return asyncio.run(run())


def test_policy_switching_between_plain_and_trees_keeps_the_draft_in_step() -> None:
    """The cycle policy alternates plain rounds and trees: a plain round of a speculative sequence asks
    for its features after the rows still pending (hidden_row), appends tokens and rows to the pending
    item, and the next tree starts from all of them; every committed token is exact, and each tree is
    drafted at the shape of its round."""
    policy = CyclePolicy([PLAIN, Shape(1, 3), Shape(2, 2)])
    cfg = SchedulerConfig(max_active=4, plain_steps=4)
    outs, log, choices = _follow(policy, cfg, [(100, 30, None), (200, 30, None)])
    assert outs == [list(range(101, 131)), list(range(201, 231))]
    decodes = [e for e in log if e[0] == "decode"]
    assert decodes and all(e[2] for e in decodes)  # every plain round follows both sequences
    # after the prefill the pending item holds the prompt's 2 rows; after a verify accepting 2, 3 rows
    assert {rows for e in decodes for rows in e[2].values()} <= {2, 3}
    trees = {(d, n) for e in log if e[0] == "tree" for d, n in [e[2:]]}
    assert trees == {(1, 3), (2, 2)}
    assert choices[PLAIN] >= 2 and choices[Shape(1, 3)] >= 2


def test_pinned_trees_run_beside_the_policy() -> None:
    """A request pinning its tree drafts that tree whatever the policy picks for the others (here always
    plain): its rounds verify while the other request decodes plainly, both exact."""
    cfg = SchedulerConfig(max_active=4, plain_steps=4)
    outs, log, _ = _follow(CyclePolicy([PLAIN]), cfg, [(100, 12, Shape(2, 3)), (200, 12, None)])
    assert outs == [list(range(101, 113)), list(range(201, 213))]
    assert {e[1:] for e in log if e[0] == "tree"} == {("gw-0", 2, 3)}
    assert all(e[1] == ["gw-1"] for e in log if e[0] == "decode")


def test_sequences_the_policy_keeps_plain_are_parked_and_catch_up_for_a_tree() -> None:
    """Six plain rounds, then trees: the draft follows for park_after = 4 plain rounds (features
    fetched), then not at all (parked: no features), and when the policy picks a tree the sequences catch
    up (Features, a start=True item) and speculate again; every token exact."""
    policy = CyclePolicy([PLAIN] * 6 + [Shape(1, 3)] * 40)
    cfg = SchedulerConfig(max_active=4, plain_steps=2, park_after=4)
    outs, log, _ = _follow(policy, cfg, [(100, 30, None), (200, 30, None)])
    assert outs == [list(range(101, 131)), list(range(201, 231))]
    decodes = [e for e in log if e[0] == "decode"]
    assert [bool(e[2]) for e in decodes[:6]] == [True] * 4 + [False] * 2  # followed, then parked
    assert ("features", ["gw-0", "gw-1"]) in log  # the catch-up when the tree was chosen
    after = log[log.index(("features", ["gw-0", "gw-1"])) :]
    assert any(e[0] == "verify" for e in after)  # speculating again


class SlowPrefill(FakeVerifier):
    """A prefill call that takes 50 ms (the rounds go on meanwhile)."""

    async def prefill_many(self, items, owner="", draft=""):
        self.log.append(("prefill-sent", [it.seq_id for it in items]))
        await asyncio.sleep(0.05)
        return await super().prefill_many(items, owner, draft)


def test_a_request_cancelled_during_its_prefill_is_released_after_the_call() -> None:
    """The prefill runs beside the rounds (Scheduler._start_prefill). A request cancelled while its prefill
    call is in flight leaves once the call is over, so that its release reaches the verifier after the
    slot the call took (a release sent first would find nothing and leave the slot held); the running
    request is unaffected."""

    async def go():
        log: list = []
        draft = FakeDraft(log)
        verifier = SlowPrefill(log, 1, draft)
        sched = Scheduler(verifier, draft, SchedulerConfig(max_active=4, draft_address=DRAFT), FIXED)
        sched.start()
        running = asyncio.ensure_future(_collect(sched, count_up(100, 2, 30, ignore_eos=True)))
        await asyncio.sleep(0.1)  # gw-0 is in its rounds
        late = asyncio.ensure_future(_collect(sched, count_up(300, 2, 30, ignore_eos=True)))
        await asyncio.sleep(0.02)  # gw-1's prefill is in flight
        late.cancel()
        tokens = await running
        await sched.stop()
        return tokens, log

    tokens, log = asyncio.run(go())
    assert tokens == list(range(101, 131))
    sent = log.index(("prefill-sent", ["gw-1"]))
    assert ("verify", ["gw-0"]) in log[sent : log.index(("prefill", "gw-1", 2, False))]  # rounds meanwhile
    assert log.index(("release-verifier", ["gw-1"])) > log.index(("prefill", "gw-1", 2, False))


async def _collect(sched: Scheduler, gen) -> list[int]:
    return [t async for d in sched.generate(gen) for t in d.token_ids]


def test_a_calls_text_is_streamed_while_the_next_call_runs() -> None:
    """Scheduler._speak: a call's tokens are taken at once (budget and finish for the next call) and their
    text is made and streamed right after the next Verify went out: between the verifier getting that call
    (its chain logs `chained`) and its verify, which waits for the draft. 13 tokens: the prefill's, then 4
    rounds of 3; each round's text after the next round's call, the last one's once nothing runs."""

    async def go():
        log: list = []
        draft = FakeDraft(log)
        sched = Scheduler(FakeVerifier(log, 2, draft), draft, SchedulerConfig(max_active=4, draft_address=DRAFT), FIXED)
        stream = sched._stream

        def logged(deltas):
            log.append(("stream", [d.token_ids for _, d in deltas]))
            stream(deltas)

        sched._stream = logged
        sched.start()
        tokens = await _collect(sched, count_up(100, 2, 13, ignore_eos=True))
        await sched.stop()
        return tokens, log

    tokens, log = asyncio.run(go())
    assert tokens == list(range(101, 114))
    streamed_ = [e[1] for e in log if e[0] == "stream"]
    assert streamed_ == [[[101]], [[102, 103, 104]], [[105, 106, 107]], [[108, 109, 110]], [[111, 112, 113]]]
    calls = [i for i, e in enumerate(log) if e[0] == "chained"]  # rounds 2, 3, 4
    assert len(calls) == 3
    for c in calls:
        v = next(i for i in range(c, len(log)) if log[i][0] == "verify")
        assert [e[1] for e in log[c:v] if e[0] == "stream"], log[c:v]  # the round before's text, meanwhile
    assert log[-1][0] != "stream" and max(i for i, e in enumerate(log) if e[0] == "stream") > max(
        i for i, e in enumerate(log) if e[0] == "verify"
    )  # the last round's text after the last verify


def test_a_failed_step_leaves_a_sequence_in_prefill_to_retire_after_its_call() -> None:
    """A step that fails its sequences (Scheduler._guarded: a catch-up fails for every active one) releases
    them at once, except one whose prefill call is in flight: it gets the error now and leaves (and is
    released) once the call is over, as a cancelled one does."""

    async def go():
        log: list = []
        draft = FakeDraft(log)
        sched = Scheduler(FakeVerifier(log, 1, draft), draft, SchedulerConfig(max_active=4, draft_address=DRAFT), FIXED)
        running, joining = (Active(f"gw-{i}", count_up(100, 2, 5), asyncio.Queue()) for i in range(2))
        joining.in_prefill = True
        sched.active = [running, joining]

        async def fails():
            raise RuntimeError("a step failed")

        await sched._guarded([running, joining], fails())
        errors = [type(a.out.get_nowait()).__name__ for a in (running, joining)]
        return sched.active == [joining], errors, [e for e in log if e[0] == "release-verifier"]

    kept, errors, released = asyncio.run(go())
    assert kept and errors == ["RuntimeError", "RuntimeError"]
    assert released == [("release-verifier", ["gw-0"])]
