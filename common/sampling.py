"""Turn one row of logits into the distribution a request samples from, and a sequence's seed (numpy, no
torch). The engines draw on the device (common.kernels.sampling); this is their specification."""

from __future__ import annotations

import secrets

import numpy as np

from common.config import SamplingConfig

TOP_P_SLACK = 1e-6  # the top-p cut tolerates this much rounding in a cumulative sum (the device's is float32)
VERIFIER_SALT, DRAFT_SALT = 0, 1  # the two engines' seeds of one request differ


def target_distribution(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """logits [V] -> probabilities [V] after temperature, top-k and top-p (vLLM's order). Both filters keep
    every token tied with the last one they keep (so each keeps the tokens at or above one logit, which is
    how the device finds them: common.kernels.sampling.target_threshold). top-p keeps the tokens, in
    descending order, up to the first where the cumulative probability reaches top_p.

    Example: logits [2, 1, 0], temperature 1, top_k 2 -> softmax over [2, 1] and 0 for the last token.
    """
    z = logits.astype(np.float64) / cfg.temperature
    if 0 < cfg.top_k < z.shape[0]:
        kth = np.partition(z, -cfg.top_k)[-cfg.top_k]
        z = np.where(z < kth, -np.inf, z)
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if cfg.top_p < 1.0:
        desc = np.sort(p)[::-1]
        cut = min(int(np.searchsorted(np.cumsum(desc), cfg.top_p - TOP_P_SLACK, side="left")), desc.shape[0] - 1)
        p = np.where(p >= desc[cut], p, 0.0)
        p /= p.sum()
    return p


def sequence_seed(seed: int | None, salt: int) -> int:
    """A sequence's seed in [0, 2^63) for one engine (salt: VERIFIER_SALT or DRAFT_SALT): a function of the
    request's seed, or random when it has none. Example: sequence_seed(7, 0) is the same in every process."""
    if seed is None:
        return secrets.randbits(63)
    state = np.random.SeedSequence([seed % 2**64, salt]).generate_state(1, np.uint64)
    return int(state[0]) >> 1
