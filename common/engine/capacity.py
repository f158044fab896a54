"""How many sequences a service holds, from the device's memory (as vLLM's gpu_memory_utilization).
Plain arithmetic; the services pass in what torch.cuda.mem_get_info reports."""

from __future__ import annotations

from dataclasses import dataclass

CPU_SEQUENCES = 8  # the CPU default stays small: every sequence in a round costs a full forward
MAX_SEQUENCES = 64  # the largest batch bucket captured by default (common.engine.cuda_graphs)


@dataclass(frozen=True)
class KVShape:
    """One sequence's KV footprint."""

    layers: int
    positions: int  # slot capacity: context plus tree headroom
    kv_heads: int
    head_dim: int
    itemsize: int  # bytes per element

    def __post_init__(self) -> None:
        for name in ("layers", "positions", "kv_heads", "head_dim", "itemsize"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_sequence(self) -> int:
        return self.layers * self.positions * 2 * self.kv_heads * self.head_dim * self.itemsize


def sequences_for_memory(
    kv: KVShape, free_bytes: int, fraction: float, reserve_bytes: int, cap: int = MAX_SEQUENCES
) -> int:
    """Sequences whose KV fits in fraction * free_bytes - reserve_bytes (reserve: activations, graph pools,
    workspace), at least 1 and at most cap.
    Example: 30 layers x 2,113 positions x 2 x 3 heads x 64 x 2 bytes = 48.7 MB a sequence; 80 GB free,
    fraction 0.5, 4 GB reserve -> 36 GB / 48.7 MB = 739 -> capped at 64."""
    if not 0 < fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {fraction}")
    budget = int(free_bytes * fraction) - reserve_bytes
    n = budget // kv.bytes_per_sequence
    if n < 1:
        raise ValueError(
            f"{free_bytes / 2**30:.1f} GiB free leave no room for one sequence's KV "
            f"({kv.bytes_per_sequence / 2**20:.0f} MiB) at fraction {fraction}"
        )
    return int(min(n, cap))


def auto_sequences(requested: int, device: str, kv: KVShape, fraction: float, reserve_bytes: int = 2 << 30) -> int:
    """--max-sequences: `requested` when given (> 0); else CPU_SEQUENCES on CPU, and on a GPU what
    sequences_for_memory allows in the memory free now (call after the weights are loaded)."""
    if requested > 0:
        return requested
    if not device.startswith("cuda"):
        return CPU_SEQUENCES
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return sequences_for_memory(kv, free, fraction, reserve_bytes)
