"""make bench: every figure of the GPU fast path from one command, with the baselines measured in the
same run, on the same prompts.

    python -m bench.run --out bench-results [--device cuda] [--prompts 64] [--max-new-tokens 128]
                        [--concurrency 1,16,64] [--head models/eagle3-smollm2]

0. bench.decode_probe (GPU): kernels per step and graph replay time of decode (batch 1, 16, 64), verify
   of a 60-node tree and the draft's proposal, on the real model.
1. bench.engine_bench (in one process): Hugging Face `generate` (same model and dtype), the project's
   plain decoding, speculative decoding without gRPC.
2. bench.services_bench: through the three services over gRPC, in the stack's default processes (on a GPU the
   draft in the verifier's process since session 21; --ipc: CUDA IPC and/or inline bytes otherwise): the
   draft's default tree pinned, plain decoding, and the gateway's speculation policy, at the gateway's
   default rounds per Verify and (the -k1 rows, speculative only) at one round per Verify, so that one
   run shows what chaining rounds in the verifier saves. The round breakdown is per round.
Writes bench-results/{engine_bench,services}.json, summary.json, summary.md and summary.png (when
matplotlib is available), and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

import torch

from bench import engine_bench, services_bench

log = logging.getLogger("bench.run")
DEFAULT_HEAD = Path(__file__).resolve().parents[1] / "models" / "eagle3-smollm2"


def _rows(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    return data["results"] if isinstance(data, dict) and "results" in data else data


def _get(rows: list[dict], method: str, c: int) -> dict | None:
    return next((r for r in rows if r["method"] == method and r["concurrency"] == c), None)


TREE = "tree:6x60"  # the draft's default tree (steps x verify size), pinned in the services runs


def per(r: dict | None) -> float | None:
    return r["tok_s_per_request"] if r else None


def ratio(a: dict | None, b: dict | None) -> float | None:
    return per(a) / per(b) if a and b and per(b) else None


def summarize(rows: list[dict], concurrency: list[int], meta: dict) -> tuple[str, dict]:
    lines = [
        f"# Benchmark: {meta['device_name']}, {meta['dtype']}, {meta['prompts']} prompts x "
        f"{meta['max_new_tokens']} new tokens",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| method | conc. | tok/s/req | tok/s total | TTFT ms | ITL ms | accept len | draft ms | verify ms "
        "| wait ms | rpc ms | host ms | round ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fmt = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['concurrency']} | {fmt(r['tok_s_per_request'])} | {fmt(r['tok_s_total'])} "
            f"| {fmt(r['ttft_ms'])} | {fmt(r['itl_ms'], 2)} | {fmt(r.get('acceptance_length'), 2)} "
            f"| {fmt(r.get('draft_ms_per_round'), 2)} | {fmt(r.get('verify_ms_per_round'), 2)} "
            f"| {fmt(r.get('draft_wait_ms_per_round'), 2)} | {fmt(r.get('rpc_ms_per_round'), 2)} "
            f"| {fmt(r.get('host_ms_per_round'), 2)} | {fmt(r.get('round_ms'), 2)} |"
        )
    ratios = {}
    lines += [
        "",
        "| concurrency | plain ms/token (per request) | spec / plain | spec / HF | services-ipc / in-process "
        "| services-ipc k1 / in-process | services-inline / in-process | gateway plain / engine plain "
        "| services spec / gateway plain | services tok/s total | policy / gateway plain |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    hf = _get(rows, "hf-generate", 1)
    for c in concurrency:
        plain, spec = _get(rows, "plain", c), _get(rows, "speculative", c)
        pinned = "-" + TREE.replace(":", "-")
        ipc, inline = _get(rows, "services-ipc" + pinned, c), _get(rows, "services-inline" + pinned, c)
        ipc_k1 = _get(rows, "services-ipc" + pinned + "-k1", c) or _get(rows, "services-inline" + pinned + "-k1", c)
        gw_plain = _get(rows, "services-ipc-plain", c) or _get(rows, "services-inline-plain", c)
        policy = _get(rows, "services-ipc", c) or _get(rows, "services-inline", c)
        entry = {
            "plain_ms_per_token": 1000 / per(plain) if plain and per(plain) else None,
            "spec_over_plain": ratio(spec, plain),
            "spec_over_hf": ratio(spec, hf),
            "services_ipc_over_inprocess": ratio(ipc, spec),
            "services_ipc_k1_over_inprocess": ratio(ipc_k1, spec),
            "services_inline_over_inprocess": ratio(inline, spec),
            "services_ipc_over_plain": ratio(ipc, plain),
            "services_ipc_over_hf": ratio(ipc, hf),
            "gateway_plain_over_engine_plain": ratio(gw_plain, plain),
            "services_spec_over_gateway_plain": ratio(ipc, gw_plain),
            "services_ipc_tok_s_total": ipc["tok_s_total"] if ipc else None,
            "policy_over_gateway_plain": ratio(policy, gw_plain),
        }
        ratios[c] = entry
        lines.append(
            f"| {c} | {fmt(entry['plain_ms_per_token'], 2)} | {fmt(entry['spec_over_plain'], 2)}x "
            f"| {fmt(entry['spec_over_hf'], 1)}x | {fmt(entry['services_ipc_over_inprocess'], 2)}x "
            f"| {fmt(entry['services_ipc_k1_over_inprocess'], 2)}x "
            f"| {fmt(entry['services_inline_over_inprocess'], 2)}x "
            f"| {fmt(entry['gateway_plain_over_engine_plain'], 2)}x "
            f"| {fmt(entry['services_spec_over_gateway_plain'], 2)}x "
            f"| {fmt(entry['services_ipc_tok_s_total'], 0)} | {fmt(entry['policy_over_gateway_plain'], 2)}x |"
        )
    lines += [
        "",
        "Ratios compare tokens/s per request at the same concurrency (HF: batch 1 only). Services runs pin the",
        f"draft's default tree ({TREE[5:]}, as in-process speculation) except the policy column (the gateway's",
        "adaptive speculation policy). k1: one round per Verify (the gateway's --rounds-per-call 1); the others",
        "run the gateway's default rounds per Verify.",
    ]
    return "\n".join(lines) + "\n", ratios


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no PNG")
        return False
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in (
        (axes[0], "tok_s_per_request", "tokens/s per request"),
        (axes[1], "tok_s_total", "tokens/s total"),
    ):
        for m in methods:
            pts = sorted((r["concurrency"], r[key]) for r in rows if r["method"] == m)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="bench-results")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--hf-prompts", type=int, default=3)
    p.add_argument("--head", default=str(DEFAULT_HEAD))
    p.add_argument("--skip-services", action="store_true")
    p.add_argument("--ipc", default="on", help="services runs: on (CUDA IPC when colocated), off (inline), on,off")
    p.add_argument(
        "--rounds-per-call",
        default="1,0",
        help="services runs: the gateway's --rounds-per-call values, one stack each (0 = its default)",
    )
    a = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = (
        "bfloat16"
        if a.dtype == "auto" and a.device.startswith("cuda")
        else ("float32" if a.dtype == "auto" else a.dtype)
    )
    common = [
        "--device",
        a.device,
        "--prompts",
        str(a.prompts),
        "--max-new-tokens",
        str(a.max_new_tokens),
        "--concurrency",
        a.concurrency,
        "--head",
        a.head,
    ]
    if a.device.startswith("cuda"):  # kernels per step and replay times of decode, verify and propose
        subprocess.run([sys.executable, "-m", "bench.decode_probe", "--out", str(out), "--dtype", dtype], check=True)
    rc = engine_bench.main([*common, "--dtype", dtype, "--hf-prompts", str(a.hf_prompts), "--out", str(out)])
    if rc:
        return rc
    rows = _rows(out / "engine_bench.json")
    if not a.skip_services:
        # the draft's default tree pinned (what in-process speculation runs), plain, and the gateway's policy
        modes = f"{TREE},plain,spec"
        services_bench.main(
            [*common, "--dtype", dtype, "--modes", modes, "--ipc", a.ipc, "--rounds-per-call", a.rounds_per_call]
            + ["--out", str(out)]
        )
        rows += _rows(out / "services.json")
    meta = {
        "device_name": engine_bench.device_name(a.device),
        "dtype": dtype,
        "prompts": a.prompts,
        "max_new_tokens": a.max_new_tokens,
        "command": "python -m bench.run " + " ".join(argv or sys.argv[1:]),
    }
    conc = [int(c) for c in a.concurrency.split(",")]
    md, ratios = summarize(rows, conc, meta)
    (out / "summary.md").write_text(md)
    (out / "summary.json").write_text(json.dumps({"meta": meta, "ratios": ratios, "rows": rows}, indent=2))
    plot(rows, out / "summary.png")
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
