"""Detokenizing a round's tokens at once: the text that common.tokenizer.IncrementalDecoder emits for them
one by one, in one decode of the window (two tokenizer calls a sequence a round, not two a token)."""

from __future__ import annotations

from typing import NamedTuple

from common.tokenizer import IncrementalDecoder


class Mark(NamedTuple):  # a tuple: made twice a sequence a round, a frozen dataclass costs 1 us more each
    """A RoundDecoder's state before a round, to go back to (RoundDecoder.rewind)."""

    tokens: int  # len(ids)
    prefix_offset: int
    read_offset: int


class RoundDecoder(IncrementalDecoder):
    """IncrementalDecoder fed a round at a time: push_round(ids) emits what push([t]) for each t in turn
    would have emitted in all.

    Token by token, the decoder emits the text up to the last token after which the text is whole (does
    not end inside a character: no trailing U+FFFD) and longer than before. Decoding the window with the
    whole round in it emits the same when the round's end is such a point: the tokens after the last
    whole point before it add no text (else the end would not be whole, or they would make a later whole
    point). When it is not (the round ends inside a character, or adds no text), the round is pushed up to
    its last whole point found from the end, then the rest. Example, the bytes of "é€" in three tokens
    [c3 a9] [e2 82] [ac]: a round of all three -> "é€" in one push; a round of the first two -> "é"
    (pushed [c3 a9], then [e2 82] -> ""), and "€" comes with the next round's [ac]."""

    def push_round(self, ids: list[int]) -> str:
        if not ids:  # a round of an end-of-sequence or stop token alone
            return ""
        mark = self.mark()
        text = self.push(ids)
        if text or len(ids) <= 1:
            return text
        for end in range(len(ids) - 1, 0, -1):  # the last whole point, from the end
            self.rewind(mark)
            text = self.push(ids[:end])
            if text:
                self.push(ids[end:])  # ends inside a character: nothing yet
                return text
        self.rewind(mark)  # no text: every token in, nothing emitted
        self.ids += ids
        return ""

    def mark(self) -> Mark:
        return Mark(len(self.ids), self.prefix_offset, self.read_offset)

    def rewind(self, mark: Mark) -> None:
        """Forget the tokens pushed since `mark`, as if they never came."""
        del self.ids[mark.tokens :]
        self.prefix_offset, self.read_offset = mark.prefix_offset, mark.read_offset
