"""The speculation-policy table of docs/benchmarks.md from a services_bench run with --modes
spec,plain,tree:...: total tokens/s per concurrency for the policy, plain decoding and each pinned tree,
the policy against plain and against the best fixed choice.

    python -m bench.policy_table DIR/services.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def table(path: Path) -> str:
    rows = json.loads(path.read_text())["results"]
    tok = {(r["method"], r["concurrency"]): r["tok_s_total"] for r in rows}
    methods = sorted({m for m, _ in tok})
    policy = next(m for m in methods if not m.endswith("-plain") and "-tree-" not in m)
    trees = [m for m in methods if "-tree-" in m]
    fixed = [policy + "-plain", *trees]
    names = ["plain"] + [m.split("-tree-")[1] for m in trees]
    lines = [
        "| concurrency | policy | " + " | ".join(names) + " | policy / plain | policy / best fixed |",
        "|---:|---:|" + "---:|" * len(names) + "---:|---:|",
    ]
    for c in sorted({c for _, c in tok}):
        pol = tok[(policy, c)]
        vals = [tok[(m, c)] for m in fixed]
        lines.append(
            f"| {c} | {pol:,.0f} | "
            + " | ".join(f"{v:,.0f}" for v in vals)
            + f" | {pol / vals[0]:.2f}x | {pol / max(vals):.2f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1])))
