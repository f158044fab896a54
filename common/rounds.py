"""The EAGLE one-token shift, written once (plain Python: the gateway uses it without torch).

The draft pairs each base hidden state with the token that follows it. After a prefill of the prompt
[p0, p1, ..., pn] that chose the first token t, the hidden states are those of p0..pn and the tokens they
produced are p1..pn, t; p0 travels as context. After a verification the accepted tokens already pair up
with the hidden states the verifier returns (the root's and each accepted node's).
Example: prompt [5, 6, 7], first token 8 -> token_ids [6, 7, 8], context_prefix [5].
"""

from __future__ import annotations

# Rounds one Verify may run (VerifyRequest.rounds): bounds one call's time, and the rounds a sequence that
# hit a stop string the verifier does not know of can waste (services/verifier/rounds.py).
MAX_ROUNDS_PER_CALL = 16


def start_shift(prompt_ids: list[int], first_token: int) -> tuple[list[int], list[int]]:
    """(token_ids [prompt_len], context_prefix [1]) of a sequence's first propose."""
    return list(prompt_ids[1:]) + [first_token], list(prompt_ids[:1])
