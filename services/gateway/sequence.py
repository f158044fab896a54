"""One generation's bookkeeping in the gateway: committing tokens, stop conditions, streamed deltas
and speculation statistics. Plain Python: no torch, no gRPC."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.config import SamplingConfig
from common.policy import Shape
from common.rounds import cut_at_stop
from services.gateway.detokenize import RoundDecoder


class Finish(enum.Enum):
    STOP = 1  # a stop string or a stop token id
    LENGTH = 2  # max_tokens reached
    EOS = 3  # the model's end-of-sequence token
    ABORT = 4  # cancelled or failed


@dataclass(frozen=True)
class GenRequest:
    """A validated generation request."""

    prompt_ids: list[int]  # [prompt_len]
    max_tokens: int
    sampling: SamplingConfig
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    speculative: bool = True
    tree: Shape | None = None  # a pinned tree for every round (None: the gateway's policy chooses)


@dataclass(frozen=True)
class Delta:
    """What one commit adds to the stream."""

    token_ids: list[int]  # [new_tokens]
    text: str
    finish: Finish | None


@dataclass(frozen=True)
class Take:
    """A round's tokens as Generation.take committed them by the token rules, awaiting their text (speak)."""

    new_tokens: list[int]  # [round] what the round brought
    taken: list[int]  # [committed] its first tokens, cut at a stop token id or max_tokens
    finish: Finish | None  # the finish they reached


@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    def count(self, rounds: int, drafted: int, accepted: int) -> None:
        """Verification rounds: `drafted` tree nodes in all, `accepted` of them accepted."""
        self.rounds += rounds
        self.drafted += drafted
        self.accepted += accepted

    def mean_acceptance_length(self) -> float:
        """Tokens per verification round: the accepted drafted tokens and the bonus token. Tokens the
        policy decoded plainly are not rounds' tokens and do not count (0.0 before any round).
        Example: 2 rounds accepting 3 and 1 drafted tokens -> (4 + 2) / 2 = 3.0."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


@dataclass
class Generation:
    """A request's progress. `commit` cuts a round where plain decoding would have stopped: at an
    end-of-sequence or stop token, at max_tokens, or at the token that completes a stop string."""

    request: GenRequest
    decoder: RoundDecoder
    eos_token_id: int
    token_ids: list[int] = field(default_factory=list)  # [completion_tokens]
    text: str = ""  # text emitted so far, stop strings excluded
    _held: str = ""  # text held back because it may be the start of a stop string
    finish: Finish | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    # the token ids that end it: the request's stop ids and, unless ignore_eos, end-of-sequence
    token_stops: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        eos = frozenset() if self.request.ignore_eos else frozenset((self.eos_token_id,))
        self.token_stops = self.request.stop_token_ids | eos

    def tokens_left(self) -> int:
        """Tokens it may still commit before max_tokens."""
        return self.request.max_tokens - len(self.token_ids)

    def commit(self, new_tokens: list[int]) -> Delta:
        """The round's tokens at once: cut by the token rules, detokenized in one call, checked for a stop
        string once. The delta is what committing them one at a time (_commit_each) would give in all: a
        stop string can only start in the held text or the round's (see _push_text), and the text held
        after the round is the same. A round that completes a stop string goes token by token, to find
        the token that completed it. commit = speak(take(...)): the scheduler takes at once and speaks
        later, while the next call runs."""
        taken = self.take(new_tokens)
        return self.speak(taken) if taken is not None else self._commit_each(new_tokens)

    def take(self, new_tokens: list[int]) -> Take | None:
        """commit's token rules, now: the tokens cut at an end-of-sequence or stop token id or at max_tokens
        join token_ids and set the finish they reach, so that tokens_left and finish are what the next call
        needs; the text comes with speak(). None when the generation had finished already (nothing is
        taken; commit then emits what token-by-token commits would)."""
        if self.finish is not None:
            return None
        taken, finish = self._cut(new_tokens)
        self.token_ids += taken
        self.finish = finish
        return Take(new_tokens, taken, finish)

    def speak(self, t: Take) -> Delta:
        """The text of a take (the last one: nothing was taken since), and stop strings: one that the round
        completes cuts it where token-by-token commits would (the take's tokens are given back and
        _commit_each goes through the round). A generation cancelled since the take only gets its finish."""
        if self.finish is Finish.ABORT:  # take never sets it: cancelled since
            return Delta(token_ids=t.taken, text="", finish=Finish.ABORT)
        taken, finish = t.taken, t.finish
        spoken = taken if finish is None or finish == Finish.LENGTH else taken[:-1]  # eos, stop ids: no text
        stops = self.request.stop
        mark = self.decoder.mark() if stops else None
        window = self._held + self.decoder.push_round(spoken)
        if mark is not None and any(s in window for s in stops):
            self.decoder.rewind(mark)
            del self.token_ids[len(self.token_ids) - len(taken) :]
            self.finish = None
            return self._commit_each(t.new_tokens)
        if not stops or finish in (Finish.EOS, Finish.LENGTH):  # nothing more can complete a stop string
            text, self._held = window, ""
        else:  # a stop token drops the held text, as token by token
            hold = _longest_stop_prefix_suffix(window, stops)
            text, self._held = window[: len(window) - hold], window[len(window) - hold :]
        self.text += text
        return Delta(token_ids=taken, text=text, finish=finish)

    def _cut(self, new_tokens: list[int]) -> tuple[list[int], Finish | None]:
        """Which of new_tokens are committed, and the finish they reach, by the token rules alone: the first
        max_tokens - len(token_ids) of them, up to an end-of-sequence or stop token.
        Example: 3 tokens to go, eos 2, new [5, 6, 2, 7] -> ([5, 6, 2], EOS); [5, 6, 7, 8] -> ([5, 6, 7], LENGTH)."""
        room = max(self.tokens_left(), 1)
        n, stopped = cut_at_stop(new_tokens, room, self.token_stops)
        taken = list(new_tokens[:n])
        if stopped:
            return taken, self._stop_finish(taken[-1])
        return taken, Finish.LENGTH if n >= room else None

    def _stop_finish(self, token: int) -> Finish:
        """The finish of a token in token_stops: EOS for end-of-sequence (when it counts), else STOP."""
        return Finish.EOS if token == self.eos_token_id and not self.request.ignore_eos else Finish.STOP

    def _commit_each(self, new_tokens: list[int]) -> Delta:
        """commit, token by token: the rule that commit's one pass over a round reproduces. Each token's
        text is checked for a stop string as it comes, and text that may start one is held back."""
        taken: list[int] = []
        text = ""
        for t in new_tokens:
            if self.finish is not None:
                break
            taken.append(t)
            self.token_ids.append(t)
            if t in self.token_stops:
                self.finish = self._stop_finish(t)
            else:
                text += self._push_text(t)
            if self.finish is None and len(self.token_ids) >= self.request.max_tokens:
                self.finish = Finish.LENGTH
        if self.finish is not None and self.finish != Finish.STOP:
            text += self._held  # nothing more can complete a stop string
            self._held = ""
        self.text += text
        return Delta(token_ids=taken, text=text, finish=self.finish)

    def abort(self) -> None:
        if self.finish is None:
            self.finish = Finish.ABORT

    def _push_text(self, token: int) -> str:
        piece = self._held + self.decoder.push([token])
        if not self.request.stop:
            self._held = ""
            return piece
        window = piece
        # Emitted text never ends in a stop string's prefix (that part is held), so a stop string
        # can only start inside the window.
        hits = [at for at in (window.find(s) for s in self.request.stop) if at >= 0]
        if hits:
            self.finish = Finish.STOP
            self._held = ""
            return window[: min(hits)]
        hold = _longest_stop_prefix_suffix(window, self.request.stop)
        self._held = window[len(window) - hold :] if hold else ""
        return window[: len(window) - hold]


def _longest_stop_prefix_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string.
    Example: text "hello wor", stops ("world",) -> 3 ("wor")."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
