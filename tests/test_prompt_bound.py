"""The gateway's bound on input size (services/gateway/convert.py, check_input_size): input whose characters cannot
fit the context is refused before the tokenizer sees it, so the work a hostile prompt costs is bounded."""

from __future__ import annotations

import time

import pytest

from common.errors import InvalidRequest
from common.model_path import default_model_path
from common.tokenizer import Tokenizer
from services.gateway.convert import gen_request
from specdec.v1 import generation_pb2 as gpb
from tests.helpers import chat

MAX_CONTEXT = 512


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(default_model_path())


class Untokenizing:
    """The tokenizer's bound, and a test failure should anything be tokenized."""

    def __init__(self, tok: Tokenizer) -> None:
        self.max_token_chars, self.vocab_size = tok.max_token_chars, tok.vocab_size

    def __getattr__(self, name: str):
        raise AssertionError(f"tokenizer.{name} called for input beyond the bound")


def test_no_token_stands_for_more_characters_than_the_bound(tok) -> None:
    """The bound's premise on the real vocabulary: every token decodes to at most max_token_chars characters."""
    assert tok.max_token_chars == 81  # SmolLM2: "\n" and 80 spaces
    longest = max(len(tok._tok.decode([i], skip_special_tokens=False)) for i in range(tok.vocab_size))
    assert longest <= tok.max_token_chars


def test_input_beyond_the_bound_is_refused_before_tokenizing(tok) -> None:
    limit = MAX_CONTEXT * tok.max_token_chars
    spy = Untokenizing(tok)
    for req in (
        gpb.GenerateRequest(prompt="x" * (limit + 1)),
        chat("y" * (limit - 3)),  # "user" makes it limit + 1
        gpb.GenerateRequest(messages=[gpb.ChatMessage(role="user", content="z" * (limit // 2))] * 2),
    ):
        with pytest.raises(InvalidRequest, match=f"at most {limit} can fit the context of {MAX_CONTEXT} tokens"):
            gen_request(req, spy, MAX_CONTEXT)
    with pytest.raises(InvalidRequest, match=f"prompt has {MAX_CONTEXT} tokens; the context holds {MAX_CONTEXT}"):
        gen_request(gpb.GenerateRequest(prompt_token_ids=[10**9] * MAX_CONTEXT), spy, MAX_CONTEXT)


def test_input_within_the_bound_is_tokenized_and_judged_by_its_tokens(tok) -> None:
    limit = MAX_CONTEXT * tok.max_token_chars
    with pytest.raises(InvalidRequest, match="tokens; the context holds 512"):
        gen_request(gpb.GenerateRequest(prompt="hello world " * (limit // 12)), tok, MAX_CONTEXT)
    fits = "#" * 24_000  # long tokens: 24,000 characters in a few hundred tokens, which fit
    n = len(tok.encode_prompt(fits))
    assert n < MAX_CONTEXT - 8
    assert len(gen_request(gpb.GenerateRequest(prompt=fits, max_tokens=8), tok, MAX_CONTEXT).prompt_ids) == n


def test_a_3_6_mb_prompt_costs_no_tokenizing(tok) -> None:
    req = gpb.GenerateRequest(prompt="hello world " * 300_000)  # 3.6 MB
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequest):
        gen_request(req, tok, 2048)
    assert time.perf_counter() - t0 < 0.05
