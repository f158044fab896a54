"""The engine core's configuration and per-sequence records (common/engine/core.py runs the rounds)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.engine.base import ProposeInput
from common.policy import Shape
from common.sequence import Sequence

# EngineCore.times' phases of a speculative call and of a plain call (their counts: EngineCore.calls' 'rounds' and
# 'plain_calls'); besides them: idle, setup (admission, prefill, catching up a drafter), retire
ROUND_PHASES = ("choose", "trees", "joining", "verify", "commit")
PLAIN_PHASES = ("plain", "plain_commit")


@dataclass(frozen=True)
class CoreConfig:
    max_sequences: int  # generations holding a slot at once (the verifier has one more: the spare)
    prefill_chunk: int = 512  # prompt tokens prefilled per step (0: every waiting prompt whole)
    plain_steps: int = 8  # decoding steps per host synchronisation in a plain step
    # speculative rounds per step: admission, prefill, releases and the outputs' hand-over come once per step,
    # as a plain step's 8 decoding steps share them (a plain round ends the step)
    rounds_per_step: int = 4
    draft_retry_s: float = 1.0  # after a drafter failure, catching up is tried again no sooner than this
    # rounds one verifier call may run on to while its batch is all there is (every row drafted on the device, none
    # stopped, nothing waiting; a call runs rounds_per_step at least): it asks the verifier for one more behind the
    # last as it reads each (core.AHEAD launched ahead), so that the device is not left idle between calls; its
    # tokens still go out every rounds_per_step rounds (EngineCore.publish). Each round's features [B, depth + 1,
    # 3H] stay on the device until the call returns: 32 rounds of 64 rows of SmolLM2's hold about 50 MB
    call_rounds: int = 32
    # prompts prefilled while a call runs, beside its rounds on the device (the verifier holds as many slots
    # beyond max_sequences: VerifierConfig.prefill_ahead): a request arriving mid-call joins the next call with its
    # prefill done rather than the step waiting for it; with it, a step's own new prompts are launched beside the
    # step's call too when sequences run (read at its end). 0: prompts are prefilled at a step's start, before its call
    prefill_ahead: int = 0

    def __post_init__(self) -> None:
        if self.max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {self.max_sequences}")
        if self.prefill_chunk < 0 or not 1 <= self.plain_steps <= 64 or self.draft_retry_s <= 0:
            raise ValueError("prefill_chunk must be >= 0, plain_steps in [1, 64], draft_retry_s > 0")
        if not 1 <= self.rounds_per_step <= 64:
            raise ValueError(f"rounds_per_step must be in [1, 64], got {self.rounds_per_step}")
        if not 1 <= self.call_rounds <= 256:
            raise ValueError(f"call_rounds must be in [1, 256], got {self.call_rounds}")
        if not 0 <= self.prefill_ahead <= 256:
            raise ValueError(f"prefill_ahead must be in [0, 256], got {self.prefill_ahead}")


@dataclass(slots=True)
class Draft:
    """What the drafter has not seen of a speculative sequence."""

    tokens: list[int] = field(default_factory=list)  # [n] committed since it last saw the sequence
    hidden: list[torch.Tensor] = field(default_factory=list)  # their features, in chunks [n_i, 3H]
    start: ProposeInput | None = None  # the drafter does not hold it: its whole context (after a prefill)
    lost: bool = False  # the drafter lost it: caught up once the drafter answers again
    dead: bool = False  # the drafter cannot follow it (its context is full for the drafter): plain from now on


@dataclass(frozen=True)
class Snapshot:
    """The core's state for Info and the metrics (read from another thread: a copy)."""

    running: int
    waiting: int
    degraded: bool  # the drafter is down: speculation waits for it
    choices: dict[Shape, int]  # rounds per shape since start (PLAIN: plain steps)
    estimates: list  # the policy's (common.policy.Estimate)
    times: dict[str, float] = field(default_factory=dict)  # EngineCore.times: seconds by phase since start
    calls: dict[str, int] = field(default_factory=dict)  # EngineCore.calls: rounds, plain_calls, switches since start


@dataclass(frozen=True)
class Beside:
    """A prefill launched beside a step's call (EngineCore._launch_ahead), read at the step's end."""

    work: list[tuple[Sequence, int]]  # the sequences and the prompt tokens each had prefilled
    launch: object  # the engine's handle (VerifierEngine.prefill_launch), for its prefill_read
