"""The collector's pauses per load window, from bench/gcprobe's files and a services_bench log:

    python -m bench.gcprobe.summary GC_DIR --log services.log [--rounds services.json]

A window runs from a "c=N: load starts" line to the next "c=N: ... tok/s total" line of the log. For each
window and process (gateway, verifier, draft, the bench's client): collections of each generation, their
total and largest pause, and the pause per second of the window; first, the same of each process before the
first window (its start-up: loading, graph capture, the warm-up)."""

from __future__ import annotations

import argparse
import json
import re
from datetime import datetime
from pathlib import Path

LINE = re.compile(r"^(\S+ \S+) bench\.services_bench INFO (\S+) c=(\d+): (load starts|[\d.]+ tok/s total)")


def windows(log: str) -> list[tuple[str, float, float]]:
    """(name, start, end) in seconds since the epoch, one per load window of the log."""
    out, start = [], {}
    for line in log.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        t = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if m[4] == "load starts":
            start[m[3]] = t
        elif m[3] in start:
            out.append((f"{m[2]} c={m[3]}", start.pop(m[3]), t))
    return out


def role(argv: list[str]) -> str:
    text = " ".join(argv)
    for name in ("gateway", "verifier", "draft", "services_bench"):
        if name in text:
            return name
    return text[:40]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gcprobe.summary", description=__doc__)
    p.add_argument("gc_dir")
    p.add_argument("--log", required=True)
    a = p.parse_args(argv)
    procs = [json.loads(f.read_text()) for f in sorted(Path(a.gc_dir).glob("gc.*.json"))]
    spans = windows(Path(a.log).read_text())
    first = spans[0][1] if spans else float("inf")
    start = min((e[0] for p in procs for e in p["events"]), default=first)
    for name, t0, t1 in [("start-up, before the first window", start, first), *spans]:
        print(f"{name} ({t1 - t0:.1f} s)")
        for proc in procs:
            inside = [e for e in proc["events"] if t0 <= e[0] <= t1]
            if not inside:
                continue
            gens = [[e for e in inside if e[1] == g] for g in range(3)]
            total = sum(e[2] for e in inside)
            print(
                f"  {role(proc['argv']):>15}: collections gen0/1/2 {'/'.join(str(len(g)) for g in gens)}, "
                f"{total * 1e3:.1f} ms in all ({total / max(t1 - t0, 1e-9) * 1e3:.2f} ms a second), "
                f"largest {max(e[2] for e in inside) * 1e3:.2f} ms, frozen objects {proc['frozen']}"
            )


if __name__ == "__main__":
    main()
