"""The gateway's commit logic: stop rules applied token by token, text held back at stop prefixes."""

import random

import pytest

from common.config import SamplingConfig
from services.gateway.detokenize import RoundDecoder
from services.gateway.sequence import Delta, Finish, Generation, GenRequest

EOS = 2


class FakeTokenizer:
    """Each token id decodes to a fixed piece of text."""

    PIECES = {5: "Hel", 6: "lo", 7: " wor", 8: "ld", 9: "!", 2: ""}

    def decode(self, ids: list[int]) -> str:
        return "".join(self.PIECES[i] for i in ids)


def gen(**kw):
    req = GenRequest(prompt_ids=[1], max_tokens=kw.pop("max_tokens", 10), sampling=SamplingConfig(), **kw)
    return Generation(request=req, decoder=RoundDecoder(FakeTokenizer()), eos_token_id=EOS)


def test_max_tokens_cuts_a_round():
    g = gen(max_tokens=3)
    d = g.commit([5, 6, 7, 8])
    assert d.token_ids == [5, 6, 7] and d.finish == Finish.LENGTH and g.text == "Hello wor"


def test_eos_ends_unless_ignored():
    g = gen()
    assert g.commit([5, EOS, 6]).finish == Finish.EOS
    assert g.token_ids == [5, EOS]
    g = gen(ignore_eos=True)
    assert g.commit([5, EOS, 6]).finish is None and g.token_ids == [5, EOS, 6]


def test_stop_token_ids():
    g = gen(stop_token_ids=frozenset({7}))
    d = g.commit([5, 6, 7, 8])
    assert d.finish == Finish.STOP and g.token_ids == [5, 6, 7] and g.text == "Hello"


def test_stop_string_across_tokens_is_held_then_cut():
    g = gen(stop=("world",))
    d1 = g.commit([5, 6, 7])  # "Hello wor": " wor" could start "world"? no, "wor" could: held
    assert d1.text == "Hello " and d1.finish is None
    d2 = g.commit([8, 9])
    assert d2.finish == Finish.STOP and g.text == "Hello " and d2.text == ""


def test_held_text_released_when_not_a_stop():
    g = gen(stop=("world",), max_tokens=3)
    d = g.commit([5, 6, 7])  # ends by length: the held "wor" is flushed
    assert d.finish == Finish.LENGTH and g.text == "Hello wor"


def test_mean_acceptance_length_counts_rounds_only() -> None:
    """Tokens per verification round, bonus included: 2 rounds accepting 3 and 1 drafted tokens give
    (4 + 2) / 2 = 3.0, however many tokens the request also decoded plainly; no round: 0."""
    from services.gateway.convert import speculation
    from services.gateway.sequence import SpecStats

    stats = SpecStats(rounds=2, drafted=16, accepted=4)
    assert stats.mean_acceptance_length() == 3.0
    msg = speculation(stats)
    assert (msg.rounds, msg.drafted_tokens, msg.accepted_tokens, msg.mean_acceptance_length) == (2, 16, 4, 3.0)
    assert SpecStats().mean_acceptance_length() == 0.0


# ---- a round at once against the rule token by token, with the real tokenizer ----
# SmolLM2's tokens of "café 👋🏽!": c, af, é, then " 👋" in three ([space F0 9F] [91] [8B]) and "🏽" in
# three ([F0 9F] [8F] [BD]), then "!". A character's bytes split over tokens come out when it is whole.
CAFE = [83, 1939, 2756, 15107, 235, 229, 10813, 233, 138, 17]


@pytest.fixture(scope="module")
def tok():
    from common.model_path import default_model_path
    from common.tokenizer import Tokenizer

    return Tokenizer(default_model_path())


def real(tok, **kw) -> Generation:
    req = GenRequest(prompt_ids=[1], max_tokens=kw.pop("max_tokens", 100), sampling=SamplingConfig(), **kw)
    return Generation(request=req, decoder=RoundDecoder(tok), eos_token_id=tok.eos_token_id)


def test_characters_split_across_rounds_are_streamed_whole(tok):
    """Round 1 ends after the first byte token of 👋 (its text ends inside the character): "café" comes out
    (as it would token by token), the space and 👋 with round 2, which ends inside 🏽; then "🏽!"."""
    g = real(tok)
    deltas = [g.commit(CAFE[:4]), g.commit(CAFE[4:7]), g.commit(CAFE[7:])]
    assert [d.text for d in deltas] == ["café", " 👋", "🏽!"]
    assert [d.token_ids for d in deltas] == [CAFE[:4], CAFE[4:7], CAFE[7:]]
    assert g.text == "café 👋🏽!" and g.token_ids == CAFE and g.finish is None


def test_a_stop_string_in_a_multibyte_character_cuts_at_the_token_that_completes_it(tok):
    """Stop "👋": round 2 completes it at its second token (229), so the round commits [235, 229] and
    streams the space before the stop string; the third token is not committed."""
    g = real(tok, stop=("👋",))
    assert g.commit(CAFE[:4]).text == "café"
    d = g.commit(CAFE[4:7])
    assert (d.token_ids, d.text, d.finish) == ([235, 229], " ", Finish.STOP)
    assert g.text == "café " and g.token_ids == CAFE[:6]
    assert g.commit(CAFE[7:]) == Delta(token_ids=[], text="", finish=Finish.STOP)


def test_held_text_and_max_tokens_in_one_round(tok):
    """Stop "é!" (never complete here): "caf" goes out and "é" is held after round 1; round 2 reaches
    max_tokens (5) at its first token, which releases the held "é" with the space byte's text (none yet)."""
    g = real(tok, stop=("é!",), max_tokens=5)
    d1 = g.commit(CAFE[:3])
    assert (d1.text, g._held) == ("caf", "é")
    d2 = g.commit(CAFE[3:7])
    assert (d2.token_ids, d2.text, d2.finish) == ([15107, 235], "é", Finish.LENGTH)


TEXT = (
    "The café served crème brûlée — naïve, perhaps. 日本語のテキスト, 한국어, русский; emoji 👋🏽 🇫🇷 ❤️ 🧑🏿‍💻.\n"
    "def f(x):\n    return x ** 2  # done!\n"
)


def _rounds(rng: random.Random, ids: list[int]) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 9)
        out.append(ids[i : i + n])
        i += n
    return out


def test_a_round_at_once_equals_the_rule_token_by_token(tok):
    """Random token streams (a multilingual text's tokens with raw byte tokens and special tokens mixed
    in), cut into random rounds, with random stop strings (pieces of the text, so that they hit), stop
    ids, end-of-sequence tokens and max_tokens: every round's delta and the final state equal those of the
    same rounds committed token by token (the rule kept as Generation._commit_each)."""
    rng = random.Random(0)
    base = tok.encode_prompt(TEXT)
    text = tok.decode(base)
    for case in range(300):
        ids = list(base)
        for _ in range(rng.randint(0, 6)):  # stray bytes (ids 3..258 are SmolLM2's byte tokens) or specials
            ids.insert(rng.randrange(len(ids) + 1), rng.choice([rng.randint(3, 258), 0, 1, tok.eos_token_id]))
        start = rng.randrange(len(ids))
        ids = ids[start:] + ids[:start]
        stop = tuple(text[a : a + rng.randint(1, 4)] for a in rng.sample(range(len(text)), rng.randint(0, 2)))
        kw = dict(
            stop=stop,
            stop_token_ids=frozenset(rng.sample(ids, 1)) if rng.random() < 0.2 else frozenset(),
            ignore_eos=rng.random() < 0.5,
            max_tokens=rng.randint(1, len(ids) + 5),
        )
        fast, each = real(tok, **kw), real(tok, **kw)
        for r in _rounds(rng, ids):
            assert fast.commit(r) == each._commit_each(r), (case, kw, r)
        assert (fast.text, fast.token_ids, fast.finish, fast._held) == (
            each.text,
            each.token_ids,
            each.finish,
            each._held,
        )


def test_take_applies_the_token_rules_now_and_speak_the_text_later():
    """take: token_ids, tokens_left and the finish by token rules at once (what the next call needs);
    speak: the text. Hand-computed on FakeTokenizer's pieces."""
    g = gen(max_tokens=4)
    t = g.take([5, 6, 7, 8, 9])
    assert (t.taken, t.finish) == ([5, 6, 7, 8], Finish.LENGTH)
    assert g.token_ids == [5, 6, 7, 8] and g.tokens_left() == 0 and g.finish == Finish.LENGTH and g.text == ""
    assert g.speak(t) == Delta(token_ids=[5, 6, 7, 8], text="Hello world", finish=Finish.LENGTH)
    assert g.take([9]) is None  # finished: nothing taken


def test_speak_gives_back_what_a_stop_string_cuts():
    """The take [5, 6, 7, 8, 9] ("Hello world!") by token rules; its speak finds "lo w" completed by token 7
    and leaves token_ids where token-by-token commits would: [5, 6, 7], finish STOP, text "Hel"."""
    g = gen(stop=("lo w",))
    t = g.take([5, 6, 7, 8, 9])
    assert g.token_ids == [5, 6, 7, 8, 9] and g.finish is None
    d = g.speak(t)
    assert d == Delta(token_ids=[5, 6, 7], text="Hel", finish=Finish.STOP)
    assert g.token_ids == [5, 6, 7] and g.text == "Hel"


def test_a_request_cancelled_between_take_and_speak_only_gets_its_finish():
    g = gen()
    t = g.take([5, 6])
    g.abort()
    assert g.speak(t) == Delta(token_ids=[5, 6], text="", finish=Finish.ABORT)
