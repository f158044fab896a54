"""Hostile input: the public request size limit, tokenizing off the event loop, and a fuzz corpus
against the internal APIs (every malformed call is INVALID_ARGUMENT or NOT_FOUND, never INTERNAL or
UNKNOWN; nothing is left allocated; every service stays up)."""

from __future__ import annotations

import random
import threading
import time

import grpc
import numpy as np
import pytest
import torch

from common.tensors import encode_inline
from services.tree_wire import draft_tree
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc
from tests.faults import complete, figures, health, held
from tests.helpers import chat

pytestmark = pytest.mark.slow
WIDTH = 3 * 576  # SmolLM2-135M: hidden size 576
GOOD_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


def test_request_size_limit(stack):
    with pytest.raises(grpc.RpcError) as e:
        complete(stack.gateway, chat("x " * (5 << 19), max_tokens=4))  # 5 MiB of prompt
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert all(stack.alive().values())
    figures("size-limit", sent_bytes=5 << 20, code=e.value.code().name)


def test_tokenizing_does_not_block_the_event_loop(stack):
    """While a 3.5 MB prompt is tokenized, health checks are answered."""
    answered, done = [], threading.Event()

    def probe() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            if health(stack.gateway, timeout=5) == "SERVING":
                answered.append(time.monotonic() - t0)
            time.sleep(0.05)

    t = threading.Thread(target=probe, daemon=True)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        t.start()
        complete(stack.gateway, chat("hello world " * 290_000, max_tokens=4))
    took = time.monotonic() - t0
    done.set()
    t.join()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in e.value.details()
    assert answered  # the loop answered while the tokenizer worked
    figures("tokenize-off-loop", request_s=took, health_answers=len(answered), slowest_health_s=max(answered))


def _propose(seq_id: str, tokens: list[int], hidden: torch.Tensor, start: bool = True, **kw) -> pb.ProposeItem:
    item = pb.ProposeItem(seq_id=seq_id, token_ids=tokens, start=start, context_prefix=kw.pop("prefix", [1]), **kw)
    encode_inline(hidden, item.hidden)
    return item


def _corpus() -> list[tuple[str, str, object]]:
    """(service, method, request) triples that must all be refused cleanly."""
    ok = torch.zeros(2, WIDTH)
    nan = ok.clone()
    nan[1, 7] = float("nan")
    overflow = _propose("f-ovf", [5, 6], ok)
    overflow.hidden.shape[:] = [2**32, 2**32]
    negative = _propose("f-neg", [5, 6], ok)
    negative.hidden.shape[:] = [-2, WIDTH]
    many_dims = _propose("f-dims", [5, 6], ok)
    many_dims.hidden.shape[:] = [1, 1, 1, 1, 2, WIDTH]
    bad_dtype = _propose("f-dt", [5, 6], ok)
    bad_dtype.hidden.dtype = "complex128"
    return [
        ("draft", "Propose", pb.ProposeRequest(items=[_propose("f-oov", [5, 10**6], ok)])),
        ("draft", "Propose", pb.ProposeRequest(items=[_propose("f-neg-id", [5, -3], ok)])),
        ("draft", "Propose", pb.ProposeRequest(items=[_propose("f-pre", [5, 6], ok, prefix=[10**7])])),
        ("draft", "Propose", pb.ProposeRequest(items=[_propose("f-nan", [5, 6], nan)])),
        (
            "draft",
            "Propose",
            pb.ProposeRequest(items=[_propose("f-int", [5, 6], torch.zeros(2, WIDTH, dtype=torch.int32))]),
        ),
        ("draft", "Propose", pb.ProposeRequest(items=[_propose("f-wide", [5, 6], torch.zeros(2, WIDTH + 1))])),
        ("draft", "Propose", pb.ProposeRequest(items=[overflow])),
        ("draft", "Propose", pb.ProposeRequest(items=[negative])),
        ("draft", "Propose", pb.ProposeRequest(items=[many_dims])),
        ("draft", "Propose", pb.ProposeRequest(items=[bad_dtype])),
        ("draft", "Propose", pb.ProposeRequest(items=[_propose("f-mx", [5, 6], ok, max_nodes=-1)])),
        ("draft", "Propose", pb.ProposeRequest(items=[_propose("f-d", [5, 6], ok), _propose("f-d", [5, 6], ok)])),
        ("draft", "Propose", pb.ProposeRequest(items=[_propose("f-ghost", [5, 6], ok, start=False)])),
        ("draft", "Propose", pb.ProposeRequest()),
        ("verifier", "Prefill", pb.PrefillRequest(items=[pb.PrefillItem(seq_id="f-p", token_ids=[1, 2, 10**6])])),
        ("verifier", "Prefill", pb.PrefillRequest(items=[pb.PrefillItem(seq_id="f-e", token_ids=[])])),
        (
            "verifier",
            "Prefill",
            pb.PrefillRequest(
                items=[
                    pb.PrefillItem(seq_id="f-s", token_ids=[1, 2], sampling=pb.SamplingParams(temperature=float("nan")))
                ]
            ),
        ),
        ("verifier", "Prefill", pb.PrefillRequest(items=[pb.PrefillItem(seq_id="", token_ids=[1, 2])])),
        ("verifier", "Prefill", pb.PrefillRequest(items=[pb.PrefillItem(seq_id="f-long", token_ids=[5] * 600)])),
        ("verifier", "Decode", pb.DecodeRequest(items=[pb.DecodeItem(seq_id="f-ghost")])),
        ("verifier", "Decode", pb.DecodeRequest()),
        (
            "verifier",
            "Verify",
            pb.VerifyRequest(items=[pb.VerifyItem(seq_id="f-ghost", tree=draft_tree([5], [-1]))]),
        ),
        ("verifier", "Features", pb.FeaturesRequest(items=[pb.FeaturesItem(seq_id="f-ghost", token_ids=[1])])),
        ("verifier", "Features", pb.FeaturesRequest()),
        ("verifier", "Lease", pb.LeaseRequest(instance_id="")),
    ]


def _stubs(stack):
    return {
        "draft": pb_grpc.DraftStub(grpc.insecure_channel(stack.address("draft"))),
        "verifier": pb_grpc.VerifierStub(grpc.insecure_channel(stack.address("verifier"))),
    }


def test_internal_fuzz_corpus(stack):
    stubs = _stubs(stack)
    before = held(stack)
    codes = []
    for service, method, request in _corpus():
        with pytest.raises(grpc.RpcError) as e:
            getattr(stubs[service], method)(request, timeout=60)
        assert e.value.code() in GOOD_CODES, (service, method, e.value.code(), e.value.details())
        codes.append(e.value.code())
    # a multi-item prefill whose second item fails leaves the first one's slot free
    v = stubs["verifier"]
    with pytest.raises(grpc.RpcError) as e:
        v.Prefill(
            pb.PrefillRequest(
                items=[
                    pb.PrefillItem(seq_id="f-a", token_ids=[1, 2, 3]),
                    pb.PrefillItem(seq_id="f-b", token_ids=[1, 10**6]),
                ]
            ),
            timeout=60,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    r = v.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(seq_id="f-a", token_ids=[1, 2, 3])]), timeout=60)
    v.Release(pb.ReleaseRequest(seq_ids=["f-a"]), timeout=60)
    assert len(r.results) == 1
    assert held(stack) == before
    assert all(stack.alive().values())
    figures("fuzz-corpus", sent=len(codes) + 2, internal_or_unknown=0)


def test_undecodable_bytes_are_invalid_argument(stack):
    garbage = [b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", bytes(range(256))]
    n = 0
    for addr, path in [
        (stack.address("verifier"), "/specdec.v1.Verifier/Prefill"),
        (stack.address("draft"), "/specdec.v1.Draft/Propose"),
        (stack.gateway, "/specdec.v1.Generation/Complete"),
        (stack.gateway, "/specdec.v1.Generation/Generate"),
    ]:
        with grpc.insecure_channel(addr) as ch:
            for raw in garbage:
                call = (ch.unary_stream if path.endswith("Generate") else ch.unary_unary)(path)
                with pytest.raises(grpc.RpcError) as e:
                    r = call(raw, timeout=30)
                    if path.endswith("Generate"):
                        list(r)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, e.value.code(), e.value.details())
                n += 1
    with grpc.insecure_channel(stack.address("draft")) as ch:
        stream = ch.stream_stream("/specdec.v1.Draft/ProposeStream")
        with pytest.raises(grpc.RpcError) as e:
            list(stream(iter([b"\xff\xff\xff"]), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    figures("undecodable", sent=n + 1, invalid_argument=n + 1)


def test_mutated_messages_never_internal(stack):
    """Seeded random byte flips of valid internal requests: each call succeeds or is refused with a
    specific code; sequences a mutated prefill created are released."""
    stubs = _stubs(stack)
    rng = random.Random(0)
    hidden = torch.from_numpy(np.random.default_rng(0).standard_normal((3, WIDTH)).astype(np.float32))
    seeds = [
        ("verifier", "Prefill", pb.PrefillRequest(items=[pb.PrefillItem(seq_id="m-p", token_ids=[1, 2, 3])])),
        ("draft", "Propose", pb.ProposeRequest(items=[_propose("m-d", [5, 6, 7], hidden)])),
    ]
    allowed = GOOD_CODES | {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    response_type = {"verifier": pb.PrefillResponse, "draft": pb.ProposeResponse}
    seen: dict[str, int] = {}
    for i in range(60):
        service, method, msg = seeds[i % 2]
        raw = bytearray(msg.SerializeToString())
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(min(len(raw), 64))] = rng.randrange(256)
        path = f"/specdec.v1.{'Verifier' if service == 'verifier' else 'Draft'}/{method}"
        with grpc.insecure_channel(stack.address(service)) as ch:
            try:
                resp = response_type[service].FromString(ch.unary_unary(path)(bytes(raw), timeout=60))
                code, details = grpc.StatusCode.OK, ""
                stubs[service].Release(pb.ReleaseRequest(seq_ids=[r.seq_id for r in resp.results]), timeout=60)
            except grpc.RpcError as e:
                code, details = e.code(), e.details()
        assert code in allowed, (service, method, code, details)
        seen[code.name] = seen.get(code.name, 0) + 1
    assert held(stack) == (0, 0)
    assert all(stack.alive().values())
    figures("mutation-fuzz", sent=60, **seen)
