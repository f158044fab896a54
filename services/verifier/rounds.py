"""A multi-round Verify's bookkeeping (VerifyRequest.rounds): which items run the next round, what each
has committed, and why each stopped. Plain Python: no torch, no gRPC, no messages; services/verifier/
chain.py drives it, one engine call a round.

An item stops after the round that commits one of its stop token ids (end-of-sequence included), that
reaches its max_new budget, or that was the call's last; before a round, when its KV cache has no room
for the round's tree; and when its next tree never came (the draft failed). Its committed tokens are cut
where the gateway's commit would cut them (common.rounds.cut_at_stop, which both use): after the first
stop id, at the budget. Per-round acceptance counts are the engine's, before any cut (the speculation
policy learns acceptance, not budgets).

Example, rounds 4: s1 (stop id 2) and s2 (budget 9), both chained.
  round 1: s1 [5, 6, 7]     s2 [8, 8]        -> both run on
  round 2: s1 [9, 2, 4]     s2 [8, 8, 8]     -> s1 stops (TOKEN): committed [5, 6, 7, 9, 2]
  round 3:                  s2 [8, 8]        -> s2 has 7 of 9
  round 4:                  s2 [8, 8, 8, 8]  -> s2 stops (LENGTH): committed 9 tokens, accepted [1, 2, 1, 3]
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.rounds import MAX_ROUNDS_PER_CALL, cut_at_stop


class Stop(enum.Enum):
    ROUNDS = 1  # ran the call's rounds (or one round: nothing to chain)
    TOKEN = 2  # committed a stop token id (end-of-sequence included)
    LENGTH = 3  # reached its max_new budget
    CAPACITY = 4  # its KV cache has no room for another tree
    DRAFT = 5  # its next tree never came
    BEFORE = 6  # the call before stopped it (TOKEN or LENGTH): a call queued behind it (VerifyItem.follows)


@dataclass(frozen=True)
class ItemRules:
    """What ends one item's rounds."""

    chained: bool  # its outcome goes to the draft after each round (next_nodes > 0): it may run on
    rows: int = 1  # KV rows its next trees take at most (the root and next_nodes)
    max_new: int = 0  # tokens it may still commit (0 = no budget: the caller cuts)
    stop_ids: frozenset[int] = frozenset()  # end-of-sequence and stop token ids

    def __post_init__(self) -> None:
        if self.rows < 1 or self.max_new < 0:
            raise ValueError(f"rows must be >= 1 and max_new >= 0, got {self.rows} and {self.max_new}")


@dataclass
class ItemRounds:
    rules: ItemRules
    tokens: list[int] = field(default_factory=list)  # [committed] all rounds' tokens, cut at a stop
    accepted: list[int] = field(default_factory=list)  # [rounds run] drafted tokens accepted in each round
    nodes: list[int] = field(default_factory=list)  # [rounds run] nodes of each round's tree
    stop: Stop | None = None  # None while it runs
    draft_error: str = ""  # Stop.DRAFT: why there is no tree


class CallRounds:
    """The rounds of one Verify. Each round: `running()` are the items in it; `fit(rooms)` stops those that
    have no KV room (from round 2 on), `failed(i, why)` those whose tree never came, `record(i, ...)` takes
    each outcome, `end_round()` closes it. The call is over when `running()` is empty."""

    def __init__(self, rules: list[ItemRules], rounds: int) -> None:
        if not 1 <= rounds <= MAX_ROUNDS_PER_CALL:
            raise ValueError(f"rounds must be in [1, {MAX_ROUNDS_PER_CALL}], got {rounds}")
        self.rounds = rounds
        self.items = [ItemRounds(r) for r in rules]
        self.ran = 0  # rounds closed so far

    def running(self) -> list[int]:
        """Indices of the items that run the next round, in item order."""
        return [i for i, it in enumerate(self.items) if it.stop is None]

    def failed(self, i: int, why: str) -> None:
        """Item i's tree for this round never came: it stops with what it committed so far."""
        it = self.items[i]
        it.stop, it.draft_error = Stop.DRAFT, why

    def fit(self, rooms: dict[int, int]) -> None:
        """Before a round after the first: rooms {item: KV rows its sequence has left}. The engine verifies a
        batch at its largest tree, so an item whose room is below the largest `rows` of those running stops.
        Example: rows 61 and 9, rooms 100 and 40 -> the second stops (CAPACITY); the first runs."""
        running = self.running()
        if not running:
            return
        rows = max(self.items[i].rules.rows for i in running)
        for i in running:
            if rooms[i] < rows:
                self.items[i].stop = Stop.CAPACITY

    def record(self, i: int, tokens: list[int], nodes: int) -> None:
        """Item i's outcome this round: tokens [accepted + 1] (the accepted drafted tokens, the bonus), from
        a tree of `nodes` nodes. Cuts at a stop id or the budget and stops the item there.
        Example: budget 5, 3 committed, tokens [4, 4, 4] -> commits [4, 4], stops (LENGTH), accepted 2."""
        it, rules = self.items[i], self.items[i].rules
        it.accepted.append(len(tokens) - 1)
        it.nodes.append(nodes)
        room = rules.max_new - len(it.tokens) if rules.max_new else len(tokens)
        n, stopped = cut_at_stop(tokens, room, rules.stop_ids)
        it.tokens += tokens[:n]
        if stopped:
            it.stop = Stop.TOKEN
        elif rules.max_new and len(it.tokens) >= rules.max_new:
            it.stop = Stop.LENGTH

    def cut(self) -> None:
        """Before a round after the first: the call ends here (VerifyRequest.cut of the call queued behind
        it): the items still running stop as after the call's last round (ROUNDS)."""
        for i in self.running():
            self.items[i].stop = Stop.ROUNDS

    def end_round(self) -> None:
        """The round is over: items that ran the call's last round, or cannot chain, stop (ROUNDS)."""
        self.ran += 1
        for i in self.running():
            if self.ran >= self.rounds or not self.items[i].rules.chained:
                self.items[i].stop = Stop.ROUNDS
