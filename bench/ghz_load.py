"""The load run of bench.services_bench with ghz instead of the Python client: the three services started
here, the gateway called by reflection (no proto files), speculative and plain requests at each
concurrency, same prompt, 128 tokens each with EOS ignored.

    python -m bench.ghz_load --ghz PATH/TO/ghz --out DIR [--device cuda] [--concurrency 1,16,64] \\
        [--colocate auto|on|off]

Each run is, as printed in DIR/ghz.md:

    ghz --insecure --call specdec.v1.Generation.Complete \\
        -d '{"messages":[{"role":"user","content":"..."}],"max_tokens":128,"ignore_eos":true,"speculative":true}' \\
        -c C -n N --format json HOST:PORT

tokens/s total = N x 128 / ghz's total time (ghz counts requests, not tokens). Before them, untimed, one run of
each kind (4 at a time, 8 requests). On a GPU the stack runs the draft in the verifier's process, as
`python -m services.stack` does there (--colocate auto; off: three processes).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
from pathlib import Path

from services.stack import Stack, colocate_argument, colocated

log = logging.getLogger("bench.ghz_load")
PROMPT = "Explain how a refrigerator keeps food cold."
WARM_UP = (4, 8)  # concurrency, requests: the untimed run of each kind before the measured ones


def run_ghz(args, gateway: str, c: int, n: int, spec: bool) -> tuple[dict, str]:
    """One ghz run of n requests, c at a time: (ghz's JSON report, the command as printed in ghz.md)."""
    data = json.dumps(
        {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "speculative": spec,
        }
    )
    cmd = [args.ghz, "--insecure", "--call", "specdec.v1.Generation.Complete", "-d", data, "-c", str(c), "-n", str(n)]
    cmd += ["--format", "json", gateway]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(done.stdout), " ".join(cmd[:4]) + f" -d '{data}' -c {c} -n {n} --format json HOST:PORT"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ghz", required=True, help="the ghz binary")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests-per-worker", type=int, default=4)
    colocate_argument(ap)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    colocate = colocated(args.colocate, args.device)
    with Stack(common_args=["--device", args.device, "--max-context", "1024"], colocate=colocate) as stack:
        # untimed first, as bench.services_bench warms up: a stack's first requests of each kind pay one-time costs
        # (session 21, H200: it did not change the c=1 figures, docs/benchmarks.md)
        for spec in (True, False):
            run_ghz(args, stack.gateway, WARM_UP[0], WARM_UP[1], spec)
        for c in [int(x) for x in args.concurrency.split(",")]:
            for spec in (True, False):
                n = max(8, args.requests_per_worker * c)
                report, command = run_ghz(args, stack.gateway, c, n, spec)
                total_s = report["total"] / 1e9
                ok = report.get("statusCodeDistribution", {}).get("OK", 0)
                rows.append(
                    {
                        "concurrency": c,
                        "speculative": spec,
                        "requests": n,
                        "ok": ok,
                        "tok_s_total": ok * args.max_tokens / total_s,
                        "latency_ms_avg": report["average"] / 1e6,
                        "command": command,
                    }
                )
                log.info("c=%d speculative=%s: %d/%d OK, %.0f tok/s total", c, spec, ok, n, rows[-1]["tok_s_total"])
    (out / "ghz.json").write_text(json.dumps(rows, indent=1))
    lines = [
        f"# ghz load run ({args.device}, {args.max_tokens} tokens per request)",
        "",
        "| concurrency | mode | requests | OK | tok/s total | mean latency ms |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {'speculative' if r['speculative'] else 'plain'} | {r['requests']} "
            f"| {r['ok']} | {r['tok_s_total']:.0f} | {r['latency_ms_avg']:.1f} |"
        )
    lines += ["", "Command of each run: " + f"`{rows[0]['command']}`" if rows else ""]
    (out / "ghz.md").write_text("\n".join(lines) + "\n")
    log.info("\n%s", "\n".join(lines))


if __name__ == "__main__":
    main()
