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

# Rounds one Verify may run (VerifyRequest.rounds): bounds one call's time, and the rounds a sequence that
# hit a stop string the verifier does not know of can waste (services/verifier/rounds.py).
MAX_ROUNDS_PER_CALL = 16
# A call that brings sequences the call in flight does not have cuts it short (VerifyRequest.cut) when they
# are at least 1/CUT_SHARE of the sequences it continues: every cut costs each of those a call's work more
# (session 14, H100: cutting for any joiner took c=16 from 224 to 216 group rounds but made c=64's rounds 6%
# longer, where a joiner comes every half round)
CUT_SHARE = 16


def cut_pays(new: int, going_on: int) -> bool:
    """Whether a call with `new` sequences that the call in flight does not have, and `going_on` that it
    continues, should cut that one short. Examples: 1 new, 15 going on -> True; 1 and 17 -> False; 4 and
    60 -> True; 0 new -> False."""
    return new > 0 and new * CUT_SHARE >= going_on


def cut_at_stop(tokens: list[int], room: int, stop_ids: frozenset[int]) -> tuple[int, bool]:
    """How many of a round's tokens are committed: the first `room` of them, up to and including the first
    stop id (end-of-sequence included when it counts). Returns (committed, whether a stop id ended them).
    The gateway's commit (services/gateway/sequence.py) and the verifier's rounds of one call
    (services/verifier/rounds.py) both cut here, so a call of several rounds stops where the gateway would.
    Example: room 3, stop ids {2}: [5, 2, 7] -> (2, True); [5, 6, 7, 8] -> (3, False); [5] -> (1, False)."""
    for i, t in enumerate(tokens[:room]):
        if t in stop_ids:
            return i + 1, True
    return min(len(tokens), room), False


def start_shift(prompt_ids: list[int], first_token: int) -> tuple[list[int], list[int]]:
    """(token_ids [prompt_len], context_prefix [1]) of a sequence's first propose."""
    return list(prompt_ids[1:]) + [first_token], list(prompt_ids[:1])
