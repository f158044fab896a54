"""The engine core (common/engine/core.py) in process, on the real model in float32 with the shipped EAGLE-3
head: whatever the rounds draft (pinned trees, plain rows riding along, shapes switching every round, joiners,
prompts in chunks, a drafter that fails and comes back), the tokens are the base model's greedy decoding cut
by each request's rules; finished and aborted sequences leave nothing held; the policy learns from steady
rounds only."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from bench import policy_log
from common.config import DraftingConfig, SamplingConfig
from common.engine.base import PrefillInput
from common.engine.core import AHEAD, CoreConfig, EngineCore
from common.engine.draft import Eagle3Drafter
from common.engine.verifier import Verifier, VerifierConfig
from common.errors import PeerUnavailable
from common.policy import PLAIN, Choice, FixedPolicy, Shape
from common.sequence import Finish, Request

PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198, 1, 4093, 198],
    [1, 4093, 198, 4898, 314, 260, 6376, 4461, 47, 2, 198, 1, 520, 9531, 198],
    [1, 520, 9531, 198, 504],
    [1, 9690, 198, 4093, 198, 2683, 359, 253, 966, 282, 260, 2591, 506, 47],
]
TREE = Shape(3, 8)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def engines(checkpoint):
    from common.model.eagle3_io import load_eagle3

    v = Verifier(checkpoint, VerifierConfig(max_sequences=5, max_context=256, max_tree_nodes=24, prefill_ahead=2))
    head, _ = load_eagle3("models/eagle3-smollm2")
    d = Eagle3Drafter(head.float().eval(), v.model.embed_tokens, DraftingConfig(4, 4, 20), 5, 256, "cpu")
    return v, d


@pytest.fixture(scope="module")
def plain(engines):
    """The verifier's own greedy decoding of each prompt, 16 tokens: what every core run must produce."""
    v, _ = engines
    out = []
    for p in PROMPTS:
        tokens = [v.prefill(PrefillInput("ref", p, SamplingConfig())).next_token]
        while len(tokens) < 16:
            tokens += v.decode(["ref"])
        v.release(["ref"])
        out.append(tokens)
    return out


class Cycle:
    """A test policy: the next shape of a list every round (plain included)."""

    name = "cycle"

    def __init__(self, shapes):
        self.shapes = itertools.cycle(shapes)
        self.rounds: list = []  # observe_round's calls
        self.seconds: list[float] = []  # and the costs they reported

    def choose(self, members, plain_steps, batch=None, sampled=False):
        return Choice(next(self.shapes))

    def rates(self, members, plain_steps, batch=None, sampled=False):
        return {}

    def observe_round(self, batch, shape, seconds, steps=1, sampled=False, rounds=1):
        self.rounds.append((batch, shape, steps))
        self.seconds.append(seconds)

    def observe_verified(self, rows):
        pass

    def forget(self, seq_id):
        pass

    def estimates(self):
        return []


def run(core: EngineCore, arrivals: dict[int, list[Request]] | None = None, abort: dict[int, str] | None = None):
    """Step the core until every sequence is done: {seq_id: (tokens, finish, rounds)}. arrivals: requests added
    before the step of that number; abort: a sequence aborted before that step."""
    got: dict[str, list] = {}
    for step in itertools.count():
        for r in (arrivals or {}).get(step, []):
            core.add(r)
        if (abort or {}).get(step):
            core.abort(abort[step])
        if step > max((arrivals or {0: 0}).keys()) and not core.seqs and not core._inbox:
            return got
        for o in core.step():
            tokens, _, rounds = got.get(o.seq_id, ([], None, 0))
            got[o.seq_id] = (tokens + o.tokens, o.finish, rounds + o.rounds)
        assert step < 400, "the core does not finish"


def run_stream(core: EngineCore, arrivals: dict[int, list[Request]], stream: list) -> dict[str, list[int]]:
    """Step the core until every sequence is done, requests added before the step of their number; each sequence's
    tokens in order, from `stream` (where a publish hook puts its outputs) and the steps' outputs."""
    for step in itertools.count():
        for r in arrivals.get(step, []):
            core.add(r)
        if step > max(arrivals) and not core.seqs and not core._inbox:
            break
        stream.extend(core.step())
        assert step < 400, "the core does not finish"
    tokens: dict[str, list[int]] = {}
    for o in stream:
        tokens.setdefault(o.seq_id, []).extend(o.tokens)
    return tokens


def req(i: int, max_new: int = 16, **kw) -> Request:
    return Request(f"s{i}", PROMPTS[i], SamplingConfig(), max_new=max_new, **kw)


def rounds_run(v: Verifier, monkeypatch) -> list[int]:
    """The rounds each verifier call ran, appended as the call returns."""
    ran: list[int] = []
    verify = v.verify_rounds_steps

    def counted(items, rounds=1, then=None, each=None):
        out = yield from verify(items, rounds, then, each)
        ran.append(len(out))
        return out

    monkeypatch.setattr(v, "verify_rounds_steps", counted)
    return ran


def check_free(core: EngineCore) -> None:
    v, d = core.verifier, core.drafter
    assert not core.seqs and not core.drafts
    assert v.release([f"s{i}" for i in range(len(PROMPTS))]) == 0  # nothing left held on either engine
    assert d.release([f"s{i}" for i in range(len(PROMPTS))]) == 0


def test_rounds_equal_plain_decoding_with_pins_plain_rows_and_stops(engines, plain):
    """A policy tree, a pinned smaller tree, a request that does not speculate (it rides along as a tree of no
    nodes), a stop token id and a short budget: every output is the plain greedy one cut by its own rules, and
    the drafting after the first round was launched behind each verify (the device chain)."""
    v, d = engines
    launched, settled = [], []
    launch, settle = d.launch_after, d.settle_after
    d.launch_after = lambda items, acc, after=None: launched.append(len(items)) or launch(items, acc, after)
    d.settle_after = lambda h: settled.append(h) or settle(h)
    try:
        core = EngineCore(v, d, FixedPolicy(TREE), CoreConfig(max_sequences=4))
        stop = plain[3][9]  # its first occurrence ends s3
        got = run(
            core,
            {
                0: [
                    req(0),
                    req(1, tree=Shape(2, 4)),
                    req(2, speculative=False),
                    req(3, stop_ids=frozenset({stop})),
                ]
            },
        )
    finally:
        d.launch_after, d.settle_after = launch, settle
    for i in range(3):
        assert got[f"s{i}"][0] == plain[i], i
    cut = plain[3].index(stop) + 1
    assert got["s3"][0] == plain[3][:cut] and got["s3"][1] is Finish.TOKEN
    assert got["s0"][1] is Finish.LENGTH and got["s0"][2] > 0 and got["s1"][2] > 0 and got["s2"][2] == 0
    assert len(launched) > 3  # the rounds after the first drafted on the device behind the verify
    assert settled  # and verified there too: rounds chained in one verifier call (greedy rows)
    check_free(core)


def test_shapes_switching_every_round_keep_the_output(engines, plain):
    """Plain steps, chains and trees in turn, joiners arriving mid-run and prompts prefilled 6 tokens a step:
    the same tokens as plain decoding."""
    v, d = engines
    policy = Cycle([PLAIN, Shape(1, 1), Shape(3, 8), TREE, Shape(2, 4)])
    core = EngineCore(v, d, policy, CoreConfig(max_sequences=3, prefill_chunk=6, plain_steps=3))
    got = run(core, {0: [req(0, 16), req(1, 12)], 3: [req(2, 10)], 6: [req(3, 16)]})
    for i, n in enumerate((16, 12, 10, 16)):
        assert got[f"s{i}"][0] == plain[i][:n], i
    shapes = {s for _, s, _ in policy.rounds}
    assert PLAIN in shapes  # plain calls are reported (the tree calls here, cut short or of mixed shapes, are not)
    check_free(core)


def test_the_policy_is_told_the_cost_of_whole_calls_only(engines, plain):
    """A shape a call: with one round a call every call is whole and pure, so each shape the policy picked is
    reported (the first tree call after the prompts, every row joining, too: its catch-up left out); with four
    rounds a call and the next shape another, a call runs its shape once and the next one's chained behind it,
    so no tree call is reported, only the plain ones."""
    v, d = engines
    shapes = [PLAIN, Shape(1, 1), TREE, Shape(2, 4)]
    for rounds, reported in ((1, set(shapes)), (4, {PLAIN})):
        policy = Cycle(shapes)
        core = EngineCore(v, d, policy, CoreConfig(max_sequences=2, plain_steps=2, rounds_per_step=rounds))
        got = run(core, {0: [req(0, 16), req(1, 16)]})
        assert [got[f"s{i}"][0] for i in range(2)] == [plain[0][:16], plain[1][:16]]
        assert {s for _, s, _ in policy.rounds} == reported, rounds
        check_free(core)


def test_a_try_is_costed_by_a_whole_call_not_the_one_cut_before_it(engines, plain, monkeypatch, caplog):
    """A policy trying 2x4 (explored) for two calls after every two 3x8 ones: the call before each try is cut to
    one round and ends its step, so the try's calls run the two rounds of a fresh step; every tree cost the
    policy is told comes from a call of two rounds (a cut call's one round would carry a whole call's host
    work). --log-level DEBUG logs each cost sample told."""
    v, d = engines
    policy = Cycle([TREE, TREE, Shape(2, 4), Shape(2, 4)])
    tries = policy.choose
    monkeypatch.setattr(policy, "choose", lambda *a, **k: (c := tries(*a, **k)) and Choice(c.shape, c.shape != TREE))
    cfg = CoreConfig(max_sequences=2, plain_steps=2, rounds_per_step=2, call_rounds=2)  # calls of 2 rounds at most
    core = EngineCore(v, d, policy, cfg)
    told = []
    observe = core._observe
    monkeypatch.setattr(core, "_observe", lambda *a, **k: told.append((a[2], a[4], a[7])) or observe(*a, **k))
    caplog.set_level(logging.DEBUG, logger="common.engine.core")
    got = run(core, {0: [req(0, 16), req(1, 16)]})
    assert [got[f"s{i}"][0] for i in range(2)] == [plain[0][:16], plain[1][:16]]
    samples = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cost sample")]
    assert len(samples) == len(policy.seconds) > 0 and "2 rounds of" in samples[-1], samples
    assert all(policy_log.SAMPLE.search(s) for s in samples), samples  # the lines bench.policy_log reads
    reported = [(shape, rounds) for shape, steady, rounds in told if steady and not shape.plain]
    assert any(rounds == 1 for shape, steady, rounds in told if not shape.plain), told  # cut calls ran
    assert reported and all(rounds == 2 for _, rounds in reported), told
    assert Shape(2, 4) in {shape for shape, _ in reported}, told
    check_free(core)


def test_each_switch_between_plain_and_trees_is_counted_and_logged_with_the_rates(engines, plain, monkeypatch, caplog):
    """A choice that switches a batch between plain and trees is counted (calls' switches: GetModelInfo's
    engine_calls) and, at --log-level DEBUG, logged with the policy's rates: every switch once and nothing else."""
    v, d = engines
    policy = Cycle([PLAIN, TREE])
    made = []
    cycle = policy.choose
    monkeypatch.setattr(policy, "choose", lambda *a, **k: made.append(c := cycle(*a, **k)) or c)
    monkeypatch.setattr(policy, "rates", lambda *a: {PLAIN: 100.0, TREE: 1234.4})
    core = EngineCore(v, d, policy, CoreConfig(max_sequences=2, plain_steps=2, rounds_per_step=2))
    caplog.set_level(logging.DEBUG, logger="common.engine.core")
    got = run(core, {0: [req(0, 16), req(1, 16)]})
    assert [got[f"s{i}"][0] for i in range(2)] == [plain[0][:16], plain[1][:16]]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("choice:")]
    kinds = [c.shape.plain for c in made]
    switches = [c.shape for k, c, last in zip(kinds, made, [True, *kinds]) if k != last]
    assert len(switches) >= 2 and [line.split()[1] for line in lines] == [str(s) for s in switches], (lines, made)
    assert lines[0] == f"choice: {TREE} at 2 sequences; tok/s plain 100, {TREE} 1,234", lines
    assert all(policy_log.CHOICE.search(line) for line in lines), lines  # the lines bench.policy_log reads
    assert core.calls["switches"] == len(switches), core.calls


def test_a_sampled_row_joining_a_batch_on_trees_is_no_switch(engines):
    """Trees every round: a greedy request, then a sampled one joining its batch (the round variant changes, the
    batch stays on trees): one switch, the first tree choice."""
    v, d = engines
    core = EngineCore(v, d, Cycle([TREE]), CoreConfig(max_sequences=2, plain_steps=2, rounds_per_step=2))
    hot = Request("s1", PROMPTS[1], SamplingConfig(temperature=0.7, seed=5), max_new=8)
    got = run(core, {0: [req(0, 16)], 2: [hot]})
    assert set(got) == {"s0", "s1"} and core.calls["rounds"] > 0
    assert core.calls["switches"] == 1, core.calls
    check_free(core)


def test_a_lone_batch_goes_on_in_one_call_its_tokens_going_out_as_it_goes(engines, plain, monkeypatch):
    """Two rounds a step, calls of up to 8: a request alone runs on past its call's two rounds, the verifier
    launching one round behind the last as the core reads each (AHEAD launched beyond the one read), its tokens
    going out every two rounds (publish), unfinished; a request arriving mid-call (at the first publish) ends
    the call within AHEAD + 1 rounds, and the two then share calls. Both get plain decoding's tokens, in order."""
    v, d = engines
    calls = []  # (rows, rounds asked, rounds run, the rounds launched when each round was read)
    verify = v.verify_rounds_steps

    def counted(items, rounds=1, then=None, each=None):
        seen = []

        def told(r, launched, outs):
            seen.append(launched)
            return each(r, launched, outs)

        out = yield from verify(items, rounds, then, told if each is not None else None)
        calls.append((len(items), rounds, len(out), seen))
        return out

    monkeypatch.setattr(v, "verify_rounds_steps", counted)
    core = EngineCore(v, d, FixedPolicy(TREE), CoreConfig(max_sequences=2, rounds_per_step=2, call_rounds=8))
    stream, published = [], []

    def publish(outs):
        if not published:
            core.add(req(1))  # arrives while s0's call goes on
        published.append(len(calls))
        stream.extend(outs)

    core.publish = publish
    core.add(req(0))
    for _ in range(100):
        if not core.seqs and not core._inbox:
            break
        stream.extend(core.step())
    tokens = {}
    for o in stream:
        tokens.setdefault(o.seq_id, []).extend(o.tokens)
    assert tokens == {"s0": plain[0], "s1": plain[1]}
    assert [o.finish for o in stream if o.seq_id == "s0"][-1] is Finish.LENGTH
    assert sorted(o.seq_id for o in stream if o.finish is not Finish.NONE) == ["s0", "s1"]  # each finish once
    first = calls[published[0]]  # the call that went on when s1 arrived
    assert first[0] == 1 and 2 < first[2] <= 2 + AHEAD  # past its 2 rounds; ended within AHEAD + 1 of the arrival
    assert any(n == 2 and ran > 2 for n, _, ran, _ in calls[published[0] + 1 :])  # then both, going on together
    for _, asked, ran, seen in calls:
        assert ran <= 8 and all(k - r - 1 <= max(AHEAD, asked - 1) for r, k in enumerate(seen)), calls
    check_free(core)


def test_a_finish_goes_out_at_once_while_its_call_runs_on(engines, plain, monkeypatch):
    """Four rounds a call: s0 (a budget of 4 tokens) finishes in the first round of a call that runs four; its finish
    is published while that call still runs (its client need not wait for the call), and not again with the step's
    outputs; s1 goes on to its 16 tokens. Both get plain decoding's tokens, each finish exactly once."""
    v, d = engines
    calls = rounds_run(v, monkeypatch)
    core = EngineCore(v, d, FixedPolicy(TREE), CoreConfig(max_sequences=2, rounds_per_step=4, call_rounds=4))
    stream, finished_at = [], {}  # the outputs in order; seq id -> (calls returned, from a publish) at its finish

    def publish(outs):
        stream.extend(outs)
        finished_at.update({o.seq_id: (len(calls), True) for o in outs if o.finish is not Finish.NONE})

    core.publish = publish
    core.add(req(0, 4))
    core.add(req(1))
    for _ in range(100):
        if not core.seqs and not core._inbox:
            break
        outs = core.step()
        stream.extend(outs)
        finished_at.update({o.seq_id: (len(calls), False) for o in outs if o.finish is not Finish.NONE})
    tokens = {}
    for o in stream:
        tokens.setdefault(o.seq_id, []).extend(o.tokens)
    assert tokens == {"s0": plain[0][:4], "s1": plain[1]}
    assert [o.finish for o in stream if o.finish is not Finish.NONE] == [Finish.LENGTH, Finish.LENGTH]
    assert finished_at["s0"] == (0, True), (finished_at, calls)  # published within the first call, which ran on
    assert calls[0] == 4, calls
    check_free(core)


def test_a_request_arriving_mid_call_is_prefilled_beside_it_and_waits_for_room(engines, plain, monkeypatch):
    """One sequence at a time, one prompt prefilled beside a call (prefill_ahead 1), two rounds a step, calls of up
    to 8: s1 arrives while s0's call runs on (at its first publish); its prompt is launched inside that call and read
    at the step's end, and it waits, prefilled, while s0 runs: no call takes two rows. s2, arriving after that call,
    finds no slot beside and is prefilled by a step of its own. All get plain decoding's tokens."""
    v, d = engines
    rows, inside, launched = [], [False], []  # rows of each verify call; whether one runs; (seq ids, inside one)
    verify, launch = v.verify_rounds_steps, v.prefill_launch

    def counted(items, rounds=1, then=None, each=None):
        inside[0] = True
        out = yield from verify(items, rounds, then, each)
        inside[0] = False
        rows.append(len(items))
        return out

    def noted(items):
        launched.append(([it.seq_id for it in items], inside[0]))
        return launch(items)

    monkeypatch.setattr(v, "verify_rounds_steps", counted)
    monkeypatch.setattr(v, "prefill_launch", noted)
    cfg = CoreConfig(max_sequences=1, rounds_per_step=2, call_rounds=8, prefill_ahead=1)
    core = EngineCore(v, d, FixedPolicy(TREE), cfg)
    stream = []

    def publish(outs):
        if len(launched) == 1:  # s0's prefill only: s1 arrives while s0's first call goes on
            core.add(req(1))
        stream.extend(outs)

    core.publish = publish
    got = run_stream(core, {0: [req(0)], 1: [req(2)]}, stream)
    assert got == {"s0": plain[0], "s1": plain[1], "s2": plain[2]}
    assert launched[:2] == [(["s0"], False), (["s1"], True)], launched  # s1 beside s0's first call
    assert (["s2"], True) not in launched and (["s2"], False) in launched, launched
    assert max(rows) == 1, rows
    check_free(core)


@pytest.mark.parametrize("shape", [PLAIN, TREE])
def test_a_prompt_arriving_between_steps_is_prefilled_beside_the_steps_call(engines, plain, monkeypatch, shape):
    """s0 runs alone (one round or plain call a step); s1 arrives before its third step. With prefill_ahead 2 the
    step launches s1's prefill, runs s0's call beside it, reads it at its end: s1's first call is the next step's,
    with s0. Without (prefill_ahead 0) the step prefills s1 first (launch and read back to back) and its call takes
    both. Either way each gets plain decoding's tokens."""
    v, d = engines
    events = []  # ("launch" | "read" | "call", seq ids)
    launch, read, decode, verify = v.prefill_launch, v.prefill_read, v.decode_many, v.verify_rounds_steps

    def launched(items):
        events.append(("launch", [it.seq_id for it in items]))
        return launch(items)

    def was_read(x):
        events.append(("read", [it.seq_id for it in x.items]))
        return read(x)

    def decoded(seq_ids, steps, with_hidden=False):
        events.append(("call", list(seq_ids)))
        return decode(seq_ids, steps, with_hidden)

    def verified(items, rounds=1, then=None, each=None):
        events.append(("call", [it.seq_id for it in items]))
        return (yield from verify(items, rounds, then, each))

    monkeypatch.setattr(v, "prefill_launch", launched)
    monkeypatch.setattr(v, "prefill_read", was_read)
    monkeypatch.setattr(v, "decode_many", decoded)
    monkeypatch.setattr(v, "verify_rounds_steps", verified)
    for ahead in (2, 0):
        events.clear()
        cfg = CoreConfig(max_sequences=2, rounds_per_step=1, call_rounds=1, plain_steps=2, prefill_ahead=ahead)
        core = EngineCore(v, d, FixedPolicy(shape), cfg)
        assert run_stream(core, {0: [req(0, max_new=12)], 2: [req(1, max_new=6)]}, []) == {
            "s0": plain[0][:12],
            "s1": plain[1][:6],
        }
        at = events.index(("launch", ["s1"]))
        if ahead:
            assert events[at + 1 : at + 4] == [("call", ["s0"]), ("read", ["s1"]), ("call", ["s0", "s1"])], events
        else:
            assert events[at + 1 : at + 3] == [("read", ["s1"]), ("call", ["s0", "s1"])], events
        check_free(core)


@pytest.mark.parametrize("fails", ["launch", "read"])
def test_a_prefill_beside_a_call_that_fails_is_prefilled_again(engines, plain, monkeypatch, fails):
    """s1 arrives while s0 runs: its prefill is launched beside the step's call. Its launch fails (the step's own
    prefill takes s1 at once), or reading it fails (the verifier frees what the launch began, as
    Verifier.prefill_read does; the next step prefills s1 again). Both get plain decoding's tokens, nothing stays
    held."""
    v, d = engines
    cfg = CoreConfig(max_sequences=2, rounds_per_step=1, call_rounds=1, prefill_ahead=2)
    core = EngineCore(v, d, FixedPolicy(TREE), cfg)
    launch, read, batch, calls, failed = v.prefill_launch, v.prefill_read, v.prefill_batch, [], []

    def noted(items):
        ids = [it.seq_id for it in items]
        calls.append(("launch", ids))
        if fails == "launch" and "s1" in ids and not failed:
            failed.append(ids)
            raise RuntimeError("no room for the launch")
        return launch(items)

    def read_once(x):
        ids = [it.seq_id for it in x.items]
        if fails == "read" and "s1" in ids and not failed:
            failed.append(ids)
            v.release(ids)
            raise RuntimeError("the device lost the prefill")
        return read(x)

    def whole(items):
        calls.append(("prefill", [it.seq_id for it in items]))
        return batch(items)

    monkeypatch.setattr(v, "prefill_launch", noted)
    monkeypatch.setattr(v, "prefill_read", read_once)
    monkeypatch.setattr(v, "prefill_batch", whole)
    assert run_stream(core, {0: [req(0, max_new=12)], 2: [req(1, max_new=6)]}, []) == {
        "s0": plain[0][:12],
        "s1": plain[1][:6],
    }
    assert failed == [["s1"]], calls
    if fails == "launch":  # the same step prefills it
        at = calls.index(("launch", ["s1"]))
        assert calls[at + 1] == ("prefill", ["s1"]), calls
    else:  # launched again beside the next step's call
        assert calls.count(("launch", ["s1"])) == 2, calls
    check_free(core)


def test_a_prompt_aborted_while_its_prefill_runs_beside_a_call_is_released(engines, plain, monkeypatch):
    """s1 arrives between steps while s0 runs: its prefill is launched beside the step's call; the client aborts it
    as that call begins, and the launch after the call's first round takes the abort from the inbox before s1's
    prefill is read. The read leaves it out, the step's end releases its slot, s0 is untouched."""
    v, d = engines
    cfg = CoreConfig(max_sequences=2, rounds_per_step=2, call_rounds=2, prefill_ahead=2)
    core = EngineCore(v, d, FixedPolicy(TREE), cfg)
    verify, aborted = v.verify_rounds_steps, []

    def verified(items, rounds=1, then=None, each=None):
        if "s1" in core.seqs and core._ahead and not aborted:
            aborted.append(core.seqs["s1"].prefilled)
            core.abort("s1")
        return (yield from verify(items, rounds, then, each))

    monkeypatch.setattr(v, "verify_rounds_steps", verified)
    stream = []
    got = run_stream(core, {0: [req(0)], 1: [req(1)]}, stream)
    assert aborted == [len(PROMPTS[1])], aborted  # launched, not yet read, when aborted
    assert got["s0"] == plain[0] and not got.get("s1")
    assert [o.finish for o in stream if o.seq_id == "s1"] == [Finish.ABORT]
    check_free(core)


def test_a_prefill_beside_a_call_counts_once_in_the_engine_time(engines, plain, monkeypatch):
    """The scenario above on a clock that only the prefill launched beside a call moves (1 s): the engine time's
    phases hold that second once, in setup, whatever the verify call around it took."""
    v, d = engines
    now, launch, verify, inside, beside = [0.0], v.prefill_launch, v.verify_rounds_steps, [False], []

    def slow(items):
        if not core._ahead and any(it.seq_id == "s1" for it in items):
            beside.append(inside[0])
            now[0] += 1.0
        return launch(items)

    def counted(items, rounds=1, then=None, each=None):
        inside[0] = True
        out = yield from verify(items, rounds, then, each)
        inside[0] = False
        return out

    monkeypatch.setattr(v, "prefill_launch", slow)
    monkeypatch.setattr(v, "verify_rounds_steps", counted)
    cfg = CoreConfig(max_sequences=1, rounds_per_step=2, call_rounds=8, prefill_ahead=1)
    core = EngineCore(v, d, FixedPolicy(TREE), cfg, clock=lambda: now[0])
    stream = []

    def publish(outs):
        if "s1" not in core.seqs and not core._inbox and now[0] == 0.0:
            core.add(req(1))
        stream.extend(outs)

    core.publish = publish
    assert run_stream(core, {0: [req(0)]}, stream) == {"s0": plain[0], "s1": plain[1]}
    assert beside == [True]  # s1 was prefilled beside s0's call, not by a step's own prefill
    assert core.times["setup"] == 1.0 and sum(core.times.values()) == 1.0, dict(core.times)
    check_free(core)


def test_a_sampled_prompt_prefilled_beside_a_call_draws_as_a_steps_prefill_would(engines):
    """Seeded sampled requests, one arriving at each mid-call publish, two sequences at a time: with two prompts
    prefilled beside a call (prefill_ahead 2) each output is the one it gets with every prompt prefilled by a step
    (prefill_ahead 0): the first token is drawn with the request's own sampling and seed either way, and the
    later rounds run the same path. Prompts were launched beside a call in the first run."""
    v, d = engines
    got, beside = [], []
    for ahead in (2, 0):
        todo = [
            Request(f"s{i}", PROMPTS[i], SamplingConfig(temperature=0.8, top_p=0.9, seed=i + 3), max_new=12)
            for i in range(4)
        ]
        cfg = CoreConfig(max_sequences=2, rounds_per_step=2, call_rounds=8, prefill_ahead=ahead)
        core = EngineCore(v, d, FixedPolicy(TREE), cfg)
        stream = []
        launch = core._launch_ahead

        def noted(core=core, launch=launch, ahead=ahead):
            launch()
            if core._ahead:  # a prompt launched beside the call
                beside.append(ahead)

        core._launch_ahead = noted

        def publish(outs, core=core, todo=todo, stream=stream):
            stream.extend(outs)
            if todo:
                core.add(todo.pop(0))

        core.publish = publish
        got.append(run_stream(core, {0: [todo.pop(0)]}, stream))
        assert not todo
        check_free(core)
    assert got[0] == got[1] and sorted(got[0]) == ["s0", "s1", "s2", "s3"], got
    assert all(len(t) == 12 for t in got[0].values()) and 2 in beside


def test_a_failed_step_frees_a_prompt_prefilled_beside_its_call(engines, monkeypatch):
    """A step that fails (a bug) after a prompt was launched beside its call, before the read: fail_all fails every
    generation, the one in flight included, and leaves nothing held on either engine."""
    v, d = engines
    core = EngineCore(v, d, FixedPolicy(TREE), CoreConfig(max_sequences=1, rounds_per_step=2, prefill_ahead=1))
    launched = []
    launch = v.prefill_launch
    monkeypatch.setattr(v, "prefill_launch", lambda items: launched.append(items) or launch(items))
    core.publish = lambda outs: None if "s1" in core.seqs else core.add(req(1))
    read = core._read_ahead

    def failing(news):
        if core._ahead:
            raise RuntimeError("a bug")
        read(news)

    monkeypatch.setattr(core, "_read_ahead", failing)
    core.add(req(0))
    with pytest.raises(RuntimeError):
        for _ in range(20):
            core.step()
    assert [[it.seq_id for it in items] for items in launched] == [["s0"], ["s1"]]  # s1 beside a call, not read
    outs = core.fail_all(RuntimeError("a bug"))
    assert sorted(o.seq_id for o in outs) == ["s0", "s1"] and all(o.finish is Finish.ERROR for o in outs)
    check_free(core)


def test_a_call_with_a_row_not_drafted_on_the_device_does_not_go_on(engines, plain, monkeypatch):
    """A request pinning 3x8 beside one the policy keeps plain, calls of up to 8 rounds: the plain row rides in the
    tree rounds as a row of no tree (a token a round), so no call goes on past its rounds_per_step (2); both get
    plain decoding's tokens."""
    v, d = engines
    ran = rounds_run(v, monkeypatch)
    core = EngineCore(v, d, FixedPolicy(PLAIN), CoreConfig(max_sequences=2, rounds_per_step=2, call_rounds=8))
    got = run(core, {0: [req(0, 16, tree=TREE), req(1, 16)]})
    assert [got[f"s{i}"][0] for i in range(2)] == [plain[0], plain[1]]
    assert ran and max(ran) <= 2, ran
    check_free(core)


def test_a_pinned_row_beside_rows_that_go_plain_keeps_every_call_whole(engines, plain):
    """A request pinning 2x4 beside one the policy decides for, the policy choosing a tree twice, then plain,
    four rounds a call: when the next shape is plain for the policy's row only, the pinned row's trees go on
    being drafted on the device while the other row verifies no tree (not its last one again): both get plain
    decoding's tokens and no request fails."""
    v, d = engines
    core = EngineCore(v, d, Cycle([TREE, TREE, PLAIN]), CoreConfig(max_sequences=2, rounds_per_step=4))
    got = run(core, {0: [req(0, 16, tree=Shape(2, 4)), req(1, 16)]})
    assert [got[f"s{i}"][:2] for i in range(2)] == [(plain[0], Finish.LENGTH), (plain[1], Finish.LENGTH)]
    check_free(core)


class Ticks:
    """A clock that moves 10 us a read, and the test adds idle time to t itself."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1e-5
        return self.t


def test_idle_time_between_requests_is_no_calls_cost(engines, plain):
    """One request at a time, 40 ms idle between them (under the 50 ms within which two calls count as back to
    back): every cost the policy is told is a few clock reads (10 us each), none holds the idle time: after an
    idle wait the next call is not timed from the last one before it."""
    v, d = engines
    clock, policy = Ticks(), Cycle([PLAIN, TREE])
    core = EngineCore(v, d, policy, CoreConfig(max_sequences=2, plain_steps=2, rounds_per_step=2), clock=clock)
    one_at_a_time(core, clock, plain, tokens=8, idle_s=0.04)
    assert policy.seconds and max(policy.seconds) < 0.005, policy.seconds
    check_free(core)


def one_at_a_time(core: EngineCore, clock: Ticks, plain, tokens: int, idle_s: float) -> None:
    """Three requests of `tokens` tokens one at a time (each the reference's), idle_s of idle time after each."""
    for i in range(3):
        got = run(core, {0: [req(i, tokens)]})
        assert got[f"s{i}"][0] == plain[i][:tokens], i
        clock.t += idle_s
        core.wait(0.001)


def test_a_requests_only_call_after_idle_time_is_a_cost_sample(engines, plain):
    """One request at a time, each served by one tree call that goes on to its end (the batch is all there is):
    with nothing before it but idle time, the call is timed from its own start, and the policy is told of one
    tree call a request, its time a few clock reads a round."""
    v, d = engines
    clock, policy = Ticks(), Cycle([TREE])
    core = EngineCore(v, d, policy, CoreConfig(max_sequences=2, rounds_per_step=2, call_rounds=32), clock=clock)
    one_at_a_time(core, clock, plain, tokens=16, idle_s=1.0)
    assert [shape for _, shape, _ in policy.rounds] == [TREE] * 3, policy.rounds
    assert max(policy.seconds) < 0.005, policy.seconds
    check_free(core)


def test_a_catch_up_is_no_cost_sample_and_the_next_call_is(engines, plain, monkeypatch):
    """Plain calls of 10 steps, then two tree calls: in the first every row catches up (more new tokens than a
    round's), and building a joining row's propose input makes a clock jump 1 s. That call is not steady (its first
    round overlaps nothing): the policy is told of none of them, and of every tree call after a tree call, none
    holding a jump (every call whole: one round a step)."""
    v, d = engines
    clock, policy = Ticks(), Cycle([PLAIN, TREE, TREE])
    core = EngineCore(v, d, policy, CoreConfig(max_sequences=2, plain_steps=10, rounds_per_step=1), clock=clock)
    build, joined = core._propose_input, []

    def slow(s, t):
        it = build(s, t)
        if it.start or len(it.token_ids) > 8:
            joined.append(s.seq_id)
            clock.t += 1.0
        return it

    trees, told, catch_ups = core._trees, [], []
    monkeypatch.setattr(core, "_propose_input", slow)
    monkeypatch.setattr(core, "_trees", lambda spec: (out := trees(spec)) and catch_ups.append(out[2]) or out)
    observe = core._observe
    monkeypatch.setattr(core, "_observe", lambda *a, **k: told.append((a[2], a[4])) or observe(*a, **k))
    got = run(core, {0: [req(0, 40), req(1, 40)]})
    assert [got[f"s{i}"][0][:16] for i in range(2)] == [plain[0], plain[1]]  # the reference's 16 tokens
    steady = [ok for shape, ok in told if not shape.plain]  # a tree call's, in order, as its trees' catch-up flags
    assert len(steady) == len(catch_ups) and True in catch_ups and False in catch_ups, (steady, catch_ups)
    assert not any(ok for ok, caught in zip(steady, catch_ups) if caught), (steady, catch_ups)
    assert len(joined) > 2 and TREE in {shape for _, shape, _ in policy.rounds}, (joined, policy.rounds)
    assert max(policy.seconds) < 0.5, policy.seconds
    check_free(core)


def test_a_drafter_that_never_chains_has_its_one_round_calls_costed(engines, plain):
    """A drafter that declines every launch behind a verify (a draft service in another process): each tree call
    is one round, all it can be, and whole: the policy is told of tree calls (before, none: a call of one round
    was taken as cut short of the four it asked for)."""
    v, d = engines
    policy = Cycle([TREE])
    core = EngineCore(v, Declining(d), policy, CoreConfig(max_sequences=2, rounds_per_step=4))
    got = run(core, {0: [req(0, 16), req(1, 16)]})
    assert [got[f"s{i}"][0] for i in range(2)] == [plain[0][:16], plain[1][:16]]
    assert TREE in {shape for _, shape, _ in policy.rounds}, policy.rounds
    check_free(core)


class Declining:
    """A drafter that never drafts behind a verify (RemoteDrafter's launch_after)."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def launch_after(self, items, accepted, after=None):
        return None

    def take(self, items):
        return False


class Flaky:
    """The EAGLE drafter behind a link that goes down: proposes fail while `down`, and available() says so."""

    def __init__(self, inner):
        self.inner, self.down, self.name = inner, False, inner.name
        self.fails = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, items):
        if self.down:
            self.fails += 1
            raise PeerUnavailable("the draft is down")
        return self.inner.propose(items)

    def launch_after(self, items, accepted, after=None):
        return None  # a drafter in another process never drafts on this device

    def take(self, items):
        return False  # nor takes prompts in without a tree

    def available(self):
        return not self.down


def test_a_drafter_that_fails_costs_nothing_and_speculation_resumes(engines, plain):
    """The drafter goes down mid-run: the sequences go on plainly (same tokens), the core reports degraded; it
    comes back: they are caught up (features recomputed in the spare slot) and draft again."""
    v, d = engines
    flaky = Flaky(d)
    cfg = CoreConfig(max_sequences=4, plain_steps=1, rounds_per_step=1, draft_retry_s=1e-3)
    core = EngineCore(v, flaky, Cycle([Shape(1, 1), Shape(3, 8)]), cfg)
    for i in range(2):
        core.add(req(i))
    got = {f"s{i}": [] for i in range(2)}
    rounds_after = 0
    for step in range(200):
        if step == 3:
            flaky.down = True
        if step == 6:
            assert core.degraded and flaky.fails
            flaky.down = False
        for o in core.step():
            got[o.seq_id] += o.tokens
            if step > 6:
                rounds_after += o.rounds
        if not core.seqs:
            break
    for i in range(2):
        assert got[f"s{i}"] == plain[i], i
    assert flaky.fails and rounds_after > 0 and not core.degraded
    check_free(core)


def join_while_down(v, drafter) -> tuple[dict[str, list[int]], bool, EngineCore]:
    """s0 runs three steps on trees, then s1 joins with the drafter armed to go down as s1's prompt reaches it; it
    answers again from the step after the core went plain. -> (each sequence's tokens, whether the core went
    plain, the core)."""
    core = EngineCore(v, drafter, FixedPolicy(TREE), CoreConfig(max_sequences=2, rounds_per_step=1, draft_retry_s=1e-3))
    core.add(req(0, 16))
    got: dict[str, list[int]] = {}
    for _ in range(3):
        for o in core.step():
            got[o.seq_id] = got.get(o.seq_id, []) + o.tokens
    drafter.armed = True
    core.add(req(1, 16))
    degraded = False
    for _ in range(60):
        for o in core.step():
            got[o.seq_id] = got.get(o.seq_id, []) + o.tokens
        if core.degraded:
            degraded, drafter.down = True, False  # it answers again from the next step on
        if not core.seqs:
            break
    return got, degraded, core


class DownAtJoin(Flaky):
    """The drafter goes down during the propose of a joiner's prompt (once armed)."""

    armed = False

    def propose(self, items):
        if self.armed and any(it.start for it in items):
            self.down, self.armed = True, False
        return super().propose(items)


def test_a_drafter_lost_during_a_joiners_propose_fails_no_request(engines, plain):
    """A sequence runs on trees; a second joins and the drafter goes down during the joiner's propose: the other
    rows' proposes (built before it) fail plainly too, no step raises; once the drafter is back both are caught up,
    and both get the base model's tokens."""
    v, d = engines
    flaky = DownAtJoin(d)
    got, degraded, core = join_while_down(v, flaky)
    assert degraded and flaky.fails >= 1 and [got["s0"], got["s1"]] == [plain[0], plain[1]]
    d.release(["s0", "s1"])  # a drafter that went down lost what it held (a restarted process); this double kept it
    check_free(core)


def test_abort_and_a_one_token_budget(engines, plain):
    v, d = engines
    core = EngineCore(v, d, FixedPolicy(TREE), CoreConfig(max_sequences=4, rounds_per_step=1))
    got = run(core, {0: [req(0), req(1, max_new=1)]}, abort={3: "s0"})
    assert got["s1"][0] == plain[1][:1] and got["s1"][1] is Finish.LENGTH
    assert got["s0"][1] is Finish.ABORT and got["s0"][0] == plain[0][: len(got["s0"][0])]
    check_free(core)


def test_more_requests_than_slots_wait_their_turn(engines, plain):
    v, d = engines
    core = EngineCore(v, d, FixedPolicy(Shape(2, 4)), CoreConfig(max_sequences=2))
    got = run(core, {0: [req(i, 10) for i in range(4)]})
    for i in range(4):
        assert got[f"s{i}"][0] == plain[i][:10]
    check_free(core)


def test_oracle_drafters_accept_whole_chains_or_nothing(engines, plain):
    """The greedy oracle drafts the base model's own continuation (every round accepts its 4 levels: 5 tokens a
    round, the 10 after the prefill's first in 2 rounds); the wrong oracle drafts tokens the model never chooses
    (one token a round: 10 rounds). Both give plain decoding's tokens."""
    from common.engine.oracle import GreedyOracleDrafter, WrongOracleDrafter

    v, _ = engines
    deep = Shape(4, 20)
    for oracle, rounds in ((GreedyOracleDrafter, 2), (WrongOracleDrafter, 10)):
        core = EngineCore(v, oracle(v.model, 4, CPU), FixedPolicy(deep), CoreConfig(max_sequences=3))
        got = run(core, {0: [req(0, 11), req(1, 11)]})
        for i in range(2):
            tokens, _, n = got[f"s{i}"]
            assert tokens == plain[i][:11] and n == rounds, (oracle.__name__, i, n)
        assert core.choices[deep] == rounds and not core.seqs


def test_the_policy_hears_of_steady_rounds_only(engines):
    """Rounds that propose a joiner's first tree (its whole prompt through the drafter) are not steady: the
    policy's cost samples come from the rounds after them."""
    v, d = engines
    policy = Cycle([TREE])
    torch.manual_seed(0)
    core = EngineCore(v, d, policy, CoreConfig(max_sequences=4, call_rounds=4))  # calls of 4 rounds at most
    run(core, {0: [req(0, 12), req(1, 12)]})
    assert policy.rounds and all(shape == TREE for _, shape, _ in policy.rounds)
    spec_rounds = sum(n for s, n in core.choices.items() if not s.plain)
    assert len(policy.rounds) < spec_rounds  # the first round (the joiners' proposes) was left out


def test_sampled_rounds_chain_on_the_device_with_the_hosts_tokens(engines, plain):
    """Seeded requests at temperature 0.7 (top-p 0.9) beside a greedy one, one-hot trees: up to four rounds a
    verifier call, each round's one-hot sets built in the verify (common.kernels.onehot_sets), give the tokens
    of rounds whose trees the host reads and whose sets it packs (common.tree.row_sets: a drafter that never
    drafts behind a verify); the greedy one stays plain decoding's."""
    v, d = engines
    assert d.drafting.sampling_rule == "onehot"
    hot = [SamplingConfig(temperature=0.7, top_p=0.9, seed=11), SamplingConfig(temperature=0.7, seed=5)]
    got, settled = [], []
    settle = d.settle_after
    d.settle_after = lambda h: settled.append(h) or settle(h)
    try:
        for drafter in (d, Flaky(d)):  # Flaky: launch_after declines, every tree read and packed by the host
            core = EngineCore(v, drafter, FixedPolicy(TREE), CoreConfig(max_sequences=4, rounds_per_step=4))
            reqs = [Request(f"s{i}", PROMPTS[i], s, max_new=16) for i, s in enumerate(hot)] + [req(2)]
            got.append(run(core, {0: reqs}))
            check_free(core)
            if drafter is d:
                assert settled, "no round was chained"
                chained = len(settled)
    finally:
        d.settle_after = settle
    assert len(settled) == chained  # the host's rounds: nothing chained
    assert got[0] == got[1]
    assert got[0]["s2"][0] == plain[2] and got[0]["s0"][0] != plain[0]


class Counting(Flaky):
    """The EAGLE drafter in this process (it drafts behind verifies and takes prompts in), its proposes' and takes'
    items recorded; take fails once armed (the drafter goes down), and everything while down (Flaky)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.proposed: list[tuple[str, bool]] = []  # (seq id, a start item) of every propose
        self.taken: list[str] = []
        self.armed = False

    def propose(self, items):
        if not self.down:
            self.proposed += [(it.seq_id, it.start) for it in items]
        return super().propose(items)

    def take(self, items):
        if self.armed:
            self.down, self.armed = True, False
        if self.down:
            raise PeerUnavailable("the draft is down")
        self.taken += [it.seq_id for it in items]
        return self.inner.take(items)

    def launch_after(self, items, accepted, after=None):
        return None if self.down else self.inner.launch_after(items, accepted, after)


def test_a_joiner_beside_running_rows_is_taken_in_and_drafts_behind_its_first_verify(engines, plain):
    """A sequence runs on trees; a second joins: its prompt is taken in without a propose (nothing waited for), its
    first round decodes one token in the others' verify, and its trees come from the drafting behind it (no
    propose for it ever). A lone first request is proposed (a decode round of its own would cost a round). Both
    get the base model's tokens; the joiner's first round (no tree) is not counted as one of its tree rounds."""
    v, d = engines
    drafter = Counting(d)
    core = EngineCore(v, drafter, Cycle([TREE]), CoreConfig(max_sequences=2, rounds_per_step=1))
    tokens: dict[str, list[int]] = {"s0": [], "s1": []}
    rounds, drafted = 0, 0  # s1's tree rounds and the nodes they verified
    core.add(req(0, 16))
    for step in range(60):
        if step == 2:
            core.add(req(1, 16))
        for o in core.step():
            tokens[o.seq_id] += o.tokens
            if o.seq_id == "s1":
                rounds, drafted = rounds + o.rounds, drafted + o.drafted
        if step > 2 and not core.seqs:
            break
    assert [tokens["s0"], tokens["s1"]] == [plain[0], plain[1]]
    assert drafter.taken == ["s1"] and drafter.proposed[0] == ("s0", True), (drafter.taken, drafter.proposed)
    assert all(sid != "s1" for sid, _ in drafter.proposed), drafter.proposed
    # every round counted verified a whole 3x8 tree: the first round (a decode, no tree) is not one of them
    assert rounds > 0 and drafted == TREE.nodes * rounds, (rounds, drafted)
    check_free(core)


def test_a_drafter_lost_during_a_joiners_take_fails_no_request(engines, plain):
    """The drafter goes down as a joiner's prompt is taken in: the core goes plain (no step raises), and once the
    drafter answers again both sequences are caught up and draft; both get the base model's tokens."""
    v, d = engines
    drafter = Counting(d)
    got, degraded, core = join_while_down(v, drafter)
    assert degraded and [got["s0"], got["s1"]] == [plain[0], plain[1]]
    assert ("s1", True) in drafter.proposed  # caught up after the failure: a start item proposed
    d.release(["s0", "s1"])  # a drafter that went down lost what it held (a restarted process); this double kept it
    check_free(core)


def test_sampled_joiners_taken_in_reproduce_their_seeded_tokens(engines, plain):
    """Seeded requests at temperature 0.7 joining a row that drafts (one-hot trees) are taken in without a tree (their
    first round a decode in its verify): two runs give the same tokens (a seed reproduces an output on one path; the
    one-hot rule's draws test each drafted node, so another path, a proposed first tree, draws other tokens of the
    same distribution), and the greedy row stays plain decoding's."""
    v, d = engines
    hot = [SamplingConfig(temperature=0.7, top_p=0.9, seed=11), SamplingConfig(temperature=0.7, seed=5)]
    got = []
    for _ in range(2):
        drafter = Counting(d)
        cfg = CoreConfig(max_sequences=4, rounds_per_step=2, call_rounds=2)  # s2 alone does not run to its end
        core = EngineCore(v, drafter, FixedPolicy(TREE), cfg)
        late = [Request(f"s{i}", PROMPTS[i], s, max_new=16) for i, s in enumerate(hot)]
        got.append(run(core, {0: [req(2)], 1: late}))
        check_free(core)
        assert sorted(drafter.taken) == ["s0", "s1"], drafter.taken
    assert got[0] == got[1]
    assert got[0]["s2"][0] == plain[2] and got[0]["s0"][0] != plain[0]
