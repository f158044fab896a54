"""A small CUDA graph manager for the engines (in the spirit of vLLM's EagleCudaGraphManager and
nano-vllm's capture_cudagraph).

An engine registers one *body* per bucket key (e.g. (batch_bucket, tree_rows)). A body is a function
of no arguments that reads only static input tensors (allocated once, at the bucket's full shape) and
returns its outputs (a tensor, or a tuple/dict of tensors). At start-up `capture_all` runs each body a
few times eagerly on the manager's stream (warm-up: cuBLAS handles, autotuning, lazy buffers) and then
captures it into a `torch.cuda.CUDAGraph` that shares one memory pool with the manager's other graphs.
`run(key, feeds)` copies the feeds into the static inputs and replays the graph, returning the static
outputs (valid until the next `run` of any graph of this manager: copy what you keep).

On CPU, or when capture is disabled or fails, `run` calls the body eagerly on the same static buffers,
so the engines have exactly one code path and the CPU tests exercise it. The model code never knows
whether it is being captured.

Rules for bodies (violations make capture fail, which falls back to eager with a warning):
  * no host synchronisation: no .item(), .cpu(), int(tensor), nonzero(), boolean-mask indexing;
  * no tensors created from Python lists or CPU tensors on the GPU (pageable H2D copies);
  * shapes depend only on the bucket key, never on the data.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16)


def pick_bucket(n: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket >= n, or None when n is larger than every bucket.  (3, (1, 2, 4, 8)) -> 4"""
    for b in sorted(buckets):
        if b >= n:
            return b
    return None


def batch_buckets_for(max_batch: int, buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> tuple[int, ...]:
    """The buckets up to max_batch, plus max_batch itself so every allowed batch has a bucket.
    (12, (1, 2, 4, 8, 16)) -> (1, 2, 4, 8, 12)"""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return tuple(sorted({b for b in buckets if b <= max_batch} | {max_batch}))


@dataclass(frozen=True)
class GraphConfig:
    """Which shapes get graphs. Batch buckets are clipped to the engine's max_sequences (which is added);
    tree buckets count verifier rows (root + nodes) and are clipped to max_tree_nodes + 1 (added)."""

    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    tree_buckets: tuple[int, ...] = (16, 32, 64)
    warmup_iters: int = 2
    capture: bool = True  # False: never capture (eager on the same static shapes; for debugging)

    def __post_init__(self) -> None:
        if not self.batch_buckets or any(b < 1 for b in self.batch_buckets):
            raise ValueError(f"batch_buckets must be positive sizes, got {self.batch_buckets}")
        if len(set(self.batch_buckets)) != len(self.batch_buckets):
            raise ValueError(f"batch_buckets has duplicates: {self.batch_buckets}")
        if not self.tree_buckets or any(t < 2 for t in self.tree_buckets):
            raise ValueError(f"tree_buckets must be row counts >= 2 (root + a node), got {self.tree_buckets}")
        if self.warmup_iters < 1:
            raise ValueError(f"warmup_iters must be >= 1, got {self.warmup_iters}")


@dataclass
class _Entry:
    body: Callable[[], Any]
    inputs: dict[str, torch.Tensor]   # static input buffers, read by body
    graph: torch.cuda.CUDAGraph | None = None
    outputs: Any = None               # static outputs of the captured graph
    size: int = 0                     # ordering hint: larger buckets are captured first


@dataclass
class CaptureReport:
    captured: list[Hashable] = field(default_factory=list)
    failed: list[Hashable] = field(default_factory=list)
    seconds: float = 0.0


class CudaGraphManager:
    """Owns the graphs, static inputs and outputs of one engine, keyed by bucket."""

    def __init__(self, device: torch.device, *, name: str = "graphs", enabled: bool = True,
                 warmup_iters: int = 2, stream: torch.cuda.Stream | None = None) -> None:
        self.device = torch.device(device)
        self.name = name
        self.warmup_iters = warmup_iters
        self.use_graphs = bool(enabled) and self.device.type == "cuda"
        self.stream = None
        self.pool = None
        if self.device.type == "cuda":
            # the engine's own stream: capture is illegal on the legacy default stream, and running all
            # of the engine's work on one stream keeps eager ops and replays ordered
            self.stream = stream or torch.cuda.Stream(self.device)
            if self.use_graphs:
                self.pool = torch.cuda.graph_pool_handle()
        self._entries: dict[Hashable, _Entry] = {}
        self.report = CaptureReport()

    # ---- registration ----
    def register(self, key: Hashable, body: Callable[[], Any], inputs: dict[str, torch.Tensor] | None = None,
                 size: int = 0) -> None:
        if key in self._entries:
            raise ValueError(f"{self.name}: graph key {key!r} registered twice")
        self._entries[key] = _Entry(body=body, inputs=dict(inputs or {}), size=size)

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    def inputs(self, key: Hashable) -> dict[str, torch.Tensor]:
        return self._entries[key].inputs

    def is_captured(self, key: Hashable) -> bool:
        return self._entries[key].graph is not None

    # ---- capture ----
    def capture_all(self) -> CaptureReport:
        """Warm up and capture every registered body, largest first (their intermediates then fit in
        the blocks the largest graph leaves in the shared pool). A no-op on CPU."""
        if not self.use_graphs:
            return self.report
        t0 = time.perf_counter()
        order = sorted(self._entries.items(), key=lambda kv: -kv[1].size)
        for key, entry in order:
            if entry.graph is not None:
                continue
            try:
                self._capture(entry)
                self.report.captured.append(key)
            except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager
                entry.graph, entry.outputs = None, None
                self.report.failed.append(key)
                log.warning("%s: CUDA graph capture failed for %r, running it eagerly: %s", self.name, key, exc)
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(self.device)
        self.report.seconds += time.perf_counter() - t0
        log.info("%s: captured %d CUDA graphs (%d failed) in %.1f s", self.name, len(self.report.captured),
                 len(self.report.failed), self.report.seconds)
        return self.report

    def _capture(self, entry: _Entry) -> None:
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(self.warmup_iters):
                entry.body()
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            outputs = entry.body()
        self.stream.synchronize()
        entry.graph, entry.outputs = graph, outputs

    # ---- running ----
    def run(self, key: Hashable, feeds: dict[str, torch.Tensor] | None = None) -> Any:
        """Copy feeds into the static inputs (a feed may cover a leading slice of the batch dimension),
        then replay the graph (or call the body eagerly). Returns the static outputs: they are overwritten
        by the next run of any graph of this manager, so copy what must survive."""
        entry = self._entries[key]
        for name, value in (feeds or {}).items():
            dst = entry.inputs[name]
            if value.shape != dst.shape:
                dst = dst[: value.shape[0]]
            dst.copy_(value, non_blocking=True)
        if entry.graph is None:
            return entry.body()
        entry.graph.replay()
        return entry.outputs

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """Run a public engine call on the engine's stream, ordered after and before the caller's stream
        (so tensors handed in or out need no further synchronisation). A no-op on CPU."""
        if self.stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            caller.wait_stream(self.stream)


def staging(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host buffer for one H2D copy per call: pinned when the target is a GPU (non_blocking copies from
    it are asynchronous, so it must not be rewritten before that copy ran: the engines synchronise on
    their results every call)."""
    pin = torch.device(device).type == "cuda"
    return torch.zeros(shape, dtype=dtype, pin_memory=pin)
