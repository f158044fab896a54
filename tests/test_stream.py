"""The per-round calls on long-lived streams (Draft.ProposeStream, Verifier.VerifyStream), through the
gateway's clients against the real services: a failed call is that call's error (the status the
unary call would end with) and the stream carries the next call; a round gives the same results
on the stream as unary."""

import asyncio

import grpc
import numpy as np
import pytest
import torch

from common.config import SamplingConfig
from common.tensors import encode_inline
from services.clients import DraftClient, RoundItem, VerifierClient, start_item
from services.tree_wire import draft_tree
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
PROMPT = [1, 9690, 314, 260, 2152, 30]


def _clients(stack):
    return (
        VerifierClient(f"127.0.0.1:{stack.ports['verifier']}", timeout=120),
        DraftClient(f"127.0.0.1:{stack.ports['draft']}", timeout=120),
    )


async def _started(v: VerifierClient, seqs) -> dict[str, pb.ProposeItem]:
    """Each sequence prefilled with PROMPT, and the draft's start item for it."""
    nxt = {}
    for s in seqs:
        pre = await v.prefill(s, PROMPT, SamplingConfig(), want_hidden=True)
        nxt[s] = start_item(s, PROMPT, pre.next_token, pre.hidden, pb.SamplingParams(), (0, 30))
    return nxt


def test_invalid_tree_fails_only_its_call_on_the_stream(stack):
    async def go():
        v, _ = _clients(stack)
        try:
            await v.prefill("st-bad", PROMPT, SamplingConfig(), want_hidden=False)
            one = draft_tree([5], [-1])
            first = await v.verify([RoundItem("st-bad", one)])
            opened = v.streamed._stream
            assert opened is not None and len(first.results[0].tokens) >= 1
            bad = draft_tree([5, 6], [-1, 7])  # parent index out of range
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await v.verify([RoundItem("st-bad", bad)])
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside" in e.value.details()
            # the same stream carries the next call, and the sequence is untouched
            ok = await v.verify([RoundItem("st-bad", one)])
            assert len(ok.results[0].tokens) >= 1
            assert v.streamed._stream is opened and not opened.done() and v.streamed.streaming
            # an unknown sequence is NOT_FOUND, as on the unary call
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await v.verify([RoundItem("ghost", one)])
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
            nxt = await _started(v, seqs)
            for _ in range(3):
                out = {}
                for s, stream in seqs.items():
                    proposed = await d.propose([nxt[s]], stream=stream)
                    verified = await v.verify([RoundItem(s, proposed.results[0])], stream=stream)
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


def test_chained_rounds_equal_rounds_the_gateway_proposes(stack):
    """The round protocol against the real services: one sequence whose outcome the verifier sends to the
    draft itself (next tree kept there, the next Verify names it `chained`), one whose every tree the
    caller proposes, same prompt, four rounds: the same tokens; the chained trees come from the draft's
    calls that the verifier reports. Then the protocol's bad input: a chained item with no pending tree is
    a per-item draft_error (the call succeeds), a tree and `chained` together or next_nodes without an
    address are INVALID_ARGUMENT."""
    draft_addr = f"127.0.0.1:{stack.ports['draft']}"

    async def go():
        v, d = _clients(stack)
        seqs = ["st-chain", "st-direct"]
        try:
            nxt = await _started(v, seqs)
            first = (await d.propose([nxt["st-chain"]])).results[0]
            got = {s: [] for s in seqs}
            for i in range(4):
                item = RoundItem("st-chain", first if i == 0 else None, next=(4, 30))
                c = await v.verify([item], draft=draft_addr)
                r = c.results[0]
                assert r.chained and not r.draft_error and not r.hidden.ByteSize() and r.nodes > 0
                assert (c.draft_batch > 0) == (i > 0)  # rounds after the first verify a tree the draft chained
                got["st-chain"] += r.tokens
                proposed = await d.propose([nxt["st-direct"]])
                r = (await v.verify([RoundItem("st-direct", proposed.results[0])])).results[0]
                got["st-direct"] += r.tokens
                nxt["st-direct"] = pb.ProposeItem(seq_id="st-direct", token_ids=r.tokens, hidden=r.hidden, max_nodes=30)
            assert got["st-chain"] == got["st-direct"] and len(got["st-chain"]) > 4
            # the last round chained a tree; a Decode drops it (and waits for it), then nothing is pending
            await v.decode(["st-chain"])
            lost = (await v.verify([RoundItem("st-chain", None)])).results[0]
            assert lost.draft_error and not lost.tokens
            one = draft_tree([5], [-1])
            bad = pb.VerifyRequest(items=[pb.VerifyItem(seq_id="st-direct", tree=one, chained=True)])
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await v.stub.Verify(bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "one or the other" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await v.verify([RoundItem("st-direct", one, next=(2, 4))])
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "draft address" in e.value.details()
            # a queued call's item for a sequence released since (its call before stopped it) is answered
            # with nothing beside the others; without `follows` an unknown id is NOT_FOUND
            gone = RoundItem("st-released", None, None, 8, b"", follows=True)
            ok = await v.verify([gone, RoundItem("st-direct", one)])
            assert ok.results[0].tokens == [] and not ok.results[0].draft_error and len(ok.results[1].tokens) >= 1
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await v.verify([RoundItem("st-released", None)])
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            await v.release(seqs)
            await d.release(seqs)
            await v.close()
            await d.close()

    asyncio.run(go())
    assert all(stack.alive().values())


def test_raw_stream_answers_every_request_in_order(stack):
    """The wire contract, without the gateway's client: one response per request, `error` set only on
    the failed one."""
    ch = grpc.insecure_channel(f"127.0.0.1:{stack.ports['verifier']}")
    v = pb_grpc.VerifierStub(ch)
    v.Prefill(pb.PrefillRequest(items=[pb.PrefillItem(seq_id="st-raw", token_ids=PROMPT)]))
    one = draft_tree([5], [-1])
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


def test_chunked_prefill_on_the_wire(stack):
    """Prefill in two chunks (more=True, then the rest) returns what one Prefill returns: the same first
    token and, with want_hidden, the hidden states of the whole prompt (gathered across the chunks); a
    Verify between the chunks is INVALID_ARGUMENT and leaves the sequence to its last chunk."""
    ch = grpc.insecure_channel(f"127.0.0.1:{stack.ports['verifier']}")
    v = pb_grpc.VerifierStub(ch)

    def prefill(seq_id: str, tokens: list[int], more: bool = False) -> pb.PrefillResult:
        item = pb.PrefillItem(seq_id=seq_id, token_ids=tokens, want_hidden=True, more=more)
        return v.Prefill(pb.PrefillRequest(items=[item]), timeout=60).results[0]

    try:
        whole = prefill("st-whole", PROMPT)
        assert prefill("st-chunks", PROMPT[:4], more=True).next_token == 0
        with pytest.raises(grpc.RpcError) as e:
            v.Verify(pb.VerifyRequest(items=[pb.VerifyItem(seq_id="st-chunks", tree=draft_tree([5], [-1]))]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "still being prefilled" in e.value.details()
        last = prefill("st-chunks", PROMPT[4:])
        assert last.next_token == whole.next_token
        assert list(last.hidden.shape) == list(whole.hidden.shape) == [len(PROMPT), 3 * 576]
        a = np.frombuffer(last.hidden.inline_data, dtype=np.float32)
        b = np.frombuffer(whole.hidden.inline_data, dtype=np.float32)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    finally:
        v.Release(pb.ReleaseRequest(seq_ids=["st-whole", "st-chunks"]))
        ch.close()


def test_a_prefill_that_asks_for_the_first_tree_equals_the_callers_propose(stack):
    """A prompt prefilled in two chunks whose last asks for its first tree (next_nodes: the verifier hands
    the prompt's features to the draft, as after a round) answers `chained` with no hidden states, and its
    first Verify, naming it chained, gives what the caller's own start propose and Verify give for the same
    prompt. Bad input is INVALID_ARGUMENT: next_nodes on a chunk that more follow, without want_hidden, or
    without a draft address."""
    draft_addr = f"127.0.0.1:{stack.ports['draft']}"

    def item(seq_id: str, tokens: list[int], **kw) -> pb.PrefillItem:
        return pb.PrefillItem(seq_id=seq_id, token_ids=tokens, want_hidden=True, **kw)

    async def go():
        v, d = _clients(stack)
        try:
            await v.prefill_many([item("st-pre-chain", PROMPT[:4], more=True)])
            (last,) = await v.prefill_many([item("st-pre-chain", PROMPT[4:], next_nodes=30)], draft=draft_addr)
            assert last.chained and not last.hidden.ByteSize()
            nxt = await _started(v, ["st-pre-direct"])
            tree = (await d.propose([nxt["st-pre-direct"]])).results[0]
            both = await v.verify([RoundItem("st-pre-chain", None), RoundItem("st-pre-direct", tree)])
            chained, direct = both.results
            assert not chained.draft_error and chained.tokens == direct.tokens and chained.nodes == direct.nodes
            assert both.draft_batch == 1  # the chained tree came from the draft call the prefill made
            for bad, addr, words in [
                (item("st-pre-bad", PROMPT[:4], more=True, next_nodes=30), draft_addr, "last chunk"),
                (pb.PrefillItem(seq_id="st-pre-bad", token_ids=PROMPT, next_nodes=30), draft_addr, "want_hidden"),
                (item("st-pre-bad", PROMPT, next_nodes=30), "", "draft address"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await v.prefill_many([bad], draft=addr)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details(), words
        finally:
            await v.release(["st-pre-chain", "st-pre-direct", "st-pre-bad"])
            await d.release(["st-pre-chain", "st-pre-direct"])
            await v.close()
            await d.close()

    asyncio.run(go())
    assert all(stack.alive().values())
