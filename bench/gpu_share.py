"""Do two processes' CUDA graphs run at the same time on one GPU, or take turns? The question behind the
split's overlap (issue 8): the draft and the verifier are separate processes, each with its own CUDA
context, and without MPS a GPU time-slices between contexts. Two streams of one process share a context
and can run kernels side by side.

    python -m bench.gpu_share [--kernels 300] [--rows 64] [--replays 200] [--out DIR]

Each step is a CUDA graph of `--kernels` small GEMMs ([rows, 576] x [576, 576] in bfloat16, the shape of
a decode or tree step's projections, too small to fill the GPU). Figures, ms per replay (each replay
waited for, as a round waits for its step):
- alone: one process replays its graph;
- two processes: two processes replay theirs at the same time (each one's ms per replay);
- one process, two streams: one process replays two graphs on two streams, then waits for both.
If two processes take as long as one replay after the other (2x alone) while two streams take about one,
the contexts take turns and the draft cannot work while the verifier verifies unless they share a process.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

WIDTH = 576  # SmolLM2-135M's hidden size


def _graph(kernels: int, rows: int, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """A captured chain of `kernels` GEMMs [rows, WIDTH] x [WIDTH, WIDTH], between two buffers."""
    bufs = [torch.randn(rows, WIDTH, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    w = torch.randn(WIDTH, WIDTH, device="cuda", dtype=torch.bfloat16) / WIDTH**0.5
    with torch.cuda.stream(stream):
        for i in range(4):  # warm-up: cuBLAS picks its kernels outside the capture
            torch.mm(bufs[i % 2], w, out=bufs[1 - i % 2])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for i in range(kernels):
            torch.mm(bufs[i % 2], w, out=bufs[1 - i % 2])
    g.buffers = (bufs, w)  # kept alive with the graph
    return g


def _replays(graphs: list[tuple[torch.cuda.CUDAGraph, torch.cuda.Stream]], n: int) -> float:
    """ms per replay of all `graphs` (each on its stream), waiting for all after each."""
    t0 = time.perf_counter()
    for _ in range(n):
        for g, s in graphs:
            with torch.cuda.stream(s):
                g.replay()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


def _worker(kernels: int, rows: int, n: int, ready, start, out) -> None:
    s = torch.cuda.Stream()
    g = _graph(kernels, rows, s)
    _replays([(g, s)], 10)
    ready.set()
    start.wait()
    out.put(_replays([(g, s)], n))


def _two_processes(kernels: int, rows: int, n: int) -> list[float]:
    ctx = mp.get_context("spawn")
    ready, start, out = [ctx.Event(), ctx.Event()], ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(kernels, rows, n, r, start, out)) for r in ready]
    for p in procs:
        p.start()
    for r in ready:
        r.wait(timeout=120)
    start.set()
    times = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", type=int, default=300, help="GEMMs per graph (a decode step has ~280 kernels)")
    p.add_argument("--rows", type=int, default=64, help="rows of each GEMM (a 61-row tree, or 64 sequences)")
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--out", type=Path, default=None, help="write gpu_share.json here")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_share needs a CUDA device")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    g1, g2 = _graph(a.kernels, a.rows, s1), _graph(a.kernels, a.rows, s2)
    _replays([(g1, s1)], 10)
    res = {
        "device": torch.cuda.get_device_name(),
        "kernels": a.kernels,
        "rows": a.rows,
        "alone_ms": _replays([(g1, s1)], a.replays),
        "one_process_two_streams_ms": _replays([(g1, s1), (g2, s2)], a.replays),
        "one_process_one_stream_two_graphs_ms": _replays([(g1, s1), (g2, s1)], a.replays),
    }
    del g1, g2
    torch.cuda.synchronize()
    res["two_processes_ms"] = _two_processes(a.kernels, a.rows, a.replays)
    print(json.dumps(res, indent=1))
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "gpu_share.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
