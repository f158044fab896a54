"""Continuous batching of generations over the draft and verifier services.

One loop owns every active sequence. Each iteration admits waiting requests, starts the next prefill in
the background when none is in flight (up to `prefill_chunk` prompt tokens on the verifier in one call,
oldest first, several prompts together; a longer prompt goes in chunks, one per iteration), and runs one
round for every sequence whose prompt is in (propose, verify, commit, stream) while that prefill goes on:
the verifier runs the prefill between the round's engine calls (services/engine_runner.py), so a joiner's
first token does not wait for the round and the round does not wait for the joiner's whole prompt, only
for the GPU time its chunk takes. Sequences join the round after their prefill and leave when finished,
between rounds, without stalling the others.

The draft is optional to every request. When it is down or a propose fails, the round's speculative
sequences are decoded plainly on the verifier (the same tokens, one a round) and the draft's state of
them is forgotten. Once the draft answers again they catch up: the verifier recomputes the hidden states
of each sequence's cached tokens (Features, in a spare slot) and the draft is restarted on them with a
start=True ProposeItem, exactly as after a prefill. Sequence ids start with this gateway's instance id,
under which the services hold them (see common/leases.py).

The round protocol, one gateway hop a round (services/verifier/chain.py): a round's Verify names, for each
sequence, the tree of the next round to ask the draft for. The verifier sends the outcome straight to the
draft and keeps the draft's next tree; the next round's Verify names the sequence `chained` instead of
carrying a tree. So the draft proposes while the gateway commits, detokenizes, streams and sends the next
round. A joiner's first tree comes the same way: its prefill names it (PrefillItem.next_nodes, the shape its
group's next round was given), the verifier hands the prompt's features to the draft and keeps the tree, and
the joiner's first Verify names it `chained` (_prefill). Sequences that caught up or come from a plain round
get their tree from a propose the gateway makes itself at the round's start; a joiner with no shape to ask
for yet has its own asked for in the background as soon as its prompt is in (_propose_early), and the
others' rounds do not wait for it. A chained tree whose sequence finished is
dropped (wasted work, never a wrong token); the verifier's Release waits for the proposal naming it, and
the draft's copy is released after that (both in the background: _retire). With no draft address for
the verifier (SchedulerConfig.draft_address ""), every tree comes from the gateway's own propose.

The gateway's host work overlaps the services': a call's tokens are taken as soon as it answers (the
token rules: each sequence's budget and finish, what the next call needs, Generation.take), the next call
is sent, and only then is the first call's text made and streamed (detokenizing, stop strings:
Generation.speak, _speak), while the services work on the next one. A stop string found then ends its
sequence one call late: that call's rounds for it are wasted, never streamed.

Several rounds a call (SchedulerConfig.rounds_per_call = k): a Verify of chained sequences asks for up to k
rounds, which the verifier runs by itself with the draft (services/verifier/chain.py), stopping each
sequence where this gateway would (end-of-sequence and stop token ids, its max_tokens budget; stop strings
are cut here at commit); the call answers every committed token and each round's accepted count, so the
gateway's hop and host work come once per k rounds. The group's tokens are committed and streamed once per
call; the request statistics, the metrics, the policy and the round breakdown still count each round
(_take_rounds, _time_round). k is 1 while requests wait for admission (a free slot), so that they wait
for one round, not k (_rounds_per_call); a prompt being prefilled does not lower it (its chunks run beside
the call; the sequence joins at the next call, which the gateway sends as soon as the joiners are ready and
enough, marked `cut`: the call in flight ends before its next round, _hold, common.rounds.cut_pays), and
plain rounds are as before. With SchedulerConfig.early_answers (off by default: no gain measured), a sequence
that a round stops by its token rules while the others run on comes back at once in an early answer
(VerifyRequest.early): its tokens are taken and its last delta streamed then (_took_early: after the tokens
of the calls before it, which may not be taken yet), not after the call's last round.

Speculation policy (common/policy.py): each group round has a shape, chosen when the round before was sent
(its trees are drafted from there) or at the round's start: a tree (depth, nodes) or plain decoding. A request may pin
its own tree. Speculative sequences in a plain round bring their features back from the verifier, so
the draft stays in step without a catch-up (services/gateway/speculation.py); the next tree's accept pass takes
every token since (in several captured passes when they are many). With `park_after` set, after that many plain
rounds in a row they are parked instead: no features are fetched while the policy keeps choosing plain, and when
it chooses a tree again they catch up as after a draft failure (Verifier.Features: the base model over each
whole context again, one sequence at a time, while the rounds wait). An exploring choice never unparks. Off by
default (session 17, H100, bench.prefill_stall): following costs a copy of a few feature rows per sequence and
round; with parking after 4 plain rounds, 16 streams at about 700 tokens caught up three times within a second
and their longest gap (1.3 s) began with the first catch-up.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from common.errors import CapacityExhausted, PeerUnavailable
from common.policy import PLAIN, Policy, Shape
from common.rounds import MAX_ROUNDS_PER_CALL, cut_pays
from services.clients import (
    DraftClient,
    RoundItem,
    Verified,
    VerifiedRound,
    VerifierClient,
    prefill_item,
    start_item,
)
from services.gateway.health import DraftLink
from services.gateway.metrics import Metrics
from services.gateway.sequence import Delta, Finish, Generation, Take
from services.gateway.speculation import append_plain_round
from services.packed import pack_ints
from services.sampling import sampling_msg
from specdec.v1 import internal_pb2 as pb

log = logging.getLogger(__name__)
# a queued Verify is sent this long before the call in flight is expected to start its last round (_hold):
# the gateway's work to send it, the hop, and the estimate's error
HOLD_MARGIN_S = 0.002
# a joiner's first tree comes through its prefill (chained) only for prompts up to this many tokens; a longer
# one's first tree is asked for here and the joiner sits out until it is in (_early_trees). A chained first
# tree is drafted in line with the running sequences' chained proposals and the call it joins waits for it, so
# a long prompt's pass would hold that call. Added in session 16 for a stall it did not cause (session 17 traced
# that to catch-ups of parked sequences, docs/benchmarks.md); kept, not measured since
CHAINED_FIRST_TREE_TOKENS = 512


@dataclass(eq=False)  # identity: rounds test membership of 64-long lists (a field-wise __eq__ cost ms)
class Active:
    seq_id: str
    gen: Generation
    out: asyncio.Queue  # Delta items, then None; or an exception
    speculative: bool = False  # the request wants speculation and a draft is configured
    group: int = 0  # the round group it runs in (SchedulerConfig.groups)
    pin: Shape | None = None  # the request's own tree (the policy off for it)
    parked: bool = False  # speculative, but the draft does not follow it while the policy chooses plain
    plain_streak: int = 0  # plain rounds in a row while followed
    next_propose: pb.ProposeItem | None = None  # the draft's input for the next round; None: plain (or lost)
    early: Early | None = None  # its first tree, asked for when its prompt was in (see Scheduler._propose_early)
    chained: bool = False  # the verifier holds its next tree (the draft has every token; next_propose is empty)
    prefilled: int = 0  # prompt tokens in the verifier's cache so far
    prefilling: bool = True  # its prompt is not all in yet: no rounds
    in_prefill: bool = False  # a prefill call naming it is in flight: it does not retire before the call is over
    calls: int = 0  # Verify calls naming it in flight (two when one is queued): it retires when none is ...
    rule_stopped: bool = False  # ... or once a call's token rules finished it (the call queued behind skips it)
    wants_hidden: bool = False  # decided at its first chunk: the prefill returns the prompt's features
    solo: bool = False  # a prefill it shared failed: its prompt goes in calls of its own
    started: float = field(default_factory=time.perf_counter)
    # its way into the rounds (Metrics.stage; perf_counter): its first prefill call sent, its first token, its
    # first tree in (the early propose; the first token when there is none), the first Verify naming it sent
    prefill_at: float | None = None
    first_token_at: float | None = None
    ready_at: float | None = None
    first_call_at: float | None = None
    first_answered: bool = False  # that Verify's answer was taken


@dataclass(frozen=True)
class Early:
    """A propose call the gateway made for sequences as they joined, before their first round."""

    task: asyncio.Task  # -> services.clients.Batched, or None when the draft failed
    index: int  # this sequence's tree among the call's results
    depth: int  # the call's draft depth (its deepest tree)


@dataclass(frozen=True)
class Call:
    """A group's Verify in flight, and what taking its answer needs."""

    task: asyncio.Future  # -> services.clients.VerifiedRound
    spec: list[Active]  # its items' sequences, in item order
    given: set[str]  # seq ids whose tree the gateway gave (proposed or early): the others were chained
    shape: Shape  # its first round's shape
    nxt: Shape | None  # the shape of the trees it asked the draft for (None: no chaining)
    t0: float  # its round began (perf_counter)
    t1: float  # it was sent
    draft_s: float  # the draft's engine seconds for the trees the gateway gave
    k: int  # the rounds it asked for
    said: Said  # its early answers


@dataclass(eq=False)
class Said:
    """A call's early answers (VerifyRequest.early), from the stream's reader while it runs."""

    taken: set[str] = field(default_factory=set)  # seq ids taken from one (the call's own answer skips them)
    stash: list[tuple[str, Verified]] = field(default_factory=list)  # not taken yet (_take_early)


@dataclass(frozen=True)
class SchedulerConfig:
    max_active: int = 8  # sequences in the rounds at once (<= the services' slots)
    max_waiting: int = 64  # queued requests beyond that before RESOURCE_EXHAUSTED
    instance_id: str = "gw"  # this gateway process; prefix of its sequence ids, owner of its sequences
    draft_retry_s: float = 0.5  # after a draft failure, speculation is retried no sooner than this
    plain_steps: int = 8  # plain decoding tokens per verifier call (one RPC and one host sync for all)
    groups: int = 1  # round groups run concurrently (2: one verifies while the other drafts)
    park_after: int = 0  # plain rounds in a row after which the draft stops following a sequence (0: never)
    draft_address: str = ""  # the draft as the verifier reaches it: chained rounds ("" = the gateway proposes)
    prefill_chunk: int = 512  # prompt tokens prefilled between two rounds (0 = every prompt whole)
    # rounds one Verify may run for chained sequences (the verifier goes on with the draft's trees by itself:
    # one gateway hop per call, not per round); 1 while requests wait to join
    rounds_per_call: int = 1
    # a group's next Verify is sent before its last one is answered, while the trees are chained: the verifier
    # goes on without waiting for the gateway (see Scheduler._round)
    queue_calls: bool = False
    # a sequence that a call of several rounds stops by its token rules is answered after that round, not the
    # call's last (VerifyRequest.early): its last tokens stream then (see Scheduler._take_early)
    early_answers: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.rounds_per_call <= MAX_ROUNDS_PER_CALL:
            raise ValueError(f"rounds_per_call must be in [1, {MAX_ROUNDS_PER_CALL}], got {self.rounds_per_call}")
        if self.max_active < 1 or self.max_waiting < 0:
            raise ValueError("max_active must be >= 1, max_waiting >= 0")
        if not 1 <= self.groups <= 4:
            raise ValueError(f"groups must be in [1, 4], got {self.groups}")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0 = whole prompts), got {self.prefill_chunk}")
        if self.park_after < 0:
            raise ValueError(f"park_after must be >= 0 (0: never), got {self.park_after}")
        if not 1 <= self.plain_steps <= 64:
            raise ValueError(f"plain_steps must be in [1, 64], got {self.plain_steps}")
        if not self.instance_id or self.draft_retry_s <= 0:
            raise ValueError("instance_id must not be empty and draft_retry_s must be > 0")


class Scheduler:
    def __init__(
        self,
        verifier: VerifierClient,
        draft: DraftClient | None,
        cfg: SchedulerConfig,
        policy: Policy,
        metrics: Metrics | None = None,
    ) -> None:
        self.verifier, self.draft, self.cfg = verifier, draft, cfg
        self.metrics = metrics or Metrics()
        self.policy = policy  # the shape of each round (common/policy.py)
        self.choices: dict[Shape, int] = {}  # group rounds per round shape (plain: no draft), since start
        self.waiting: dict[str, Active] = {}  # seq id -> queued request, oldest first
        self.active: list[Active] = []
        self.draft_link = DraftLink(cfg.draft_retry_s)
        self.draining = False
        self._decided: dict[int, Shape] = {}  # per group: the next round's shape, chosen when this one was sent
        self._background: set[asyncio.Task] = set()  # work stop() waits for (releases, early proposes): _spawn
        self._prefilling: asyncio.Task | None = None  # the prefill call in flight beside the rounds (_start_prefill)
        self._queued: dict[int, Call] = {}  # per group: its Verify in flight, answered at its next round
        # per group: its Verify calls whose answers are not taken yet, oldest first (early answers: _take_early)
        self._untaken: dict[int, collections.deque[Call]] = {}
        self._answered_at: dict[int, float] = {}  # per group: when its last Verify was answered
        self._round_s: dict[int, float] = {}  # per group: seconds a round of its calls takes at the verifier (mean)
        self._releasing = 0  # sequences whose release (_release) is in flight: their slots are not free yet
        self._unspoken: list[tuple[Active, Take]] = []  # the last call's tokens, taken, their text not yet streamed
        self._verifier_releases: set[asyncio.Task] = set()  # releases in flight (slots freed when done)
        self._wake = asyncio.Event()
        self._joinable = asyncio.Event()  # a joiner became ready for a call (its prompt and first tree in): _hold
        self._ids = itertools.count()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def drain(self) -> None:
        """Admit nothing new; return once every queued and active generation has finished."""
        self.draining = True
        while self.active or self.waiting:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Stop the loop; generations still running fail with UNAVAILABLE and their sequences are released."""
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._prefilling is not None:  # its slots exist once it is over: released below, not before
            await asyncio.gather(self._prefilling, return_exceptions=True)
        queued, self._queued = list(self._queued.values()), {}
        await asyncio.gather(*(c.task for c in queued), return_exceptions=True)  # before their slots are released
        self._speak()
        left = self.active + list(self.waiting.values())
        self.waiting.clear()
        self._fail(left, PeerUnavailable("the gateway shut down before this request finished"))
        await self._release([a for a in left if a in self.active])
        self.active = []
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    @property
    def speculation_degraded(self) -> bool:
        return self.draft is not None and self.draft_link.degraded

    async def generate(self, gen: Generation) -> AsyncIterator[Delta]:
        """Queue a generation and yield its deltas; the last one carries the finish reason."""
        if self.draining:
            raise PeerUnavailable("the gateway is shutting down; retry on another replica")
        if len(self.waiting) >= self.cfg.max_waiting:
            raise CapacityExhausted(f"{len(self.waiting)} requests are already waiting; try again later")
        a = Active(
            seq_id=f"{self.cfg.instance_id}-{next(self._ids)}",
            gen=gen,
            out=asyncio.Queue(),
            speculative=gen.request.speculative and self.draft is not None,
            pin=gen.request.tree,
        )
        self.waiting[a.seq_id] = a
        self._wake.set()
        if self._task is not None and not self._task.done() and self.active:  # rounds run: admit now, prefill beside
            self._admit()  # (the loop would reach it only after the call in flight; asyncio: no await between)
            self._start_prefill()
        try:
            while True:
                item = await a.out.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            gen.abort()  # no-op when finished; a cancelled client's sequence leaves at the next round
            self.waiting.pop(a.seq_id, None)  # cancelled or past its deadline while queued: its place is free

    # ---- the loop ----
    async def _loop(self) -> None:
        while True:
            if not self.active and not self.waiting:
                self._speak()
                self._wake.clear()
                await self._wake.wait()
            self._admit()
            await self._retire()  # finished by their first token, or cancelled while prefilling
            self._start_prefill()
            if self.active:
                await self._guarded(self.active, self._catch_up())  # sequences the draft lost, once it is back
            groups = [(g, self._ready(g)) for g in range(self.cfg.groups)]
            if any(m for _, m in groups):
                await asyncio.gather(*(self._guarded(m, self._round(g, m)) for g, m in groups if m))
            elif self._prefilling is not None:  # nobody to run a round for: the prompts in first
                self._speak()
                await asyncio.wait({self._prefilling})

    async def _round(self, group: int, members: list[Active]) -> None:
        """One round for the members of a group: its Verify is sent, then the text of the last one is
        streamed, then its answer is taken. With several groups their rounds run concurrently: one group's
        verification while another's draft proposes, so that neither service waits for the other.

        Queued calls (SchedulerConfig.queue_calls, while the verifier chains the trees): the round's Verify
        is sent before the group's last one is answered, and the round takes that last one's answer instead
        of its own, which stays in flight for the next round to take. The verifier goes from one call to the
        next without waiting for the gateway's hop and host work (VerifyStream answers in order). The
        sequences of the call in flight go on in the new one as `follows` items (chained: the verifier
        subtracts what the call before committed from their budget and answers those it stopped with
        nothing); one that the call before's token rules finished leaves the rounds at once (the call in
        flight skips it: Active.rule_stopped), one finished by a stop string or a cancellation in between
        runs one call more, wasted, never streamed, and leaves once no call in flight names it (Active.calls)."""
        if group in self._queued and await self._hold(group, self._queued[group]):
            members = self._ready(group)  # joiners included
        t0 = time.perf_counter()
        prev = self._queued.pop(group, None)
        follow = self._follows(prev)
        decided = self._decided.pop(group, None)  # chosen when the last round was sent (its trees are chained)
        shape = decided if decided is not None else self._choose(members)  # the policy's
        members, early = await self._early_trees(members)  # joiners whose first tree is not in yet sit out
        # finished ones wait for their calls to be answered (then they retire), as do those not following
        members = [a for a in members if a.gen.finish is None and (a.calls == 0 or id(a) in follow)]
        spec = [a for a in members if id(a) in follow or a.next_propose is not None and not self._tree(a, shape).plain]
        spec = [a for a in spec if a.seq_id not in early] + [a for a in spec if a.seq_id in early]
        fresh = [a for a in spec if not a.chained and id(a) not in follow and a.seq_id not in early]
        trees, draft_s = await self._proposals(fresh, shape)
        trees.update(early)
        spec = [a for a in spec if a.chained or id(a) in follow or a.seq_id in trees]
        in_spec = set(spec)  # by identity (Active is eq=False): a list's `in` costs 64 comparisons at 64
        plain = [a for a in members if a not in in_spec and a.gen.finish is None]
        call = None
        if spec:
            t1 = time.perf_counter()
            nxt = self._next_shape(group, spec)
            k = self._rounds_per_call(members, nxt)
            items = [self._round_item(a, trees.get(a.seq_id), nxt, k, id(a) in follow) for a in spec]
            # sequences that were not in the call in flight (joiners): it ends after its current round
            # instead of running its other rounds without them (VerifyRequest.cut), when they are enough
            cut = prev is not None and prev.k > 1 and cut_pays(len(spec) - len(follow), len(follow))
            said = Said()
            tell = functools.partial(self._took_early, group, said) if self.cfg.early_answers else None
            task = asyncio.ensure_future(
                self.verifier.verify(
                    items, self.cfg.draft_address, self.cfg.instance_id, rounds=k, cut=cut, lane=group, early=tell
                )
            )
            call = Call(task, spec, set(trees), shape, nxt, t0, t1, draft_s, k, said)
            self._untaken.setdefault(group, collections.deque()).append(call)
            for a in spec:
                a.calls += 1
                if a.first_call_at is None:
                    a.first_call_at = t1
                    self.metrics.stage("join", t1 - (a.ready_at or a.first_token_at or t1))
        try:
            await asyncio.sleep(0)  # the call's request goes out (the client writes it on its stream) ...
            spoke = self._speak()  # ... and the last call's text is made and streamed while the services work
            keep = call is not None and self.cfg.queue_calls and call.nxt is not None  # in flight past this round
            if prev is not None:
                plain += [a for a in await self._answered(group, prev, spoke, keep) if a not in in_spec]
                spoke = 0.0
            if call is not None and not keep:
                call, this = None, call
                plain += await self._answered(group, this, spoke, False)
        finally:
            if call is not None:  # stays in flight: the next round takes its answer (and stop() waits for it)
                self._queued[group] = call
        plain = [a for a in dict.fromkeys(plain) if a.calls == 0 and a.gen.finish is None]
        if plain:
            await self._plain_round(plain)
        if not spec and any(a.speculative for a in members):
            self._count_choice(PLAIN)  # a call's rounds count when it is answered (_answered): those it ran
        await self._retire()

    def _ready(self, group: int) -> list[Active]:
        """The group's sequences whose prompt is in: those a round runs for."""
        return [a for a in self.active if a.group == group and not a.prefilling]

    async def _hold(self, group: int, prev: Call) -> bool:
        """Before the group's next Verify is queued behind `prev` (in flight): wait until enough sequences not in
        prev are ready to join (prompt and first tree in: _joiner_ready), or until about one round before prev
        is expected to start its last round at the verifier (its rounds at the group's mean round time, from
        when it began: the call before it was answered), or until prev is answered. A request that replaces a
        finished one arrives just after that one's call is taken, when the next call would go out at once; its
        prefill and first tree run beside prev's rounds, and waiting lets it into the next call instead of
        the one after it; when the joiners are enough, that call cuts prev short (VerifyRequest.cut), so they
        wait about a round, not the rest of prev. Otherwise the verifier still finds the next call queued when
        prev ends (HOLD_MARGIN_S covers sending it). Only while a sequence can join (a free slot, or a prompt
        going in in this group) and nobody waits for admission (calls are one round then). Returns whether it
        waited. Example: prev asks for 4 rounds of ~3.8 ms and began 0.5 ms ago -> the next call goes out in
        3 x 3.8 - 2 - 0.5 = 8.9 ms, or when prev is answered or enough joiners are ready, if sooner."""
        round_s = self._round_s.get(group)
        if round_s is None or prev.k < 2 or self.waiting:
            return False
        if len(self.active) >= self.cfg.max_active and not any(a.prefilling for a in self.active if a.group == group):
            return False
        begun = max(self._answered_at.get(group, 0.0), prev.t1)
        wait = begun + (prev.k - 1) * round_s - HOLD_MARGIN_S - time.perf_counter()
        if wait <= 0 or self._joiner_ready(group, prev):
            return False
        self._speak()  # the last call's text need not wait
        self._joinable.clear()
        joinable = asyncio.ensure_future(self._joinable.wait())
        try:
            while not prev.task.done() and not self._joiner_ready(group, prev):
                left = begun + (prev.k - 1) * round_s - HOLD_MARGIN_S - time.perf_counter()
                if left <= 0:
                    break
                await asyncio.wait({prev.task, joinable}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if joinable.done():  # a joiner's first tree (or prompt) came in: is it this group's?
                    self._joinable.clear()
                    joinable = asyncio.ensure_future(self._joinable.wait())
        finally:
            joinable.cancel()
        return True

    def _joiner_ready(self, group: int, prev: Call) -> bool:
        """Enough speculative sequences of the group that no call in flight names (common.rounds.cut_pays
        against prev's) could run a round now: joiners whose prompt is in and first tree too, if one was asked
        for, or sequences back from a plain round."""
        ready = sum(
            a.calls == 0 and a.next_propose is not None and a.gen.finish is None
            and (a.early is None or a.early.task.done())
            for a in self._ready(group)
        )  # fmt: skip
        return cut_pays(ready, len(prev.spec))

    def _follows(self, prev: Call | None) -> set[int]:
        """The sequences of the call in flight that go on in the next one as `follows` items (by id(Active)):
        those it asked the draft's next tree for, unless known finished or lost since it was sent."""
        if prev is None or prev.nxt is None:
            return set()
        return {
            id(a)
            for a in prev.spec
            if a.gen.finish is None and a.next_propose is not None and self._next_tree(a, prev.nxt) is not None
        }

    async def _answered(self, group: int, call: Call, spoke: float, ahead: bool) -> list[Active]:
        """A call's answer taken (its tokens, the policy, the metrics, the round breakdown; `ahead`: the
        group's next call is in flight); returns the sequences to decode plainly (their chained tree never
        came and the call gave them no token)."""
        try:
            self._take_early(call)  # early answers kept because the call ahead of it failed (nothing took them)
            verified = await call.task
        finally:
            for a in call.spec:
                a.calls -= 1
            untaken = self._untaken[group]
            untaken.remove(call)  # the oldest (or one that failed)
        t2 = time.perf_counter()
        for a in call.spec:
            if not a.first_answered:  # its first Verify: the call in flight's rest, then this one
                a.first_answered = True
                self.metrics.stage("first_call", t2 - a.first_call_at)
        # a queued call began when the one before it was answered (it waited at the verifier until then)
        begun = self._answered_at.get(group, 0.0)
        t0, t1 = max(call.t0, begun), max(call.t1, begun)
        self._answered_at[group] = t2
        if verified.rounds:  # the mean round at the verifier, for _hold (recent calls weigh most)
            per_round = (t2 - t1) / verified.rounds
            last = self._round_s.get(group, per_round)
            self._round_s[group] = 0.7 * last + 0.3 * per_round
        self.metrics.verify_calls.inc()
        spec, plain = call.spec, []
        lost = [(a, r) for a, r in zip(spec, verified.results) if r.draft_error]
        news = [(a, r) for a, r in lost if a.next_propose is not None or a.chained]  # not lost before
        if news:  # their chained trees never came: caught up later, plain this round if it got no tokens
            self._draft_failed([a for a, _ in news], news[0][1].draft_error)
        plain = [a for a, r in lost if not r.tokens]
        takes = self._take_rounds(spec, verified, call.shape, call.nxt, call.said.taken)
        # the text is streamed during the next call, but a finished request's at once: its client sends its
        # next request on it (a closed loop's replacement would wait a call for it)
        ends = [(a, t) for a, t in takes if t.finish is not None]
        if ends:
            self._speak()  # the takes before them first (a sequence's own earlier take may be among them)
            self._stream([(a, a.gen.speak(t)) for a, t in ends])
        self._unspoken += [(a, t) for a, t in takes if t.finish is None]
        if untaken:  # the next call's early answers that came meanwhile: after this call's tokens
            self._take_early(untaken[0])
        if verified.draft_batch:  # the chained trees' calls: the draft's engine time at its batch and depth
            chained = [a for a in spec if a.seq_id not in call.given] if verified.rounds == 1 else spec
            depth = self._round_shape(chained, call.shape if verified.rounds == 1 else call.nxt or call.shape).depth
            self.policy.observe_step("propose", verified.draft_batch, depth, verified.draft_s / verified.rounds)
        if not any(r.accepted for r in verified.results):  # a queued call whose sequences had all stopped
            return plain
        self._time_round(t0, t1, t2, call.draft_s, verified, spoke, ahead)
        self.policy.observe_round(len(spec), self._round_shape(spec, call.shape), (t2 - t0) / verified.rounds, 1)
        self._count_choice(self._round_shape(spec, call.shape))
        for _ in range(verified.rounds - 1):  # the call's later rounds drafted the next shape
            self._count_choice(self._round_shape(spec, call.nxt or call.shape))
        return plain

    def _next_shape(self, group: int, spec: list[Active]) -> Shape | None:
        """The group's next round shape, chosen now so that the verifier can chain its trees (None: no
        chaining, the next round chooses at its start)."""
        if not self.cfg.draft_address or self.draft_link.degraded:
            return None
        shape = self._decided[group] = self._choose(spec)
        return shape

    def _rounds_per_call(self, members: list[Active], nxt: Shape | None) -> int:
        """Rounds the verifier may run in this Verify: cfg.rounds_per_call while the trees are chained and
        no request waits for admission (it would wait for all of them: a prompt being prefilled does not,
        its prefill runs beside the call); else one. One as well when a member's next tree is plain: the
        policy's sequences stop after one round and would wait for the pinned ones' others. Sequences with
        pinned trees draft them whatever the policy's shape (PLAIN when every sequence is pinned: nobody for
        the policy to choose for)."""
        if self.waiting:
            return 1
        if any(self._next_tree(a, nxt) is None for a in members):  # None: no chaining, or a plain next tree
            return 1
        return self.cfg.rounds_per_call

    def _round_item(
        self, a: Active, tree: pb.DraftTree | None, nxt: Shape | None, k: int, follows: bool = False
    ) -> RoundItem:
        """A's item of a Verify of k rounds: with k > 1 or queued calls, the stop rules its commit applies
        (sequence.py), so that the verifier stops it where the commit will and a call queued behind does
        not verify it again; one that follows a call in flight has its budget as it was before that call
        (the verifier subtracts what that call commits)."""
        nxt_tree = self._next_tree(a, nxt)
        if k == 1 and not self.cfg.queue_calls:
            return RoundItem(a.seq_id, tree, nxt_tree)
        rules = (a.gen.tokens_left(), pack_ints(a.gen.token_stops))
        return RoundItem(a.seq_id, None if follows else tree, nxt_tree, *rules, follows)

    def _take_rounds(
        self,
        spec: list[Active],
        verified: VerifiedRound,
        shape: Shape,
        nxt: Shape | None,
        early: set[str] | frozenset[str] = frozenset(),
    ) -> list[tuple[Active, Take]]:
        """Each sequence's tokens of the call, taken at once by the token rules (Generation.take: its budget
        and finish are right for the next call), and its rounds counted one by one: the request's
        statistics, the metrics and the policy learn per round (round 1 drafted `shape`, later ones `nxt`).
        Returns the takes to speak (_speak: their text, stop strings, the stream), which the next call
        overlaps. A sequence that had finished (a stop string found by the last speak, a cancelled request)
        takes nothing: rounds run past a stop string are wasted, never wrong. Those in `early` (seq ids) were
        taken from an early answer (_take_early): only now that the call is over may they leave at once."""
        takes, accepted, nodes = [], [], 0
        for a, r in zip(spec, verified.results):
            if a.seq_id in early:
                # the verifier stopped it by the same rules: a call queued behind answers it with nothing
                a.rule_stopped = a.gen.finish is not None
                continue
            if not r.tokens:  # a round-1 draft_error: nothing verified
                continue
            if not r.draft_error:
                self._follow(a, r)
            accepted += r.accepted
            nodes += r.nodes
            taken = self._take(a, r, shape, nxt)
            if taken is not None:
                takes.append((a, taken))
                a.rule_stopped = taken.finish is not None  # as above
        self.metrics.verified(accepted, nodes)
        return takes

    def _take(self, a: Active, r: Verified, shape: Shape, nxt: Shape | None) -> Take | None:
        """A sequence's rounds of a call counted (round 1 drafted `shape`, later ones `nxt`) and its tokens
        taken (None: it had finished)."""
        for j, (n, m) in enumerate(zip(r.accepted, r.round_nodes)):
            a.gen.stats.count_round(m, n)
            self.policy.observe(a.seq_id, self._tree(a, shape if j == 0 or nxt is None else nxt), n)
        return a.gen.take(r.tokens)

    def _took_early(self, group: int, said: Said, results: list[tuple[str, Verified]]) -> None:
        """An early answer of a call in flight (VerifyRequest.early: sequences a round stopped by their token
        rules while the others run on), from the stream's reader: kept, and taken now if no call before it
        waits to be taken (its sequences' earlier tokens come first: _answered takes it then)."""
        said.stash.extend(results)
        untaken = self._untaken.get(group)
        if untaken and untaken[0].said is said:
            self._take_early(untaken[0])

    def _take_early(self, call: Call) -> None:
        """The early answers of `call` not taken yet: each sequence's rounds counted and its tokens taken,
        and, as it finished, its text streamed at once (the takes of earlier calls first). It leaves the
        rounds when the call is answered (whose own answer skips it: Said.taken)."""
        said = call.said
        if not said.stash:
            return
        results, said.stash = said.stash, []
        by_id = {a.seq_id: a for a in call.spec}
        takes, accepted, nodes = [], [], 0
        for seq_id, r in results:
            a = by_id.get(seq_id)
            if a is None or seq_id in said.taken:
                continue
            said.taken.add(seq_id)
            accepted += r.accepted
            nodes += r.nodes
            taken = self._take(a, r, call.shape, call.nxt)
            if taken is not None:
                takes.append((a, taken))
        self.metrics.verified(accepted, nodes)
        if takes:
            self._speak()
            self._stream([(a, a.gen.speak(t)) for a, t in takes])

    def _speak(self) -> float:
        """Stream the text of the takes not yet spoken (detokenizing them, checking stop strings); called
        right after the next Verify went out, and before anything else that streams or waits. Returns the
        seconds it took."""
        if not self._unspoken:
            return 0.0
        t0 = time.perf_counter()
        pending, self._unspoken = self._unspoken, []
        self._stream([(a, a.gen.speak(t)) for a, t in pending])
        return time.perf_counter() - t0

    def _next_tree(self, a: Active, nxt: Shape | None) -> tuple[int, int] | None:
        """(depth, nodes) of the tree the verifier asks the draft for after this round, or None."""
        if nxt is None:
            return None
        tree = self._tree(a, nxt)
        return None if tree.plain else (tree.depth, tree.nodes)

    def _follow(self, a: Active, r: Verified) -> None:
        """Where the draft's next input is after a verify: with the draft already (chained), or here."""
        a.chained = r.chained
        if r.chained:
            a.next_propose = pb.ProposeItem(seq_id=a.seq_id)
        else:
            a.next_propose = pb.ProposeItem(seq_id=a.seq_id, token_ids=r.tokens, hidden=r.hidden)
        a.plain_streak = 0

    async def _plain_round(self, plain: list[Active]) -> None:
        """Several tokens per call; commit cuts at a stop (steps past it are wasted, not wrong). Speculative
        sequences bring their features back for the draft (see services/gateway/speculation.py)."""
        self._speak()  # the takes first: this round commits and streams at once
        left = max(a.gen.request.max_tokens - len(a.gen.token_ids) for a in plain)
        steps = max(1, min(self.cfg.plain_steps, left))
        follow = {a.seq_id: len(a.next_propose.token_ids) for a in plain if a.next_propose is not None}
        t0 = time.perf_counter()
        decoded = await self.verifier.decode([a.seq_id for a in plain], steps, follow)
        self.policy.observe_round(len(plain), PLAIN, time.perf_counter() - t0, steps)
        self.policy.observe_step("decode", len(plain), 1, decoded.compute_us / 1e6 / steps)
        deltas = []
        for a, r in zip(plain, decoded.results):
            a.chained = False  # a pending chained tree was dropped by the Decode
            tokens = r.tokens[:]  # the repeated field as a list, read once
            if a.seq_id in follow:
                append_plain_round(a.next_propose, tokens, r.hidden)
                a.plain_streak += 1
                if self.cfg.park_after and a.plain_streak >= self.cfg.park_after and a.pin is None:
                    a.next_propose, a.parked = None, True  # see Speculation policy: parked
            deltas.append((a, a.gen.commit(tokens)))
        self._stream(deltas)

    def _tree(self, a: Active, shape: Shape) -> Shape:
        """The tree a sequence drafts in a round of `shape`: its pinned one, else the round's."""
        return a.pin if a.pin is not None else shape

    def _round_shape(self, spec: list[Active], shape: Shape) -> Shape:
        """What a round of these sequences drafts and verifies: the deepest depth, the most nodes."""
        trees = [self._tree(a, shape) for a in spec]
        return Shape(max(t.depth for t in trees), max(t.nodes for t in trees))

    def _choose(self, members: list[Active]) -> Shape:
        """The policy's shape for the speculative members without a pinned tree (PLAIN when none). A tree
        it prefers (not one it explores) unparks the parked ones: they catch up and join later rounds."""
        mine = [a for a in members if a.pin is None and (a.next_propose is not None or a.parked)]
        if not mine:
            return PLAIN
        choice = self.policy.choose([a.seq_id for a in mine], self.cfg.plain_steps)
        parked = [a for a in mine if a.parked]
        if parked and not choice.shape.plain:
            if choice.explored:
                return PLAIN
            for a in parked:
                a.parked = False  # lost now: _catch_up restores the draft's state of it
        return choice.shape

    def _propose_early(self, joined: list[Active]) -> None:
        """Ask the draft for the first trees of sequences whose prompt just went in, in the background, in
        the shape their group's next round was given when the round before was sent; the rounds go on
        without them until the trees are in (_early_trees), so a joiner's propose does not hold up the
        others' round. Nothing when the group has no chosen shape yet, or it is plain: then their first
        tree comes from the propose at the round's start."""
        if self.draft is None or self.draft_link.degraded:
            return
        by_shape: dict[Shape, list[Active]] = {}
        for a in joined:
            shape = self._decided.get(a.group)
            if a.next_propose is not None and shape is not None and not self._tree(a, shape).plain:
                by_shape.setdefault(shape, []).append(a)
        for shape, group in by_shape.items():
            task = self._spawn(self._propose(group, shape))
            task.add_done_callback(lambda _, group=group: self._ready_now(group))  # their first trees are in
            depth = self._round_shape(group, shape).depth
            for i, a in enumerate(group):
                a.early = Early(task, i, depth)

    async def _early_trees(self, members: list[Active]) -> tuple[list[Active], dict[str, pb.DraftTree]]:
        """The members that run this round, and the first trees of joiners whose early propose is in
        ({seq_id: tree}; a failed call left them plain: _propose forgot them). Joiners still waiting for
        theirs sit the round out, unless nobody else is in it: then the round waits for them."""
        early = [a for a in members if a.early is not None]
        if not early:
            return members, {}
        if all(a.early is not None for a in members):
            self._speak()  # others' text need not wait for these trees
            await asyncio.wait({a.early.task for a in early}, return_when=asyncio.FIRST_COMPLETED)
        sitting = {id(a) for a in early if not a.early.task.done()}
        trees, counted = {}, set()
        for a in early:
            if id(a) in sitting:
                continue
            proposed, i = a.early.task.result(), a.early.index
            if proposed is not None:
                trees[a.seq_id] = proposed.results[i]
                if a.early.task not in counted:
                    counted.add(a.early.task)
                    self.policy.observe_step("propose", len(proposed.results), a.early.depth, proposed.compute_s)
            a.early = None
        return [a for a in members if id(a) not in sitting], trees

    async def _proposals(self, fresh: list[Active], shape: Shape) -> tuple[dict[str, pb.DraftTree], float]:
        """Trees of the sequences the verifier holds none for ({seq_id: tree}) and the draft's engine
        seconds; none when the draft failed (those sequences are plain this round, see _propose)."""
        if fresh:
            self._speak()  # the text need not wait for this call
        proposed = await self._propose(fresh, shape)
        if proposed is None:
            return {}, 0.0
        depth = self._round_shape(fresh, shape).depth
        self.policy.observe_step("propose", len(fresh), depth, proposed.compute_s)
        return dict(zip([a.seq_id for a in fresh], proposed.results)), proposed.compute_s

    async def _propose(self, spec: list[Active], shape: Shape):
        """The draft's trees for `spec` in a round of `shape`, or None when it failed: then its state of
        them is forgotten (they catch up later) and nobody's request fails for it."""
        if not spec:
            return None
        for a in spec:
            tree = self._tree(a, shape)
            a.next_propose.max_nodes, a.next_propose.max_depth = tree.nodes, tree.depth
        try:
            proposed = await self.draft.propose([a.next_propose for a in spec], owner=self.cfg.instance_id)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any draft failure means plain decoding, not a failed request
            self._draft_failed(spec, e)
            return None
        self.draft_link.succeeded()
        return proposed

    def _draft_failed(self, group: list[Active], e: Exception | str) -> None:
        log.warning("draft failed for %d sequence(s) (%s): plain decoding until it is back", len(group), e)
        self.draft_link.failed(time.monotonic())
        self.metrics.draft_failures.inc()
        for a in group:
            a.next_propose, a.chained = None, False

    async def _catch_up(self) -> None:
        """Restart the draft on every speculative sequence it does not hold: hidden states of the tokens
        in the verifier's cache, recomputed, paired with the tokens that follow them (as after a prefill:
        context [t0 .. tn] with tn pending -> hidden of t0..t(n-1), token_ids t1..tn, prefix [t0])."""
        lost = [  # one a call in flight names is not caught up under that call (its answer may lose it again)
            a
            for a in self.active
            if a.speculative and a.next_propose is None and not a.parked and not a.prefilling and not a.calls
        ]
        self.metrics.degraded.set(1 if self.speculation_degraded else 0)
        if not lost or not self.draft_link.may_try(time.monotonic()) or not self.draft.reachable():
            return
        self._speak()  # token_ids as the stream has them (a stop string may have ended one)
        lost = [a for a in lost if a.gen.finish is None]
        if not lost:
            return
        contexts = [a.gen.request.prompt_ids + a.gen.token_ids for a in lost]
        try:
            hidden = await self.verifier.features([(a.seq_id, ctx[:-1]) for a, ctx in zip(lost, contexts)])
        except PeerUnavailable:
            raise  # the verifier is down: the round fails anyway
        except Exception as e:  # noqa: BLE001 - no catch-up this round; they stay plain
            log.warning("could not recompute features for the draft to catch up: %s", e)
            self.draft_link.failed(time.monotonic())
            return
        for a, ctx, h in zip(lost, contexts, hidden):  # as after a prefill of ctx[:-1] that chose ctx[-1]
            a.next_propose = start_item(a.seq_id, ctx[:-1], ctx[-1], h, sampling_msg(a.gen.request.sampling))
        log.info("the draft catches up on %d sequence(s)", len(lost))

    def _count_choice(self, shape: Shape) -> None:
        self.choices[shape] = self.choices.get(shape, 0) + 1
        self.metrics.round_shape(shape.depth, shape.nodes)

    def _time_round(
        self, t0: float, t1: float, t2: float, draft_s: float, v: VerifiedRound, spoke: float, ahead: bool = False
    ) -> None:
        """Round breakdown, per round (a call of several rounds: its figures over the rounds it ran): engine
        time in each service (the draft's: the trees of the call's rounds, chained or not), the verifier's
        wait for chained trees not ready when it needed them (rounds after a call's first always wait: the
        draft works between them), the verifier's own work in the call (`verifier_host`: its wall less its
        engine's verify and that wait: the chain's bookkeeping, messages, anything it ran between the
        rounds, such as a prefill), `starved`: how long the verifier had nothing to do while the call was on
        its way (it had answered the one before and this one had not come), RPC (call wall minus all that and the
        streaming it overlapped: the hops, serialization, the gateway's event loop reading the answer late),
        the gateway's own orchestration after the call (taking the tokens, the policy, the metrics), and
        `stream`: the last call's text and streaming, done while this call ran (not part of total). A
        queued call (`ahead`: the next one was in flight when it was taken) began when the call before was
        answered, and its orchestration overlaps the next call: not part of total either."""
        host = max(v.wall_s - v.compute_s - v.wait_s, 0)
        # the verifier's idle time while this call was on its way (not before it was sent: an idle stream
        # between two runs of requests is nobody's round)
        starved = min(v.idle_s, max((t2 - t1) - v.wall_s, 0))
        rpc = max((t1 - t0) - draft_s, 0) + max((t2 - t1) - v.compute_s - v.wait_s - host - starved - spoke, 0)
        t3 = time.perf_counter()
        n = v.rounds
        seconds = {
            "draft": draft_s + v.draft_s,
            "verify": v.compute_s,
            "draft_wait": v.wait_s,
            "verifier_host": host,
            "starved": starved,
            "rpc": rpc,
            "orchestration": t3 - t2,
            "stream": spoke,
            "total": (t2 if ahead else t3) - t0,
        }
        for name, histogram in self.metrics.round_phase.items():  # each round once: sum / count is per round
            for _ in range(n):
                histogram.observe(seconds[name] / n)

    def _admit(self) -> None:
        """Waiting requests into the rounds' sequences while there is room (their prompts go in next)."""
        self.metrics.running.set(len(self.active))
        self.metrics.waiting.set(len(self.waiting))
        while self.waiting and len(self.active) < self.cfg.max_active:
            a = self.waiting.pop(next(iter(self.waiting)))
            if a.gen.finish is not None:  # cancelled while waiting
                continue
            sizes = [sum(b.group == g for b in self.active) for g in range(self.cfg.groups)]
            a.group = sizes.index(min(sizes))  # the smaller group
            self.active.append(a)

    def _start_prefill(self, fresh: bool = False) -> None:
        """The next prefill call, in the background, unless one is in flight or no prompt is left to go in:
        up to prefill_chunk tokens, oldest first (see the module's docstring). When a prefill call is over,
        the prompts that arrived meanwhile go in at once (`fresh`: only prompts not begun), not at the loop's
        next turn, a call later: replacements of sequences that one call finished arrive together, and all but
        the first would wait that long for their first token. A long prompt's later chunks still go one per
        turn, so that they do not take the verifier from the rounds back to back."""
        if self._prefilling is not None and not self._prefilling.done():
            return
        budget = self.cfg.prefill_chunk or float("inf")
        work: list[tuple[Active, int]] = []  # (sequence, prompt tokens it gets now)
        for a in [a for a in self.active if a.prefilling and a.gen.finish is None]:  # oldest first
            if budget <= 0:
                break
            if fresh and a.prefilled:
                continue
            n = int(min(len(a.gen.request.prompt_ids) - a.prefilled, budget))
            budget -= n
            work.append((a, n))
        for a, _ in work:
            a.in_prefill = True
        self._prefilling = self._spawn(self._prefill_work(work)) if work else None
        if self._prefilling is not None:
            self._prefilling.add_done_callback(self._prefill_over)

    def _prefill_over(self, task: asyncio.Task) -> None:
        if not task.cancelled() and self._task is not None and not self._task.done():  # not while stopping
            self._start_prefill(fresh=True)

    async def _prefill_work(self, work: list[tuple[Active, int]]) -> None:
        """One prefill step (_start_prefill's): the sequences alone that a shared call failed, then the
        others in one call. Until it is over they do not retire (a release sent before the call lands
        would leave the call's slots held)."""
        try:
            await self._prefill_calls(work)
        finally:
            for a, _ in work:
                a.in_prefill = False

    async def _prefill_calls(self, work: list[tuple[Active, int]]) -> None:
        new = any(a.prefilled == 0 for a, _ in work)
        if new and self._verifier_releases and len(self.active) + self._releasing > self.cfg.max_active:
            # the verifier's slots are full until releases land (see _retire): wait for them
            await asyncio.gather(*self._verifier_releases, return_exceptions=True)
        for a, n in [(a, n) for a, n in work if a.solo]:  # see _prefill_together
            await self._guarded([a], self._prefill([(a, n)]))
        together = [(a, n) for a, n in work if not a.solo]
        if len(together) == 1:
            await self._guarded([together[0][0]], self._prefill(together))
        elif together:
            await self._prefill_together(together)

    async def _prefill_together(self, work: list[tuple[Active, int]]) -> None:
        """Several sequences in one call. It is all or nothing, so that one request's failure never fails the
        others: they start again, each in a call of its own (the verifier freed what the call had begun)."""
        try:
            await self._prefill(work)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - isolated below: each retried alone, failing only itself
            log.warning("a prefill of %d sequences failed (%s): each is retried alone", len(work), e)
            for a, _ in work:
                a.prefilled, a.solo = 0, True

    async def _prefill(self, work: list[tuple[Active, int]]) -> None:
        """The next n prompt tokens of each sequence, in one verifier call; a last chunk makes its sequence
        join the rounds with its first token. A speculative sequence's last chunk also asks the verifier for
        its first tree, in the shape its group's next round was given (_first_tree): the prompt's features go
        from the verifier to the draft as a round's outcome does, and the tree waits there for the sequence's
        first Verify (chained). Without that shape, or without a draft address for the verifier, its first
        tree is asked for here (_propose_early)."""
        items, now = [], time.perf_counter()
        for a, n in work:
            req = a.gen.request
            if a.prefill_at is None:
                a.prefill_at = now
                self.metrics.stage("queue", now - a.started)
            if a.prefilled == 0:
                # while the draft is down, no hidden states: the sequence catches up once it is back
                a.wants_hidden = a.speculative and not self.draft_link.degraded
            more = a.prefilled + n < len(req.prompt_ids)
            chunk = req.prompt_ids[a.prefilled : a.prefilled + n]
            first = None if more or not a.wants_hidden else self._first_tree(a)
            items.append(prefill_item(a.seq_id, chunk, req.sampling, a.wants_hidden, more, first))
        draft = self.cfg.draft_address if any(it.next_nodes for it in items) else ""
        results = await self.verifier.prefill_many(items, self.cfg.instance_id, draft)
        if results:
            self.metrics.prefill_timed(time.perf_counter() - now, results[0].verifier_s, results[0].engine_s)
        joined = []
        for (a, n), it, pre in zip(work, items, results):
            a.prefilled += n
            if not it.more:
                self._joined(a, pre.next_token, pre.hidden, pre.chained)
                joined.append(a)
        self._propose_early([a for a in joined if a.gen.finish is None and not a.chained])
        self._ready_now([a for a in joined if a.early is None])  # no first tree to wait for here

    def _first_tree(self, a: Active) -> tuple[int, int] | None:
        """(depth, nodes) of the first tree the verifier asks the draft for after a's prefill, or None: no
        chaining, a degraded draft, a request that ends with its first token (no tree would be verified: the
        draft's pass over the prompt would be wasted), a long prompt (CHAINED_FIRST_TREE_TOKENS), no shape
        chosen for its group yet, or a plain one."""
        req = a.gen.request
        if not self.cfg.draft_address or self.draft_link.degraded:
            return None
        if req.max_tokens <= 1 or len(req.prompt_ids) > CHAINED_FIRST_TREE_TOKENS:
            return None
        return self._next_tree(a, self._decided.get(a.group))

    def _joined(self, a: Active, first_token: int, hidden: pb.TensorRef, chained: bool = False) -> None:
        """Its prompt is in: its first token, and the draft's start item when it speculates (or, chained,
        the draft has it and its first tree waits at the verifier)."""
        req = a.gen.request
        a.prefilling = False
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        if chained:
            a.next_propose, a.chained = pb.ProposeItem(seq_id=a.seq_id), True
        elif a.wants_hidden:
            a.next_propose = start_item(a.seq_id, req.prompt_ids, first_token, hidden, sampling_msg(req.sampling))
        self._stream([(a, a.gen.commit([first_token]))])
        if a.first_token_at is not None and a.prefill_at is not None:  # None: its first token ended it unseen
            self.metrics.stage("prefill", a.first_token_at - a.prefill_at)

    def _ready_now(self, joined: list[Active]) -> None:
        """Their first tree is in (or none is coming): they can join a call, and a hold ends if they are
        enough (_hold, _joiner_ready)."""
        if not joined:
            return
        now = time.perf_counter()
        for a in joined:
            if a.ready_at is None and a.first_token_at is not None:
                a.ready_at = now
                self.metrics.stage("first_tree", now - a.first_token_at)
        self._joinable.set()

    def _stream(self, deltas: list[tuple[Active, Delta]]) -> None:
        """Send each sequence its delta (all sent at this moment: one clock reading, one counter update)."""
        now = time.perf_counter()
        m = self.metrics
        m.generation_tokens.inc(sum(len(d.token_ids) for _, d in deltas))
        for a, delta in deltas:
            if a.first_token_at is None and delta.token_ids:
                a.first_token_at = now
                m.ttft.observe(now - a.started)
            if delta.token_ids or delta.text or delta.finish is not None:
                a.out.put_nowait(delta)
            if delta.finish is not None:
                a.out.put_nowait(None)
                m.e2e.observe(now - a.started)
                n = len(a.gen.token_ids)
                if n > 1 and a.first_token_at is not None:
                    m.itl.observe((now - a.first_token_at) / (n - 1))

    async def _retire(self) -> asyncio.Task | None:
        """Finished sequences leave the rounds; their slots are released in the background (the next round
        need not wait for the verifier's Release, which waits for their chained proposals): a prefill step
        that would find the verifier's slots full waits for those releases before it prefills a new sequence
        (_prefill_calls). One whose prefill call is in flight leaves once the call is over (Active.in_prefill);
        one that a Verify in flight names, once that call is answered, unless the token rules of the call
        before finished it: the verifier stopped it there by the same rules, so the call in flight does not
        touch it and its slots can go at once (Active.rule_stopped; a stop string or a cancellation is the
        gateway's alone). Returns the release's task (None when nobody left): a failed step (_guarded) waits
        for it."""
        done = [
            a for a in self.active if a.gen.finish is not None and not a.in_prefill and (not a.calls or a.rule_stopped)
        ]
        if not done:
            return None
        gone = set(done)  # by identity (Active is eq=False)
        self.active = [a for a in self.active if a not in gone]
        self._releasing += len(done)  # until the release is over (its slots are in use until then)
        task = self._spawn(self._release(done), self._verifier_releases)
        task.add_done_callback(lambda _, n=len(done): self._release_over(n))
        return task

    def _release_over(self, n: int) -> None:
        self._releasing -= n

    def _spawn(self, work, *also: set[asyncio.Task]) -> asyncio.Task:
        """Run `work` in the background, tracked (until done) by stop() and by the sets `also`."""
        task = asyncio.get_running_loop().create_task(work)
        for tasks in (self._background, *also):
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return task

    async def _release(self, done: list[Active]) -> None:
        """The verifier's slots (its Release waits for the chained proposals naming them), then the draft's
        copies (after any early propose naming them): the draft must not be asked about a sequence it has
        freed. Unknown ids are ignored on both; a lost release is reaped by the lease."""
        ids = [a.seq_id for a in done]
        if not ids:
            return
        for s in ids:
            self.policy.forget(s)
        try:
            await self.verifier.release(ids)
        except Exception as e:  # noqa: BLE001 - a lost release is reaped by the lease
            log.warning("release of %s on the verifier failed: %s", ids, e)
        if self.draft is None:
            return
        early = {a.early.task for a in done if a.early is not None}
        if early:
            await asyncio.wait(early)
        try:
            await self.draft.release(ids)
        except Exception as e:  # noqa: BLE001 - a lost release is reaped by the lease
            log.warning("release of %s on the draft failed: %s", ids, e)

    async def _guarded(self, group: list[Active], work) -> None:
        """Run one step; if it fails, fail the requests it was for (others keep going)."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the step's requests get the error; the loop and other requests go on
            log.warning("step failed for %d sequence(s): %s", len(group), e)
            self._fail(group, e)
            released = await self._retire()  # they leave as finished ones do (one in a prefill call: after it)
            if released is not None:
                await released

    @staticmethod
    def _fail(group: list[Active], e: Exception) -> None:
        for a in group:
            if a.gen.finish is None:
                a.gen.finish = Finish.ABORT
                a.out.put_nowait(e)
