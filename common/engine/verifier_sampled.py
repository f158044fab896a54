"""Sampled verification, the part of the verifier engine (common/engine/verifier.py) for batches with a sampling
row (Sampler.TEMPERATURE or FILTERED): the step that accepts greedy rows by the argmax and the others by the
one-hot or the q rule (common.kernels.speculative), its block and its graph variants. A mixin: Verifier holds the
model, the cache and the tree forward it uses."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from common import kernels
from common.engine.base import VerifyInput
from common.engine.verifier_parts import SHALLOW_DEPTH, SIBLINGS, SampledColumns, Sampler, VerifierSeq, VerifyStep
from common.kernels import speculative
from common.kernels.sampling import RULE_GREEDY, RULE_ONEHOT, SamplingRows, TreeSets
from common.tree import widest


class SampledVerify:
    def _verify_sampled_step(
        self, packed: torch.Tensor, width: int, siblings: int, filtered: bool, max_depth: int | None = None
    ) -> VerifyStep:
        """packed [B, C] as SampledColumns lays it out for sets of `width` tokens; siblings: S, at least every
        row's children; filtered: a row samples with top-k or top-p (Sampler.FILTERED). Greedy rows (rule 0)
        are accepted as by _verify_step, bit for bit; the others by common.kernels.speculative's sampled
        acceptance with their rule, seed and the root's position as the counter: a one-hot row's sets built here
        from its tree (common.kernels.onehot_sets), a q rule row's read from the block."""
        b = packed.shape[0]
        cols = SampledColumns.of(packed.shape[1], width)
        t = cols.t
        ids, parent_rows = packed[:, :t], packed[:, t : 2 * t]  # [B, T] each
        n, slots, rule = packed[:, cols.n], packed[:, cols.n + 1], packed[:, cols.n + 2]  # [B] each
        anc, depth, out = self._tree_forward(ids, parent_rows, n, slots, max_depth)
        logits = self.model.lm_head(out.hidden)  # [B, T, V] (the greedy step's argmax is of these)
        greedy = rule == RULE_GREEDY
        g_result, g_src = kernels.accept_tree(ids, parent_rows, anc, depth, logits.argmax(-1), greedy.long())
        # a one-hot row's sets follow from its tree: built here, in the graph, not by the host (its set columns are
        # not packed), and written into the block's set columns, so that every tensor the acceptance reads shares
        # the block's row stride (kernels.accept_sampled's fused kernel takes one); a q rule row's come packed
        hot = (rule == RULE_ONEHOT)[:, None]  # [B, 1]
        pos, set_ids, set_q = kernels.onehot_sets(ids, parent_rows, width)  # [B, T], [B, T * W], [B, T * W / 2]
        for column, built in (
            (slice(cols.pos, cols.n), pos),
            (slice(cols.ids, cols.q), set_ids),
            (slice(cols.q, cols.end), set_q),
        ):
            packed[:, column] = torch.where(hot, built, packed[:, column])
        sets = TreeSets(
            ids=packed[:, cols.ids : cols.q].view(b, t, width),
            q=packed[:, cols.q : cols.end].view(torch.float32).view(b, t, width),
            pos=packed[:, cols.pos : cols.n],
            rule=rule,
        )
        rows = SamplingRows.unpack(packed[:, cols.draw : cols.ids], n)
        s_result, s_src = speculative.accept_sampled_tree(
            ids, parent_rows, anc, depth, logits, sets, rows, siblings, filtered
        )
        result = torch.where(greedy[:, None], g_result, s_result)
        src = torch.where(greedy[:, None], g_src, s_src)
        return self._compact(out.aux, result, src, slots, n)

    def _siblings(self, tb: int) -> int:
        """S of the captured sampled verify of tb-row trees: SIBLINGS, or all a tree of tb rows may have (at
        least 1: a batch of roots alone has tb 1 when not padded)."""
        return max(1, min(SIBLINGS, tb - 1))

    def _sets_shape(self, items: list[VerifyInput], states: list[tuple[int, VerifierSeq]], tb: int) -> tuple[int, int]:
        """(W, S) the sampling rows' trees need: the captured set_width and _siblings(tb), or more (an eager
        step) when a q or a row's children are wider. W is even."""
        trees = [it.tree for it, (_, st) in zip(items, states) if not st.sampling.greedy]
        kids = widest(trees)
        need = max([kids] + [t.q.ids.shape[1] for t in trees if t.q is not None])
        w = self.set_width if need <= self.set_width else need + need % 2
        return w, max(self._siblings(tb), kids)

    def _sampled_block(self, b: int, t: int, w: int) -> torch.Tensor:
        """An all-padding sampled verify block [b, C] (SampledColumns): token 0, every row its own parent,
        length 0, the trash slot, a greedy row, empty sets."""
        cols = SampledColumns(t, w)
        a = np.zeros((b, cols.end), dtype=np.int64)
        a[:, t : 2 * t] = np.arange(t)
        a[:, cols.n + 1] = self.trash_slot
        a[:, cols.draw : cols.ids] = self._greedy_draw
        return torch.from_numpy(a)

    def _sampled_variant(
        self, bb: int, tb: int, sampler: Sampler, shallow: bool, w: int, s: int
    ) -> tuple[tuple, Callable[..., VerifyStep]]:
        """The graph key and step of a sampled verify (captured: shallow trees, set_width, _siblings(tb))."""
        step = functools.partial(
            self._verify_sampled_step,
            width=w,
            siblings=s,
            filtered=sampler is Sampler.FILTERED,
            max_depth=SHALLOW_DEPTH if shallow else None,
        )
        return ("verify", bb, tb, shallow, sampler, w, s), step
