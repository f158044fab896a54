"""The public API through a real client (grpcurl): the documented requests, describe, health, and
INVALID_ARGUMENT for bad input while every service stays up. The internal services refuse malformed
generations, unknown sequences and bad features alone."""

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from common.tensors import encode_inline
from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import generation_pb2_grpc as gpb_grpc
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc
from tests.helpers import grpcurl

pytestmark = pytest.mark.slow
COMPLETE = "specdec.v1.Generation/Complete"


def test_documented_requests(stack):
    """The README's requests, the policy's, plain and pinned sent at once (they share the verifier's steps)."""
    question = {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 48}
    variants = [question, {**question, "speculative": False}, {**question, "tree": {"depth": 4, "nodes": 16}}]
    with ThreadPoolExecutor(len(variants)) as pool:
        done = list(pool.map(lambda data: grpcurl(stack.gateway, COMPLETE, data=data), variants))
    for d in done:
        assert d.returncode == 0, d.stderr
    spec, plain, pinned = (json.loads(d.stdout) for d in done)
    assert spec["token_ids"] == plain["token_ids"] == pinned["token_ids"] and len(spec["token_ids"]) > 0
    assert spec["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_EOS")
    assert spec["usage"]["completion_tokens"] == len(spec["token_ids"])
    assert int(pinned["speculation"]["rounds"]) > 0  # the pinned tree drafts every round
    info = json.loads(grpcurl(stack.gateway, "specdec.v1.Generation/GetModelInfo").stdout)
    assert info["speculation_policy"] == "adaptive"
    assert any(c["tree"].get("depth") == 4 and c["tree"].get("nodes") == 16 for c in info["policy_choices"])
    assert any(e["batch"] == 1 and "tokens_per_s" in e for e in info["policy_estimates"])
    raw = grpcurl(stack.gateway, COMPLETE, data={"prompt": "raw text", "max_tokens": 8})
    assert raw.returncode == 0, raw.stderr
    assert json.loads(raw.stdout)["usage"]["prompt_tokens"] == 2


def test_describe_health_and_reflection(stack):
    d = grpcurl(stack.gateway, "describe", "specdec.v1.Generation.Complete")
    assert d.returncode == 0, d.stderr
    assert "rpc Complete" in d.stdout
    for port in stack.ports.values():
        h = grpcurl(f"127.0.0.1:{port}", "grpc.health.v1.Health/Check")
        assert h.returncode == 0 and "SERVING" in h.stdout, h.stderr
    listed = grpcurl(stack.gateway, "list").stdout
    assert "specdec.v1.Generation" in listed and "grpc.health.v1.Health" in listed


BAD = [
    ({"messages": [{"role": "user", "content": ""}]}, "empty"),
    ({"prompt": "   "}, "empty"),
    ({}, "no input"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "temperature": "NaN"}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "word " * 600}, "context"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"promptTokenIds": [1, 99999999]}, "vocabulary"),
    ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "only one"),
    ({"prompt": "hi", "tree": {"depth": 0, "nodes": 0}}, "tree"),
    ({"prompt": "hi", "tree": {"depth": 4, "nodes": 2}}, "nodes >= depth"),
    ({"prompt": "hi", "tree": {"depth": 9, "nodes": 20}}, "beyond the draft"),
    ({"prompt": "hi", "tree": {"depth": 1, "nodes": 20}}, "at depth 1"),
]


@pytest.mark.parametrize("request_json, needle", BAD, ids=[n for _, n in BAD])
def test_bad_input_is_invalid_argument(stack, request_json, needle):
    r = grpcurl(stack.gateway, COMPLETE, data=request_json)
    assert r.returncode != 0
    assert "InvalidArgument" in r.stderr, r.stderr
    assert needle in r.stderr.lower()
    assert all(stack.alive().values())


def test_services_still_serve_after_bad_input(stack):
    with grpc.insecure_channel(stack.gateway) as ch:
        r = gpb_grpc.GenerationStub(ch).Complete(gpb.GenerateRequest(prompt="Hello", max_tokens=4), timeout=120)
    assert len(r.token_ids) == 4


def _generate(addr: str, adds: list[pb.NewGeneration]) -> list[pb.GenerateOut]:
    """The verifier's Generate stream: these generations in, every message until each has finished."""
    with grpc.insecure_channel(addr) as ch:
        outs, left = [], {a.seq for a in adds}
        for out in pb_grpc.VerifierStub(ch).Generate(iter([pb.GenerateIn(add=adds)]), timeout=300):
            outs.append(out)
            seqs, fin = np.frombuffer(out.seq, "<i8"), np.frombuffer(out.finish, "<i4")
            left -= {int(q) for q, f in zip(seqs, fin) if f}
            if not left:
                return outs
    raise AssertionError("the stream ended before every generation finished")


def _new(seq: int, prompt: list[int], **kw) -> pb.NewGeneration:
    return pb.NewGeneration(seq=seq, prompt_ids=np.asarray(prompt, "<i4").tobytes(), max_new=kw.pop("max_new", 4), **kw)


@pytest.mark.parametrize(
    "bad, needle",
    [
        (dict(prompt=[]), "empty"),
        (dict(prompt=[1, 10**7]), "vocabulary"),
        (dict(prompt=[1, 2], max_new=0), "max_new"),
        (dict(prompt=[1, 2], tree=gpb.TreeShape(depth=9, nodes=20)), "beyond the draft"),
        (dict(prompt=[1, 2], tree=gpb.TreeShape(depth=3, nodes=2)), "nodes >= depth"),
        (dict(prompt=[1, 2], sampling=pb.SamplingParams(temperature=-1)), "temperature"),
    ],
)
def test_the_verifier_refuses_a_bad_generation_alone(stack, bad, needle):
    """A malformed generation on the verifier's stream fails alone, with INVALID_ARGUMENT saying what is wrong;
    the good one beside it is served."""
    outs = _generate(stack.address("verifier"), [_new(1, bad.pop("prompt"), **bad), _new(2, [1, 9690, 198])])
    failed = [f for o in outs for f in o.failed]
    assert len(failed) == 1 and failed[0].seq == 1
    assert failed[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and needle in failed[0].message
    tokens = sum(int(np.frombuffer(o.count, "<i4")[np.frombuffer(o.seq, "<i8") == 2].sum()) for o in outs)
    assert tokens == 4
    assert all(stack.alive().values())


def test_the_draft_refuses_unknown_sequences_and_bad_features(stack):
    import torch

    d = pb_grpc.DraftStub(grpc.insecure_channel(stack.address("draft")))
    item = pb.ProposeItem(seq_id="ghost", token_ids=[5])
    encode_inline(torch.zeros(1, 3 * 576), item.hidden)
    code, _ = _code(lambda: d.Propose(pb.ProposeRequest(items=[item], owner="test")))
    assert code == grpc.StatusCode.NOT_FOUND
    bad = pb.ProposeItem(seq_id="x", token_ids=[5, 6], start=True)
    encode_inline(torch.from_numpy(np.zeros((1, 3 * 576), dtype=np.float32)), bad.hidden)
    code, details = _code(lambda: d.Propose(pb.ProposeRequest(items=[bad], owner="test")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "hidden rows" in details
    assert all(stack.alive().values())


def _code(call):
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()
