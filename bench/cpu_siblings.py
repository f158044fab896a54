"""Which CPUs share a physical core with a given one, measured (a VM may not say: lscpu there shows one
thread per core while the host runs two vCPUs on each core's two hardware threads):

    python -m bench.cpu_siblings --cpu 2 [--seconds 0.4]

Counts a busy loop's turns on --cpu alone, then with a second busy loop on each other CPU in turn; a CPU
that slows it by more than --slower (20%) is printed as its sibling. Prints one JSON line:
{"cpu": 2, "alone": turns, "with": {cpu: turns}, "siblings": [...]}."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time


def spin(cpu: int, seconds: float, start: float, out=None) -> int:
    os.sched_setaffinity(0, {cpu})
    while time.time() < start:
        pass
    turns, end = 0, start + seconds
    while time.time() < end:
        turns += 1
    if out is not None:
        out.put(turns)
    return turns


def turns_on(cpu: int, other: int | None, seconds: float) -> int:
    q: mp.Queue = mp.Queue()
    start = time.time() + 0.2
    procs = [mp.Process(target=spin, args=(cpu, seconds, start, q))]
    if other is not None:
        procs.append(mp.Process(target=spin, args=(other, seconds, start)))
    for p in procs:
        p.start()
    turns = q.get()
    for p in procs:
        p.join()
    return turns


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_siblings", description=__doc__)
    p.add_argument("--cpu", type=int, default=2)
    p.add_argument("--seconds", type=float, default=0.4)
    p.add_argument("--slower", type=float, default=0.2)
    a = p.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    alone = max(turns_on(a.cpu, None, a.seconds) for _ in range(2))
    beside = {c: turns_on(a.cpu, c, a.seconds) for c in cpus if c != a.cpu}
    siblings = [c for c, t in beside.items() if t < (1 - a.slower) * alone]
    print(json.dumps({"cpu": a.cpu, "alone": alone, "with": beside, "siblings": siblings}))


if __name__ == "__main__":
    main()
