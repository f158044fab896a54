"""Round rules written once for the gateway and the services (plain Python: the gateway uses them without
torch): the EAGLE one-token shift, and which of a round's tokens are committed.

The EAGLE one-token shift:

The draft pairs each base hidden state with the token that follows it. After a prefill of the prompt
[p0, p1, ..., pn] that chose the first token t, the hidden states are those of p0..pn and the tokens they
produced are p1..pn, t; p0 travels as context. After a verification the accepted tokens already pair up
with the hidden states the verifier returns (the root's and each accepted node's).
Example: prompt [5, 6, 7], first token 8 -> token_ids [6, 7, 8], context_prefix [5].
"""

from __future__ import annotations


def cut_at_stop(tokens: list[int], room: int, stop_ids: frozenset[int]) -> tuple[int, bool]:
    """How many of a round's tokens are committed: the first `room` of them, up to and including the first
    stop id (end-of-sequence included when it counts). Returns (committed, whether a stop id ended them).
    The engine core (common/sequence.py) and the gateway's commit (services/gateway/sequence.py) both cut
    here, so the gateway stops where the verifier did.
    Example: room 3, stop ids {2}: [5, 2, 7] -> (2, True); [5, 6, 7, 8] -> (3, False); [5] -> (1, False)."""
    for i, t in enumerate(tokens[:room]):
        if t in stop_ids:
            return i + 1, True
    return min(len(tokens), room), False


def start_shift(prompt_ids: list[int], first_token: int) -> tuple[list[int], list[int]]:
    """(token_ids [prompt_len], context_prefix [1]) of a sequence's first propose."""
    return list(prompt_ids[1:]) + [first_token], list(prompt_ids[:1])
