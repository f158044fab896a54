"""Sequences sized from device memory (common.engine.capacity), worked out by hand."""

import pytest

from common.engine.capacity import KVShape, sequences_for_memory

SMOLLM = KVShape(layers=30, positions=2113, kv_heads=3, head_dim=64, itemsize=2)  # bf16, 2,048 context


def test_bytes_per_sequence() -> None:
    assert SMOLLM.bytes_per_sequence == 30 * 2113 * 2 * 3 * 64 * 2 == 48_683_520


def test_sequences_from_free_memory() -> None:
    gib = 2**30
    # 80 GiB free, half of it, 4 GiB reserve: 36 GiB / 48.7 MB = 793 -> capped at 64
    assert sequences_for_memory(SMOLLM, 80 * gib, 0.5, 4 * gib) == 64
    # 2 GiB free, all of it, 1 GiB reserve: 1 GiB / 48.7 MB = 22
    assert sequences_for_memory(SMOLLM, 2 * gib, 1.0, gib) == 22
    assert sequences_for_memory(SMOLLM, 2 * gib, 1.0, gib, cap=16) == 16
    with pytest.raises(ValueError, match="no room"):
        sequences_for_memory(SMOLLM, gib, 0.5, gib)
    with pytest.raises(ValueError):
        sequences_for_memory(SMOLLM, gib, 0.0, 0)
    with pytest.raises(ValueError):
        KVShape(layers=0, positions=1, kv_heads=1, head_dim=1, itemsize=1)
