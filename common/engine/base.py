"""Protocols every backend implements. Inputs and outputs are plain data plus torch tensors."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from common.config import SamplingConfig
from common.rounds import start_shift
from common.tree import Tree

T = TypeVar("T")

# An engine call as steps: it yields an event wherever the host would wait for the device (its work is
# launched; what follows reads its results), and returns the call's result. `finish` runs it as one blocking
# call; a service's event loop instead answers other calls until the event has completed
# (services/engine_runner.py). Nothing is yielded on CPU.
Steps = Generator[torch.cuda.Event, None, T]


def finish(steps: Steps[T]) -> T:
    """The result of an engine call's steps, blocking at each of its waits for the device."""
    try:
        while True:
            steps.send(None).synchronize()
    except StopIteration as done:
        return done.value


@dataclass(frozen=True)
class EngineInfo:
    model: str
    vocab_size: int
    max_context: int  # prompt + generated tokens a sequence may hold
    max_sequences: int
    max_tree_nodes: int
    dtype: str
    device: str


@dataclass(frozen=True)
class PrefillInput:
    """A prompt, or one chunk of it. The first call creates the sequence; while `more` is set, the next
    call for the same id continues it (its tokens follow in the KV cache) and no token is chosen yet."""

    seq_id: str
    token_ids: list[int]  # [chunk_len]: the prompt, or its next chunk
    sampling: SamplingConfig
    more: bool = False  # more chunks follow


@dataclass(frozen=True)
class PrefillOutput:
    next_token: int | None  # None while more chunks follow
    hidden: torch.Tensor  # [chunk_len, 3H] EAGLE features of this call's positions


@dataclass(frozen=True)
class VerifyInput:
    seq_id: str
    tree: Tree


@dataclass(frozen=True)
class Accepted:
    """A verify's acceptance (greedy or sampled) still on the device, for a drafter that drafts the next trees there
    (Drafter.launch_after) before the host has read it. Copies, valid past the verifier's next call."""

    result: torch.Tensor  # [B, T + 1] int64: accepted count c, then the c accepted tokens and the bonus, then filler
    kept: torch.Tensor  # [B, R, 3H] features of the root and the accepted nodes in path order (R >= every c + 1)


@dataclass(frozen=True)
class Chained:
    """The next trees of a verify's first K rows, drafted on the device behind it (Drafter.launch_after): the
    verifier's next round reads them there (VerifierEngine.verify_rounds_steps), the host never does."""

    # [K, N] each (int32, int64, or float64 views of the drafter's tree block: integer values)
    tokens: torch.Tensor  # base ids of each row's nodes, a node's parent before it
    parents: torch.Tensor  # each node's parent node (-1: the root)
    keep: torch.Tensor  # [K] int64 nodes each row's tree keeps (its first keep[k])
    keep_max: int  # max(keep), known to the host
    depth: int  # a bound on the trees' depth, known to the host
    ready: object  # a CUDA event after which they may be read (None on CPU)
    kids: int  # a bound on any node's children (the drafter's top_k, the most nodes kept), known to the host


@dataclass(frozen=True, slots=True)
class VerifyOutput:
    tokens: list[int]  # [num_accepted + 1] accepted drafted tokens, then the bonus token
    kept: torch.Tensor  # [B, P, 3H] the round's features of every row's accepted path (shared by its outputs)
    row: int  # this output's row of kept

    @property
    def hidden(self) -> torch.Tensor:
        """[num_accepted + 1, 3H] features of the root and each accepted node: a view taken when asked (a round
        at 64 sequences makes 64 outputs; the core reads the features of the few the drafter has not seen)."""
        return self.kept[self.row, : len(self.tokens)]


@dataclass(frozen=True)
class Decoded:
    """Plain decoding steps of a batch."""

    tokens: list[list[int]]  # [B][steps] every sequence gets as many
    hidden: torch.Tensor | None  # [B, steps, 3H] EAGLE features (hidden[i, j] produced tokens[i][j]), when asked


@dataclass(frozen=True)
class StepTime:
    """One engine step's measured time (see common.policy.StepCost, its torch-free twin on the wire)."""

    kind: str  # "decode" | "verify" | "propose"
    batch: int  # batch bucket
    size: int  # 1 for decode, tree rows for verify, depth for propose
    seconds: float


class VerifierEngine(Protocol):
    info: EngineInfo

    def prefill(self, item: PrefillInput) -> PrefillOutput: ...

    # several sequences' prompts or chunks at once; all or nothing (see Verifier.prefill_batch)
    def prefill_batch(self, items: list[PrefillInput]) -> list[PrefillOutput]: ...
    # prefill_batch in two calls: queued on the device beside whatever runs there, then read; between them no other
    # call may name its sequences (see Verifier.prefill_launch)
    def prefill_launch(self, items: list[PrefillInput]) -> object: ...
    def prefill_read(self, launch: object) -> list[PrefillOutput]: ...
    def verify(self, items: list[VerifyInput]) -> list[VerifyOutput]: ...  # finish(verify_steps(items))
    # then(accepted): called once a verification is launched, before its wait (a drafter launching the next
    # trees after it on the device: Drafter.launch_after); the trees it returns are the next round's
    def verify_steps(
        self, items: list[VerifyInput], then: Callable[[Accepted], Chained | None] | None = None
    ) -> Steps[list[VerifyOutput]]: ...  # one round of verify_rounds_steps
    # each(r, launched, outputs): round r's outputs as soon as the host has them, the later rounds running on;
    # True launches one more round behind the last (while the chain goes on)
    def verify_rounds_steps(
        self,
        items: list[VerifyInput],
        rounds: int = 1,
        then: Callable[[Accepted], Chained | None] | None = None,
        each: Callable[[int, int, list[VerifyOutput]], bool] | None = None,
    ) -> Steps[list[list[VerifyOutput]]]: ...
    def room(self, seq_ids: list[str]) -> list[int]: ...  # KV rows each sequence has left (trees up to that fit)
    def decode(self, seq_ids: list[str]) -> list[int]: ...
    def decode_many(self, seq_ids: list[str], steps: int, with_hidden: bool = False) -> Decoded: ...  # finish(...)
    def decode_many_steps(self, seq_ids: list[str], steps: int, with_hidden: bool = False) -> Steps[Decoded]: ...
    def step_costs(self) -> list[StepTime]: ...
    def release(self, seq_ids: list[str]) -> int: ...


@dataclass(frozen=True)
class ProposeInput:
    seq_id: str
    token_ids: list[int]  # [num_new] committed tokens; token_ids[i] follows the position of hidden[i]
    hidden: torch.Tensor  # [num_new, 3H]
    start: bool  # first call for this sequence
    context_prefix: list[int]  # tokens before the first pair (on start: the prompt's first token)
    max_nodes: int
    max_depth: int = 0  # tree levels to draft; 0 = the drafter's steps
    sampling: SamplingConfig = SamplingConfig()  # read on start: how the sequence samples (the q rule's needs)

    @classmethod
    def after_prefill(
        cls,
        seq_id: str,
        prompt_ids: list[int],
        prefilled: PrefillOutput,
        max_nodes: int,
        sampling: SamplingConfig = SamplingConfig(),
        max_depth: int = 0,
    ) -> ProposeInput:
        """A sequence's first propose (common.rounds.start_shift): prompt_ids [prompt_len] the whole prompt,
        prefilled.hidden [prompt_len, 3H] its features."""
        token_ids, prefix = start_shift(prompt_ids, prefilled.next_token)
        return cls(seq_id, token_ids, prefilled.hidden, True, prefix, max_nodes, max_depth, sampling)

    @classmethod
    def after_verify(cls, seq_id: str, verified: VerifyOutput, max_nodes: int) -> ProposeInput:
        """The next propose after a round: the accepted tokens and the bonus, with their features."""
        return cls(seq_id, verified.tokens, verified.hidden, False, [], max_nodes)


@dataclass(frozen=True)
class ProposeAfter:
    """A sequence whose next tree is drafted on the device right after the verify of its current one, from
    that verify's acceptance (Accepted): its new tokens and features never pass through the host."""

    seq_id: str
    max_nodes: int
    max_depth: int = 0  # as ProposeInput's


@dataclass
class LaunchAfter:
    """A verify's `then` (VerifierEngine.verify_rounds_steps): after each round, the items' next trees launched
    behind it on the device (Drafter.launch_after), each launch after the one before; it returns them for the
    verifier's next round (None: the drafter declined, and the call's rounds end). handles: the launches, in
    order. Rows past the items (they do not draft) are left out of the drafting."""

    drafter: object  # anything with launch_after: a Drafter, or the draft service of the process
    items: list[ProposeAfter]
    handles: list = field(default_factory=list)

    @property
    def handle(self) -> object | None:
        """The last launch (None: none)."""
        return self.handles[-1] if self.handles else None

    def __call__(self, accepted: Accepted) -> Chained | None:
        k = len(self.items)
        if k < accepted.result.shape[0]:  # [B, ...] -> [k, ...]
            accepted = Accepted(result=accepted.result[:k], kept=accepted.kept[:k])
        launched = self.drafter.launch_after(self.items, accepted, self.handle)
        if launched is None:
            return None
        self.handles.append(launched)
        return launched.chained


class Drafter(Protocol):
    """Proposes a token tree per sequence. Implementations: the EAGLE-3 head, and test oracles.

    The device chain (one host synchronisation a round instead of two): a verify's `then` calls
    launch_after(items, accepted), which queues the drafting of the items' next trees (items[i] is row i of
    the verify) after the verification on the device and returns a handle, or None when it cannot (the
    caller then proposes from the verify's outputs as usual); read_after(handle, rows) later gives the trees
    of those rows, and only those rows' sequences count the verify's tokens as theirs (a row not read is as
    if never proposed: its sequence stopped). Example, one round:
        launch = LaunchAfter(drafter, [ProposeAfter(s, nodes) for s in ids])
        outs = finish(verifier.verify_steps(inputs, then=launch))
        ... commit outs (the drafting runs on the device meanwhile) ...
        trees = drafter.read_after(launch.handle, rows of the sequences that go on)  # handle None: propose
    Chained rounds (verify_rounds_steps): each launch's trees are the next round's on the device; every launch
    but the last is then settled (settle_after), the last read as above."""

    name: str

    def propose(self, items: list[ProposeInput]) -> list[Tree]: ...  # finish(propose_steps(items))
    def propose_steps(self, items: list[ProposeInput]) -> Steps[list[Tree]]: ...
    # items (a joiner's prompt) taken in without a tree, queued on the device, the host waiting for none of it:
    # their first trees come from the drafting behind their first verify (launch_after), which verifies them as
    # rows of no tree. False: this drafter cannot draft behind a verify; it took nothing (propose them instead)
    def take(self, items: list[ProposeInput]) -> bool: ...
    # after: the launch whose trees this verify verified, read by nobody (a chained round)
    def launch_after(self, items: list[ProposeAfter], accepted: Accepted, after: object = None) -> object | None: ...
    def settle_after(self, launched: object) -> None: ...  # a launch a chained round consumed: count its tokens
    def read_after(self, launched: object, rows: list[int]) -> list[Tree]: ...  # finish(read_after_steps(...))
    def read_after_steps(self, launched: object, rows: list[int]) -> Steps[list[Tree]]: ...
    def release(self, seq_ids: list[str]) -> int: ...
    def step_costs(self) -> list[StepTime]: ...
