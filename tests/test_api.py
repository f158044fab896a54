"""The public API through a real client (grpcurl): the documented requests, describe, health, and
INVALID_ARGUMENT for bad input while every service stays up. Internal services reject malformed
trees and unknown sequences."""

import json

import grpc
import numpy as np
import pytest

from common.tensors import encode_inline
from services.tree_wire import draft_tree
from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import generation_pb2_grpc as gpb_grpc
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc
from tests.helpers import grpcurl

pytestmark = pytest.mark.slow
COMPLETE = "specdec.v1.Generation/Complete"


def test_documented_requests(stack):
    question = {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 48}
    spec = grpcurl(stack.gateway, COMPLETE, data=question)
    assert spec.returncode == 0, spec.stderr
    spec = json.loads(spec.stdout)
    plain = json.loads(grpcurl(stack.gateway, COMPLETE, data={**question, "speculative": False}).stdout)
    pinned = grpcurl(stack.gateway, COMPLETE, data={**question, "tree": {"depth": 4, "nodes": 16}})
    assert pinned.returncode == 0, pinned.stderr
    pinned = json.loads(pinned.stdout)
    assert spec["token_ids"] == plain["token_ids"] == pinned["token_ids"] and len(spec["token_ids"]) > 0
    assert spec["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_EOS")
    assert spec["usage"]["completion_tokens"] == len(spec["token_ids"])
    assert int(pinned["speculation"]["rounds"]) > 0  # the pinned tree drafts every round
    info = json.loads(grpcurl(stack.gateway, "specdec.v1.Generation/GetModelInfo").stdout)
    assert info["speculation_policy"] == "adaptive"
    assert any(c["tree"].get("depth") == 4 and c["tree"].get("nodes") == 16 for c in info["policy_choices"])
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


def _verifier(stack):
    return pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{stack.ports['verifier']}"))


def _code(call):
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


@pytest.mark.parametrize(
    "tokens, parents, needle",
    [
        ([5, 6], [-1, 7], "outside"),  # parent index out of range
        ([5, 6, 7], [-1, 2, 1], "does not precede"),  # cycle 1 -> 2 -> 1
        ([5] * 100, [-1] * 100, "limit"),  # over the verifier's tree size
        ([5, 10**7], [-1, 0], "vocabulary"),
    ],
)
def test_verifier_rejects_malformed_trees(stack, tokens, parents, needle):
    v = _verifier(stack)
    v.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(seq_id="t", token_ids=[1, 2, 3])]))
    try:
        code, details = _code(
            lambda: v.Verify(pb.VerifyRequest(items=[pb.VerifyItem(seq_id="t", tree=draft_tree(tokens, parents))]))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details
        # the sequence is untouched and still verifies
        one = draft_tree([5], [-1])
        ok = v.Verify(pb.VerifyRequest(items=[pb.VerifyItem(seq_id="t", tree=one)]))
        assert len(ok.results[0].accepted_tokens) >= 1
    finally:
        v.Release(pb.ReleaseRequest(seq_ids=["t"]))


def test_internal_services_unknown_sequence_is_not_found(stack):
    v = _verifier(stack)
    code, _ = _code(lambda: v.Decode(pb.DecodeRequest(items=[pb.DecodeItem(seq_id="ghost")])))
    assert code == grpc.StatusCode.NOT_FOUND
    d = pb_grpc.DraftStub(grpc.insecure_channel(f"127.0.0.1:{stack.ports['draft']}"))
    item = pb.ProposeItem(seq_id="ghost", token_ids=[5])
    import torch

    encode_inline(torch.zeros(1, 3 * 576), item.hidden)
    code, _ = _code(lambda: d.Propose(pb.ProposeRequest(items=[item])))
    assert code == grpc.StatusCode.NOT_FOUND
    bad = pb.ProposeItem(seq_id="x", token_ids=[5, 6], start=True)
    encode_inline(torch.from_numpy(np.zeros((1, 3 * 576), dtype=np.float32)), bad.hidden)
    code, details = _code(lambda: d.Propose(pb.ProposeRequest(items=[bad])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "hidden rows" in details
    assert all(stack.alive().values())
