"""The gateway's one place for converting public messages to and from its own types."""

from __future__ import annotations

import math

from common import validate
from common.config import SamplingConfig
from common.errors import InvalidRequest
from common.policy import Shape
from common.tokenizer import Tokenizer
from services.gateway.sequence import Delta, Finish, GenRequest, SpecStats
from services.gateway.speculation import check_tree
from specdec.v1 import generation_pb2 as gpb

DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256

FINISH = {
    Finish.STOP: gpb.FINISH_REASON_STOP,
    Finish.LENGTH: gpb.FINISH_REASON_LENGTH,
    Finish.EOS: gpb.FINISH_REASON_EOS,
    Finish.ABORT: gpb.FINISH_REASON_ABORT,
}


def check_input_size(req, tok: Tokenizer, max_context: int) -> None:
    """Refuse, before tokenizing, input that cannot fit the context: a token stands for at most
    tok.max_token_chars characters, so a text longer than max_context times that has more tokens than the context
    holds (SmolLM2, context 2048: 81 x 2048 = 165,888 characters). Chat messages count their roles and contents
    (the template only adds to them)."""
    limit = max_context * tok.max_token_chars
    chars = len(req.prompt) + sum(len(m.role) + len(m.content) for m in req.messages)
    if chars > limit:
        raise InvalidRequest(
            f"input has {chars} characters; at most {limit} can fit the context of {max_context} tokens "
            f"({tok.max_token_chars} characters per token at most)"
        )
    n = len(getattr(req, "prompt_token_ids", []))
    if n >= max_context:
        raise InvalidRequest(f"prompt has {n} tokens; the context holds {max_context} (prompt plus generated tokens)")


def prompt_ids(req, tok: Tokenizer) -> list[int]:
    """The request's input as token ids: chat messages, a raw prompt, or token ids (exactly one)."""
    given = [
        name
        for name, present in (
            ("messages", len(req.messages) > 0),
            ("prompt", bool(req.prompt)),
            ("prompt_token_ids", len(getattr(req, "prompt_token_ids", [])) > 0),
        )
        if present
    ]
    if not given:
        raise InvalidRequest("no input: set one of messages, prompt or prompt_token_ids")
    if len(given) > 1:
        raise InvalidRequest(f"set only one input, got {' and '.join(given)}")
    if given[0] == "messages":
        if all(not m.content.strip() for m in req.messages):
            raise InvalidRequest("every message is empty")
        ids = tok.encode_chat([(m.role, m.content) for m in req.messages])
    elif given[0] == "prompt":
        if not req.prompt.strip():
            raise InvalidRequest("prompt is empty")
        ids = tok.encode_prompt(req.prompt)
    else:
        ids = list(req.prompt_token_ids)
        validate.token_ids(ids, tok.vocab_size, "prompt")
    if not ids:
        raise InvalidRequest("prompt is empty after tokenization")
    return ids


def pinned_tree(req: gpb.GenerateRequest, dinfo) -> Shape | None:
    """The request's pinned tree (GenerateRequest.tree), checked against the draft's; None when unset."""
    if not req.HasField("tree"):
        return None
    try:
        shape = Shape(req.tree.depth, req.tree.nodes)
    except ValueError as e:
        raise InvalidRequest(f"tree: {e}") from None
    if shape.plain:
        raise InvalidRequest("tree: depth 0 is no tree; for plain decoding set speculative to false")
    check_tree(shape, dinfo)
    return shape


def gen_request(req: gpb.GenerateRequest, tok: Tokenizer, max_context: int, dinfo=None) -> GenRequest:
    """The public request as the gateway's own; dinfo: the draft's DraftInfoResponse (None: no draft)."""
    check_input_size(req, tok, max_context)
    ids = prompt_ids(req, tok)
    if len(ids) >= max_context:
        raise InvalidRequest(
            f"prompt has {len(ids)} tokens; the context holds {max_context} (prompt plus generated tokens)"
        )
    room = max_context - len(ids)
    max_tokens = req.max_tokens if req.HasField("max_tokens") else min(DEFAULT_MAX_TOKENS, room)
    if max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be >= 1, got {max_tokens}")
    if max_tokens > room:
        raise InvalidRequest(
            f"max_tokens {max_tokens} does not fit: the prompt has {len(ids)} tokens and "
            f"the context holds {max_context}, so at most {room} can be generated"
        )
    temperature = req.temperature if req.HasField("temperature") else 0.0
    if math.isnan(temperature) or temperature < 0:
        raise InvalidRequest(f"temperature must be >= 0, got {temperature}")
    top_p = req.top_p if req.HasField("top_p") else 1.0
    if math.isnan(top_p) or not 0 < top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    top_k = req.top_k if req.HasField("top_k") else 0
    if top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0, got {top_k}")
    if len(req.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_LENGTH for s in req.stop):
        raise InvalidRequest(
            f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_LENGTH} characters"
        )
    validate.token_ids(list(req.stop_token_ids), tok.vocab_size, "stop_token_ids")
    try:
        sampling = SamplingConfig(
            temperature=temperature, top_p=top_p, top_k=top_k, seed=req.seed if req.HasField("seed") else None
        )
    except ValueError as e:
        raise InvalidRequest(str(e)) from e
    return GenRequest(
        prompt_ids=ids,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=tuple(req.stop),
        stop_token_ids=frozenset(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        speculative=req.speculative if req.HasField("speculative") else True,
        tree=pinned_tree(req, dinfo),
    )


def usage(prompt_tokens: int, completion_tokens: int) -> gpb.Usage:
    return gpb.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)


def speculation(stats: SpecStats) -> gpb.SpeculationStats:
    return gpb.SpeculationStats(
        rounds=stats.rounds,
        drafted_tokens=stats.drafted,
        accepted_tokens=stats.accepted,
        mean_acceptance_length=stats.mean_acceptance_length(),
    )


def stream_message(delta: Delta) -> gpb.GenerateResponse:
    return gpb.GenerateResponse(token_ids=delta.token_ids, text=delta.text)
