"""The verifier's host path in batches, pinned against the per-item rules it replaced: the trees of a Verify
read and checked in one numpy pass (the same trees, the same error for the first bad one), the hidden rows
of many sequences written into the exported buffer in one copy (where one write each puts them), the verify
block packed at once; and the servicer over a real channel on a tiny random model, once with the hidden
buffer (on the CPU) and once with inline bytes: its references read back the bytes the inline path sends,
a bad tree fails its call without touching any sequence, and one Verify of several rounds commits what as
many one-round Verifies do."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from common.config import LlamaConfig
from common.engine.base import VerifyInput
from common.engine.verifier import Verifier, VerifierConfig
from common.errors import InvalidRequest
from common.ipc import HiddenExport
from common.model.llama import LlamaModel
from common.rounds import start_shift
from common.rpc import CHANNEL_OPTIONS, start_server
from common.tensors import decode_inline
from common.tree import DraftQ, Tree
from common.weights import Checkpoint
from services.clients import Batched
from services.packed import unpack_ints
from services.tree_wire import BATCH_FROM, draft_tree, tree_msg, tree_of, trees_of
from services.verifier.chain import DraftChain
from services.verifier.server import VerifierServicer
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc

VOCAB = 10


def _q_tree(ids_shift: int = 0) -> pb.DraftTree:
    """A sampled tree: q at the root and at node 0 (tests/test_sampling_rule.py's example)."""
    q = DraftQ(
        rows=np.array([0, 1]),
        ids=np.array([[7, 9, 3], [4, 7, 8]]) + ids_shift,
        probs=np.array([[0.5, 0.3, 0.2], [0.6, 0.4, 0]]),
    )
    msg = pb.DraftTree()
    tree_msg(Tree(np.array([9, 7, 4]), np.array([-1, -1, 0]), np.array([0.3, 0.5, 0.6]), q), msg)
    return msg


GOOD = [
    draft_tree([1, 2, 3], [-1, 0, 0], [0.5, 0.25, 0.125]),
    draft_tree([4], [-1]),  # no probabilities: all 1
    draft_tree([], []),
    draft_tree([5, 6, 7, 8], [-1, -1, 0, 2], [1, 1, 1, 1]),
    _q_tree(),
]
BAD = [
    draft_tree([5, 6], [-1, 7]),  # parent out of range
    draft_tree([5, 6, 7], [-1, 2, 1]),  # parent does not precede
    draft_tree([5, 6], [-1, 1]),  # self loop
    draft_tree([5, 10], [-1, 0]),  # token outside the vocabulary
    draft_tree([-3, 1], [-1, 0]),  # negative token
    draft_tree([5] * 9, [-1] * 9),  # over max_nodes
    draft_tree([5, 6], [-1]),  # fewer parents than tokens
    draft_tree([5, 6], [-1, 0], [0.5]),  # wrong number of probabilities
    pb.DraftTree(token_ids=b"\0" * 6, parents=b"\0" * 6),  # not whole int32 values
    _q_tree(ids_shift=1),  # children not drawn from q
]


def _message(msg: pb.DraftTree) -> str:
    with pytest.raises(InvalidRequest) as e:
        tree_of(msg, max_nodes=8, vocab_size=VOCAB)
    return str(e.value)


def _same_tree(a: Tree, b: Tree) -> None:
    for x, y in ((a.tokens, b.tokens), (a.parents, b.parents), (a.probs, b.probs)):
        assert x.dtype == y.dtype and x.tolist() == y.tolist()
    assert (a.q is None) == (b.q is None)
    if a.q is not None:
        assert a.q.rows.tolist() == b.q.rows.tolist() and a.q.ids.tolist() == b.q.ids.tolist()


def test_trees_of_reads_the_trees_tree_of_reads() -> None:
    """Every good tree, in batches below and above BATCH_FROM, comes back as tree_of returns it (dtypes too)."""
    for batch in (GOOD[:2], GOOD * 3):
        got = trees_of(batch, max_nodes=8, vocab_size=VOCAB)
        assert len(got) == len(batch)
        for msg, tree in zip(batch, got):
            _same_tree(tree, tree_of(msg, max_nodes=8, vocab_size=VOCAB))


def test_trees_of_raises_tree_of_message_for_the_first_bad_tree() -> None:
    """Each bad tree, at the start, middle or end of a batch of good ones and before another bad one,
    raises exactly tree_of's message for it."""
    assert len(GOOD) + 2 >= BATCH_FROM  # the batched pass runs
    for i, bad in enumerate(BAD):
        want = _message(bad)
        later = BAD[(i + 1) % len(BAD)]
        for at in (0, 2, len(GOOD)):
            batch = [*GOOD[:at], bad, *GOOD[at:], later]
            with pytest.raises(InvalidRequest) as e:
                trees_of(batch, max_nodes=8, vocab_size=VOCAB)
            assert str(e.value) == want, (i, at)


def test_write_many_lands_where_one_write_each_does() -> None:
    """The docstring's example: 4 rows a region, a in region 2 from row 1 (2 rows), b in region 0 (1 row)
    -> hidden rows [a0, a1, b0] at flat rows [9, 10, 0]; the same buffer, offsets and write counts as
    write() once per sequence."""
    hidden = torch.arange(9, dtype=torch.float32).reshape(3, 3)  # [a0, a1, b0], width 3
    exports = [HiddenExport(4, 4, 3, torch.float32, torch.device("cpu")) for _ in range(2)]
    for e in exports:  # b takes region 0, then x region 1, a region 2
        for s in ("b", "x", "a"):
            e.write(s, torch.zeros(1, 3))
    batched, single = exports
    placed = batched.write_many(["a", "b"], hidden, [2, 1], [1, 0])
    row_bytes = 3 * 4
    assert placed == [(9 * row_bytes, 2), (0, 2)]
    assert placed == [single.write("a", hidden[:2], 1), single.write("b", hidden[2:], 0)]
    assert torch.equal(batched.buffer, single.buffer)
    assert torch.equal(batched.flat[[9, 10, 0]], hidden)


def test_write_many_checks_every_range_before_writing() -> None:
    export = HiddenExport(4, 4, 2, torch.float32, torch.device("cpu"))
    export.write("a", torch.zeros(1, 2))
    with pytest.raises(InvalidRequest, match=r"hidden rows \[3, 5\) exceed the exported region of 4"):
        export.write_many(["a", "new"], torch.ones(3, 2), [1, 2], [0, 3])
    assert not export.buffer.any() and len(export.table) == 1  # nothing written, no region taken
    with pytest.raises(ValueError, match="twice"):
        export.write_many(["a", "a"], torch.ones(2, 2), [1, 1])


def test_pack_trees_worked_example() -> None:
    """_pack_trees' docstring: trees [a, b] (parents [-1, 0]) and [c] ([-1]) in a block of tb = 4 rows."""
    a, b, c = 11, 12, 13
    items = [
        VerifyInput("s", Tree(np.array([a, b]), np.array([-1, 0]), np.ones(2, np.float32))),
        VerifyInput("t", Tree(np.array([c]), np.array([-1]), np.ones(1, np.float32))),
    ]
    block = np.zeros((2, 2 * 4 + 3), dtype=np.int64)
    block[:, 4:8] = np.arange(4)  # padding rows name themselves
    Verifier._pack_trees(block, items, np.array([2, 1]))
    assert block[:, :4].tolist() == [[0, a, b, 0], [0, c, 0, 0]]
    assert block[:, 4:8].tolist() == [[0, 0, 1, 3], [0, 0, 2, 3]]


# ---- the servicer over a real channel, on a tiny random model ----
CFG = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position=256,
)
ROWS = 64  # max_context: rows of a sequence's hidden region
GREEDY = pb.SamplingParams()
SAMPLED = pb.SamplingParams(temperature=0.8, seed=3, has_seed=True)


class Pair:
    """Two verifier servers over identical engines: `ipc` writes hidden states into its (CPU) buffer, `inline`
    sends bytes."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        state = {k: v for k, v in LlamaModel(CFG).state_dict().items() if not k.startswith("rope")}
        self.servicers = {}
        for name in ("ipc", "inline"):
            cfg = VerifierConfig(max_sequences=9, max_context=ROWS, max_tree_nodes=8)
            engine = Verifier(Checkpoint("tiny", CFG, state, Path(".")), cfg, graphs=True)  # padded as on a GPU
            s = VerifierServicer(engine, 3 * CFG.hidden_size, 8, lease_ttl=600.0)
            if name == "ipc":
                s.export = HiddenExport(9, ROWS, 3 * CFG.hidden_size, torch.float32, torch.device("cpu"))
            self.servicers[name] = s

    async def __aenter__(self) -> Pair:
        self.servers, self.channels, self.stubs = [], [], {}
        for name, s in self.servicers.items():
            server = await start_server("127.0.0.1:0", [(pb_grpc.add_VerifierServicer_to_server, s)], ["v"])
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS)
            self.servers.append(server)
            self.channels.append(channel)
            self.stubs[name] = pb_grpc.VerifierStub(channel)
        return self

    async def __aexit__(self, *exc) -> None:
        for c in self.channels:
            await c.close()
        for s in self.servers:
            await s.stop(0)
        for s in self.servicers.values():
            s.runner.close()

    async def both(self, method: str, request):
        return [await getattr(self.stubs[n], method)(request) for n in ("ipc", "inline")]

    def rows(self, ref: pb.TensorRef) -> torch.Tensor:
        """The rows an IPC reference of the ipc server names."""
        export = self.servicers["ipc"].export
        first = ref.ipc.offset_bytes // export.row_bytes
        assert first * export.row_bytes == ref.ipc.offset_bytes
        return export.flat[first : first + ref.shape[0]]

    def region_row(self, seq_id: str, row: int = 0) -> int:
        """Where a sequence's row lies in the ipc server's buffer, in bytes: (region * ROWS + row) * row bytes."""
        export = self.servicers["ipc"].export
        return (export.table.get(seq_id)[0] * ROWS + row) * export.row_bytes

    def states(self, name: str, ids: list[str]) -> list[tuple[int, int]]:
        engine = self.servicers[name].engine
        return [(engine.seqs.get(s)[1].length, engine.seqs.get(s)[1].pending) for s in ids]


IDS = [f"s{i}" for i in range(6)]


async def _prefilled(pair: Pair) -> None:
    rng = np.random.default_rng(0)
    items = [
        pb.PrefillItem(
            seq_id=s,
            token_ids=rng.integers(3, CFG.vocab_size, 5 + i).tolist(),
            sampling=SAMPLED if i == 4 else GREEDY,
            want_hidden=True,
        )
        for i, s in enumerate(IDS)
    ]
    ipc, inline = await pair.both("Prefill", pb.PrefillRequest(items=items))
    for s, a, b in zip(IDS, ipc.results, inline.results):
        assert a.next_token == b.next_token
        assert a.hidden.ipc.offset_bytes == pair.region_row(s)
        assert torch.equal(pair.rows(a.hidden), decode_inline(b.hidden))


def _trees(rng: np.random.Generator) -> list[pb.DraftTree]:
    """A tree per sequence of 1 to 8 nodes, each node's parent an earlier node or the root."""
    out = []
    for i in range(len(IDS)):
        n = 1 + (3 * i) % 8
        parents = [int(rng.integers(-1, j)) for j in range(n)]
        out.append(draft_tree(rng.integers(0, CFG.vocab_size, n).tolist(), parents))
    return out


def test_verify_references_read_back_the_inline_bytes() -> None:
    """Rounds of 6 items (one sampling) and of 1: the same tokens from both servers, and each IPC reference
    at its sequence's region start holding the bytes the inline server sends."""

    async def go() -> None:
        async with Pair() as pair:
            await _prefilled(pair)
            rng = np.random.default_rng(1)
            for batch in (IDS, IDS[:1], IDS):
                trees = _trees(rng)
                req = pb.VerifyRequest(items=[pb.VerifyItem(seq_id=s, tree=t) for s, t in zip(batch, trees)])
                ipc, inline = await pair.both("Verify", req)
                for s, t, a, b in zip(batch, trees, ipc.results, inline.results):
                    assert a.seq_id == b.seq_id == s and a.tree_nodes == b.tree_nodes == len(t.token_ids) // 4
                    assert list(a.accepted_tokens) == list(b.accepted_tokens)
                    assert list(a.hidden.shape) == [len(a.accepted_tokens), 3 * CFG.hidden_size]
                    assert a.hidden.ipc.offset_bytes == pair.region_row(s)
                    assert torch.equal(pair.rows(a.hidden), decode_inline(b.hidden))
            assert pair.states("ipc", IDS) == pair.states("inline", IDS)

    asyncio.run(go())


def test_a_bad_tree_fails_its_call_and_touches_no_sequence() -> None:
    """A round whose fourth tree names a parent outside it is INVALID_ARGUMENT with tree_of's message; no
    sequence moves, and the next round answers as on a server that never saw the bad one."""

    async def go() -> None:
        async with Pair() as pair:
            await _prefilled(pair)
            before = pair.states("ipc", IDS)
            trees = _trees(np.random.default_rng(2))
            bad = list(trees)
            bad[3] = draft_tree([5, 6], [-1, 7])
            req = pb.VerifyRequest(items=[pb.VerifyItem(seq_id=s, tree=t) for s, t in zip(IDS, bad)])
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await pair.stubs["ipc"].Verify(req)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details() == "tree node 1 has parent index 7 outside [-1, 2)"
            assert pair.states("ipc", IDS) == before
            req = pb.VerifyRequest(items=[pb.VerifyItem(seq_id=s, tree=t) for s, t in zip(IDS, trees)])
            ipc, inline = await pair.both("Verify", req)
            for a, b in zip(ipc.results, inline.results):
                assert list(a.accepted_tokens) == list(b.accepted_tokens)
                assert torch.equal(pair.rows(a.hidden), decode_inline(b.hidden))

    asyncio.run(go())


def test_decode_writes_the_wanted_rows_after_their_hidden_row() -> None:
    """3 steps for 5 greedy sequences, 3 of them wanting their features from rows 0, 2 and 5 of their
    regions: each reference at (region * ROWS + hidden_row) * row bytes, holding the inline server's rows."""

    async def go() -> None:
        async with Pair() as pair:
            await _prefilled(pair)
            ids = [s for i, s in enumerate(IDS) if i != 4]  # the greedy ones: several steps
            follow = {ids[0]: 0, ids[2]: 2, ids[3]: 5}
            items = [pb.DecodeItem(seq_id=s, want_hidden=s in follow, hidden_row=follow.get(s, 0)) for s in ids]
            ipc, inline = await pair.both("Decode", pb.DecodeRequest(items=items, steps=3))
            for s, a, b in zip(ids, ipc.results, inline.results):
                assert list(a.tokens) == list(b.tokens) and len(a.tokens) == 3
                assert a.HasField("hidden") == b.HasField("hidden") == (s in follow)
                if s in follow:
                    assert a.hidden.ipc.offset_bytes == pair.region_row(s, follow[s])
                    assert torch.equal(pair.rows(a.hidden), decode_inline(b.hidden))

    asyncio.run(go())


class CountDraft:
    """The draft at the other end of the chained rounds: for each sequence an 8-node tree from the last token
    t it was sent, the same for both servers: a chain t t t t (the tiny random model repeats itself) and
    four more children of the root."""

    async def propose(self, items: list[pb.ProposeItem], owner: str = "") -> Batched:
        v = CFG.vocab_size
        trees = []
        for it in items:
            t = it.token_ids[-1]
            tokens = [t] * 4 + [(t + j) % v for j in range(1, 5)]
            trees.append(draft_tree(tokens, [-1, 0, 1, 2, -1, -1, -1, -1]))
        return Batched(trees, 0.0)


def test_one_verify_of_three_rounds_commits_what_three_verifies_do() -> None:
    """The ipc server gets one Verify of 3 rounds, the inline server a Verify and two chained ones of one
    round each, over identical engines and the same draft: every sequence (one of them sampling, seeded)
    commits the same tokens with the same per-round acceptance, and ends in the same state (length, pending
    token): each round is the same engine call, on the same random state, as a Verify of its own."""

    async def go() -> None:
        async with Pair() as pair:
            for s in pair.servicers.values():
                s.chain = DraftChain(lambda address: CountDraft())
            await _prefilled(pair)
            trees = _trees(np.random.default_rng(3))

            def request(rounds: int, chained: bool) -> pb.VerifyRequest:
                req = pb.VerifyRequest(draft="draft:0", rounds=rounds)
                for s, t in zip(IDS, trees):
                    item = req.items.add(seq_id=s, next_nodes=8, next_depth=2, chained=chained)
                    if not chained:
                        item.tree.CopyFrom(t)
                return req

            multi = (await pair.stubs["ipc"].Verify(request(3, False))).results
            singles = [await pair.stubs["inline"].Verify(request(0, c)) for c in (False, True, True)]
            for i, (s, m) in enumerate(zip(IDS, multi)):
                one = [call.results[i] for call in singles]
                assert m.seq_id == s and m.chained and all(r.chained for r in one)
                assert list(m.accepted_tokens) == [t for r in one for t in r.accepted_tokens]
                assert unpack_ints(m.round_accepted, "") == [len(r.accepted_tokens) - 1 for r in one]
                assert unpack_ints(m.round_nodes, "") == [r.tree_nodes for r in one]
                assert m.tree_nodes == sum(r.tree_nodes for r in one) and not m.HasField("hidden")
            assert pair.states("ipc", IDS) == pair.states("inline", IDS)
            accepted = [unpack_ints(m.round_accepted, "") for m in multi]
            assert any(sum(a) for a in accepted), accepted  # some drafted tokens were accepted

    asyncio.run(go())


def _count_tree(last: int) -> tuple[list[int], list[int]]:
    """CountDraft's tree after token `last`: (tokens, parents)."""
    v = CFG.vocab_size
    return [last] * 4 + [(last + j) % v for j in range(1, 5)], [-1, 0, 1, 2, -1, -1, -1, -1]


class RecordingDraft:
    """CountDraft as a draft service: records what each call was sent (tokens, features read from bytes)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, tuple[list[int], torch.Tensor]]] = []

    async def propose(self, items: list[pb.ProposeItem], owner: str = "") -> Batched:
        self.calls.append({it.seq_id: (list(it.token_ids), decode_inline(it.hidden)) for it in items})
        return Batched([draft_tree(*_count_tree(it.token_ids[-1])) for it in items], 0.0)


class HereDraft:
    """CountDraft as the draft in the verifier's process (VerifierServicer.colocate): takes the handed-over
    drafter inputs, answers engine trees, and records the same as RecordingDraft."""

    def __init__(self) -> None:
        self.calls: list[dict[str, tuple[list[int], torch.Tensor]]] = []

    def launch_after(self, items, accepted) -> None:
        return None  # no device chain: the outcomes come as the drafter's inputs

    async def propose_here(self, items, owner: str = "") -> tuple[list[Tree], float]:
        self.calls.append({it.seq_id: (list(it.token_ids), it.hidden.clone()) for it in items})
        trees = []
        for it in items:
            tokens, parents = _count_tree(it.token_ids[-1])
            trees.append(Tree(np.array(tokens), np.array(parents), np.ones(len(tokens), dtype=np.float32)))
        assert all(not it.start and it.max_nodes == 8 and it.max_depth == 2 for it in items)
        return trees, 0.0


def test_the_draft_here_gets_what_a_draft_service_gets() -> None:
    """Chained rounds with the draft in the verifier's process (its outcomes handed over as tensors, its trees
    verified as engine trees) against the same draft as a service (ProposeItems with inline bytes, trees as
    messages), over identical engines: a Verify of 3 rounds, then one of 1 round. Each propose call gets the
    same sequences, tokens and feature rows (bit for bit), and the Verifies answer the same tokens, rounds
    and chained flags, with no hidden states in either's results."""

    async def go() -> None:
        async with Pair() as pair:
            here, apart = HereDraft(), RecordingDraft()
            pair.servicers["ipc"].colocate(here)
            pair.servicers["inline"].chain = DraftChain(lambda address: apart)
            await _prefilled(pair)
            trees = _trees(np.random.default_rng(4))
            first = pb.VerifyRequest(draft="draft:0", rounds=3)
            for s, t in zip(IDS, trees):
                first.items.add(seq_id=s, next_nodes=8, next_depth=2, tree=t)
            later = pb.VerifyRequest(draft="draft:0", rounds=1)
            for s in IDS:
                later.items.add(seq_id=s, next_nodes=8, next_depth=2, chained=True)
            for req in (first, later):
                a, b = await pair.both("Verify", req)
                for x, y in zip(a.results, b.results):
                    assert x.seq_id == y.seq_id and list(x.accepted_tokens) == list(y.accepted_tokens)
                    assert x.round_accepted == y.round_accepted and x.chained and y.chained
                    assert not x.HasField("hidden") and not y.HasField("hidden") and not x.draft_error
            assert len(here.calls) == len(apart.calls) == 4  # after each of the 4 rounds
            for h, r in zip(here.calls, apart.calls):
                assert list(h) == list(r)
                for s in h:
                    assert h[s][0] == r[s][0] and torch.equal(h[s][1], r[s][1])
            assert pair.states("ipc", IDS) == pair.states("inline", IDS)

    asyncio.run(go())


class StartRecorder:
    """A draft as a service (`propose`) or here (`propose_here`) that records each start item it gets: its
    tokens, features (bytes read back, or the handed-over tensor), context prefix, tree shape and owner."""

    def __init__(self) -> None:
        self.items: dict[str, tuple] = {}

    def _record(self, it, hidden: torch.Tensor, owner: str, sampled: bool) -> None:
        assert it.start
        self.items[it.seq_id] = (list(it.token_ids), hidden, list(it.context_prefix), it.max_nodes, it.max_depth)
        self.items[it.seq_id] += (owner, sampled)

    async def propose(self, items: list[pb.ProposeItem], owner: str = "") -> Batched:
        for it in items:
            self._record(it, decode_inline(it.hidden), owner, it.sampling.temperature > 0)
        return Batched([draft_tree(*_count_tree(it.token_ids[-1])) for it in items], 0.0)

    async def propose_here(self, items, owner: str = "") -> tuple[list[Tree], float]:
        for it in items:
            self._record(it, it.hidden.clone(), owner, it.sampling.temperature > 0)
        trees = []
        for it in items:
            tokens, parents = _count_tree(it.token_ids[-1])
            trees.append(Tree(np.array(tokens), np.array(parents), np.ones(len(tokens), dtype=np.float32)))
        return trees, 0.0


def test_a_prefills_first_tree_reaches_the_draft_here_as_it_reaches_a_draft_service() -> None:
    """Prefills that ask for their sequences' first trees (PrefillItem.next_nodes): s0 whole, s1 (sampled) in
    two chunks. The draft in the verifier's process gets the prompt's features as the engine's tensor, a
    draft service gets them as bytes; each gets the same start item (common.rounds.start_shift of the whole
    prompt, bit for bit the same features, tree shape, owner, sampling), the results say `chained` with no
    hidden states, and the first Verify naming them chained answers the same on both."""
    rng = np.random.default_rng(5)
    prompts = {s: rng.integers(3, CFG.vocab_size, n).tolist() for s, n in (("s0", 6), ("s1", 9))}

    def item(s: str, tokens: list[int], **kw) -> pb.PrefillItem:
        sampling = SAMPLED if s == "s1" else GREEDY
        return pb.PrefillItem(seq_id=s, token_ids=tokens, sampling=sampling, want_hidden=True, **kw)

    async def go() -> None:
        async with Pair() as pair:
            here, apart = StartRecorder(), StartRecorder()
            pair.servicers["ipc"].colocate(here)
            pair.servicers["inline"].chain = DraftChain(lambda address: apart)
            await pair.both("Prefill", pb.PrefillRequest(items=[item("s1", prompts["s1"][:4], more=True)]))
            last = [item("s0", prompts["s0"], next_nodes=8, next_depth=2), item("s1", prompts["s1"][4:], next_nodes=8)]
            a, b = await pair.both("Prefill", pb.PrefillRequest(items=last, owner="gw", draft="draft:0"))
            for x, y in zip(a.results, b.results):
                assert x.chained and y.chained and not x.HasField("hidden") and not y.HasField("hidden")
                assert x.next_token == y.next_token
            first = pb.VerifyRequest(draft="draft:0", items=[pb.VerifyItem(seq_id=s, chained=True) for s in prompts])
            v, w = await pair.both("Verify", first)
            assert [list(r.accepted_tokens) for r in v.results] == [list(r.accepted_tokens) for r in w.results]
            assert not any(r.draft_error for r in v.results) and not any(r.draft_error for r in w.results)
            for s, prompt in prompts.items():
                token_ids, prefix = start_shift(prompt, next(r.next_token for r in a.results if r.seq_id == s))
                h, r = here.items[s], apart.items[s]
                assert h[0] == r[0] == token_ids and h[2] == r[2] == prefix
                assert h[1].shape == (len(prompt), 3 * CFG.hidden_size) and torch.equal(h[1], r[1])
                assert h[3:] == r[3:] == (8, 2 if s == "s0" else 0, "gw", s == "s1")

    asyncio.run(go())


def test_a_prefill_runs_between_the_rounds_calls_on_the_loop_unless_it_is_long():
    """With prefill_between (the default) and an inline runner (a GPU's; set by hand here), a Prefill of at most
    `prefill_between_tokens` prompt tokens runs on the event loop's thread, a longer one on the engine thread (it would
    hold the loop for its whole pass); both answer the same first tokens as on a servicer without it."""
    import threading

    pair = Pair()
    s = pair.servicers["ipc"]
    s.runner.inline, s.prefill_between_tokens = True, 8
    threads: list[bool] = []
    prefill = s._prefill

    def recorded(request):
        threads.append(threading.current_thread() is threading.main_thread())
        return prefill(request)

    s._prefill = recorded

    async def main():
        async with pair:
            short = pb.PrefillRequest(items=[pb.PrefillItem(seq_id="a", token_ids=[3, 4, 5, 6, 7, 8], sampling=GREEDY)])
            long = pb.PrefillRequest(items=[pb.PrefillItem(seq_id="b", token_ids=list(range(3, 13)), sampling=GREEDY)])
            return [await pair.both("Prefill", r) for r in (short, long)]

    (a, a_inline), (b, b_inline) = asyncio.run(main())
    assert threads == [True, False]
    assert a.results[0].next_token == a_inline.results[0].next_token
    assert b.results[0].next_token == b_inline.results[0].next_token


def test_releases_run_between_the_rounds_calls_on_the_loop() -> None:
    """With an inline runner (a GPU's; set by hand here) the verifier's and the draft's Release run on the event
    loop's thread between the per-round calls, not on the engine thread: there a release held the engine's lock
    while it waited for the interpreter lock, and a per-round call arriving then ran whole on the engine thread.
    The released sequence is gone afterwards."""
    import threading

    from common.config import DraftingConfig
    from services.draft.server import DraftServicer

    class Drafter:
        def __init__(self) -> None:
            self.threads: list[bool] = []

        def step_costs(self) -> list:
            return []

        def release(self, seq_ids: list[str]) -> int:
            self.threads.append(threading.current_thread() is threading.main_thread())
            return len(seq_ids)

    pair = Pair()
    v = pair.servicers["ipc"]
    v.runner.inline = True
    threads: list[bool] = []
    release_ids = v._release_ids

    def recorded(ids: list[str]) -> int:
        threads.append(threading.current_thread() is threading.main_thread())
        return release_ids(ids)

    v._release_ids = recorded
    drafter = Drafter()
    d = DraftServicer(drafter, DraftingConfig(), 3 * CFG.hidden_size, CFG.vocab_size, torch.device("cpu"), 600.0)
    d.runner.inline = True

    async def main():
        async with pair:
            await pair.both("Prefill", pb.PrefillRequest(items=[pb.PrefillItem(seq_id="a", token_ids=[3, 4, 5])]))
            released = await pair.stubs["ipc"].Release(pb.ReleaseRequest(seq_ids=["a"]))
            drafted = await d._release_owned(pb.ReleaseRequest(seq_ids=["a", "b"]))
            d.runner.close()
            return released.released, drafted.released, len(v.engine.seqs), v.leases.table.owner_of("a")

    assert asyncio.run(main()) == (1, 2, 0, None)
    assert threads == [True] and drafter.threads == [True]
    assert v.runner.thread_calls == d.runner.thread_calls == 0
