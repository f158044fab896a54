"""Two stacks' bench.load runs compared: each (phase, concurrency, kind) that both runs of a pair measured, the after
stack's requests/s and p50 / p99 latency over the before stack's; per concurrency the mean, median and range over
every pair's rows, and per kind the means with each row's ratio. An A/B of one lease runs several pairs, the order of
the stacks swapped between them, so that the machine's drift favours neither.

    python -m bench.load_diff --pair BEFORE/load.json AFTER/load.json [--pair ...] [--out FILE.json]

(pair 1: before 100 req/s at (1, 64, plain), after 103; pair 2: 100 and 99) -> c=64 plain: n=2, req/s 1.010.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

Key = tuple[int, int, str]  # (phase, concurrency, kind)


def rows(path: Path) -> dict[Key, dict]:
    """A load.json's measured rows by (phase, concurrency, kind); a run that failed (no requests/s) is left out."""
    out: dict[Key, dict] = {}
    for r in json.loads(path.read_text())["rows"]:
        if r.get("req_s"):
            out[(r["phase"], r["concurrency"], r["kind"])] = r
    return out


def compare(pairs: list[tuple[Path, Path]]) -> dict:
    """{concurrency: {'n', 'mean', 'median', 'min', 'max', 'kinds': {kind: {'n', 'req_s', 'p50', 'p99', 'each'}}}}:
    after / before ratios of the rows both runs of a pair measured (req_s, p50, p99: means over the kind's rows)."""
    by_c: dict[int, list[tuple[str, float, float, float]]] = {}
    for before, after in pairs:
        a, b = rows(before), rows(after)
        for key in sorted(a.keys() & b.keys()):
            x, y = a[key], b[key]
            by_c.setdefault(key[1], []).append(
                (key[2], y["req_s"] / x["req_s"], y["p50_ms"] / x["p50_ms"], y["p99_ms"] / x["p99_ms"])
            )
    out: dict = {}
    for c, xs in sorted(by_c.items()):
        rs = [x[1] for x in xs]
        kinds: dict[str, dict] = {}
        for kind in dict.fromkeys(x[0] for x in xs):
            ks = [x for x in xs if x[0] == kind]
            kinds[kind] = {
                "n": len(ks),
                "req_s": statistics.mean(x[1] for x in ks),
                "p50": statistics.mean(x[2] for x in ks),
                "p99": statistics.mean(x[3] for x in ks),
                "each": [x[1] for x in ks],
            }
        out[c] = {
            "n": len(rs),
            "mean": statistics.mean(rs),
            "median": statistics.median(rs),
            "min": min(rs),
            "max": max(rs),
            "kinds": kinds,
        }
    return out


def render(result: dict) -> str:
    lines = []
    for c, s in result.items():
        lines.append(
            f"c={c}: {s['n']} rows, req/s after / before mean {s['mean']:.3f}, median {s['median']:.3f}, "
            f"{s['min']:.3f}-{s['max']:.3f}"
        )
        for kind, k in s["kinds"].items():
            each = ", ".join(f"{v:.3f}" for v in k["each"])
            lines.append(
                f"  {kind:12s} n={k['n']} req/s {k['req_s']:.3f} p50 {k['p50']:.3f} p99 {k['p99']:.3f} ({each})"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.load_diff", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pair", nargs=2, type=Path, action="append", required=True, metavar=("BEFORE", "AFTER"))
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    args = p.parse_args(argv)
    result = compare([tuple(x) for x in args.pair])
    if not result:
        p.error("no (phase, concurrency, kind) measured by both runs of any pair")
    sys.stdout.write(render(result) + "\n")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
