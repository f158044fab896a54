"""bench.accept's arithmetic and requests by hand (its run through a real stack: tests/test_e2e.py)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from bench.accept import ALL, Answer, markdown, message, parse_args, parse_tree, pooled, table
from bench.load import CATEGORIES, Prompt
from common.policy import Shape


def answer(
    category: str, temperature: float, rounds: int, acceptance: float, tokens: int = 0, prompt: int = 0
) -> Answer:
    return Answer(category, temperature, tokens, "eos", rounds, acceptance, prompt)


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
    assert a.temperatures == [0.0, 0.7, 1.0] and a.tree == Shape(3, 8) and a.max_tokens == 256 and a.seeds == 1
    for bad in (["--temperatures", "hot"], ["--temperatures", "-1"], ["--max-tokens", "0"], ["--seeds", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_two_runs_are_compared_prompt_by_prompt():
    """--compare: NEW's acceptance minus BASE's per prompt, their mean and standard error per category; runs over other
    prompts are refused."""
    from bench.accept import paired

    base = [answer("code", 0, 10, a, prompt=i) for i, a in enumerate((4.0, 4.0, 4.0))] + [answer("chat", 0, 10, 3.0)]
    new = [answer("code", 0, 10, a, prompt=i) for i, a in enumerate((4.2, 4.4, 4.3))] + [answer("chat", 0, 10, 3.5)]
    got = paired(base, new)[0]
    assert set(got) == {"code"}  # one chat prompt: no standard error
    assert math.isclose(got["code"][0], 0.3) and math.isclose(got["code"][1], 0.1 / math.sqrt(3))
    with pytest.raises(ValueError, match="same prompts"):
        paired(base, new[::-1])


class FakeClient:
    """Answers every request with 2 rounds whose acceptance is its seed's (greedy: 1.0); keeps the requests."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    def complete(self, msg: dict, timeout: float) -> dict:
        self.sent.append(msg)
        return {"tokens": 4, "finish": "eos", "rounds": 2, "acceptance": float(msg.get("seed", 1))}


def test_ask_sends_greedy_once_and_each_sampled_prompt_with_every_seed():
    from bench.accept import ask

    prompts = [Prompt("chat", "a"), Prompt("code", "b"), Prompt("math", "c")]
    client = FakeClient()
    answers = ask(client, prompts, parse_args(["--temperatures", "0,0.7", "--seeds", "2"]))
    assert [m.get("seed") for m in client.sent] == [None, None, None, 0, 1, 2, 3, 4, 5]
    assert [m["messages"][0]["content"] for m in client.sent] == ["a", "b", "c"] * 3
    assert [(a.temperature, a.prompt, a.seed) for a in answers] == [
        (0, 0, None), (0, 1, None), (0, 2, None),
        (0.7, 0, 0), (0.7, 1, 1), (0.7, 2, 2), (0.7, 0, 3), (0.7, 1, 4), (0.7, 2, 5),
    ]  # fmt: skip
    assert [a.category for a in answers[3:]] == ["chat", "code", "math"] * 2


def test_a_prompts_seeds_count_once_in_the_comparison():
    """Two code prompts, two seeds each: prompt 0's differences 0.2 and 0.6 (mean 0.4), prompt 1's 0.0 and 0.4 (0.2):
    mean 0.3, standard error stdev(0.4, 0.2) / sqrt(2) = 0.1 (two samples, not four); other seeds are refused."""
    from bench.accept import paired

    def run(values):
        return [Answer("code", 0.7, 0, "eos", 10, v, i % 2, i) for i, v in enumerate(values)]

    base, new = run([3.0, 3.0, 3.0, 3.0]), run([3.2, 3.0, 3.6, 3.4])
    mean, se = paired(base, new)[0.7]["code"]
    assert math.isclose(mean, 0.3) and math.isclose(se, 0.1)
    other = [Answer("code", 0.7, 0, "eos", 10, 3.0, i % 2, i + 10) for i in range(4)]
    with pytest.raises(ValueError, match="seeds"):
        paired(base, other)


def test_a_file_without_prompt_indices_is_read_in_order(tmp_path):
    """An accept.json whose answers name no prompt or seed (one pass a temperature) is read in the prompts' order."""
    from bench.accept import load_answers

    rows = [
        {"category": c, "temperature": t, "tokens": 1, "finish": "eos", "rounds": 1, "acceptance": 2.0}
        for t in (0, 0.7)
        for c in ("chat", "code")
    ]
    f = tmp_path / "accept.json"
    f.write_text(json.dumps({"answers": rows}))
    assert [(a.temperature, a.prompt, a.seed) for a in load_answers(f)] == [
        (0, 0, None), (0, 1, None), (0.7, 0, None), (0.7, 1, None),
    ]  # fmt: skip
