"""Engine-step probe on the real model: kernels per step (torch.profiler over one eager run of the step
function that the graph captures) and CUDA graph replay time of plain decoding, greedy and sampling, at
several batch sizes; multi-step decoding of a batch of 16, all greedy against half sampling; the draft's
whole proposal, greedy against a batch with a sampling row; the verification of trees, greedy against
sampling (the one-hot rule's trees and the q rule's), each at a stated context length; and the sampled verify's
two kernels alone (the top-p threshold, the one-hot acceptance), each replayed from a graph of its launch.

    PYTHONPATH=. python -m bench.decode_probe --out DIR [--context 256] [--batches 1,16,64] [--draft-vocab N] [-v]

(--device cpu runs the same steps eagerly at small sizes: a check of the probe itself, its times no measure.)

Writes DIR/decode_probe.json and DIR/decode_probe.md (a markdown table, also logged). Replays run back to
back without a host sync in between (the graph time); "call ms" is the engine's public call (host packing,
the H2D copy, replays, the one D2H read); "x base" is a step's replay over its base's (greedy at the same
batch; for the proposal and the verify, as named; decode B=1 for the greedy rows). Sampling rows sample at
temperature 0.7, top-p 0.9 unless the step says otherwise. -v lists the kernels of each step by name.
Under 3 minutes on an H100 after the graphs' capture.
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
from common.engine.base import PrefillInput, ProposeInput, VerifyInput
from common.engine.cuda_graphs import GraphConfig
from common.engine.draft import Eagle3Drafter
from common.engine.verifier import SampledColumns, Sampler, Verifier, VerifierConfig, pack_trees, tree_depth
from common.engine.verifier_parts import pack_sampled
from common.kernels import accept_sampled, onehot_sets, speculative, tree_mask
from common.kernels.sampling import RULE_ONEHOT, SamplingRows, TreeSets

log = logging.getLogger("bench.decode_probe")
DEFAULT_HEAD = Path(__file__).resolve().parents[1] / "models" / "eagle3-smollm2"
HOT = SamplingConfig(temperature=0.7, top_p=0.9)  # the sampling rows' (each its own seed)
WARM = SamplingConfig(temperature=0.7)  # temperature only: the unfiltered variant


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernels(fn) -> list[tuple[str, float]]:
    """(name, microseconds on the device) of each CUDA kernel launched by one call of fn (none on a CPU)."""
    if not torch.cuda.is_available():
        fn()
        return []
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type.name == "CUDA"]


def timed(fn, iters: int = 200) -> float:
    """Mean ms per call of fn, calls back to back, one sync at the end (one call, no warm-up, on a CPU)."""
    iters = iters if torch.cuda.is_available() else 1
    for _ in range(min(10, iters) if torch.cuda.is_available() else 0):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters * 1e3


def probe_step(name: str, graphs, key, step, inputs: dict, verbose: bool) -> dict:
    dev_inputs = {k: v.to(graphs.device) for k, v in inputs.items()}
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


def relative(rows: list[dict], name: str, base: str) -> None:
    """rows[name]["x_base"] = its replay over base's."""
    at = {r["step"]: r for r in rows}
    if at[name]["replay_ms"] and at[base]["replay_ms"]:
        at[name]["x_base"] = at[name]["replay_ms"] / at[base]["replay_ms"]
        at[name]["base"] = base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="GGUF or HF folder (default: the embedded model)")
    ap.add_argument("--head", default=str(DEFAULT_HEAD))
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="a head of this many draft tokens instead, its weights random (the times depend on its shapes alone)",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=256, help="committed tokens per sequence while probing")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the probe (small sizes, eager)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    dev = args.device
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from common.model.eagle3 import Eagle3Config, Eagle3Head
    from common.model.eagle3_io import load_eagle3
    from common.weights import load_checkpoint

    t_start = time.perf_counter()
    ckpt = load_checkpoint(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    max_b = max(batches)
    gc = GraphConfig(batch_buckets=tuple(sorted(set(batches) | {1, 16})), tree_buckets=(16, 32, 64))
    vcfg = VerifierConfig(max_sequences=max_b + 8, max_context=2048, max_tree_nodes=63, dtype=args.dtype, device=dev)
    verifier = Verifier(ckpt, vcfg, graphs=True, graph_cfg=gc)
    if args.draft_vocab is None:
        head, _ = load_eagle3(args.head)
    else:
        head = Eagle3Head(Eagle3Config.for_base(ckpt.config, args.draft_vocab))
        head.set_vocab_map(torch.arange(args.draft_vocab))
    head.to(device=dev, dtype=verifier.model.embed_tokens.weight.dtype).eval()
    drafting = DraftingConfig(sampling_rule="q")  # the q rule's proposal and trees too (one-hot trees: greedy ones)
    drafter = Eagle3Drafter(
        head, verifier.model.embed_tokens, drafting, max_b + 8, 2048, dev, graphs=True, graph_cfg=gc
    )
    t_captured = time.perf_counter()
    rng = np.random.default_rng(0)
    vocab = verifier.info.vocab_size

    def context() -> list[int]:
        return rng.integers(100, 20000, size=args.context).tolist()

    ids = [f"s{i}" for i in range(max_b)]  # greedy
    hot = [f"h{i}" for i in range(8)]  # sampling (HOT)
    verifier.prefill_batch([PrefillInput(s, context(), SamplingConfig()) for s in ids[:8]])
    for s in ids[8:]:
        verifier.prefill(PrefillInput(s, context(), SamplingConfig()))
    verifier.prefill_batch([PrefillInput(s, context(), SamplingConfig(0.7, 0.9, seed=i)) for i, s in enumerate(hot)])
    rows = []

    # ---- plain decoding: one step's replay per batch and Sampler (every row of the block sampling) ----
    for b in batches:
        for sampler, cfg in ((Sampler.GREEDY, None), (Sampler.TEMPERATURE, WARM), (Sampler.FILTERED, HOT)):
            block = verifier._decode_block(b, sampler)
            for i in range(b):
                slot, st = verifier.seqs.get(ids[i])
                block[i, :3] = torch.tensor([st.pending, st.length, slot])
                if cfg is not None:
                    block[i, 3:] = torch.from_numpy(SamplingRows.pack(cfg, 1000 + i, vocab))
            key, step = verifier._decode_variant(b, sampler)
            name = f"decode B={b}" + ("" if cfg is None else f", {sampler.value}")
            row = probe_step(name, verifier.graphs, key, step, {"packed": block}, args.verbose)
            if cfg is None:
                row["call_ms"] = timed(lambda b=b: _decode_same_length(verifier, ids[:b], 1), 50)
            rows.append(row)
            if cfg is not None:
                relative(rows, name, f"decode B={b}")

    # ---- multi-step decoding: 16 sequences, 16 steps a call, all greedy against half sampling ----
    steps = 16
    for name, batch in (("decode_many B=16 greedy", ids[:16]), ("decode_many B=16 half sampled", ids[:8] + hot)):
        ms = timed(lambda batch=batch: _decode_same_length(verifier, batch, steps), 20)
        rows.append({"step": name, "kernels": None, "replay_ms": None, "call_ms": ms, "tok_s": 16 * steps / ms * 1e3})
    greedy_many = rows[-2]["tok_s"]
    rows[-1]["x_base"], rows[-1]["base"] = rows[-1]["tok_s"] / greedy_many, "decode_many B=16 greedy (tokens/s)"

    # ---- the draft's proposal: 4 new tokens, tree 10/6/60, greedy against a batch with a sampling row ----
    feats = 3 * ckpt.config.hidden_size
    for b in (1, 16):
        feat = torch.randn(args.context, feats, device=dev)
        drafter.propose([ProposeInput(s, context(), feat, True, [1], 0) for s in ids[:b]])
        news = [ProposeInput(s, [5, 6, 7, 8], torch.randn(4, feats, device=dev), False, [], 0) for s in ids[:b]]
        packed, hidden = drafter._pack(news, b, 4)
        depth = drafter.drafting.steps
        noise = {"temp": torch.zeros(b), "seed": torch.arange(b, dtype=torch.int64)}
        noise["temp"][0] = 0.7  # one sampling row
        for sampled in (False, True):
            name = f"propose B={b}, 10/6/60" + (", a sampling row" if sampled else "")
            key = ("propose", b, 4, depth, sampled)
            step = functools.partial(drafter._propose_step, depth=depth)
            inputs = {"packed": packed, "hidden": hidden, **(noise if sampled else {})}
            rows.append(probe_step(name, drafter.graphs, key, step, inputs, args.verbose))
        relative(rows, f"propose B={b}, 10/6/60, a sampling row", f"propose B={b}, 10/6/60")
        drafter.release(ids[:b])

    # ---- verification of 60-node trees (61 rows, bucket 64): greedy, and sampling rows' (one-hot, q rule) ----
    def starts(names: list[str], sampling: SamplingConfig | None = None) -> list[ProposeInput]:
        return [
            ProposeInput(s, context(), torch.randn(args.context, feats, device=dev), True, [1], 0,
                         sampling=sampling or SamplingConfig(0.7, 0.9, seed=i))
            for i, s in enumerate(names)
        ]  # fmt: skip

    plain_trees = drafter.propose(starts(ids[:16], SamplingConfig()))  # top-k trees (no q)
    q_trees = drafter.propose(starts(hot))  # drawn from q
    assert all(t.size == drafting.verify_tree_size for t in plain_trees + q_trees)
    half = ids[:8] + hot  # B = 16: 8 greedy sequences, 8 sampling ones
    cases = {
        "verify B=1, 61 rows": [VerifyInput(ids[0], plain_trees[0])],
        "verify B=1, 61 rows, one-hot": [VerifyInput(hot[0], plain_trees[0])],
        "verify B=1, 61 rows, q": [VerifyInput(hot[0], q_trees[0])],
        "verify B=16, 61 rows": [VerifyInput(s, t) for s, t in zip(ids[:16], plain_trees)],
        "verify B=16, 61 rows, half one-hot": [VerifyInput(s, t) for s, t in zip(half, plain_trees)],
        "verify B=16, 61 rows, half q": [VerifyInput(s, t) for s, t in zip(half, plain_trees[:8] + q_trees)],
    }
    for name, items in cases.items():
        key, step, block = _verify_inputs(verifier, items, len(items), 64)
        rows.append(probe_step(name, verifier.graphs, key, step, {"packed": block}, args.verbose))
        base = name.split(", 61 rows")[0] + ", 61 rows"
        if name != base:
            relative(rows, name, base)

    rows += _kernel_rows(plain_trees, vocab, dev)

    decode1 = next(r for r in rows if r["step"] == "decode B=1")["replay_ms"]
    for r in rows:
        r["x_decode_b1"] = r["replay_ms"] / decode1 if r["replay_ms"] and decode1 else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else dev,
        "dtype": args.dtype,
        "context": args.context,
        "torch": torch.__version__,
        "capture_s": round(t_captured - t_start, 1),
        "probe_s": round(time.perf_counter() - t_captured, 1),
    }
    (out / "decode_probe.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        f"# Engine steps ({meta['device']}, {args.dtype}, context {args.context})",
        "",
        "| step | kernels | replay ms | call ms | tokens/s | x base | x decode B=1 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fmt = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
        lines.append(
            f"| {r['step']} | {r['kernels'] if r['kernels'] is not None else '-'} | {fmt(r['replay_ms'])} "
            f"| {fmt(r.get('call_ms'))} | {fmt(r.get('tok_s'), 0)} | {fmt(r.get('x_base'), 2)} "
            f"| {fmt(r['x_decode_b1'], 2)} |"
        )
    text = "\n".join(lines)
    (out / "decode_probe.md").write_text(text + "\n")
    log.info("\n%s\n(capture %.0f s, probe %.0f s)", text, meta["capture_s"], meta["probe_s"])
    if args.verbose:
        for r in rows:
            if "by_name" in r:
                listing = "\n".join(f"  {n:5d} {t:8.1f} us  {k}" for k, n, t in r["by_name"])
                log.info("%s kernels (%.1f us on the device, eager):\n%s", r["step"], r["kernel_us"], listing)


def _verify_inputs(verifier: Verifier, items: list[VerifyInput], bb: int, tb: int):
    """The graph key, step and input block of a verify of items at (bb, tb), as verify_steps builds them,
    without running it (lengths as they are: the replays write scratch rows past every sequence's end)."""
    states = [verifier.seqs.get(it.seq_id) for it in items]
    sizes = np.array([it.tree.size for it in items], dtype=np.int64)
    sampler = Sampler.of([st.sampling for _, st in states])
    if sampler is Sampler.GREEDY:
        block = verifier._verify_block(bb, tb)
        n_col = 2 * tb
    else:
        w, s = verifier._sets_shape(items, states, tb)
        block = verifier._sampled_block(bb, tb, w)
        n_col = 3 * tb
    a = block.numpy()
    pack_trees(a, [it.tree for it in items], sizes, tb)
    b = len(items)
    a[:b, 0] = [st.pending for _, st in states]
    a[:b, n_col] = [st.length for _, st in states]
    a[:b, n_col + 1] = [slot for slot, _ in states]
    shallow = tree_depth(a[:b, tb : 2 * tb]) <= 8
    if sampler is Sampler.GREEDY:
        key = ("verify", bb, tb, shallow)
        step = functools.partial(verifier._verify_step, max_depth=8 if shallow else None)
    else:
        pack_sampled(a, [it.tree for it in items], [st for _, st in states], SampledColumns(tb, w))
        key, step = verifier._sampled_variant(bb, tb, sampler, shallow, w, s)
    return key, step, block


def _kernel_rows(trees: list, vocab: int, dev: str, t: int = 64, w: int = 10) -> list[dict]:
    """The sampled verify's two kernels alone, each replayed from a CUDA graph of its one launch: the top-p
    target of B trees' t rows, and the one-hot acceptance of B drafted trees with sets w wide (the default
    drafter's top_k), on random logits (randn x 3)."""
    out = []
    for b in (1, 16):
        a = np.zeros((b, 2 * t), dtype=np.int64)
        a[:, t:] = np.arange(t)
        pack_trees(a, trees[:b], np.array([tr.size for tr in trees[:b]]), t)
        ids, par = torch.from_numpy(a[:, :t]).to(dev), torch.from_numpy(a[:, t:]).to(dev)
        pos, set_ids, q = onehot_sets(ids, par, w)
        rule = torch.full((b,), RULE_ONEHOT, device=dev)
        sets = TreeSets(set_ids.view(b, t, w), q.view(torch.float32).view(b, t, w), pos, rule)
        logits = (torch.randn(b, t, vocab, device=dev) * 3).to(torch.bfloat16 if dev == "cuda" else torch.float32)
        draw = np.stack([SamplingRows.pack(HOT, 1000 + i, vocab) for i in range(b)])
        rows = SamplingRows.unpack(torch.from_numpy(draw).to(dev), torch.full((b,), 300, device=dev))
        anc, depth = tree_mask(par)
        flat = logits.view(b * t, vocab)
        tgt = speculative.target(flat, rows, t, True)
        steps = {
            f"threshold, top-p 0.9, {b * t} rows": functools.partial(speculative.target, flat, rows, t, True),
            f"accept one-hot B={b}, 61 rows, sets {w} wide": functools.partial(
                accept_sampled, ids, par, anc, depth, logits, sets, tgt, rows, w
            ),
        }
        for name, fn in steps.items():
            replay = None
            if dev == "cuda":
                fn()  # compiled before the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                replay = timed(graph.replay)
            else:
                fn()
            out.append({"step": name, "kernels": 1, "replay_ms": replay})
    return out


def _decode_same_length(verifier: Verifier, ids: list[str], steps: int) -> None:
    """One public decode call of `steps` steps, then the lengths rolled back so that every call sees the same
    context."""
    verifier.decode_many(ids, steps)
    for s in ids:
        verifier.seqs.get(s)[1].length -= steps


if __name__ == "__main__":
    main()
