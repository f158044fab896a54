"""Two stacks' bench.load runs compared: each (phase, concurrency, kind) that both runs of a pair measured, the after
stack's requests/s and p50 / p99 latency over the before stack's; per pair and per concurrency the mean of those
ratios, per concurrency also the median and range, and per kind the means with each row's ratio. An A/B of one lease
runs several pairs, the order of the stacks swapped between them, so that the machine's drift favours neither (the
per-pair means show whether it did).

    python -m bench.load_diff --pair BEFORE/load.json AFTER/load.json [--pair ...] [--out FILE.json]

The two runs of a pair must have run the same phases (their concurrency in the same order): a phase's figures depend
on the history before it. A run that failed or had errors (no requests/s, or errors > 0) is left out with its partner,
and said so; so is a row the other run did not measure.
(pair 1: before 100 req/s at (1, 64, plain), after 103; pair 2: 100 and 99) -> c=64 plain: n=2, req/s 1.010.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

Key = tuple[int, int, str]  # (phase, concurrency, kind)


def load(path: Path) -> tuple[list[int], dict[Key, dict]]:
    """A load.json's phases' concurrency in order, and its rows by (phase, concurrency, kind)."""
    data = json.loads(path.read_text())
    phases = [p["concurrency"] for p in sorted(data.get("phases", []), key=lambda p: p["phase"])]
    return phases, {(r["phase"], r["concurrency"], r["kind"]): r for r in data["rows"]}


def clean(row: dict) -> bool:
    """A run whose figures stand: requests/s and both latencies measured, no request failed."""
    return bool(row.get("req_s")) and not row.get("errors") and bool(row.get("p50_ms")) and bool(row.get("p99_ms"))


def compare(pairs: list[tuple[Path, Path]]) -> dict:
    """{'pairs': [{'before', 'after', 'rows', 'mean', 'left_out': [...]}], 'by_concurrency': {c: {'n', 'mean', 'median',
    'min', 'max', 'kinds': {kind: {'n', 'req_s', 'p50', 'p99', 'each'}}}}}: after / before ratios of the clean rows
    both runs of a pair measured (req_s, p50, p99: the means of the kind's rows). Raises ValueError for a pair whose
    runs ran other phases."""
    by_c: dict[int, list[tuple[str, float, float, float]]] = {}
    summary = []
    for before, after in pairs:
        (pa, a), (pb, b) = load(before), load(after)
        if pa != pb:
            raise ValueError(f"{before} ran phases at concurrency {pa}, {after} at {pb}: their phases do not compare")
        ratios, left = [], []
        for key in sorted(a.keys() | b.keys()):
            x, y = a.get(key), b.get(key)
            if x is None or y is None or not clean(x) or not clean(y):
                left.append("{} c={} {}: {}".format(*key, "not in both runs" if x is None or y is None else "failed"))
                continue
            r = (y["req_s"] / x["req_s"], y["p50_ms"] / x["p50_ms"], y["p99_ms"] / x["p99_ms"])
            by_c.setdefault(key[1], []).append((key[2], *r))
            ratios.append(r[0])
        summary.append(
            {
                "before": str(before),
                "after": str(after),
                "rows": len(ratios),
                "mean": statistics.mean(ratios) if ratios else None,
                "left_out": left,
            }
        )
    out: dict = {"pairs": summary, "by_concurrency": {}}
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
        out["by_concurrency"][c] = {
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
    for i, p in enumerate(result["pairs"], 1):
        mean = "-" if p["mean"] is None else f"{p['mean']:.3f}"
        lines.append(f"pair {i} ({p['before']} -> {p['after']}): {p['rows']} rows, req/s after / before mean {mean}")
        lines.extend(f"  left out: {x}" for x in p["left_out"])
    for c, s in result["by_concurrency"].items():
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
    try:
        result = compare([tuple(x) for x in args.pair])
    except ValueError as e:
        p.error(str(e))
    if not result["by_concurrency"]:
        p.error("no clean (phase, concurrency, kind) row measured by both runs of any pair")
    sys.stdout.write(render(result) + "\n")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
