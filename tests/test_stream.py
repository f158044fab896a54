"""The per-round calls on long-lived streams (Draft.ProposeStream, Verifier.VerifyStream), through the
gateway's clients against the real services: a failed call is that call's error (the status the
unary call would end with) and the stream carries the next call; a round gives the same results
on the stream as unary."""

import asyncio

import grpc
import pytest
import torch

from common.config import SamplingConfig
from common.rounds import start_shift
from common.tensors import encode_inline
from services.gateway.clients import DraftClient, VerifierClient
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
PROMPT = [1, 9690, 314, 260, 2152, 30]


def _clients(stack):
    return (
        VerifierClient(f"127.0.0.1:{stack.ports['verifier']}", timeout=120),
        DraftClient(f"127.0.0.1:{stack.ports['draft']}", timeout=120),
    )


def test_invalid_tree_fails_only_its_call_on_the_stream(stack):
    async def go():
        v, _ = _clients(stack)
        try:
            await v.prefill("st-bad", PROMPT, SamplingConfig(), want_hidden=False)
            one = pb.DraftTree(token_ids=[5], parents=[-1])
            first = await v.verify([("st-bad", one)])
            opened = v.streamed._stream
            assert opened is not None and len(first.results[0].tokens) >= 1
            bad = pb.DraftTree(token_ids=[5, 6], parents=[-1, 7])  # parent index out of range
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await v.verify([("st-bad", bad)])
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside" in e.value.details()
            # the same stream carries the next call, and the sequence is untouched
            ok = await v.verify([("st-bad", one)])
            assert len(ok.results[0].tokens) >= 1
            assert v.streamed._stream is opened and not opened.done() and v.streamed.streaming
            # an unknown sequence is NOT_FOUND, as on the unary call
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await v.verify([("ghost", one)])
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert v.streamed._stream is opened
        finally:
            await v.release(["st-bad"])
            await v.close()

    asyncio.run(go())
    assert all(stack.alive().values())


def test_invalid_propose_fails_only_its_call_on_the_stream(stack):
    async def go():
        _, d = _clients(stack)
        try:
            bad = pb.ProposeItem(seq_id="st-x", token_ids=[5, 6], start=True)
            encode_inline(torch.zeros(1, 3 * 576), bad.hidden)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await d.propose([bad])
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hidden rows" in e.value.details()
            opened = d.streamed._stream
            good = pb.ProposeItem(seq_id="st-x", token_ids=[5, 6], start=True, context_prefix=[1])
            encode_inline(torch.zeros(2, 3 * 576), good.hidden)
            r = await d.propose([good])
            assert len(r.results[0].token_ids) > 0 and d.streamed._stream is opened
        finally:
            await d.release(["st-x"])
            await d.close()

    asyncio.run(go())


def test_rounds_are_identical_on_stream_and_unary(stack):
    """Two sequences with the same prompt, one driven over the streams and one over the unary
    calls, for three rounds: the same trees, accepted tokens, hidden states."""

    async def go():
        v, d = _clients(stack)
        seqs = {"st-s": True, "st-u": False}
        try:
            nxt = {}
            for s in seqs:
                pre = await v.prefill(s, PROMPT, SamplingConfig(), want_hidden=True)
                token_ids, prefix = start_shift(PROMPT, pre.next_token)
                nxt[s] = pb.ProposeItem(
                    seq_id=s, token_ids=token_ids, hidden=pre.hidden, start=True, context_prefix=prefix, max_nodes=30
                )
            for _ in range(3):
                out = {}
                for s, stream in seqs.items():
                    proposed = await d.propose([nxt[s]], stream=stream)
                    verified = await v.verify([(s, proposed.results[0])], stream=stream)
                    r = verified.results[0]
                    out[s] = (proposed.results[0], r.tokens, r.hidden)
                    nxt[s] = pb.ProposeItem(seq_id=s, token_ids=r.tokens, hidden=r.hidden, max_nodes=30)
                (ts, ks, hs), (tu, ku, hu) = out["st-s"], out["st-u"]
                assert ts == tu and len(ts.token_ids) > 0
                assert ks == ku
                assert hs.shape == hu.shape and hs.inline_data == hu.inline_data
            assert v.streamed._stream is not None and d.streamed._stream is not None
        finally:
            await v.release(list(seqs))
            await d.release(list(seqs))
            await v.close()
            await d.close()

    asyncio.run(go())


def test_raw_stream_answers_every_request_in_order(stack):
    """The wire contract, without the gateway's client: one response per request, `error` set only on
    the failed one."""
    ch = grpc.insecure_channel(f"127.0.0.1:{stack.ports['verifier']}")
    v = pb_grpc.VerifierStub(ch)
    v.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(seq_id="st-raw", token_ids=PROMPT)]))
    one = pb.DraftTree(token_ids=[5], parents=[-1])
    reqs = [
        pb.VerifyRequest(items=[pb.VerifyItem(seq_id="st-raw", tree=one)]),
        pb.VerifyRequest(),  # no items
        pb.VerifyRequest(items=[pb.VerifyItem(seq_id="st-raw", tree=one)]),
    ]
    try:
        resps = list(v.VerifyStream(iter(reqs), timeout=120))
        assert len(resps) == 3
        assert not resps[0].HasField("error") and len(resps[0].results) == 1
        assert resps[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "no items" in resps[1].error.message
        assert not resps[2].HasField("error") and len(resps[2].results) == 1
    finally:
        v.Release(pb.ReleaseRequest(seq_ids=["st-raw"]))
        ch.close()
