"""Exact and near-duplicate detection for prompts: normalized-text keys and MinHash with LSH banding (numpy).

Written here rather than taken from `datasketch` (the usual MinHash library): datasketch imports scipy, a 35 MB
dependency, only to choose band sizes, and the prompts stage and its tests should need nothing beyond numpy.

A text's shingles are the overlapping 5-character windows of its normalized form; MinHash estimates the
Jaccard similarity of two shingle sets as the share of equal signature entries. LSH splits the 64-entry
signature into 16 bands of 4: two texts become candidates when any band matches (probability
1 - (1 - s^4)^16: 0.9998 at Jaccard s = 0.8, 0.64 at 0.5, 0.015 at 0.2), and a candidate is a duplicate when
its estimated similarity reaches the threshold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from training.filters import normalize


@dataclass(frozen=True)
class DedupConfig:
    threshold: float = 0.8  # estimated Jaccard similarity at which a prompt counts as a near-duplicate
    shingle: int = 5  # characters per shingle
    num_perm: int = 64  # signature length
    bands: int = 16  # LSH bands (num_perm / bands rows each)
    seed: int = 1

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.shingle < 1:
            raise ValueError(f"shingle must be >= 1, got {self.shingle}")
        if self.bands < 1 or self.num_perm % self.bands:
            raise ValueError(f"bands ({self.bands}) must divide num_perm ({self.num_perm})")


def shingle_hashes(text: str, k: int) -> np.ndarray:
    """[S] uint64: distinct polynomial hashes of the k-byte windows of the UTF-8 text (the whole text when shorter).

    Deterministic across processes (unlike Python's salted hash()), vectorized over windows.
    """
    b = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint64)
    if b.size == 0:
        return np.zeros(1, dtype=np.uint64)
    k = min(k, int(b.size))
    n = b.size - k + 1
    h = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):  # arithmetic modulo 2^64 is the point
        for j in range(k):  # h = sum_j b[i + j] * 1_000_003^(k-1-j)
            h = h * np.uint64(1_000_003) + b[j : j + n]
    return np.unique(h)


class MinHasher:
    """Signatures under num_perm universal hash functions h_i(x) = ((a_i x + b_i) mod 2^64) >> 32."""

    def __init__(self, cfg: DedupConfig) -> None:
        rng = np.random.default_rng(cfg.seed)
        self.cfg = cfg
        self.a = rng.integers(1, 1 << 63, size=cfg.num_perm, dtype=np.uint64) | np.uint64(1)  # [P] odd multipliers
        self.b = rng.integers(0, 1 << 63, size=cfg.num_perm, dtype=np.uint64)  # [P]

    def signature(self, text: str) -> np.ndarray:
        """[P] uint64 minimum hash per function over the text's shingles."""
        x = shingle_hashes(normalize(text), self.cfg.shingle)[:, None]  # [S, 1]
        with np.errstate(over="ignore"):
            return ((self.a[None, :] * x + self.b[None, :]) >> np.uint64(32)).min(axis=0)


@dataclass(frozen=True)
class Duplicate:
    kind: str  # "exact" (same normalized text) or "near" (estimated Jaccard >= threshold)
    of: str  # the label the earlier text was added with


@dataclass
class Deduplicator:
    """Keeps the first of every group of exact (normalized) or near duplicates, in the order texts are added."""

    cfg: DedupConfig = field(default_factory=DedupConfig)
    _exact: dict[str, str] = field(default_factory=dict)  # normalized text -> label
    _buckets: dict[bytes, list[int]] = field(default_factory=dict)  # band key -> indices into _sigs
    _sigs: list[np.ndarray] = field(default_factory=list)  # [P] per kept text
    _labels: list[str] = field(default_factory=list)  # per kept text

    def __post_init__(self) -> None:
        self._hasher = MinHasher(self.cfg)

    def add(self, text: str, label: str = "") -> Duplicate | None:
        """Records `text` under `label` and returns None when it is new; returns the Duplicate (and records
        nothing) when it duplicates a text added before."""
        key = normalize(text)
        if key in self._exact:
            return Duplicate("exact", self._exact[key])
        sig = self._hasher.signature(text)
        rows = self.cfg.num_perm // self.cfg.bands
        keys = [bytes([band]) + sig[band * rows : (band + 1) * rows].tobytes() for band in range(self.cfg.bands)]
        seen: set[int] = set()
        for k in keys:
            for i in self._buckets.get(k, ()):
                if i not in seen:
                    seen.add(i)
                    if float(np.mean(self._sigs[i] == sig)) >= self.cfg.threshold:
                        return Duplicate("near", self._labels[i])
        self._exact[key] = label
        self._sigs.append(sig)
        self._labels.append(label)
        for k in keys:
            self._buckets.setdefault(k, []).append(len(self._sigs) - 1)
        return None
