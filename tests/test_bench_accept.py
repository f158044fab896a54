"""bench.accept's arithmetic and requests by hand (its run through a real stack: tests/test_e2e.py)."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.accept import ALL, Answer, markdown, message, parse_args, parse_tree, pooled, table
from bench.load import CATEGORIES, Prompt
from common.policy import Shape


def answer(category: str, temperature: float, rounds: int, acceptance: float, tokens: int = 0) -> Answer:
    return Answer(category, temperature, tokens, "eos", rounds, acceptance)


def test_pooled_weighs_by_rounds():
    # 4.0 over 10 rounds (40 tokens) and 2.0 over 30 (60): 100 tokens in 40 rounds
    assert pooled([answer("chat", 0, 10, 4.0), answer("chat", 0, 30, 2.0)]) == 2.5
    assert pooled([answer("chat", 0, 0, 0.0)]) is None and pooled([]) is None


def test_table_per_temperature_and_category():
    answers = [
        answer("chat", 0, 10, 4.0),
        answer("code", 0, 20, 5.0),
        answer("code", 0, 20, 3.0),
        answer("chat", 0.7, 5, 2.0),
        answer("math", 0.7, 0, 0.0),  # a request without a round counts for nothing
    ]
    got = table(answers)
    assert list(got) == [0, 0.7]
    assert list(got[0]) == [*CATEGORIES, ALL]
    assert got[0]["chat"] == 4.0 and got[0]["code"] == 4.0 and got[0]["qa"] is None
    assert got[0][ALL] == pytest.approx((40 + 100 + 60) / 50)  # 4.0
    assert got[0.7]["chat"] == 2.0 and got[0.7]["math"] is None and got[0.7][ALL] == 2.0
    md = markdown(got, answers, {"title": "t", "command": "c", "stack": "s"})
    assert "| 0 | 4.00 | 4.00 | - | - | - | - | 4.00 | 50 | 0 |" in md
    assert "| 0.7 | 2.00 | - | - | - | - | - | 2.00 | 5 | 0 |" in md


def test_message_greedy_and_sampled():
    p = Prompt("qa", "Why is the sky blue?")
    tree = parse_tree("6x60")
    greedy = message(p, 3, tree, 0.0, 0.9, 256)
    assert greedy == {
        "messages": [{"role": "user", "content": "Why is the sky blue?"}],
        "max_tokens": 256,
        "tree": {"depth": 6, "nodes": 60},
    }
    sampled = message(p, 3, tree, 0.7, 0.9, 256)
    assert sampled == greedy | {"temperature": 0.7, "top_p": 0.9, "seed": 3}


@pytest.mark.parametrize("bad", ["6", "x60", "0x1", "6x3", "6x", "ax60", "plain"])
def test_parse_tree_refuses(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="DEPTHxNODES"):
        parse_tree(bad)


def test_parse_args():
    a = parse_args(["--temperatures", "0,0.7,1", "--tree", "3x8"])
    assert a.temperatures == [0.0, 0.7, 1.0] and a.tree == Shape(3, 8) and a.max_tokens == 256
    for bad in (["--temperatures", "hot"], ["--temperatures", "-1"], ["--max-tokens", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_two_runs_are_compared_prompt_by_prompt():
    """--compare: NEW's acceptance minus BASE's per prompt, their mean and standard error per category; runs over other
    prompts are refused."""
    from bench.accept import paired

    base = [answer("code", 0, 10, a) for a in (4.0, 4.0, 4.0)] + [answer("chat", 0, 10, 3.0)]
    new = [answer("code", 0, 10, a) for a in (4.2, 4.4, 4.3)] + [answer("chat", 0, 10, 3.5)]
    got = paired(base, new)[0]
    assert set(got) == {"code"}  # one chat prompt: no standard error
    assert math.isclose(got["code"][0], 0.3) and math.isclose(got["code"][1], 0.1 / math.sqrt(3))
    with pytest.raises(ValueError, match="same prompts"):
        paired(base, new[::-1])
