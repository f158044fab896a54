"""What a tree costs against a decode step on the CPU: the verifier engine in this process, one sequence of
a 40-token prompt, the median time of a plain decoding step and of verifying chains of 1, 3, 7 and 15
drafted tokens (2, 4, 8, 16 rows), the matrix product underneath (one row against two rows times the
fused q|k|v weight of SmolLM2), and where a decode step's time goes: torch.profiler over 8 chained decode
steps, the share of self CPU time of the largest operators (DIR/cpu_steps_profile.txt has the table).

    python -m bench.cpu_steps --out DIR

Writes DIR/cpu_steps.json and logs it. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger("bench.cpu_steps")


def median_ms(fn, n: int = 7) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[n // 2]


def main() -> None:
    from common.config import SamplingConfig
    from common.engine.base import PrefillInput, VerifyInput
    from common.engine.verifier import Verifier, VerifierConfig
    from common.tree import Tree
    from common.weights import load_checkpoint

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    v = Verifier(load_checkpoint(), VerifierConfig(max_sequences=1, max_context=1024))
    v.prefill(PrefillInput("p", list(range(100, 140)), SamplingConfig()))
    res: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        "command": "python -m bench.cpu_steps --out DIR",
    }
    with torch.inference_mode():
        res["decode_ms"] = median_ms(lambda: v.decode(["p"]))
        for n in (1, 3, 7, 15):
            chain = Tree(tokens=np.arange(5, 5 + n), parents=np.arange(-1, n - 1), probs=np.ones(n, np.float32))
            res[f"verify_{n + 1}_rows_ms"] = median_ms(lambda chain=chain: v.verify([VerifyInput("p", chain)]))
        w = torch.randn(1728, 576)  # q|k|v of one layer
        for m in (1, 2):
            x = torch.randn(m, 576)
            res[f"matmul_{m}_row_us"] = 1e3 * median_ms(lambda x=x: F.linear(x, w), n=21)
        v.decode_many(["p"], 8)  # warm
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            v.decode_many(["p"], 8)
    ops = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ops)
    top = sorted(ops, key=lambda e: -e.self_cpu_time_total)[:5]
    res["decode_profile_self_cpu_share"] = {e.key: round(e.self_cpu_time_total / total, 3) for e in top}
    res["decode_profile_mm_calls_per_token"] = next((e.count for e in ops if e.key == "aten::mm"), 0) / 8
    res["verify_2_rows_over_decode"] = res["verify_2_rows_ms"] / res["decode_ms"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_steps_profile.txt").write_text(ops.table(sort_by="self_cpu_time_total", row_limit=20))
    (out / "cpu_steps.json").write_text(json.dumps(res, indent=1))
    log.info("\n%s", json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
