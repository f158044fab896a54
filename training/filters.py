"""Quality filters for training prompts, plain Python: each is a predicate on the prompt's text.

`FilterConfig.reason(text)` names the first filter a prompt fails (None when it passes), in FILTERS order;
the prompts stage counts prompts left after each step from those names.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

FILTERS = ("length", "english", "repetition", "greeting")

_NON_LATIN = re.compile(r"[\u0400-\u04ff\u0590-\u06ff\u0900-\u0dff\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")
_WORD = re.compile(r"[a-z0-9']+")
# Small talk that asks for nothing: a prompt made only of these words is a greeting ("Hi there, how are you?").
_SMALL_TALK = (
    "hi hii hello hey heya hiya yo greetings howdy sup whats what's up good morning afternoon evening day night "
    "there how are you u doing today it's it going is everyone anyone anybody here nice to meet thanks thank "
    "i'm im am fine ok okay well and about yourself dear friend sir bot assistant smollm"
)
GREETING_WORDS = frozenset(_SMALL_TALK.split())


def normalize(text: str) -> str:
    """NFKC, lower case, every run of non-alphanumeric characters one space: the key of exact deduplication.

    Example: "  Hello,\\n WORLD!! " -> "hello world".
    """
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(re.findall(r"\w+", text))


def is_english(text: str) -> bool:
    """Heuristic: no CJK/Cyrillic/Arabic/Indic characters and mostly ASCII letters."""
    if _NON_LATIN.search(text):
        return False
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) / len(letters) > 0.95


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def is_repetitive(text: str, min_words: int = 12, min_unique_trigrams: float = 0.5, max_char_run: int = 30) -> bool:
    """Degenerate text: under half of its word trigrams distinct (when it has >= 12 words), or one character
    repeated more than 30 times in a row.

    Example: "buy now " x 6 has 12 words, 10 trigrams, 2 distinct ("buy now buy", "now buy now"): 0.2 < 0.5.
    """
    if re.search(rf"(.)\1{{{max_char_run},}}", text):
        return True
    w = words(text)
    if len(w) < min_words:
        return False
    trigrams = list(zip(w, w[1:], w[2:], strict=False))
    return len(set(trigrams)) / len(trigrams) < min_unique_trigrams


def is_greeting(text: str, max_words: int = 8) -> bool:
    """At most 8 words, all of them small talk: "Hello! How are you doing today?" is one, "Hi, what is 2+2?" is not."""
    w = words(text)
    return 0 < len(w) <= max_words and all(x in GREETING_WORDS for x in w)


@dataclass(frozen=True)
class FilterConfig:
    min_chars: int = 12
    max_chars: int = 4096  # cheap bound before tokenizing; the token bound comes after (PromptConfig)
    min_words: int = 3

    def __post_init__(self) -> None:
        if self.min_chars < 1:
            raise ValueError(f"min_chars must be >= 1, got {self.min_chars}")
        if self.max_chars < self.min_chars:
            raise ValueError(f"max_chars ({self.max_chars}) must be >= min_chars ({self.min_chars})")
        if self.min_words < 1:
            raise ValueError(f"min_words must be >= 1, got {self.min_words}")

    def reason(self, text: str) -> str | None:
        """The first of FILTERS that `text` fails, or None."""
        if not self.min_chars <= len(text) <= self.max_chars or len(text.split()) < self.min_words:
            return "length"
        if not is_english(text):
            return "english"
        if is_repetitive(text):
            return "repetition"
        if is_greeting(text):
            return "greeting"
        return None
