"""A generation's life in the engine core: its request, its state, and the token rules that end it. Plain
Python: no torch, no gRPC.

States and the transitions allowed (Sequence.to):

    WAITING --admitted--> PREFILLING --last chunk in--> RUNNING --token rules, abort--> FINISHED
       \\______________________ abort, failure ______________________________________/

A WAITING sequence holds nothing; PREFILLING and RUNNING ones hold a KV slot on the verifier (and, when
speculative, the draft's state); FINISHED ones are released by the core at the end of the step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.config import SamplingConfig
from common.policy import Member, Shape, band
from common.rounds import cut_at_stop


class Status(enum.Enum):
    WAITING = 1  # queued: no slot yet
    PREFILLING = 2  # its prompt goes in, a chunk a step
    RUNNING = 3  # in the rounds
    FINISHED = 4  # to be released


ALLOWED = {
    Status.WAITING: {Status.PREFILLING, Status.FINISHED},
    Status.PREFILLING: {Status.RUNNING, Status.FINISHED},
    Status.RUNNING: {Status.FINISHED},
    Status.FINISHED: set(),
}


class Finish(enum.IntEnum):
    """Why a sequence finished (on the wire as an int: GenerateOut.finish)."""

    NONE = 0  # still running
    TOKEN = 1  # committed one of its stop token ids (end-of-sequence included)
    LENGTH = 2  # reached its max_new budget
    CONTEXT = 3  # its context is full
    ABORT = 4  # its client went away, or the stream that sent it closed
    ERROR = 5  # it failed (Sequence.error says why)


@dataclass(frozen=True)
class Request:
    """A generation as the engine core runs it (validated by whoever builds it)."""

    seq_id: str
    prompt_ids: list[int]  # [prompt_len]
    sampling: SamplingConfig
    max_new: int  # tokens it may commit, the first (from the prefill) included
    stop_ids: frozenset[int] = frozenset()  # end-of-sequence and stop token ids
    speculative: bool = True  # False: plain decoding only
    tree: Shape | None = None  # a pinned tree for every round (None: the policy chooses)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"sequence {self.seq_id!r}: the prompt is empty")
        if self.max_new < 1:
            raise ValueError(f"sequence {self.seq_id!r}: max_new must be >= 1, got {self.max_new}")


@dataclass(slots=True)
class Sequence:
    """A request's progress in the core."""

    req: Request
    seq_id: str = ""  # req.seq_id (an attribute: read several times a sequence a step)
    band: str = ""  # its temperature band (common.policy.band): the policy's acceptance statistics
    member: Member = field(init=False)  # the policy's view of it (made once: the policy decides for 64 of them a call)
    status: Status = Status.WAITING
    prefilled: int = 0  # prompt tokens in the verifier's cache
    tokens: list[int] = field(default_factory=list)  # [generated] committed tokens
    finish: Finish = Finish.NONE
    error: BaseException | None = None  # Finish.ERROR: what went wrong
    # the speculation counts of its rounds since its last output (SeqOutput), then reset
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [depth] rounds that accepted more than p tokens

    def __post_init__(self) -> None:
        self.seq_id = self.req.seq_id
        self.band = band(self.req.sampling.temperature)
        self.member = Member(self.seq_id, self.band)

    @property
    def generated(self) -> int:
        return len(self.tokens)

    @property
    def left(self) -> int:
        """Tokens it may still commit."""
        return self.req.max_new - len(self.tokens)

    def to(self, status: Status) -> None:
        if status not in ALLOWED[self.status]:
            raise ValueError(f"sequence {self.seq_id!r} cannot go from {self.status.name} to {status.name}")
        self.status = status

    def end(self, finish: Finish, error: BaseException | None = None) -> None:
        """Finish it (a no-op on a finished one: the first reason stands)."""
        if self.status is Status.FINISHED:
            return
        self.to(Status.FINISHED)
        self.finish, self.error = finish, error

    def commit(self, tokens: list[int]) -> list[int]:
        """The tokens of a step that it keeps: cut after its first stop token id and at its budget (common.rounds
        .cut_at_stop), which finish it. Example: max_new 4, 2 committed, stop ids {2}: [5, 2, 7] -> [5, 2]
        (TOKEN); [5, 6, 7] -> [5, 6] (LENGTH); [5] -> [5] (runs on)."""
        n, stopped = cut_at_stop(tokens, self.left, self.req.stop_ids)
        taken = tokens[:n]
        self.tokens += taken
        if stopped:
            self.end(Finish.TOKEN)
        elif self.left <= 0:
            self.end(Finish.LENGTH)
        return taken

    def count_round(self, drafted: int, accepted: int) -> None:
        """A verification round of its tree: `drafted` nodes, `accepted` of them accepted."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        at = self.accepted_at
        if len(at) < accepted:
            at += [0] * (accepted - len(at))
        for p in range(accepted):
            at[p] += 1


@dataclass(slots=True)
class SeqOutput:
    """What one step did for one sequence (the core's output; GenerateOut carries them packed)."""

    seq_id: str
    tokens: list[int]  # [new] committed this step
    finish: Finish
    rounds: int = 0  # verification rounds this step (0: prefill or plain steps)
    drafted: int = 0  # tree nodes verified in them
    accepted: int = 0  # drafted tokens accepted in them
    accepted_at: list[int] = field(default_factory=list)  # [P] of them, those that accepted more than p tokens
    error: BaseException | None = None  # Finish.ERROR: why (an exception the service maps to a status code)


def output(seq: Sequence, tokens: list[int]) -> SeqOutput:
    """seq's output for this step (its round counts taken and reset)."""
    if not seq.rounds:
        return SeqOutput(seq.seq_id, tokens, seq.finish, error=seq.error)
    out = SeqOutput(seq.seq_id, tokens, seq.finish, seq.rounds, seq.drafted, seq.accepted, seq.accepted_at, seq.error)
    seq.rounds = seq.drafted = seq.accepted = 0
    seq.accepted_at = []
    return out
