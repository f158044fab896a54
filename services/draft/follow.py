"""What the verifier's chain hands the draft of its own process for a sequence whose next tree was launched on
the device behind its verify (the device chain, common.engine.base.Drafter): instead of the drafter's input
(a ProposeInput of the verify's tokens and features), a reference to that launch. No torch here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Follow:
    seq_id: str
    launched: object  # the drafter's handle (Drafter.launch_after), shared by the rows of one verify
    row: int  # this sequence's row in it (its item's place in the verify)
