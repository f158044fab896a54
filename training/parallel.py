"""One stage over several processes, one a GPU: `python -m training.pipeline STAGE ... --workers N`.

magpie (the prompts stage) and generate split their shards: process i of N writes the shards k with k % N == i
(`Part`), then the launching process runs the stage itself, which finds every shard written and finishes (the
prompt build, gen/DONE). train is data-parallel (`Group`): every rank holds the same head, trains on its own
batches and averages the gradients with the others before clipping, so one step sees N batches.

The launcher (`launch`) starts the N processes with one GPU visible to each (CUDA_VISIBLE_DEVICES) and, for
train, the torch.distributed rendezvous on a free loopback port (NCCL on GPUs, gloo on CPU); a process that
fails stops the others.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Part:
    """Process `index` of `count` owns the shards k with k % count == index ('1/4' owns 1, 5, 9, ...)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"a part is I/N with 0 <= I < N, got {self.index}/{self.count}")

    @classmethod
    def parse(cls, text: str) -> Part:
        """'1/4' -> Part(1, 4)."""
        try:
            index, count = (int(x) for x in text.split("/"))
        except ValueError:
            raise ValueError(f"a part is I/N (for example 1/4), got {text!r}") from None
        return cls(index, count)

    def owns(self, k: int) -> bool:
        return k % self.count == self.index


class Group:
    """The data-parallel ranks of a training stage (torch.distributed, initialised by the launcher's environment).
    Every collective runs on `device` (NCCL needs CUDA tensors)."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device

    @classmethod
    def from_env(cls, device: torch.device) -> Group | None:
        """The group of WORLD_SIZE > 1 processes the launcher started (None for one process): joins the rendezvous
        at MASTER_ADDR:MASTER_PORT as RANK."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        return cls(dist.get_rank(), world, device)

    @property
    def lead(self) -> bool:
        """Rank 0 decides when to stop, writes the log, the state and the head."""
        return self.rank == 0

    def average(self, grads: Sequence[torch.Tensor]) -> None:
        """Replace each gradient by its mean over the ranks (one all-reduce of the gradients flattened together).
        Not DistributedDataParallel: its reducer is armed by the wrapped module's forward, and training-time test
        calls the head's parts step by step (training.ttt.ttt_step), never head.forward."""
        flat = torch.cat([g.reshape(-1) for g in grads])  # [sum of numels]
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def from_lead(self, values: Sequence[float]) -> list[float]:
        """Rank 0's values on every rank: the decisions that must agree (stop now, the step's wall time, which the
        time-based learning-rate schedule reads)."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)  # [len(values)]
        dist.broadcast(t, src=0)
        return t.tolist()

    def check_same(self, params: Sequence[torch.Tensor]) -> None:
        """RuntimeError on a rank whose parameters differ from rank 0's: averaged gradients keep them equal to the
        bit, so a difference is a fault in the averaging, not noise."""
        mine = torch.cat([p.detach().reshape(-1) for p in params])  # [sum of numels]
        lead = mine.clone()
        dist.broadcast(lead, src=0)
        if not torch.equal(mine, lead):
            worst = float((mine - lead).abs().max())
            raise RuntimeError(f"rank {self.rank}'s weights differ from rank 0's (largest difference {worst:.3g})")

    def close(self) -> None:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], workers: int, cuda: bool, distributed: bool) -> int:
    """Run `python -m training.pipeline *argv` in `workers` processes and wait for them; 0 when all succeed. Each
    process sees one GPU when cuda (the i-th of the launcher's CUDA_VISIBLE_DEVICES, else GPU i); distributed:
    they form a Group (train), else process i gets `--part i/workers` (magpie, generate). The first process that
    fails stops the others (SIGTERM) and its exit status is returned."""
    from services.stack import bind_to_parent

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(workers)]
    if cuda and len(gpus) < workers:
        raise ValueError(f"--workers {workers} needs {workers} GPUs, {len(gpus)} visible")
    port = free_port()
    procs = []
    for i in range(workers):
        env = dict(os.environ)
        args = list(argv)
        if cuda:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i]
        if distributed:
            env |= {"WORLD_SIZE": str(workers), "RANK": str(i), "LOCAL_RANK": str(i)}
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        else:
            args += ["--part", f"{i}/{workers}"]
        cmd = [sys.executable, "-m", "training.pipeline", *args]
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=bind_to_parent))  # none outlives a killed launcher
    log.info("parallel: %d processes (pids %s)", workers, ", ".join(str(p.pid) for p in procs))
    failed: list[int] = []
    try:
        while not failed:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if all(c == 0 for c in codes):
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait()
    if failed:
        log.error("parallel: a process failed (exit %d); the others were stopped", failed[0])
        return failed[0]
    return 0
