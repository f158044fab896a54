"""Test drafters that know the base model's answer, to exercise multi-token acceptance and its
opposite without a trained head. They run the base model themselves (eagerly, on the draft side).

Tree layout of GreedyOracleDrafter for greedy continuation g1..gD (w = a wrong token):

        root
       /    \\
     w1      g1            node order: [w1, g1, x1, w2, g2, ...]
     |      /  \\           x1 (child of w1) sits between the levels, so the accepted path
     x1   w2    g2          [g1, g2, ...] is never a prefix of the node order and the verifier
                 ...        has to move KV entries to compact it.
"""

from __future__ import annotations

import numpy as np
import torch

from common.engine.base import Accepted, ProposeAfter, ProposeInput, Steps, StepTime
from common.errors import UnknownSequence
from common.model.llama import Batch, KVCache, LlamaModel
from common.slots import check_unique
from common.tree import Tree


class _OracleBase:
    name = "oracle"

    def __init__(self, model: LlamaModel, steps: int, device: torch.device) -> None:
        self.model, self.steps, self.device = model, steps, device
        self.context: dict[str, list[int]] = {}  # seq id -> tokens so far, the tree root last

    def release(self, seq_ids: list[str]) -> int:
        return sum(self.context.pop(s, None) is not None for s in seq_ids)

    def step_costs(self) -> list[StepTime]:
        return []  # test oracles: nothing worth calibrating a policy on

    @torch.inference_mode()
    def greedy(self, tokens: list[int], steps: int) -> list[int]:
        """The base model's next `steps` greedy tokens after `tokens`."""
        cfg = self.model.cfg
        cache = KVCache.allocate(
            cfg.num_layers,
            1,
            len(tokens) + steps,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.model.embed_tokens.weight.dtype,
            self.device,
        )
        out, ids = [], list(tokens)
        start = 0
        for _ in range(steps):
            n = len(ids)
            pos = torch.arange(start, n, device=self.device)[None]
            mask = (torch.arange(n, device=self.device)[None, :] <= pos[0][:, None])[None, None]
            batch = Batch.masked(
                input_ids=torch.tensor([ids[start:]], device=self.device),
                positions=pos,
                slots=torch.zeros(1, dtype=torch.long, device=self.device),
                write_pos=pos,
                mask=mask,
            )
            h = self.model(batch, cache).hidden[0, -1]
            nxt = int(self.model.logits(h).argmax())
            out.append(nxt)
            ids.append(nxt)
            start = n
        return out

    def propose(self, items: list[ProposeInput]) -> list[Tree]:
        check_unique([it.seq_id for it in items])
        trees = []
        for it in items:
            if it.start:
                self.context[it.seq_id] = list(it.context_prefix)
            ctx = self.context.get(it.seq_id)
            if ctx is None:
                raise UnknownSequence(f"unknown sequence id {it.seq_id!r}")
            ctx.extend(it.token_ids)
            trees.append(self.tree(self.greedy(ctx, min(self.steps, it.max_depth or self.steps)), it.max_nodes))
        return trees

    def propose_steps(self, items: list[ProposeInput]) -> Steps[list[Tree]]:
        """propose as steps (common.engine.base.Steps): no wait to yield, its forwards end on the host."""
        yield from ()
        return self.propose(items)

    def launch_after(self, items: list[ProposeAfter], accepted: Accepted, after: object = None) -> None:
        """No drafting on the device after a verify: the callers propose from the verify's outputs."""
        return None

    def take(self, items: list[ProposeInput]) -> bool:
        return False  # nothing drafts behind a verify: the callers propose

    def settle_after(self, launched: object) -> None:
        raise NotImplementedError("test oracles launch nothing after a verify (launch_after gives None)")

    def read_after(self, launched: object, rows: list[int]) -> list[Tree]:
        raise NotImplementedError("test oracles launch nothing after a verify (launch_after gives None)")

    def read_after_steps(self, launched: object, rows: list[int]) -> Steps[list[Tree]]:
        raise NotImplementedError("test oracles launch nothing after a verify (launch_after gives None)")

    def tree(self, greedy: list[int], max_nodes: int) -> Tree:
        raise NotImplementedError

    def wrong(self, token: int, k: int = 1) -> int:
        return (token + k) % self.model.cfg.vocab_size


class GreedyOracleDrafter(_OracleBase):
    """Proposes the base model's own greedy continuation: every level is accepted."""

    name = "oracle-greedy"

    def tree(self, greedy: list[int], max_nodes: int) -> Tree:
        tokens, parents = [], []
        prev_good, prev_wrong = -1, -1
        for g in greedy:
            if len(tokens) + 3 > max_nodes:
                break
            if prev_wrong >= 0:  # a grandchild under the previous wrong sibling
                tokens.append(self.wrong(g, 2))
                parents.append(prev_wrong)
            tokens.append(self.wrong(g))
            parents.append(prev_good)
            prev_wrong = len(tokens) - 1
            tokens.append(g)
            parents.append(prev_good)
            prev_good = len(tokens) - 1
        n = len(tokens)
        return Tree(
            tokens=np.array(tokens, dtype=np.int64),
            parents=np.array(parents, dtype=np.int64),
            probs=np.full(n, 0.5, dtype=np.float32),
        )


class WrongOracleDrafter(_OracleBase):
    """Proposes tokens that are never the base model's choice: only the bonus token is accepted."""

    name = "oracle-wrong"

    def tree(self, greedy: list[int], max_nodes: int) -> Tree:
        tokens = [self.wrong(greedy[0], 1), self.wrong(greedy[0], 2)]
        parents = [-1, -1]
        for g in greedy[1:]:
            if len(tokens) >= max_nodes:
                break
            tokens.append(g)  # right token under a wrong parent: must still be rejected
            parents.append(len(tokens) - 2 if len(tokens) > 2 else 0)
        tokens, parents = tokens[:max_nodes], parents[:max_nodes]
        return Tree(
            tokens=np.array(tokens, dtype=np.int64),
            parents=np.array(parents, dtype=np.int64),
            probs=np.full(len(tokens), 0.5, dtype=np.float32),
        )
