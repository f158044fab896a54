"""Process failures through `python -m services.stack`, run as users run it (`make serve`; the real model on CPU,
processes on loopback), which supervises its children: the draft, the verifier or the gateway killed with -9 and
restarted by the stack, a child that keeps dying or cannot start, and requests cancelled or expired by the dozen.
Each test logs its figures (`FAULT name: ...`; run with -o log_cli=true --log-cli-level=INFO)."""

from __future__ import annotations

import random
import time

import grpc
import pytest

from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import generation_pb2_grpc as gpb_grpc
from tests.conftest import CHAT_PROMPTS
from tests.faults import (
    EXIT_CHILD_FAILED,
    ServedStack,
    Streams,
    all_start_together,
    answers,
    complete,
    figures,
    health,
    wait_for,
)
from tests.helpers import chat, complete_many

pytestmark = pytest.mark.slow
TREE = gpb.TreeShape(depth=3, nodes=8)  # pinned: these requests draft every round, whatever the policy


class Shared:
    """The stack the tests share, started again when a test has ended it."""

    def __init__(self, folder) -> None:
        self.folder, self.stack, self.n = folder, None, 0

    def get(self) -> ServedStack:
        if self.stack is None or self.stack.proc.poll() is not None:
            self.close()
            self.n += 1
            self.stack = ServedStack.launch(self.folder / f"stack{self.n}")
        return self.stack

    def close(self) -> None:
        if self.stack is not None:
            self.stack.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    s = Shared(tmp_path_factory.mktemp("faults"))
    yield s
    s.close()


@pytest.fixture
def served(shared) -> ServedStack:
    s = shared.get()
    yield s
    assert not s.children_left() or s.proc.poll() is None, s.logs()


def test_draft_killed_with_six_in_flight_nothing_is_lost(served):
    """kill -9 the draft while 6 greedy generations speculate: 6 of 6 complete, equal to plain decoding; the stack
    serves throughout and restarts the draft; a request that pins a tree speculates again within 30 s."""
    s = served
    n_tokens = 40
    prompts = CHAT_PROMPTS[:6]
    streams = Streams(s.gateway, [chat(p, max_tokens=n_tokens, ignore_eos=True, tree=TREE) for p in prompts])
    streams.wait_tokens(2)
    old = s.kill("draft")
    killed_at = time.monotonic()
    serving_after_kill = health(s.gateway)
    outcomes = streams.join(timeout=180)
    s.serving_again("draft", old, timeout=120)
    restarted = time.monotonic() - killed_at

    def speculates() -> bool:
        r = complete(s.gateway, chat("Hello!", max_tokens=8, ignore_eos=True, tree=TREE))
        return r.speculation.rounds > 0

    wait_for(speculates, timeout=60, interval=0.1)
    speculating = time.monotonic() - killed_at
    # compared after the restart, so that the plain requests do not slow it down
    plain = complete_many(
        s.gateway, [chat(p, max_tokens=n_tokens, ignore_eos=True, speculative=False) for p in prompts]
    )
    complete_ok = sum(o.error is None and len(o.tokens) == n_tokens for o in outcomes)
    equal = sum(o.tokens == list(r.token_ids) for o, r in zip(outcomes, plain))
    figures(
        "draft-kill",
        sent=len(outcomes),
        completed=complete_ok,
        equal_to_plain=equal,
        health_after_kill=serving_after_kill,
        draft_serving_again_s=restarted,
        speculating_again_s=speculating,
        restarts=s.state()["draft"]["restarts"],
    )
    assert not streams.failed, [str(o.error) for o in streams.failed]
    assert complete_ok == equal == len(prompts)
    assert serving_after_kill == "SERVING" and health(s.gateway) == "SERVING"
    assert s.state()["draft"]["restarts"] >= 1
    assert speculating <= 30


def test_verifier_killed_waiting_requests_are_served_and_streams_end_unavailable(served):
    """kill -9 the verifier with 4 generations streaming: those fail with UNAVAILABLE saying the verifier restarted;
    4 requests sent while it is down wait for its restart and succeed; health is NOT_SERVING while it is down and
    SERVING once it is back; requests succeed again within 30 s."""
    s = served
    streams = Streams(s.gateway, [chat(p, max_tokens=64, ignore_eos=True) for p in CHAT_PROMPTS[:4]])
    streams.wait_tokens(2)
    old = s.kill("verifier")
    killed_at = time.monotonic()
    waiting = Streams(s.gateway, [chat(p, max_tokens=8, ignore_eos=True) for p in CHAT_PROMPTS[4:8]], timeout=90)
    try:
        not_serving = wait_for(lambda: health(s.gateway, timeout=1) == "NOT_SERVING", timeout=10, interval=0.05)
    except TimeoutError:
        not_serving = None
    wait_for(lambda: answers(s.gateway), timeout=60, interval=0.1)
    recovery = time.monotonic() - killed_at
    s.serving_again("verifier", old, timeout=120)
    back = time.monotonic() - killed_at
    wait_for(lambda: health(s.gateway) == "SERVING", timeout=30, interval=0.05)
    serving = time.monotonic() - killed_at
    streamed, waited = streams.join(timeout=60), waiting.join(timeout=120)
    figures(
        "verifier-kill",
        streaming=len(streamed),
        streams_failed=len(streams.failed),
        sent_while_down=len(waited),
        sent_while_down_failed=len(waiting.failed),
        not_serving_after_s=-1.0 if not_serving is None else not_serving,
        verifier_serving_again_s=back,
        requests_succeed_again_s=recovery,
        health_serving_again_s=serving,
    )
    for o in streamed:
        assert o.error is not None and o.error.code() == grpc.StatusCode.UNAVAILABLE, o.error or len(o.tokens)
        details = o.error.details().lower()
        assert "verifier" in details and "restart" in details, o.error.details()
    assert not waiting.failed, [str(o.error) for o in waiting.failed]
    assert all(len(o.tokens) == 8 for o in waited)
    assert not_serving is not None, "health was not NOT_SERVING while the verifier was down"
    assert recovery <= 30


def test_gateway_killed_is_restarted_and_nothing_it_held_is_lost(served):
    """kill -9 the gateway with 6 generations streaming (they fail: their connection is gone): the stack restarts
    it, requests succeed again within 30 s, and every slot the dead gateway held is free (8 generations at once
    all start before any finishes)."""
    s = served
    streams = Streams(s.gateway, [chat(p, max_tokens=64, ignore_eos=True) for p in CHAT_PROMPTS[:6]])
    streams.wait_tokens(2)
    old = s.kill("gateway")
    killed_at = time.monotonic()
    streams.join(timeout=60)
    wait_for(lambda: answers(s.gateway, timeout=5), timeout=60, interval=0.1)
    recovery = time.monotonic() - killed_at
    s.serving_again("gateway", old, timeout=120)
    back = time.monotonic() - killed_at
    spread = all_start_together(s.gateway)
    figures(
        "gateway-kill",
        in_flight_failed=len(streams.failed),
        gateway_serving_again_s=back,
        requests_succeed_again_s=recovery,
        first_tokens_of_8_within_s=spread,
    )
    assert len(streams.failed) == 6
    assert recovery <= 30


def test_cancelled_and_expired_requests_leave_nothing_behind(served):
    """Every slot taken by 8 long generations: 3 requests that expire while queued and 40 cancelled at random
    moments (queued, mid-prefill, mid-round) leave nothing behind: afterwards 8 generations at once all start
    before any finishes."""
    s = served
    blockers = Streams(s.gateway, [chat(p, max_tokens=48, ignore_eos=True) for p in CHAT_PROMPTS[:8]])
    blockers.wait_tokens(1)
    expiring = Streams(s.gateway, [chat(f"Question {i}", max_tokens=8) for i in range(3)], timeout=0.5)
    expiring.join(timeout=30)
    rng = random.Random(0)
    with grpc.insecure_channel(s.gateway) as ch:
        stub = gpb_grpc.GenerationStub(ch)
        calls = [stub.Complete.future(chat(rng.choice(CHAT_PROMPTS), max_tokens=48), timeout=120) for _ in range(40)]
        for c in calls:
            time.sleep(rng.uniform(0, 0.1))
            c.cancel()
        cancelled = sum(c.cancelled() for c in calls)
    blockers.join(timeout=240)
    spread = all_start_together(s.gateway)
    figures(
        "cancel-and-expire",
        expired_in_queue=sum(o.error is not None for o in expiring.outcomes),
        cancelled=cancelled,
        blockers_failed=len(blockers.failed),
        first_tokens_of_8_within_s=spread,
    )
    assert all(o.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED for o in expiring.outcomes)
    assert not blockers.failed, [str(o.error) for o in blockers.failed]


def test_a_child_that_keeps_dying_stops_the_stack(served):
    """kill -9 the draft each time the stack starts it again: at its fifth death within a minute the stack stops
    with exit status 3 and a clear error, and no process is left."""
    s = served
    t0 = time.monotonic()
    pid = s.kill("draft")
    for _ in range(4):  # the stack may give up sooner: an earlier test's draft death counts within the window
        wait_for(
            lambda p=pid: s.proc.poll() is not None or s.state().get("draft", {}).get("pid") not in (None, p),
            timeout=60,
            interval=0.02,
        )
        if s.proc.poll() is not None:
            break
        pid = s.kill("draft")
    code = s.proc.wait(timeout=60)
    stopped = time.monotonic() - t0
    wait_for(lambda: not s.children_left(), timeout=15)
    text = (s.folder / "stack.log").read_text()
    figures("keeps-dying", kills=5, exit_status=code, stopped_after_s=stopped, processes_left=len(s.children_left()))
    assert code == EXIT_CHILD_FAILED, s.logs()
    assert "draft died 5 times within 60 s (last: killed by SIGKILL" in text, text[-3000:]
    assert not s.state()  # the state file goes with the stack


def test_a_child_that_cannot_start_stops_the_stack_at_once(tmp_path):
    """A draft given a model that does not exist: the stack exits with status 3 and the draft's error, and no
    process is left."""
    s = ServedStack.launch(tmp_path, "--draft-arg=--model=/nonexistent/model.gguf", wait=False)
    try:
        t0 = time.monotonic()
        code = s.proc.wait(timeout=120)
        took = time.monotonic() - t0
        text = (tmp_path / "stack.log").read_text()
        figures("cannot-start", exit_status=code, stopped_after_s=took, processes_left=len(s.children_left()))
        assert code == EXIT_CHILD_FAILED, s.logs()
        assert "draft failed to start (exit status 1" in text and "nonexistent" in text, text[-3000:]
        assert not s.children_left()
    finally:
        s.close()
