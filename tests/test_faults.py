"""Process failures through the three services as real processes on loopback (CPU): the draft killed
mid-batch, the gateway killed and restarted, the verifier killed and restarted, a cancellation storm,
requests expiring in the queue, and health that tells the truth. Each test logs its figures
(`FAULT name: sent=.. failed=.. recovery_s=..`; run with -o log_cli=true --log-cli-level=INFO)."""

from __future__ import annotations

import random
import time

import grpc
import pytest

from services.stack import Stack
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc
from tests.conftest import CHAT_PROMPTS, COMMON
from tests.faults import Streams, complete, figures, health, held, info, wait_for
from tests.helpers import chat, complete_many

pytestmark = pytest.mark.slow
LEASE_TTL = 2.0
CAPACITY_TIMEOUT = 2.0
# the fixed policy: every round drafts (the adaptive one may decode plainly on a CPU, and these tests are
# about what happens to speculation when a process fails)
GATEWAY = ["--health-interval", "0.2", "--capacity-timeout", str(CAPACITY_TIMEOUT), "--policy", "fixed"]


@pytest.fixture(scope="module")
def faulty():
    """A stack of its own (the tests kill its processes and start them again on the same ports), with
    short leases so that expiry is observable."""
    s = Stack(common_args=[*COMMON, "--lease-ttl", str(LEASE_TTL)], gateway_args=list(GATEWAY), drain_grace=5)
    s.start()
    yield s
    s.stop()


def _restart_gateway(s: Stack, *extra: str) -> None:
    s.kill("gateway")
    s.gateway_args = [*GATEWAY, *extra]
    s.restart("gateway")


def test_draft_killed_mid_batch_nothing_fails(faulty):
    """kill -9 the draft while 8 generations (2 of them plain) share the rounds: none fails, the greedy
    output equals plain decoding; health stays SERVING with the speculation reported degraded; once the
    draft is back the sequences return to speculation."""
    s = faulty
    prompts = CHAT_PROMPTS[:6]
    n_tokens = 40
    spec_reqs = [chat(p, max_tokens=n_tokens, ignore_eos=True) for p in prompts]
    streams = Streams(
        s.gateway, spec_reqs + [chat(p, max_tokens=n_tokens, ignore_eos=True, speculative=False) for p in prompts[:2]]
    )
    streams.wait_tokens(2)
    s.kill("draft")
    killed_at = time.monotonic()
    time.sleep(1.0)
    assert health(s.gateway) == "SERVING"
    with grpc.insecure_channel(s.gateway) as ch:
        from specdec.v1 import generation_pb2 as gpb
        from specdec.v1 import generation_pb2_grpc as gpb_grpc

        assert gpb_grpc.GenerationStub(ch).GetModelInfo(gpb.ModelInfoRequest(), timeout=10).speculation_degraded
    outcomes = streams.join()
    assert not streams.failed, [str(o.error) for o in streams.failed]
    plain = complete_many(
        s.gateway, [chat(p, max_tokens=n_tokens, ignore_eos=True, speculative=False) for p in prompts]
    )
    for o, r in zip(outcomes, plain):
        assert o.tokens == list(r.token_ids)
    outage = time.monotonic() - killed_at
    s.restart("draft")
    back_at = time.monotonic()

    def speculates() -> bool:
        return complete(s.gateway, chat("Hello!", max_tokens=8, ignore_eos=True)).speculation.rounds > 0

    recovery = wait_for(speculates, timeout=30, interval=0.05)
    assert wait_for(lambda: held(s) == (0, 0), timeout=10) >= 0
    figures(
        "draft-kill", sent=len(outcomes), failed=len(streams.failed), outage_s=outage, back_to_speculation_s=recovery
    )
    assert time.monotonic() - back_at < 30


def test_gateway_killed_and_restarted_frees_its_sequences(faulty):
    """kill -9 the gateway mid-generation: the restarted gateway frees its predecessor's sequences at
    start-up (takeover) and serves; killed and not restarted, the leases expire within the TTL."""
    s = faulty
    streams = Streams(s.gateway, [chat(p, max_tokens=64, ignore_eos=True) for p in CHAT_PROMPTS[:6]])
    streams.wait_tokens(2)
    s.kill("gateway")
    streams.join()
    stranded = held(s)
    assert stranded == (6, 6)  # what the old gateway held, now ownerless
    s.restart("gateway")
    after_restart = held(s)
    assert after_restart == (0, 0)  # freed at the new instance's start, not after a TTL
    ok = complete_many(s.gateway, [chat(p, max_tokens=16) for p in CHAT_PROMPTS[:4]])
    assert all(len(r.token_ids) > 0 for r in ok)
    assert wait_for(lambda: held(s) == (0, 0), timeout=5) >= 0

    streams = Streams(s.gateway, [chat(p, max_tokens=64, ignore_eos=True) for p in CHAT_PROMPTS[:4]])
    streams.wait_tokens(2)
    s.kill("gateway")
    killed = time.monotonic()
    expired = wait_for(lambda: held(s) == (0, 0), timeout=LEASE_TTL * 4)
    figures(
        "gateway-kill",
        sent=10,
        failed_in_flight=10,
        next_requests_ok=len(ok),
        held_before_restart=stranded,
        held_after_restart=after_restart,
        lease_expiry_s=time.monotonic() - killed,
    )
    assert expired <= LEASE_TTL * 4
    s.restart("gateway")


def test_verifier_killed_only_in_flight_fail_and_recovery_is_prompt(faulty):
    """kill -9 the verifier: the generations in flight fail with UNAVAILABLE and a message naming the
    verifier, the gateway says NOT_SERVING, new requests are refused; once the verifier serves again on
    its port, requests succeed within 5 s and nothing is left held."""
    s = faulty
    streams = Streams(s.gateway, [chat(p, max_tokens=64, ignore_eos=True) for p in CHAT_PROMPTS[:4]])
    streams.wait_tokens(2)
    s.kill("verifier")
    outcomes = streams.join()
    assert len(streams.failed) == len(outcomes)
    for o in streams.failed:
        assert o.error.code() == grpc.StatusCode.UNAVAILABLE and "Verifier" in o.error.details(), o.error
    wait_for(lambda: health(s.gateway) == "NOT_SERVING", timeout=5)
    with pytest.raises(grpc.RpcError) as e:
        complete(s.gateway, chat("Hi", max_tokens=4))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    s.restart("verifier")

    def answers() -> bool:
        try:
            return len(complete(s.gateway, chat("Hi", max_tokens=4), timeout=30).token_ids) == 4
        except grpc.RpcError:
            return False

    recovery = wait_for(answers, timeout=30, interval=0.05)
    wait_for(lambda: health(s.gateway) == "SERVING", timeout=5)
    assert wait_for(lambda: held(s) == (0, 0), timeout=5) >= 0
    figures("verifier-kill", sent=len(outcomes), failed_in_flight=len(streams.failed), recovery_s=recovery)
    assert recovery < 5.0


def test_expired_and_cancelled_requests_leave_the_queue(faulty):
    """One generation runs (max_active 1) and the queue holds 3: three requests that expire while queued
    give their places back at once, so the next request is queued, not RESOURCE_EXHAUSTED."""
    s = faulty
    _restart_gateway(s, "--max-active", "1", "--max-waiting", "3")
    try:
        blocker = Streams(
            s.gateway, [chat("Tell me a long story.", max_tokens=120, ignore_eos=True, speculative=False)]
        )
        blocker.wait_tokens(1)
        expiring = Streams(s.gateway, [chat(f"Question {i}", max_tokens=8) for i in range(3)], timeout=0.5)
        expiring.join()
        assert all(o.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED for o in expiring.outcomes)
        fresh = complete(s.gateway, chat("Hi", max_tokens=4), timeout=300)
        assert len(fresh.token_ids) == 4
        blocker.join()
        assert not blocker.failed
        figures("queue-deadline", sent=5, expired_in_queue=3, fresh_ok=1)
    finally:
        _restart_gateway(s)


def test_cancellation_storm_leaks_nothing(faulty):
    """40 generations, each cancelled at a random moment (queued, mid-prefill, mid-round): afterwards no
    sequence is held on either service and a fresh request is served."""
    s = faulty
    rng = random.Random(0)
    with grpc.insecure_channel(s.gateway) as ch:
        from specdec.v1 import generation_pb2_grpc as gpb_grpc

        stub = gpb_grpc.GenerationStub(ch)
        calls = [stub.Complete.future(chat(rng.choice(CHAT_PROMPTS), max_tokens=48), timeout=120) for _ in range(40)]
        for c in calls:
            time.sleep(rng.uniform(0, 0.15))
            c.cancel()
        cancelled = sum(c.cancelled() for c in calls)
    released = wait_for(lambda: held(s) == (0, 0), timeout=10)
    r = complete(s.gateway, chat("Hello!", max_tokens=8))
    assert len(r.token_ids) == 8
    figures("cancel-storm", sent=len(calls), cancelled=cancelled, all_released_within_s=released)


def test_health_not_serving_without_capacity_then_serving(faulty):
    """Every verifier slot held by someone else (here: anonymous sequences): after the capacity timeout
    the gateway says NOT_SERVING; once they are released it serves again."""
    s = faulty
    # the previous test's last request releases its sequence after its response: wait for that
    wait_for(lambda: held(s) == (0, 0), timeout=10)
    v = pb_grpc.VerifierStub(grpc.insecure_channel(s.address("verifier")))
    ids = [f"squatter{i}" for i in range(info(s.address("verifier")).max_sequences)]
    v.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(seq_id=i, token_ids=[1, 2, 3]) for i in ids]), timeout=60)

    def not_serving_while_squatting() -> bool:
        # a decode step touches the squatters' anonymous leases (TTL LEASE_TTL, as long as the capacity
        # timeout): without it they could expire before the gateway gives up on capacity
        v.Decode(pb.DecodeRequest(items=[pb.DecodeItem(seq_id=i) for i in ids]), timeout=60)
        return health(s.gateway) == "NOT_SERVING"

    try:
        stalled = wait_for(not_serving_while_squatting, timeout=CAPACITY_TIMEOUT + 5)
        for _ in range(3):
            assert not_serving_while_squatting()
    finally:
        v.Release(pb.ReleaseRequest(seq_ids=ids), timeout=60)
    back = wait_for(lambda: health(s.gateway) == "SERVING", timeout=5)
    assert len(complete(s.gateway, chat("Hi", max_tokens=4)).token_ids) == 4
    figures("capacity-health", not_serving_after_s=stalled, serving_again_after_s=back)
