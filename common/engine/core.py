"""The engine core: continuous batching of generations over a verifier engine and a drafter, one step at a time.
The verifier service runs it in a thread of its own; the benchmarks and the training evaluation run it in
process. It is the only place a round exists.

One step (EngineCore.step):

    admit waiting requests while slots are free          (WAITING -> PREFILLING)
    while sequences run (prefill_ahead on: a GPU): new prompts prefilled on the device beside this step's call,
        read at its end (they join the next step's call); what is left (a prompt in chunks, every prompt when
        nothing runs or on a CPU) prefilled now, up to `prefill_chunk` prompt tokens   (-> RUNNING, first token)
    up to `rounds_per_step` rounds for every running sequence, in verifier calls of one host synchronisation
    (a call cut short, before a try or with nothing chained behind it, ends the step):
        shape = the policy's (decided when the last call was launched, or now)
        trees = the drafting launched behind the last verify (the device chain), or a propose
        verify every sequence's tree at once; launch the next trees behind it on the device, and verify those
            there too, round after round, the host reading none of it (not past a q rule row's tree)
        commit each round's tokens by each sequence's token rules as soon as the host has them (the call's later
            rounds run on meanwhile); its output goes out. While the call's rows are all there is (none stopped,
            nothing waiting), each round read launches one more behind the last (AHEAD launched beyond the one
            read, up to call_rounds a call): the device is not left idle between calls, and the tokens go out
            every rounds_per_step rounds, a finish at once (publish). Requests that arrive meanwhile are
            prefilled on the device beside the call's rounds (prefill_ahead slots beyond the batch), read at
            the step's end: they join the next call
      or, when the shape is plain, `plain_steps` decoding steps with one host synchronisation (the step's last)
    release the finished ones, hand the step's outputs over (FINISHED)

A round's rows: sequences that draft (their tree this round), then sequences that do not (a tree of no
nodes: the verify gives them one token, exactly a decode step): requests that do not speculate, and those
whose drafter state is lost. The rows that go on drafting come first, so that the device chain drafts for
a prefix of the verify's rows (LaunchAfter).

The drafter's view of a sequence (Draft): the tokens committed since it last saw it, with the base
model's features that produced them (common.rounds explains the one-token shift). After a verify whose
next trees were launched on the device, the drafter has them already; otherwise (a plain round, a batch the
device chain declined) they wait here and go with its next propose. A joiner's prompt beside rows that draft
already is taken in without a tree (Drafter.take: nothing waited for): its first round decodes one token in their
verify, and its trees are drafted behind it from then on; a prompt alone is proposed. A drafter that fails
(a remote draft service down) loses every sequence: they go on plainly, and once it answers again each is
caught up from features recomputed over its whole context in the verifier's spare slot.

The policy (common/policy.py) sees the cost of each call that ran every round it asked for, with its joiners'
first proposes, without the step's prefill; a call cut short (before a try, or the last of a tree stretch: no
trees chained behind it) teaches it nothing, its host work shared by fewer rounds than any steady call's, nor
does the catch-up after a plain stretch (every row joining: its first round overlaps nothing). A drafter that
cannot draft behind a verify (a draft service in another process) makes every call one round: those are whole.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import torch

from common.engine.base import (
    Drafter,
    LaunchAfter,
    PrefillInput,
    PrefillOutput,
    ProposeAfter,
    ProposeInput,
    VerifierEngine,
    VerifyInput,
    finish,
)
from common.engine.core_drafts import DraftSupply
from common.engine.core_parts import Beside, CoreConfig, Draft, Snapshot
from common.policy import PLAIN, Choice, Member, Shape
from common.sequence import Finish, Request, SeqOutput, Sequence, Status, output
from common.tree import NO_TREE

log = logging.getLogger(__name__)
AHEAD = 2  # rounds a call that goes on keeps launched beyond the one the host reads (each about a round's device time)


class EngineCore(DraftSupply):
    def __init__(
        self,
        verifier: VerifierEngine,
        drafter: Drafter | None,
        policy,
        cfg: CoreConfig,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.verifier, self.drafter, self.policy, self.cfg, self.clock = verifier, drafter, policy, cfg, clock
        self.seqs: dict[str, Sequence] = {}  # every sequence not yet released, oldest first
        self.drafts: dict[str, Draft] = {}  # speculative sequences: what their drafter has not seen
        self.choices: collections.Counter[Shape] = collections.Counter()
        # where the engine thread's time goes (seconds by phase: core_parts.ROUND_PHASES, PLAIN_PHASES, idle, setup,
        # retire) and its calls counted (rounds: speculative rounds; plain_calls; switches: the policy's choices that
        # moved a batch between plain and trees): bench.engine_bench reports them per round, Info and bench.load per
        # run; a few clock reads a step
        self.times: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.degraded = False  # the drafter failed: every sequence plain until it answers again
        self._retry_at = 0.0
        self._launch: tuple[object, dict[str, int]] | None = None  # the chained drafting and its rows by seq id
        self._next: Choice | None = None  # the policy's for the next round, decided at the launch
        self._last_end: float | None = None  # when the last round ended (a steady round's cost runs from there)
        self._inbox: collections.deque = collections.deque()  # ("add", Request) | ("abort", seq_id), any thread
        self._wake = threading.Event()
        self._snapshot = Snapshot(0, 0, False, {}, [])
        self._snapshot_at = -1.0
        # the outputs of a call that goes on, every rounds_per_step rounds and a finish at once (the service routes
        # them to their streams); None: they go out with the step's
        self.publish: Callable[[list[SeqOutput]], None] | None = None
        self._ahead: list[Beside] = []  # prefills launched beside the step's call (cfg.prefill_ahead), read at its end
        self._out: set[str] = set()  # finished sequences whose last output a call published (released at the step end)
        self._on_trees = False  # the policy's last choice was a tree (the core starts on plain)

    # ---- the service's side (any thread) ----
    def add(self, req: Request) -> None:
        self._inbox.append(("add", req))
        self._wake.set()

    def abort(self, seq_id: str) -> None:
        self._inbox.append(("abort", seq_id))
        self._wake.set()

    def wait(self, timeout: float | None = None) -> None:
        """Block while there is nothing to do (no sequence, nothing in the inbox), at most `timeout` seconds."""
        if not self.seqs and not self._inbox:
            t0 = self.clock()
            self._wake.wait(timeout)
            self.times["idle"] += self.clock() - t0
            self._last_end = None  # the next call's cost does not run from before the idle time
        self._wake.clear()

    def drafter_down(self) -> None:
        """The drafter does not answer (at start-up): plain decoding until it does (_recover)."""
        self.degraded = True
        self._retry_at = self.clock() + self.cfg.draft_retry_s

    def abort_all(self) -> None:
        """Abort every generation (the service is stopping)."""
        for seq_id in list(self.seqs):
            self.abort(seq_id)

    def fail_all(self, e: BaseException) -> list[SeqOutput]:
        """After a step failed in a way its own handlers did not catch (a bug): every generation fails and
        what it held is released, so that the core starts clean."""
        for s in self.seqs.values():
            s.end(Finish.ERROR, e)
        self._launch, self._next, self._ahead = None, None, []  # a prefill beside a call: its slots counted
        try:
            return self._retire({})
        except Exception:  # noqa: BLE001 - the engines' state is suspect: forget the sequences anyway
            log.exception("releasing after a failed step failed too")
            outs = [output(s, []) for s in self.seqs.values()]
            self.seqs.clear()
            self.drafts.clear()
            return outs

    def snapshot(self) -> Snapshot:
        """The state as of the last step (made by the engine thread: safe to read from any thread)."""
        return self._snapshot

    def _take_snapshot(self, every_s: float = 0.25) -> None:
        now = self.clock()
        if now - self._snapshot_at < every_s and self.seqs:
            return
        self._snapshot_at = now
        seqs = list(self.seqs.values())
        self._snapshot = Snapshot(
            running=sum(s.status is Status.RUNNING for s in seqs),
            waiting=sum(s.status is Status.WAITING for s in seqs),
            degraded=self.degraded,
            choices=dict(self.choices),
            estimates=self.policy.estimates(self.policy.bands()) if hasattr(self.policy, "bands") else [],
            times=dict(self.times),
            calls=dict(self.calls),
        )

    # ---- one step (the engine thread) ----
    def step(self) -> list[SeqOutput]:
        t0 = self.clock()
        news: dict[str, list[int]] = {}  # seq id -> tokens committed this step
        self._take_inbox()
        self._admit(self.cfg.max_sequences)
        if self.cfg.prefill_ahead and self._batch():  # a call runs this step: the new prompts are prefilled beside it
            self._launch_ahead()
        self._prefill(news)
        self._recover()
        running = self._batch()
        t1 = self.clock()
        self.times["setup"] += t1 - t0
        setup_s = t1 - t0
        left = self.cfg.rounds_per_step
        while left > 0 and running:
            done = self._round(running, news, setup_s, left)
            if not done:
                break  # a plain round (its steps are the step's), or a failed verify
            if done < left:
                break  # a call cut short (a try next, or nothing chained): the next begins a step of whole rounds
            left -= done
            setup_s = 0.0
            running = [s for s in running if s.status is Status.RUNNING]
        t2 = self.clock()
        self._read_ahead(news)
        outs = self._retire(news)
        t3 = self.clock()
        self.times["retire"] += t3 - t2
        self._take_snapshot()  # after the step's rounds and releases: a reader after its outputs sees them
        self.times["retire"] += self.clock() - t3  # the snapshot's own time (in the next one)
        return outs

    def _batch(self) -> list[Sequence]:
        """The running sequences a call takes: the oldest max_sequences (those prefilled beside a call wait for
        room)."""
        return [s for s in self.seqs.values() if s.status is Status.RUNNING][: self.cfg.max_sequences]

    def _take_inbox(self) -> None:
        while self._inbox:
            kind, x = self._inbox.popleft()
            if kind == "add":
                if x.seq_id in self.seqs:
                    log.warning("sequence %s added twice: the second is ignored", x.seq_id)
                    continue
                self.seqs[x.seq_id] = Sequence(x)
            elif (s := self.seqs.get(x)) is not None:
                s.end(Finish.ABORT)

    def _admit(self, limit: int) -> None:
        """Waiting requests admitted, oldest first, while fewer than `limit` sequences hold a verifier slot or are
        about to (prefilling, running, or finished and not yet released: mid-call)."""
        held = sum(s.status in (Status.PREFILLING, Status.RUNNING) or s.prefilled > 0 for s in self.seqs.values())
        for s in self.seqs.values():
            if held >= limit:
                return
            if s.status is Status.WAITING:
                s.to(Status.PREFILLING)
                held += 1

    # ---- prefill ----
    def _prefill_work(self, whole: bool = False) -> list[tuple[Sequence, int]]:
        """Up to prefill_chunk prompt tokens of the prefilling sequences, oldest first: (sequence, its tokens this
        call); a prompt too long for the budget goes in chunks, one a step. whole: new prompts that fit whole only,
        up to the first that does not (a prefill beside a call)."""
        budget = self.cfg.prefill_chunk or float("inf")
        work: list[tuple[Sequence, int]] = []
        for s in self.seqs.values():
            left = len(s.req.prompt_ids) - s.prefilled
            if s.status is not Status.PREFILLING or budget <= 0 or not left:  # not left: launched, not yet read
                continue
            if whole and (s.prefilled or left > budget):
                break
            n = int(min(left, budget))
            budget -= n
            work.append((s, n))
        return work

    def _prefill(self, news: dict[str, list[int]]) -> None:
        """The prefilling sequences' next prompt tokens (_prefill_work) in one engine call."""
        work = self._prefill_work()
        if not work:
            return
        try:
            outs = self.verifier.prefill_batch([self._prefill_input(s, n) for s, n in work])
        except Exception as e:  # noqa: BLE001 - all or nothing: each is tried again alone, failing only itself
            if len(work) == 1:
                self._fail(work[0][0], e)
                return
            log.warning("a prefill of %d sequences failed (%s): each is tried alone", len(work), e)
            outs = []
            for s, _ in work:
                s.prefilled = 0  # the failed call freed what it began
                self.drafts.pop(s.seq_id, None)
                try:
                    outs += self.verifier.prefill_batch([self._prefill_input(s, len(s.req.prompt_ids))])
                except Exception as e1:  # noqa: BLE001 - its own failure
                    self._fail(s, e1)
                    outs.append(None)
            work = [(s, len(s.req.prompt_ids)) for s, _ in work]
        for (s, n), out in zip(work, outs):
            if out is not None:
                s.prefilled += n
                self._prefilled(s, out, news)

    def _launch_ahead(self) -> None:
        """At a step's start while sequences run (after the step's admission), and inside a call that runs on (a
        round's commit, after admitting the requests that arrived while the verifier has slots for them: prefill_ahead
        beyond max_sequences; finished rows hold theirs until the step's end): the admitted new prompts that fit whole
        (_prefill_work) prefilled on the device beside the call (Verifier.prefill_launch), counted as prefilled from
        then on (the verifier counts them so); read at the step's end (_read_ahead). The engine thread does not wait
        for their prefill: it goes on with the call. A launch that fails leaves them to a step's own prefill (this
        one's, at a step's start)."""
        work = self._prefill_work(whole=True)
        if not work:
            return
        try:
            launch = self.verifier.prefill_launch([self._prefill_input(s, n) for s, n in work])
        except Exception as e:  # noqa: BLE001 - the step's own prefill tries them again, each failing only itself
            log.warning("a prefill beside a call of %d prompts failed (%s): the next step prefills them", len(work), e)
            return
        for s, n in work:
            s.prefilled += n
        self._ahead.append(Beside(work, launch))

    def _read_ahead(self, news: dict[str, list[int]]) -> None:
        """The prefills launched beside the step's call, read (their sequences running from the next step on)."""
        launches, self._ahead = self._ahead, []
        for beside in launches:
            work = beside.work
            try:
                outs = self.verifier.prefill_read(beside.launch)
            except Exception as e:  # noqa: BLE001 - freed by the verifier: the next step's prefill tries them again
                log.warning("reading a prefill of %d prompts failed (%s): the next step prefills them", len(work), e)
                for s, _ in work:
                    s.prefilled = 0
                continue
            for (s, _), out in zip(work, outs):
                if s.status is Status.PREFILLING:  # not aborted since (a call's later launch takes the inbox)
                    self._prefilled(s, out, news)

    def _prefill_input(self, s: Sequence, n: int) -> PrefillInput:
        chunk = s.req.prompt_ids[s.prefilled : s.prefilled + n]
        return PrefillInput(s.seq_id, chunk, s.req.sampling, more=s.prefilled + n < len(s.req.prompt_ids))

    def _prefilled(self, s: Sequence, out: PrefillOutput, news: dict[str, list[int]]) -> None:
        """A prefill's output for s (its tokens counted in s.prefilled): its features kept for the drafter, and when
        the prompt is in, its first token committed."""
        speculative = s.req.speculative and self.drafter is not None
        if speculative:
            self.drafts.setdefault(s.seq_id, Draft()).hidden.append(out.hidden)
        if out.next_token is None:  # more chunks follow
            return
        s.to(Status.RUNNING)
        news[s.seq_id] = s.commit([out.next_token])
        if speculative and s.status is Status.RUNNING:
            d = self.drafts[s.seq_id]
            hidden = torch.cat(d.hidden) if len(d.hidden) > 1 else d.hidden[0]  # [prompt_len, 3H]
            d.hidden = []
            d.start = ProposeInput.after_prefill(
                s.seq_id, s.req.prompt_ids, PrefillOutput(out.next_token, hidden), 0, s.req.sampling
            )
            d.lost = self.degraded  # a drafter that is down catches it up once back

    # ---- a round ----
    def _tree(self, s: Sequence, shape: Shape) -> Shape:
        """The tree s drafts in a round of `shape`: its pinned one, the round's, or none."""
        d = self.drafts.get(s.seq_id)
        if d is None or d.lost or d.dead or self.degraded:
            return PLAIN
        return s.req.tree if s.req.tree is not None else shape

    def _members(self, running: list[Sequence]) -> list[Member]:
        """The sequences the policy decides for: speculative, not pinned, followed by the drafter."""
        return [
            s.member
            for s in running
            if s.req.tree is None and (d := self.drafts.get(s.seq_id)) is not None and not d.lost and not d.dead
        ]

    def _choose(self, running: list[Sequence]) -> Choice:
        members = [] if self.degraded else self._members(running)
        if not members:
            return Choice(PLAIN)
        sampled = any(s.band != "greedy" for s in running)
        choice = self.policy.choose(members, self.cfg.plain_steps, batch=len(running), sampled=sampled)
        if choice.shape.plain == self._on_trees:
            self._on_trees = not choice.shape.plain
            self._switched(choice, members, len(running), sampled)
        return choice

    def _switched(self, choice: Choice, members: list[Member], batch: int, sampled: bool) -> None:
        """A choice that moves the batch between plain decoding and trees, whatever its round variant (tries
        included; the first tree choice counts, the core starting on plain): counted (engine_calls' switches: each
        switch to trees costs a catch-up of every row, so a batch that goes back and forth loses to both kinds), and
        logged at --log-level DEBUG with the rates the policy compared: why a batch leaves trees or takes them."""
        self.calls["switches"] += 1
        if log.isEnabledFor(logging.DEBUG):
            seen = self.policy.rates(members, self.cfg.plain_steps, batch, sampled)
            log.debug(
                "choice: %s at %d sequences%s%s; tok/s %s",
                choice.shape,
                batch,
                " (sampling)" if sampled else "",
                ", a try" if choice.explored else "",
                ", ".join(f"{shape} {rate:,.0f}" for shape, rate in seen.items()) or "-",
            )

    def _round(self, running: list[Sequence], news: dict[str, list[int]], setup_s: float, rounds: int) -> int:
        """Up to `rounds` rounds for every running sequence in one verifier call (the module docstring); setup_s:
        this step's work before it, which the policy's cost sample leaves out. Returns the rounds run (0: plain
        steps, or a failed verify)."""
        t0 = self.clock()
        shape = (self._next or self._choose(running)).shape
        self._next = None
        rows = [(s, self._tree(s, shape)) for s in running]
        if all(t.plain for _, t in rows):
            self._settle_launch()
            self._plain(running, news, t0, setup_s)
            return 0
        rooms = self.verifier.room([s.seq_id for s in running])
        spec = [(s, t) for (s, t), room in zip(rows, rooms) if not t.plain and room > t.nodes]
        full = [s for (s, _), room in zip(rows, rooms) if room < 1]
        for s in full:
            s.end(Finish.CONTEXT)
        speccing = {id(s) for s, _ in spec}
        plain = [s for (s, _), room in zip(rows, rooms) if id(s) not in speccing and room >= 1]
        t1 = self.clock()
        trees, joiners_alone, catch_up, joining_s = self._trees(spec)
        t2 = self.clock()
        spec = [(s, t) for s, t in spec if s.seq_id in trees]
        plain += [s for s, _ in rows if id(s) in speccing and s.seq_id not in trees and s.status is Status.RUNNING]
        if not spec:
            self._plain(plain, news, t0, setup_s)
            return 0
        # the next round's shape, decided now: its trees are drafted on the device behind this verify (and
        # behind each chained round's)
        choice = self._choose(running)
        nxt = choice.shape
        # a try of a shape not the best (choice.explored) begins with the next call: this one runs a round and
        # ends the step, and the try's calls run as many as any (its cost sample a steady call's, the host work
        # shared by every round)
        asked, rounds = rounds, 1 if choice.explored and nxt != shape else rounds
        going = [(s, t, self._tree(s, nxt)) for s, t in spec]
        chained = [(s, n) for s, _, n in going if not n.plain]
        rest = [(s, t) for s, t, n in going if n.plain] + [(s, NO_TREE) for s in plain]
        order = [(s, t) for s, t, n in going if not n.plain] + rest
        later = [n for _, n in chained] + [NO_TREE] * len(rest)  # each row's tree in the chained rounds
        chain = None
        if self.drafter is not None and chained:
            chain = LaunchAfter(self.drafter, [ProposeAfter(s.seq_id, n.nodes, n.depth) for s, n in chained])
        sampled = any(s.band != "greedy" for s, _ in order)
        inputs = [VerifyInput(s.seq_id, trees[s.seq_id] if t is not NO_TREE else NO_TREE) for s, t in order]
        follow, committing, aside = [self._following(s) for s, _ in order], [0.0], [0.0]  # aside: _launch_ahead
        # each row's tree in the first round: its shape, or NO_TREE (a row that does not draft, a joiner taken in)
        first = [NO_TREE if t is NO_TREE or trees[s.seq_id] is NO_TREE else t for s, t in order]
        extend = chain is not None and rounds > 1  # a try's call runs its round alone

        def commit(r: int, done: int, results: list) -> bool:
            """Round r's tokens by each sequence's rules, while the call's later rounds run on the device; whether
            the call goes on (one more round launched behind the last): every row running and drafted on the
            device, nothing else waiting, no try, fewer than call_rounds rounds and fewer than AHEAD launched beyond
            this one."""
            c0, beside = self.clock(), 0.0
            launched = chain is not None and len(chain.handles) == done  # the last round's next trees are coming
            drafting = len(chained) if r < done - 1 or launched else 0  # rows whose tokens the drafter has
            verified = []  # every tree teaches the policy what the draft accepts, pinned ones too
            ended = []  # the rows this round finished
            for i, ((s, _), out) in enumerate(zip(order, results)):
                if s.status is not Status.RUNNING:  # it stopped in an earlier round of the call
                    continue
                tokens, tree = out.tokens, first[i] if r == 0 else later[i]
                if tree is not NO_TREE:
                    s.count_round(trees[s.seq_id].size if r == 0 else tree.nodes, len(tokens) - 1)
                    verified.append((s.seq_id, s.band, tree, min(len(tokens) - 1, tree.depth)))
                news[s.seq_id] = news.get(s.seq_id, []) + s.commit(tokens)
                if s.status is not Status.RUNNING:
                    ended.append(s.seq_id)
                if follow[i] and i >= drafting:
                    d = self.drafts[s.seq_id]
                    d.tokens += tokens
                    d.hidden.append(out.hidden)
            self.policy.observe_verified(verified)
            if self.cfg.prefill_ahead and self._inbox and r + 1 < done:  # rounds still to run
                a0 = self.clock()
                self._take_inbox()
                self._admit(self.cfg.max_sequences + self.cfg.prefill_ahead)
                self._launch_ahead()
                beside = self.clock() - a0
                aside[0] += beside
            # every row drafted on the device (a row without a tree would decode a token a round in a tree's verify)
            # and nothing else waits
            alone = extend and len(chained) == len(order) and len(self.seqs) == len(order) and not self._inbox
            alone = alone and all(s.status is Status.RUNNING for s, _ in order)
            goes = alone and done - r - 1 < AHEAD and done < self.cfg.call_rounds
            if self.publish is not None and (r + 1 < done or goes):  # the call goes on past this round
                if (r + 1) % self.cfg.rounds_per_step == 0:
                    self._publish(news, list(news))  # past rounds_per_step: the tokens so far go out
                elif ended:  # a finish goes out at once: its client's next request need not wait for the call
                    self._publish(news, ended)
            committing[0] += self.clock() - c0 - beside
            return goes

        try:
            t3 = self.clock()
            done = len(finish(self.verifier.verify_rounds_steps(inputs, rounds, chain, commit)))
        except Exception as e:  # noqa: BLE001 - the round's sequences fail; the core goes on
            log.exception("a verify of %d sequences failed", len(order))
            for s, _ in order:
                self._fail(s, e)
            return 0
        t4 = self.clock()
        handles = chain.handles if chain is not None else []
        for h in handles[: done - 1]:  # launches a chained round verified: the host never read them
            self.drafter.settle_after(h)
        self._next = choice
        launched = len(handles) == done
        self._launch = (handles[-1], {s.seq_id: i for i, (s, _) in enumerate(chained)}) if launched else None
        times = self.times
        times["choose"] += t1 - t0 + t3 - t2
        times["trees"] += t2 - t1 - joining_s
        times["joining"] += joining_s
        # the device's rounds, less the commits they hid and the prefill launched beside them (setup's: each second
        # of the engine thread counts in one phase)
        times["verify"] += t4 - t3 - committing[0] - aside[0]
        times["commit"] += committing[0]
        times["setup"] += aside[0]
        self.calls["rounds"] += done
        drafted = Shape(max(t.depth for _, t in spec), max(t.nodes for _, t in spec))
        self.choices[drafted] += done
        pure = not plain and all(t == shape for _, t in spec) and (done == 1 or all(n == shape for _, n in chained))
        # not cut short by the core: its host work shared by as many rounds as any call's, or more; or one round
        # because the drafter declined to draft behind its verify (a draft service in another process always does:
        # its calls are all one round)
        whole = done >= asked or (chain is not None and not handles)
        # a catch-up (every row joining after a plain stretch) is no steady call: its first round waits for the
        # proposes and overlaps nothing (at 64 sequences its rounds cost a fifth more than steady ones): a try
        # from plain is costed by its next call. A call of new prompts alone (one request at a time) is, less
        # their proposes: it is the request's longest call
        steady = whole and pure and not catch_up
        outside = (joining_s if joiners_alone else 0.0) + aside[0]  # new prompts' proposes, a prefill beside the call
        self._observe(t0, len(order), drafted, 1, steady, setup_s, sampled, done, outside)
        return done

    def _plain(self, seqs: list[Sequence], news: dict[str, list[int]], t0: float, setup_s: float) -> None:
        """`plain_steps` decoding steps (fewer near every sequence's budget) with one host synchronisation;
        the drafter's sequences keep the features of their tokens."""
        seqs = [s for s in seqs if s.status is Status.RUNNING]
        if not seqs:
            return
        rooms = self.verifier.room([s.seq_id for s in seqs])
        for s, room in zip(seqs, rooms):
            if room < 1:
                s.end(Finish.CONTEXT)
        seqs = [s for s, room in zip(seqs, rooms) if room >= 1]
        if not seqs:
            return
        steps = max(1, min(self.cfg.plain_steps, max(s.left for s in seqs)))
        follow = [self._following(s) for s in seqs]
        try:
            t1 = self.clock()
            decoded = self.verifier.decode_many([s.seq_id for s in seqs], steps, with_hidden=any(follow))
        except Exception as e:  # noqa: BLE001 - the step's sequences fail; the core goes on
            log.exception("a decode of %d sequences failed", len(seqs))
            for s in seqs:
                self._fail(s, e)
            return
        t2 = self.clock()
        took = len(decoded.tokens[0])
        for i, (s, tokens) in enumerate(zip(seqs, decoded.tokens)):
            news[s.seq_id] = news.get(s.seq_id, []) + s.commit(tokens)
            if follow[i]:
                d = self.drafts[s.seq_id]
                d.tokens += tokens
                d.hidden.append(decoded.hidden[i])
        self.choices[PLAIN] += 1
        self.times["plain"] += t2 - t1
        self.times["plain_commit"] += self.clock() - t2
        self.calls["plain_calls"] += 1
        pure = all(s.req.tree is None for s in seqs)
        self._observe(t0, len(seqs), PLAIN, took, pure, setup_s, any(s.band != "greedy" for s in seqs))

    def _following(self, s: Sequence) -> bool:
        d = self.drafts.get(s.seq_id)
        return d is not None and not d.lost and not d.dead

    def _observe(
        self,
        t0: float,
        batch: int,
        shape: Shape,
        steps: int,
        steady: bool,
        setup_s: float,
        sampled: bool,
        rounds: int = 1,
        joining_s: float = 0.0,
    ) -> None:
        """A round's cost for the policy, when the call is steady (not cut short, no catch-up): from the end of
        the call before (the host work between calls is this one's too) less the step's setup (admission, prefill:
        setup_s, before t0) when both ran back to back (at most 50 ms besides the setup between them), or from its
        own start when it is the first after idle time (one request at a time: a request's call that goes on to
        its end is its first), less joining_s (new prompts' proposes in a call of their own), shared by the
        call's rounds."""
        end = self.clock()
        last, self._last_end = self._last_end, end
        if not steady or (last is not None and t0 - last >= 0.05 + setup_s):
            return
        seconds = max((end - t0 if last is None else end - last - setup_s) - joining_s, 1e-6) / rounds
        log.debug(  # the policy's inputs, for an operator asking why (--log-level DEBUG)
            "cost sample: %s, %d sequences%s, %d rounds of %.3f ms, %d steps",
            shape,
            batch,
            " (sampling)" if sampled else "",
            rounds,
            seconds * 1e3,
            steps,
        )
        self.policy.observe_round(batch, shape, seconds, steps, sampled, rounds)

    # ---- failures ----
    @staticmethod
    def _fail(s: Sequence, e: BaseException) -> None:
        s.end(Finish.ERROR, e)

    def _publish(self, news: dict[str, list[int]], seq_ids: list[str]) -> None:
        """The outputs of a call that goes on, out now for seq_ids: their tokens so far, and a finished one's
        finish (its slot is released with the step's, its output not sent again)."""
        if not seq_ids:
            return
        self.publish([output(self.seqs[sid], news.get(sid, [])) for sid in seq_ids])
        for sid in seq_ids:  # out: not again with the step's (kept there should publish fail)
            news.pop(sid, None)
            if self.seqs[sid].status is Status.FINISHED:
                self._out.add(sid)

    # ---- retire ----
    def _retire(self, news: dict[str, list[int]]) -> list[SeqOutput]:
        outs = [output(self.seqs[sid], tokens) for sid, tokens in news.items() if sid in self.seqs]
        done = [s for s in self.seqs.values() if s.status is Status.FINISHED]
        if not done:
            return outs
        noted = set(news) | self._out
        outs += [output(s, []) for s in done if s.seq_id not in noted]
        self._out.clear()  # every finished one is released here
        ids = [s.seq_id for s in done if s.prefilled]  # a waiting one holds nothing
        for s in done:
            del self.seqs[s.seq_id]
            self.policy.forget(s.seq_id)
        self.verifier.release(ids)
        drafted = [sid for sid in ids if self.drafts.pop(sid, None) is not None]
        if drafted and self.drafter is not None and not self.degraded:
            try:
                self.drafter.release(drafted)
            except Exception as e:  # noqa: BLE001 - a lost release: the drafter frees them when it restarts
                log.warning("release of %d sequence(s) on the drafter failed: %s", len(drafted), e)
        if self._launch is not None:
            rows = self._launch[1]
            for sid in ids:
                rows.pop(sid, None)
        return outs
