"""Turn one row of logits into the distribution a request samples from (numpy, no torch)."""

from __future__ import annotations

import numpy as np

from common.config import SamplingConfig


def target_distribution(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """logits [V] -> probabilities [V] after temperature, top-k and top-p (vLLM's order).

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
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        cut = int(np.searchsorted(cum, cfg.top_p - 1e-9, side="left")) + 1  # tolerate rounding in the sum
        mask = np.zeros_like(p, dtype=bool)
        mask[order[:cut]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p
