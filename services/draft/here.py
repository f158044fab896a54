"""The draft engine of the verifier's own process (`python -m services.verifier --draft-here`), as the
verifier's chain (services/verifier/chain.py) calls it: the outcomes it verified go in as the drafter's
inputs and the trees come out as the engine's, with no message, no serialisation and no IPC handle between
the two engines. The answers are services.clients.Batched, as a DraftClient's."""

from __future__ import annotations

from common.engine.base import ProposeInput
from services.clients import Batched
from services.draft.follow import Follow
from services.draft.server import DraftServicer


class LocalDraftClient:
    def __init__(self, servicer: DraftServicer) -> None:
        self.servicer = servicer

    async def propose(self, items: list[ProposeInput] | list[Follow], owner: str = "") -> Batched:
        """Trees [len(items)] (common.tree.Tree) for the verifier's outcomes: after a verify, of sequences
        the draft holds, or after a prefill, start items that begin them (they belong to `owner`); or, for
        Follows, the trees launched behind a verify on the device. The servicer's errors are raised as they
        are (the chain answers them as draft_error)."""
        if items and isinstance(items[0], Follow):  # a round's outcomes are all of one kind (VerifierServicer._verify)
            trees, compute_s = await self.servicer.read_here(items, owner)
        else:
            trees, compute_s = await self.servicer.propose_here(items, owner)
        return Batched(trees, compute_s)
