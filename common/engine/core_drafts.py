"""The engine core's drafter side (a mixin of EngineCore, common/engine/core.py): the trees of a call's drafting
rows (read from the drafting launched behind the last verify, or proposed, joiners and catch-ups in a call of
their own), what the drafter has not seen of a sequence, and a drafter's failures and recovery."""

from __future__ import annotations

import logging

import torch

from common.config import SamplingConfig
from common.engine.base import PrefillInput, ProposeInput
from common.errors import PeerUnavailable, UnknownSequence
from common.policy import Shape
from common.rounds import start_shift
from common.sequence import Sequence, Status
from common.tree import NO_TREE, Tree

log = logging.getLogger(__name__)
SPARE_ID = "~features"  # the verifier's spare slot: features recomputed for a drafter catching up
JOINING_TOKENS = 8  # a propose of more new tokens than a round's (a prompt, a catch-up) joins in a call of its own


class DraftSupply:
    """EngineCore's methods that feed the drafter and take its trees (they use the core's drafter, verifier,
    sequences, drafts, launch and clock)."""

    def _trees(self, spec: list[tuple[Sequence, Shape]]) -> tuple[dict[str, Tree], bool, bool, float]:
        """The trees of this round's drafting rows ({seq_id: tree}; a row missing: the drafter failed it; NO_TREE: a
        joiner taken in, which decodes this round and drafts behind it), whether every row joins, whether the
        round is a catch-up, and the seconds spent on joining rows. A joining row is a joiner's prompt, or a
        sequence caught up after a plain stretch or a drafter failure: its accept pass is long. A prompt (a start
        item) beside rows that are not joining is taken in without a tree where the drafter can (Drafter.take:
        nothing waited for); else, and for a catch-up, its propose runs in a call of its own. A round that has
        nothing but joining rows, one of them with more tokens than a round's to catch up (the first after plain
        steps), is a catch-up; one of new prompts alone (one request at a time) is not."""
        trees = self._settle_launch()
        todo = [(s, t) for s, t in spec if s.seq_id not in trees]
        joins = [(d := self.drafts[s.seq_id]).start is not None or len(d.tokens) > JOINING_TOKENS for s, _ in todo]
        caught = any(len(self.drafts[s.seq_id].tokens) > JOINING_TOKENS for s, _ in todo)  # after plain calls
        # the other rows' inputs first: a joining propose that fails loses every row's features (_lose). A joining
        # row's input (its features since the drafter last saw it: after a plain stretch, one chunk a plain call
        # to concatenate) is joining work, timed with its propose
        going = [(s, t, self._propose_input(s, t)) for (s, t), j in zip(todo, joins) if not j]
        t0 = self.clock()
        joining = [(s, t, self._propose_input(s, t)) for (s, t), j in zip(todo, joins) if j]
        # prompts riding along in a call of rows that draft already (its round costs them nothing more); a call of
        # prompts alone proposes them: a decode round of its own would cost one round
        starts = [x for x in joining if x[2].start] if len(joining) < len(spec) else []
        if starts and self._take(starts, trees):
            joining = [x for x in joining if not x[2].start]
        self._propose(joining, trees)
        joining_s = self.clock() - t0
        self._propose(going, trees)
        alone = len(joining) + len(starts) == len(spec)
        return trees, alone, alone and caught, joining_s

    def _take(self, todo: list[tuple[Sequence, Shape, ProposeInput]], trees: dict[str, Tree]) -> bool:
        """These start items taken in by the drafter without a tree (Drafter.take), NO_TREE into `trees` for
        each; False: it cannot (propose them). When it fails they get none: they go on plainly."""
        try:
            if not self.drafter.take([it for _, _, it in todo]):
                return False
        except Exception as e:  # noqa: BLE001 - a drafter failure never fails a request: they go on plainly
            self._lose([s for s, _, _ in todo], e)
            return True
        for s, _, _ in todo:
            trees[s.seq_id] = NO_TREE
            d = self.drafts[s.seq_id]
            d.tokens, d.hidden, d.start = [], [], None
        return True

    def _propose(self, todo: list[tuple[Sequence, Shape, ProposeInput]], trees: dict[str, Tree]) -> None:
        """The drafter's trees for these rows, into `trees` (none when it fails: they go on plainly)."""
        if not todo:
            return
        try:
            proposed = self.drafter.propose([it for _, _, it in todo])
        except Exception as e:  # noqa: BLE001 - a drafter failure never fails a request: they go on plainly
            self._lose([s for s, _, _ in todo], e)
            return
        for (s, _, _), tree in zip(todo, proposed):
            trees[s.seq_id] = tree
            d = self.drafts[s.seq_id]
            d.tokens, d.hidden, d.start = [], [], None

    def _propose_input(self, s: Sequence, t: Shape) -> ProposeInput:
        """Its next propose: what the drafter has not seen (after a start item, the whole context: a joiner's
        prompt, or a sequence caught up, with what it committed since)."""
        d = self.drafts[s.seq_id]
        st = d.start
        if st is None:
            hidden = torch.cat(d.hidden) if len(d.hidden) > 1 else d.hidden[0]  # [n, 3H]
            return ProposeInput(s.seq_id, d.tokens, hidden, False, [], t.nodes, t.depth)
        hidden = torch.cat([st.hidden, *d.hidden]) if d.hidden else st.hidden
        tokens = st.token_ids + d.tokens
        return ProposeInput(s.seq_id, tokens, hidden, True, st.context_prefix, t.nodes, t.depth, st.sampling)

    def _settle_launch(self) -> dict[str, Tree]:
        """The trees of the drafting launched behind the last verify, for its rows still running ({seq_id:
        tree}): read even when a row does not draft this round, so that the drafter has its tokens."""
        launch, self._launch = self._launch, None
        if launch is None:
            return {}
        handle, rows = launch
        read = [(sid, row) for sid, row in rows.items() if self.seqs[sid].status is Status.RUNNING]
        return dict(zip([sid for sid, _ in read], self.drafter.read_after(handle, [row for _, row in read])))

    # ---- failures ----
    def _lose(self, seqs: list[Sequence], e: BaseException) -> None:
        """The drafter failed these sequences; nobody's request fails for it. A peer that is down: every
        sequence is lost and the core goes plain until it answers again (_recover). One that no longer knows
        them (it restarted): they are lost, caught up at the next retry. Another error (a context full for the
        drafter, a bad input): these go on plainly to their end."""
        down = isinstance(e, PeerUnavailable)
        log.warning("the drafter failed %d sequence(s) (%s): plain decoding%s", len(seqs), e,
                    " until it is back" if down else "")  # fmt: skip
        if down:
            self.degraded = True
            self._launch, self._next = None, None
        recover = down or isinstance(e, UnknownSequence)
        for d in self.drafts.values() if down else [self.drafts[s.seq_id] for s in seqs]:
            d.start, d.tokens, d.hidden = None, [], []
            d.lost, d.dead = recover, d.dead or not recover
        if recover:
            self._retry_at = min(self._retry_at, self.clock() + self.cfg.draft_retry_s) if not down else (
                self.clock() + self.cfg.draft_retry_s)  # fmt: skip

    def _recover(self) -> None:
        """Every draft_retry_s while sequences are lost: when the drafter answers, catch each running one up
        (the features of its context recomputed in the verifier's spare slot, as after a prefill of all but its
        last token, which is the one it chose)."""
        if self.drafter is None or self.clock() < self._retry_at:
            return
        lost = [(sid, d) for sid, d in self.drafts.items() if d.lost and self.seqs[sid].status is Status.RUNNING]
        if not lost and not self.degraded:
            return
        self._retry_at = self.clock() + self.cfg.draft_retry_s
        if not getattr(self.drafter, "available", lambda: True)():
            return
        if self.degraded:
            log.info("the drafter answers again: catching up %d sequence(s)", len(lost))
        self.degraded = False
        try:  # a drafter that kept its state of them (it did not restart) starts them afresh
            self.drafter.release([sid for sid, _ in lost])
        except Exception as e:  # noqa: BLE001 - the start items restart them anyway on a draft service
            log.warning("releasing %d lost sequence(s) on the drafter failed: %s", len(lost), e)
        for sid, d in lost:
            s = self.seqs[sid]
            context = s.req.prompt_ids + s.tokens  # its last token is the next tree's root
            try:
                out = self.verifier.prefill(PrefillInput(SPARE_ID, context[:-1], SamplingConfig()))
            finally:
                self.verifier.release([SPARE_ID])
            ids, prefix = start_shift(context[:-1], context[-1])
            d.start = ProposeInput(sid, ids, out.hidden, True, prefix, 0, 0, s.req.sampling)
            d.lost = False
