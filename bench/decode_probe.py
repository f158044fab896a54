"""Engine-step probe on the real model: kernels per step (torch.profiler over one eager run of the step
function that the graph captures) and CUDA graph replay time of plain decoding at several batch sizes,
verification of a tree, and the draft's whole proposal, each at a stated context length.

    PYTHONPATH=. python -m bench.decode_probe --out DIR [--context 256] [--batches 1,16,64] [-v]

Writes DIR/decode_probe.json and prints a markdown table. Replays run back to back without a host sync
in between (the graph time); "call ms" is the engine's public call (host packing, the H2D copy, replay,
the one D2H read) for the same shape. -v lists the kernels of each step by name.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from common.config import DraftingConfig, SamplingConfig
from common.engine.base import PrefillInput, ProposeInput
from common.engine.cuda_graphs import GraphConfig
from common.engine.draft import Eagle3Drafter
from common.engine.verifier import SHALLOW_DEPTH, Verifier, VerifierConfig

log = logging.getLogger("bench.decode_probe")
DEFAULT_HEAD = Path(__file__).resolve().parents[1] / "models" / "eagle3-smollm2"


def kernels(fn) -> list[tuple[str, float]]:
    """(name, microseconds on the device) of each CUDA kernel launched by one call of fn."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type.name == "CUDA"]


def timed(fn, iters: int = 200) -> float:
    """Mean ms per call of fn, calls back to back, one sync at the end."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def probe_step(name: str, graphs, key, step, inputs: dict, verbose: bool) -> dict:
    dev_inputs = {k: v.to("cuda") for k, v in inputs.items()}
    with torch.inference_mode(), graphs.on_stream():
        names = kernels(lambda: step(**dev_inputs))
        replay = timed(lambda: graphs.run(key, step, inputs)) if graphs.is_captured(key) else None
    row = {"step": name, "kernels": len(names), "replay_ms": replay, "captured": graphs.is_captured(key)}
    if verbose:
        count, us = collections.Counter(), collections.Counter()
        for n, t in names:
            count[n[:90]] += 1
            us[n[:90]] += t
        row["by_name"] = [(n, count[n], round(t, 1)) for n, t in us.most_common()]  # most device time first
        row["kernel_us"] = round(sum(us.values()), 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="GGUF or HF folder (default: the embedded model)")
    ap.add_argument("--head", default=str(DEFAULT_HEAD))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=256, help="committed tokens per sequence while probing")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from common.model.eagle3_io import load_eagle3
    from common.weights import load_checkpoint

    ckpt = load_checkpoint(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    max_b = max(batches)
    gc = GraphConfig(batch_buckets=tuple(sorted(set(batches) | {1})), tree_buckets=(16, 32, 64))
    verifier = Verifier(
        ckpt,
        VerifierConfig(max_sequences=max_b, max_context=2048, max_tree_nodes=63, dtype=args.dtype, device="cuda"),
        graphs=True,
        graph_cfg=gc,
    )
    head, _ = load_eagle3(args.head)
    head.to(device="cuda", dtype=verifier.model.embed_tokens.weight.dtype).eval()
    drafting = DraftingConfig()
    drafter = Eagle3Drafter(head, verifier.model.embed_tokens, drafting, max_b, 2048, "cuda", graphs=True, graph_cfg=gc)
    rng = np.random.default_rng(0)
    ids = [f"s{i}" for i in range(max_b)]
    for s in ids:
        verifier.prefill(PrefillInput(s, rng.integers(100, 20000, size=args.context).tolist(), SamplingConfig()))
    rows = []
    for b in batches:
        block = verifier._decode_block(b)
        for i in range(b):
            slot, st = verifier.seqs.get(ids[i])
            block[i] = torch.tensor([st.pending, st.length, slot])
        row = probe_step(
            f"decode B={b}", verifier.graphs, ("decode", b), verifier._decode_step, {"packed": block}, args.verbose
        )
        row["call_ms"] = timed(lambda b=b: _decode_same_length(verifier, ids[:b]), 50)
        rows.append(row)
    # verify: a 60-node tree (61 rows, bucket 64), batch 1
    tree_rows = 1 + drafting.verify_tree_size
    # verify: the 60-node tree the draft proposes (depth <= 6: the shallow graph), batch 1, bucket 64
    feats = 3 * ckpt.config.hidden_size
    first = drafter.propose(
        [
            ProposeInput(
                ids[0],
                rng.integers(100, 20000, size=args.context).tolist(),
                torch.randn(args.context, feats, device="cuda"),
                True,
                [1],
                0,
            )
        ]
    )
    assert len(first[0].tokens) == drafting.verify_tree_size
    tb = 64
    block = verifier._verify_block(1, tb)
    slot, st = verifier.seqs.get(ids[0])
    a = block.numpy()
    a[0, 1:tree_rows] = first[0].tokens
    a[0, tb + 1 : tb + tree_rows] = first[0].parents + 1
    a[0, 2 * tb], a[0, 2 * tb + 1] = st.length, slot
    rows.append(
        probe_step(
            f"verify B=1, {tree_rows} rows",
            verifier.graphs,
            ("verify", 1, tb, True),
            functools.partial(verifier._verify_step, max_depth=SHALLOW_DEPTH),
            {"packed": block},
            args.verbose,
        )
    )
    # propose: batch 1, 4 new tokens (a typical round), tree 10/6/60
    packed, hidden = drafter._pack(
        [ProposeInput(ids[0], [5, 6, 7, 8], torch.randn(4, feats, device="cuda"), False, [], 0)], 1, 4
    )
    rows.append(
        probe_step(
            "propose B=1, 10/6/60",
            drafter.graphs,
            ("propose", 1, 4, drafter.drafting.steps, False),  # greedy: the top-k variant, no draws
            functools.partial(drafter._propose_step, depth=drafter.drafting.steps),
            {"packed": packed, "hidden": hidden},
            args.verbose,
        )
    )
    rows.append(  # a batch with a sampling row (temperature > 0): the q rule's variant
        probe_step(
            "propose B=1, 10/6/60, sampled",
            drafter.graphs,
            ("propose", 1, 4, drafter.drafting.steps, True),
            functools.partial(drafter._propose_step, depth=drafter.drafting.steps),
            {"packed": packed, "hidden": hidden, **drafter._noise_block(1)},
            args.verbose,
        )
    )
    decode1 = next(r for r in rows if r["step"] == "decode B=1")["replay_ms"]
    for r in rows:
        r["x_decode_b1"] = r["replay_ms"] / decode1 if r["replay_ms"] and decode1 else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "dtype": args.dtype,
        "context": args.context,
        "torch": torch.__version__,
    }
    (out / "decode_probe.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        f"# Engine steps ({meta['device']}, {args.dtype}, context {args.context})",
        "",
        "| step | kernels | replay ms | call ms | x decode B=1 |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        fmt = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
        lines.append(
            f"| {r['step']} | {r['kernels']} | {fmt(r['replay_ms'])} | {fmt(r.get('call_ms'))} "
            f"| {fmt(r['x_decode_b1'], 2)} |"
        )
    text = "\n".join(lines)
    (out / "decode_probe.md").write_text(text + "\n")
    log.info("\n%s", text)
    if args.verbose:
        for r in rows:
            lines = "\n".join(f"  {n:5d} {t:8.1f} us  {k}" for k, n, t in r["by_name"])
            log.info("%s kernels (%.1f us on the device, eager):\n%s", r["step"], r["kernel_us"], lines)


def _decode_same_length(verifier: Verifier, ids: list[str]) -> None:
    """One public decode call, then the lengths rolled back so that every call sees the same context."""
    verifier.decode(ids)
    for s in ids:
        verifier.seqs.get(s)[1].length -= 1


if __name__ == "__main__":
    main()
