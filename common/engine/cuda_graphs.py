"""A small CUDA graph manager for the engines (in the spirit of vLLM's EagleCudaGraphManager and
nano-vllm's capture_cudagraph).

The engines' step functions are plain methods of tensors: `step(**inputs) -> outputs` (a tensor, or a
tuple/dataclass of tensors). They run eagerly on CPU and for shapes without a graph, and the very same
functions are captured here on a GPU, one graph per bucket key:

    graphs.capture(key, step, example_inputs)   # static copies of the inputs, warm-up, capture
    graphs.run(key, step, inputs)               # replay when key was captured, else step(**inputs)

`run` copies the inputs into the graph's static buffers (host tensors through a pinned staging buffer,
so the copy is asynchronous) and returns the static outputs, valid until the next `run` of any graph of
this manager: copy what must survive. The model code never knows whether it is being captured.

Rules for steps (violations make capture fail, which falls back to eager with a warning):
  * no host synchronisation: no .item(), .cpu(), int(tensor), nonzero(), boolean-mask indexing;
  * no tensors created from Python lists or CPU tensors;
  * shapes depend only on the input shapes, never on the data.
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

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


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
    # the policy's menu (common.policy.DEFAULT_MENU) exactly: its trees' rows (nodes + 1) and depths, so that a
    # round of a menu shape verifies no padding rows and expands no level it does not keep (tests/test_policy.py
    # checks the match)
    tree_buckets: tuple[int, ...] = (2, 5, 9, 17, 33)  # the engine's largest tree (61 rows by default) is added
    depth_buckets: tuple[int, ...] = (1, 2, 3, 4)  # the drafter's expansion depths (its steps are added)
    # prefill: tokens per row (prompts and chunks up to the largest: the gateway's default chunk is 512) and
    # rows per call; longer or larger calls run eagerly. An eager forward costs about 16 ms of launches on
    # an H100 whatever its length, a replayed one about what its matmuls cost.
    prefill_buckets: tuple[int, ...] = (32, 64, 128, 256, 512)
    prefill_batch_buckets: tuple[int, ...] = (1, 2, 4, 8)
    warmup_iters: int = 2
    capture: bool = True  # False: never capture (eager on the same static shapes; for debugging)

    def __post_init__(self) -> None:
        if not self.batch_buckets or any(b < 1 for b in self.batch_buckets):
            raise ValueError(f"batch_buckets must be positive sizes, got {self.batch_buckets}")
        if len(set(self.batch_buckets)) != len(self.batch_buckets):
            raise ValueError(f"batch_buckets has duplicates: {self.batch_buckets}")
        if not self.tree_buckets or any(t < 2 for t in self.tree_buckets):
            raise ValueError(f"tree_buckets must be row counts >= 2 (root + a node), got {self.tree_buckets}")
        for name in ("prefill_buckets", "prefill_batch_buckets"):
            if any(n < 1 for n in getattr(self, name)):
                raise ValueError(f"{name} must be positive sizes, got {getattr(self, name)}")
        if not self.depth_buckets or any(d < 1 for d in self.depth_buckets):
            raise ValueError(f"depth_buckets must be depths >= 1, got {self.depth_buckets}")
        if self.warmup_iters < 1:
            raise ValueError(f"warmup_iters must be >= 1, got {self.warmup_iters}")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # static input buffers the graph reads
    staging: dict[str, torch.Tensor]  # pinned host twins of the inputs (for host-side feeds)
    outputs: Any  # static outputs the graph writes


@dataclass
class CaptureReport:
    captured: list[Hashable] = field(default_factory=list)
    failed: list[Hashable] = field(default_factory=list)
    seconds: float = 0.0


class CudaGraphManager:
    """Owns the graphs, static inputs and outputs of one engine, keyed by bucket."""

    def __init__(
        self,
        device: torch.device,
        *,
        name: str = "graphs",
        enabled: bool = True,
        warmup_iters: int = 2,
        stream: torch.cuda.Stream | None = None,
        pad: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.name = name
        self.warmup_iters = warmup_iters
        self.enabled = bool(enabled) and self.device.type == "cuda"
        self.stream = None
        self.pool = None
        if self.device.type == "cuda":
            # the engine's own stream: capture is illegal on the legacy default stream, and running all
            # of the engine's work on one stream keeps eager ops and replays ordered
            self.stream = stream or torch.cuda.Stream(self.device)
            if self.enabled:
                self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[Hashable, _Graph] = {}
        self.report = CaptureReport()
        # pad calls to their bucket: with graphs requested, also on CPU where nothing is captured, so that
        # the CPU tests run the padded shapes a GPU replays
        self.pad = pad

    @classmethod
    def for_engine(cls, device: torch.device, name: str, graphs: bool, cfg: GraphConfig) -> CudaGraphManager:
        """The manager of an engine built with `graphs` requested, under cfg."""
        return cls(device, name=name, enabled=graphs and cfg.capture, warmup_iters=cfg.warmup_iters, pad=graphs)

    def bucket(self, n: int, buckets: Sequence[int]) -> int:
        """The size a call of n runs at: its bucket when padding, else n (and n past the largest bucket)."""
        return (pick_bucket(n, buckets) or n) if self.pad else n

    def is_captured(self, key: Hashable) -> bool:
        return key in self._graphs

    # ---- capture ----
    def capture(self, key: Hashable, step: Callable[..., Any], inputs: dict[str, torch.Tensor]) -> bool:
        """Capture step(**static copies of inputs) under key. Capture larger buckets first: later graphs
        reuse the blocks the largest leaves in the shared pool. False (and a warning) when capture is
        off or fails; run() then calls the step eagerly."""
        if not self.enabled or key in self._graphs:
            return key in self._graphs
        t0 = time.perf_counter()
        static = {k: v.to(self.device).clone() for k, v in inputs.items()}
        try:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for _ in range(self.warmup_iters):
                    step(**static)
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                outputs = step(**static)
            self.stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager
            self.report.failed.append(key)
            log.warning("%s: CUDA graph capture failed for %r, running it eagerly: %s", self.name, key, exc)
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.device)
            return False
        staging = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in static.items()}
        self._graphs[key] = _Graph(graph=graph, inputs=static, staging=staging, outputs=outputs)
        self.report.captured.append(key)
        self.report.seconds += time.perf_counter() - t0
        return True

    def log_report(self) -> None:
        log.info(
            "%s: captured %d CUDA graphs (%d failed) in %.1f s",
            self.name,
            len(self.report.captured),
            len(self.report.failed),
            self.report.seconds,
        )

    # ---- running ----
    def run(self, key: Hashable, step: Callable[..., Any], inputs: dict[str, torch.Tensor]) -> Any:
        """Replay key's graph on inputs (copied into its static buffers), or step(**inputs) eagerly on
        the device when key has no graph. Returns the outputs (a graph's are overwritten by its next
        run: copy what must survive)."""
        return self.replay(key, step, self.feed(key, inputs))

    def inputs(self, key: Hashable) -> dict[str, torch.Tensor] | None:
        """key's static input buffers, for device work that writes a replay's inputs in place (feed then skips
        them), or None when key has no graph."""
        g = self._graphs.get(key)
        return None if g is None else g.inputs

    def feed(self, key: Hashable, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inputs on the device: key's static buffers, filled (host tensors through pinned staging), or
        plain device copies when key has no graph. Device ops may update them between replays (a step
        chained on its own outputs, as multi-step decoding does)."""
        g = self._graphs.get(key)
        if g is None:
            return {k: v.to(self.device, non_blocking=True) for k, v in inputs.items()}
        for name, value in inputs.items():
            dst = g.inputs[name]
            if value is dst:  # written in place (a chained round's block): nothing to copy
                continue
            if value.device.type == "cpu":
                g.staging[name].copy_(value)
                dst.copy_(g.staging[name], non_blocking=True)
            else:
                dst.copy_(value)
        return g.inputs

    def replay(self, key: Hashable, step: Callable[..., Any], fed: dict[str, torch.Tensor]) -> Any:
        """One run of key on inputs returned by feed(key, ...)."""
        g = self._graphs.get(key)
        if g is None:
            return step(**fed)
        g.graph.replay()
        return g.outputs

    def seconds(self, key: Hashable, step: Callable[..., Any], inputs: dict[str, torch.Tensor], reps: int = 3) -> float:
        """Median seconds of one run of key on inputs (a replay, or the eager step), after one warm-up:
        the engines' step costs that the gateway's speculation policy starts from."""
        fed = self.feed(key, inputs)
        times = []
        for i in range(reps + 1):
            if self.stream is not None:
                self.stream.synchronize()
            t0 = time.perf_counter()
            with self.on_stream():
                self.replay(key, step, fed)
            if self.stream is not None:
                self.stream.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    def launched(self) -> Iterator[torch.cuda.Event]:
        """An engine call's wait for its device work (common.engine.base.Steps), as `yield from`: yields an event
        recorded on the engine's stream after the work queued so far, then the call reads its results; nothing
        on CPU."""
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
            yield event

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A copy of t on the host, queued on the engine's stream behind the work queued so far (pinned memory,
        no wait), with the event after which it may be read; on CPU a copy at once and None. Called inside
        on_stream (the copy goes on the current stream, the event on the engine's)."""
        if self.stream is None:
            return t.clone(), None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(self.stream)
        return host, ready

    def to_device(self, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """host on the device, the host waiting for nothing: on a GPU through pinned memory of torch's caching host
        allocator (not reused before the copy has run, unlike a graph's staging buffer, which the next feed of its
        key rewrites), queued on the current stream (a pageable copy would hold the host until the stream's queued
        work is done); into out when given (a graph's input buffer). On CPU host itself, or out filled."""
        if self.device.type != "cuda":
            return host if out is None else out.copy_(host)
        pinned = host.pin_memory()
        return pinned.to(self.device, non_blocking=True) if out is None else out.copy_(pinned, non_blocking=True)

    def event(self) -> torch.cuda.Event | None:
        """A timing event recorded on the engine's stream after the work queued so far; None on CPU."""
        if self.stream is None:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    @contextlib.contextmanager
    def after_caller(self) -> Iterator[torch.cuda.Stream | None]:
        """Work queued on the engine's stream after the work queued on the caller's stream, without the caller's
        stream waiting for it (unlike on_stream): one engine's work chained behind another's on the device,
        read once an event recorded after it has completed. Yields the engine's stream (None on CPU)."""
        if self.stream is None:
            yield None
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield self.stream

    @contextlib.contextmanager
    def beside(self) -> Iterator[None]:
        """Work on the engine's stream that neither waits for the caller's stream nor makes it wait (unlike
        on_stream): it may only touch what nothing queued elsewhere touches until the host has read an event
        recorded behind it (to_host's). A no-op on CPU."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

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
