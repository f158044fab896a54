"""The gateway's commit logic: stop rules applied token by token, text held back at stop prefixes."""

from common.config import SamplingConfig
from services.gateway.sequence import Finish, Generation, GenRequest

EOS = 2


class FakeDecoder:
    """Each token id i decodes to the i-th entry of a fixed list of pieces."""

    PIECES = {5: "Hel", 6: "lo", 7: " wor", 8: "ld", 9: "!", 2: ""}

    def push(self, ids):
        return "".join(self.PIECES[i] for i in ids)


def gen(**kw):
    req = GenRequest(prompt_ids=[1], max_tokens=kw.pop("max_tokens", 10), sampling=SamplingConfig(), **kw)
    return Generation(request=req, decoder=FakeDecoder(), eos_token_id=EOS)


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
