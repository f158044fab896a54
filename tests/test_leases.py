"""Bookkeeping of ownership and health, without processes: leases (takeover, expiry, anonymous
sequences), the capacity tracker, the draft link, TensorRef size checks; and the channel's reconnect
backoff against a real server that goes away and comes back on its port."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from common.errors import InvalidRequest
from common.leases import ANONYMOUS, LeaseTable
from common.rpc import CHANNEL_OPTIONS, start_server
from common.tensors import checked_shape
from services.gateway.health import Capacity, DraftLink, HealthConfig
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc


def test_takeover_frees_the_predecessors_sequences_only():
    t = LeaseTable(ttl_s=10)
    t.connect("gw.a", "gw", now=0)
    t.connect("other.x", "other", now=0)
    t.add("gw.a-0", "gw.a", now=0)
    t.add("gw.a-1", "gw.a", now=0)
    t.add("other.x-0", "other.x", now=0)
    assert t.connect("gw.b", "gw", now=3) == ["gw.a-0", "gw.a-1"]
    assert len(t) == 1 and t.owner_of("other.x-0") == "other.x"
    assert t.connect("gw.b", "gw", now=4) == []  # reconnecting is not a takeover of oneself


def test_owner_that_stops_renewing_expires_with_its_sequences():
    t = LeaseTable(ttl_s=10)
    t.connect("gw.a", "gw", now=0)
    t.add("s1", "gw.a", now=0)
    t.renew("gw.a", now=8)
    assert t.expired(now=17) == []  # renewed at 8: good until 18
    assert t.expired(now=18.5) == ["s1"]
    assert len(t) == 0 and "gw.a" not in t.owners


def test_renewal_after_expiry_or_restart_grants_a_new_lease():
    t = LeaseTable(ttl_s=10)
    t.renew("gw.a", now=0)  # unknown here (this service restarted): a fresh lease, nothing to free
    t.add("s1", "gw.a", now=1)
    assert t.expired(now=5) == [] and t.owner_of("s1") == "gw.a"


def test_anonymous_sequences_live_while_used():
    t = LeaseTable(ttl_s=10)
    t.add("tool", ANONYMOUS, now=0)
    t.touch(["tool"], now=9)
    assert t.expired(now=15) == []
    assert t.expired(now=19.5) == ["tool"]


def test_release_forgets_the_sequence():
    t = LeaseTable(ttl_s=10)
    t.add("s1", "gw.a", now=0)
    t.remove(["s1", "never-there"])
    assert len(t) == 0 and t.connect("gw.b", "gw", now=1) == []


def test_lease_config_is_validated():
    with pytest.raises(ValueError):
        LeaseTable(ttl_s=0)
    with pytest.raises(ValueError):
        LeaseTable(ttl_s=1).connect("", "gw", now=0)
    with pytest.raises(ValueError):
        HealthConfig(capacity_timeout_s=-1)


def test_capacity_stalls_only_when_exhausted_for_longer_than_the_timeout():
    c = Capacity(timeout_s=30)
    c.observe(False, 0)
    c.observe(False, 20)
    c.observe(True, 25)
    assert not c.stalled(26)
    for now in (30, 50, 61):
        c.observe(False, now)
    assert c.stalled(61) and not c.stalled(59)


def test_draft_link_degrades_and_retries():
    d = DraftLink(retry_s=0.5)
    d.failed(10.0)
    assert d.degraded and not d.may_try(10.2) and d.may_try(10.6)
    d.succeeded()
    assert not d.degraded
    d.probed(False, 20.0)
    assert d.degraded and not d.may_try(20.1)
    d.probed(True, 21.0)
    assert not d.degraded


@pytest.mark.parametrize(
    "shape, dtype, needle",
    [
        ([2**32, 2**32], "float32", "exceeds"),  # 2**64 elements: an int64 product would wrap to 0
        ([2**62, 4], "float32", "exceeds"),
        ([-1, 4], "float32", "invalid"),
        ([1, 1, 1, 1, 1], "float32", "invalid"),
        ([2, 2], "complex64", "dtype"),
    ],
)
def test_tensor_shapes_are_checked_before_allocating(shape, dtype, needle):
    with pytest.raises(InvalidRequest, match=needle):
        checked_shape(pb.TensorRef(shape=shape, dtype=dtype))
    assert checked_shape(pb.TensorRef(shape=[3, 4], dtype="bfloat16"))[2] == 24


def test_reconnect_is_prompt_after_a_long_outage():
    """A peer down for 12 s while calls keep trying (as the gateway's health probes do), then back on its
    port: with gRPC's default backoff (1 s, x1.6: attempts near 1, 2.6, 5.2, 9.3, 15.9 s) the first call
    to get through comes ~4 s after it is back (5.1 s measured); with ours (100 ms, at most 1 s) within
    ~1 s (0.97 s measured)."""

    async def call(stub) -> bool:
        try:
            await stub.Info(pb.InfoRequest(), timeout=1)
        except grpc.aio.AioRpcError as e:
            return e.code() == grpc.StatusCode.UNIMPLEMENTED  # reached a server (one without Info)
        return True

    async def go() -> float:
        first = await start_server("127.0.0.1:0", [], ["probe"])
        port = first.port
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
        stub = pb_grpc.VerifierStub(ch)
        assert await call(stub)
        await first.stop(0)
        t_end = time.monotonic() + 12
        while time.monotonic() < t_end:
            await call(stub)
            await asyncio.sleep(0.2)
        second = await start_server(f"127.0.0.1:{port}", [], ["probe"])
        t0 = time.monotonic()
        while not await call(stub):
            await asyncio.sleep(0.05)
        took = time.monotonic() - t0
        await second.stop(0)
        await ch.close()
        return took

    took = asyncio.run(go())
    assert took < 2.0, f"reconnected {took:.2f} s after the peer came back"
