"""The verifier's side of the round protocol (see VerifyItem in protos/specdec/v1/internal.proto).

After a verify, the outcome of each chained sequence goes straight from the verifier to the draft
(accepted tokens and a reference to their hidden states), and the draft's next tree waits here until the
gateway's next Verify names the sequence `chained`. A round then costs one gateway hop: the draft
proposes while the gateway commits, streams and sends the next round, and the verifier waits only for
what is not done by then (`Taken.wait_s`).

Example, one sequence s, accepting 2 of 4 drafted tokens a round:
  Verify([s: tree T1, next 4x8])  -> verifies T1, answers [t1 t2 t3]; send(draft, [s: t1 t2 t3 + hidden])
  (gateway streams t1 t2 t3)         the draft proposes T2 meanwhile; pending[s] = (call, 0)
  Verify([s: chained, next 4x8])  -> take([s]) = T2 (waits if the call is still running); verifies T2 ...
  Decode([s]) instead              -> settle([s]): waits for the call, drops T2; then decodes

Several rounds a call (VerifyRequest.rounds = k): the verifier goes on by itself, so the gateway's hop is
paid once per k rounds. After each round it takes the next trees of the items that run on (waiting for the
draft: within a call nothing else overlaps it) and verifies them, until every item stopped (an end-of-
sequence or stop token, its token budget, no KV room, its tree never came; services/verifier/rounds.py
keeps that bookkeeping) or k rounds ran, and answers once: every committed token, and per round the
accepted count and tree size. The same example, k = 2:
  Verify([s: chained, next 4x8], rounds 2) -> take T2, verify, send; take T3, verify, send;
                                              answers [t4 t5 t6 t7 t8], round_accepted [2, 1]; T4 waits here
With VerifyRequest.early (on a stream), an item that a round stops by its stop rules while others run on is
answered at once (`early`: a response with only its result, before the call's own): its sequence has
finished, and its last tokens need not wait for the other sequences' rounds.
A call that arrives on the stream with VerifyRequest.cut while the one before it runs ends that one
before its next round (`cut`, set by the stream's reader in services/verifier/server.py): the gateway
sends it when it brings enough sequences that were not in the call in flight (joiners; common.rounds.
cut_pays), so that they wait for one round instead of the rest of the call; the cut call's items go on in
it as after a last round.

The draft in this process (`--draft-here`, services/draft/here.py): no messages between the two engines.
The verifier's `run` hands over each outcome that goes to the draft as the drafter's own input (its
tokens and a reference to their features on the device, no copy into the exported buffer), and the
drafter's trees come back as the engine's trees, which the next round verifies as they are: per
sequence and round, no message is built, serialized, parsed or checked, and no hidden row is written.

Bookkeeping only (asyncio and messages, no torch): `connect(address)` returns a client whose
`propose(items, owner=...)` answers services.clients.Batched (trees in item order, engine seconds). The
chain never reads an outcome or a tree: it passes them between `run` and the client."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from common.errors import InvalidRequest
from common.rounds import MAX_ROUNDS_PER_CALL
from services.packed import pack_ints, unpack_ints
from services.verifier.rounds import CallRounds, ItemRounds, ItemRules, Stop
from specdec.v1 import internal_pb2 as pb

log = logging.getLogger(__name__)
MAX_DRAFTS = 4  # distinct draft addresses one verifier talks to (a typo in a flag should not open channels forever)
_STOPPED = (Stop.TOKEN, Stop.LENGTH)  # what a call queued behind does not verify again


@dataclass(frozen=True)
class Pending:
    task: asyncio.Task  # the propose call -> Batched
    index: int  # this sequence's tree among the call's results
    batch: int  # sequences in the call


@dataclass
class Taken:
    """The chained trees of a Verify, and what was missing."""

    # seq id -> its next tree: a pb.DraftTree from a draft service, the engine's tree from the draft here
    trees: dict[str, object] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # seq id -> why there is no tree
    compute_s: float = 0.0  # the draft's engine time in the calls that made them
    batch: int = 0  # the largest of those calls
    wait_s: float = 0.0  # how long the Verify waited for them


# run(request, failed, trees) -> (the round's response, {seq id: its outcome as the draft here takes it})
Run = Callable[
    [pb.VerifyRequest, dict[str, str], dict[str, object]], Awaitable[tuple[pb.VerifyResponse, dict[str, object]]]
]


@dataclass(frozen=True)
class Last:
    """How a call left a sequence, for the call queued behind it (VerifyItem.follows)."""

    stopped: bool  # by its rules (a stop token id, its budget) or before the call (it followed one that did)
    committed: int  # tokens the call committed


def _rules(it: pb.VerifyItem, last: Last | None) -> ItemRules | None:
    """An item's stop rules (checked by DraftChain.check); None when it follows a call that stopped it.
    An item that follows a call (`last`: how that call left it) has its budget less what that call committed.
    Example: max_new 10 for both calls, the first committed 4 (not stopped) -> 6 here."""
    stop_ids = frozenset(unpack_ints(it.stop_ids, "stop_ids")) if it.stop_ids else frozenset()
    max_new = it.max_new
    if last is not None:
        if last.stopped or (max_new and max_new <= last.committed):
            return None
        max_new = max_new - last.committed if max_new else 0
    return ItemRules(chained=it.next_nodes > 0, rows=1 + it.next_nodes, max_new=max_new, stop_ids=stop_ids)


def _check_next(it: pb.VerifyItem | pb.PrefillItem) -> None:
    """An item's next tree (next_nodes, next_depth): none, or one to ask the draft for."""
    if it.next_nodes < 0 or it.next_depth < 0:
        raise InvalidRequest(f"sequence {it.seq_id!r}: next_nodes and next_depth must be >= 0")


def _fill(r: pb.VerifyResult, it: ItemRounds) -> None:
    """An item's result of the call from its rounds (r: round 1's result, edited in place, or a new one)."""
    del r.accepted_tokens[:]
    r.accepted_tokens.extend(it.tokens)
    r.round_accepted, r.round_nodes = pack_ints(it.accepted), pack_ints(it.nodes)
    r.tree_nodes, r.draft_error = sum(it.nodes), it.draft_error


def _early_answer(call: CallRounds, ids: list[str], answered: set[int]) -> pb.VerifyResponse | None:
    """After a round, while items run on: an early answer (VerifyRequest.early) of the items stopped by their
    stop rules and not answered yet (`answered`, updated), or None. Their results are those the call's own
    response gives them, without hidden states (a finished sequence's features are nobody's).
    Example: rounds 4, s1 commits its stop id in round 2, s2 runs on -> after round 2: [s1: round 1's and 2's
    tokens, round_accepted [a1, a2]]; after rounds 3 and 4: nothing (round 4: s2 stops, the call answers)."""
    if not call.running():
        return None
    out = None
    for i, it in enumerate(call.items):
        if it.stop in _STOPPED and i not in answered:
            answered.add(i)
            out = out or pb.VerifyResponse(early=True)
            _fill(out.results.add(seq_id=ids[i]), it)
    return out


def _retrieve(task: asyncio.Task) -> None:
    """Mark a dropped call's failure as seen (asyncio logs unretrieved exceptions at exit)."""
    if not task.cancelled():
        task.exception()


class DraftChain:
    def __init__(self, connect: Callable[[str], object]) -> None:
        self._connect = connect
        self._clients: dict[str, object] = {}  # address -> client
        self._pending: dict[str, Pending] = {}  # seq id -> the call proposing its next tree
        self._last: dict[str, Last] = {}  # seq id -> how the last Verify naming it left it (until the next one)

    async def verify(
        self,
        request: pb.VerifyRequest,
        run: Run,
        room: Callable[[list[str]], list[int]],
        gone: frozenset[str] = frozenset(),
        cut: asyncio.Event | None = None,
        early: Callable[[pb.VerifyResponse], None] | None = None,
    ) -> pb.VerifyResponse:
        """A Verify under the protocol, of one round or several (VerifyRequest.rounds). Each round: the
        chained items' trees (waiting for calls still running), `run(request, failed, trees)` verifies every
        item but the failed ones (answered with draft_error), each with its chained tree from `trees` or
        else its own, then each item with next_nodes that runs on, or ran the call's last round, goes to
        the draft for its next tree: as `run` handed it over, or as a ProposeItem of its result. `room(seq_ids)`:
        the KV rows each sequence has left, read before every round after the first (services/verifier/rounds.py).
        `gone`: `follows` items whose sequence was released since the call before stopped it: not verified.
        `cut`: set while the call runs (a call queued behind it with VerifyRequest.cut arrived): no round
        begins after it is set; the items still running end as after the call's last round. `early`: where
        early answers go (given by answers_in_order for a call on a stream that asked, VerifyRequest.early):
        after a round that stopped items by their stop rules while others run on, a response of those items'
        results."""
        items = request.items
        ids = [it.seq_id for it in items]
        last = {s: self._last.pop(s) for s in ids if s in self._last}  # the call before's, used once
        await self.settle([s for it, s in zip(items, ids) if not it.chained])
        rules = [None if s in gone else _rules(it, last.get(s) if it.follows else None) for it, s in zip(items, ids)]
        call = CallRounds([r or ItemRules(chained=False) for r in rules], max(request.rounds, 1))
        before = {ids[i]: "" for i, r in enumerate(rules) if r is None}  # stopped by the call before: not verified
        for i, r in enumerate(rules):
            if r is None:
                call.items[i].stop = Stop.BEFORE
        todo = call.running()
        trees = await self.take([ids[i] for i in todo if items[i].chained])
        resp, handed = await run(request, trees.failed | before if before else trees.failed, trees.trees)
        first, sent = resp.results, set()  # round 1's results become the call's (edited in place below)
        self._close_round(request, call, ids, todo, trees, first, handed, sent)
        answered: set[int] = set()  # items answered early
        if early is not None and (said := _early_answer(call, ids, answered)) is not None:
            early(said)
        resp.draft_compute_us = int(trees.compute_s * 1e6)
        resp.draft_batch, resp.draft_wait_us = trees.batch, int(trees.wait_s * 1e6)
        while todo := call.running():
            if cut is not None and cut.is_set():
                call.cut()  # their next trees went to the draft: the call queued behind takes them
                break
            trees = await self.take([ids[i] for i in todo])
            sent.difference_update(todo)
            for i in todo:
                if ids[i] in trees.failed:
                    call.failed(i, trees.failed[ids[i]])
            call.fit(dict(zip(todo, room([ids[i] for i in todo]))))
            todo = call.running()
            resp.draft_compute_us += int(trees.compute_s * 1e6)
            resp.draft_batch = max(resp.draft_batch, trees.batch)
            resp.draft_wait_us += int(trees.wait_s * 1e6)
            if not todo:
                break
            more = pb.VerifyRequest()
            for i in todo:  # what run reads of an item (its tree comes from trees)
                more.items.add(seq_id=ids[i], next_nodes=items[i].next_nodes, next_depth=items[i].next_depth)
            out, handed = await run(more, {}, trees.trees)
            resp.compute_us += out.compute_us
            self._close_round(request, call, ids, todo, trees, out.results, handed, sent)
            if early is not None and (said := _early_answer(call, ids, answered)) is not None:
                early(said)
        resp.rounds_run = call.ran
        for s, it in zip(ids, call.items):  # for a call queued behind this one (VerifyItem.follows)
            if it.stop is not Stop.BEFORE:  # its gateway sends no third call (and may have released it)
                self._last[s] = Last(it.stop in _STOPPED, len(it.tokens))
        for i, (r, it) in enumerate(zip(first, call.items)):
            _fill(r, it)
            r.chained = i in sent
            if r.chained or r.draft_error or len(it.accepted) > 1:
                r.ClearField("hidden")  # the draft has it, nobody needs it, or it is round 1's
        return resp

    def _close_round(
        self,
        request: pb.VerifyRequest,
        call: CallRounds,
        ids: list[str],
        todo: list[int],
        trees: Taken,
        results,
        handed: dict[str, object],
        sent: set[int],
    ) -> None:
        """A round's results (those of the items `todo` that had a tree, in order) into the call's
        bookkeeping; then each item with next_nodes that runs on, or ran the call's last round, goes to
        the draft (`sent`: those whose next tree waits here), as `run` handed it over (`handed`: seq id ->
        the drafter's input, for the draft in this process) or as a ProposeItem of its result."""
        verified = [i for i in todo if ids[i] not in trees.failed]
        keep = {ids[i] for i in verified}  # results hold the unverified items too (failed, stopped before)
        by_item = dict(zip(verified, (r for r in results if r.seq_id in keep)))
        for i in todo:
            if ids[i] in trees.failed:
                call.failed(i, trees.failed[ids[i]])
            else:
                call.record(i, by_item[i].accepted_tokens, by_item[i].tree_nodes)
        call.end_round()
        outcomes = []
        for i in verified:
            it, r = request.items[i], by_item[i]
            if it.next_nodes > 0 and call.items[i].stop in (None, Stop.ROUNDS):
                out = handed.get(ids[i])
                if out is None:
                    out = pb.ProposeItem(
                        seq_id=ids[i], token_ids=r.accepted_tokens, max_nodes=it.next_nodes, max_depth=it.next_depth
                    )
                    out.hidden.CopyFrom(r.hidden)
                outcomes.append(out)
                sent.add(i)
        self.send(request.draft, request.owner, outcomes)

    def check(self, request: pb.VerifyRequest) -> None:
        """The protocol's fields of a Verify (InvalidRequest), before anything runs."""
        if not 0 <= request.rounds <= MAX_ROUNDS_PER_CALL:
            raise InvalidRequest(f"rounds must be in [0, {MAX_ROUNDS_PER_CALL}], got {request.rounds}")
        to_draft = False
        for it in request.items:
            if it.max_new < 0 or len(it.stop_ids) % 4:
                raise InvalidRequest(f"sequence {it.seq_id!r}: max_new must be >= 0 and stop_ids whole int32s")
            if it.follows and not it.chained:
                raise InvalidRequest(f"sequence {it.seq_id!r} follows the call before but is not chained")
            if it.chained and it.HasField("tree"):
                raise InvalidRequest(f"sequence {it.seq_id!r} is chained and carries a tree: one or the other")
            _check_next(it)
            to_draft |= it.next_nodes > 0
        if to_draft:
            self.link(request.draft)

    def check_prefill(self, request: pb.PrefillRequest) -> None:
        """The protocol's fields of a Prefill (PrefillItem.next_nodes: the first tree, asked for on a prompt's
        last chunk, with its features), before anything runs."""
        for it in request.items:
            _check_next(it)
            if it.next_nodes and (it.more or not it.want_hidden):
                raise InvalidRequest(
                    f"sequence {it.seq_id!r}: next_nodes is for a prompt's last chunk, with want_hidden"
                )
        if any(it.next_nodes for it in request.items):
            self.link(request.draft)

    def link(self, address: str):
        """The client of the draft at `address` (connected on first use); checked before a Verify runs."""
        if not address:
            raise InvalidRequest("next_nodes is set but the request names no draft address")
        client = self._clients.get(address)
        if client is None:
            if len(self._clients) >= MAX_DRAFTS:
                raise InvalidRequest(f"already linked to {MAX_DRAFTS} draft addresses; refusing {address!r}")
            client = self._clients[address] = self._connect(address)
        return client

    def send(self, address: str, owner: str, items: list) -> None:
        """Ask the draft at `address` for these sequences' next trees, in the background."""
        if not items:
            return
        task = asyncio.get_running_loop().create_task(self.link(address).propose(items, owner=owner))
        task.add_done_callback(_retrieve)
        for i, it in enumerate(items):
            self._pending[it.seq_id] = Pending(task, i, len(items))

    async def take(self, seq_ids: list[str]) -> Taken:
        """The pending trees of these sequences (waiting for calls still running); each is used once."""
        t0 = time.perf_counter()
        pend = {s: self._pending.pop(s) for s in seq_ids if s in self._pending}
        calls = {p.task for p in pend.values()}
        if calls:
            await asyncio.wait(calls)
        out = Taken(wait_s=time.perf_counter() - t0)
        counted: set[asyncio.Task] = set()
        for s in seq_ids:
            p = pend.get(s)
            if p is None:
                out.failed[s] = "no proposal pending (the last Verify did not chain this sequence)"
            elif p.task.cancelled() or p.task.exception() is not None:
                out.failed[s] = f"the draft failed: {'cancelled' if p.task.cancelled() else p.task.exception()}"
            else:
                done = p.task.result()
                out.trees[s] = done.results[p.index]
                if p.task not in counted:
                    counted.add(p.task)
                    out.compute_s += done.compute_s
                    out.batch = max(out.batch, p.batch)
        return out

    async def settle(self, seq_ids: list[str]) -> None:
        """Wait for the calls proposing these sequences' next trees and drop the trees: another call on
        them follows (the draft must be done reading their hidden states before those are rewritten)."""
        for s in seq_ids:
            self._last.pop(s, None)
        calls = {self._pending.pop(s).task for s in seq_ids if s in self._pending}
        if calls:
            await asyncio.wait(calls)

    def forget(self, seq_ids: list[str]) -> None:
        """Drop without waiting (sequences freed by lease expiry: the draft frees its copies on its own)."""
        for s in seq_ids:
            self._pending.pop(s, None)
            self._last.pop(s, None)
