"""CLI: python -m training.pipeline {prompts,generate,features,train,eval,all,pack,unpack} --workdir W [options].

Every stage is resumable and skips finished work; --minutes bounds one invocation's wall-clock time so
that a call under a hard time limit ends cleanly with its progress saved. pack / unpack carry a workdir's
state (training state, generated shards, prompt files) to the next machine (training/carry.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.model.llama import LlamaModel
from common.weights import Checkpoint, load_checkpoint
from training.generate import GEN_DIR
from training.parallel import Group, Part, launch
from training.sources import parse_source_weights

if TYPE_CHECKING:
    from training.magpie import MagpieConfig

log = logging.getLogger(__name__)

STAGES = ("prompts", "generate", "features", "train", "eval", "all", "pack", "unpack")
PARALLEL_STAGES = ("prompts", "generate", "train")  # --workers N
FEAT_DIR, MAGPIE_DIR = "features", "magpie"


def source_weights_arg(text: str) -> tuple[tuple[str, int], ...]:
    """--source-weights' value (training.sources.parse_source_weights), its error as argparse's."""
    try:
        return parse_source_weights(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def build_parser() -> argparse.ArgumentParser:
    from training.carry import MOMENTS, MiB, PackLimits  # the defaults of the knobs below are the configs' own
    from training.evaluate import EvalConfig
    from training.generate import GenerateConfig

    p = argparse.ArgumentParser(prog="python -m training.pipeline", description=__doc__)
    p.add_argument("stage", choices=STAGES)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--model", default=None, help="base model (GGUF or HF folder); default: the embedded SmolLM2")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="base model dtype (default: bfloat16 on cuda, float32 on cpu)",
    )
    p.add_argument("--minutes", type=float, default=None, help="wall-clock budget of this invocation")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes, one a GPU with --device cuda (training/parallel.py): the prompts stage's Magpie shards and "
        "generate's shards split between them, train data-parallel (one step = a batch on each)",
    )
    p.add_argument("--part", type=Part.parse, default=None, help=argparse.SUPPRESS)  # set by --workers' launcher
    p.add_argument("--log-level", default="INFO")
    g = p.add_argument_group("prompts")
    g.add_argument("--max-prompt-tokens", type=int, default=512)
    g.add_argument("--heldout", type=int, default=100)
    g.add_argument("--max-train-prompts", type=int, default=None)
    g.add_argument(
        "--sources",
        default="all",
        help="training sources, comma-separated (default: all; empty, --sources=, for Magpie's prompts alone)",
    )
    g.add_argument("--magpie", type=int, default=0, help="user messages the base model samples itself (Magpie)")
    g.add_argument("--magpie-batch", type=int, default=64)
    g.add_argument("--magpie-shard", type=int, default=1024, help="messages per Magpie shard (unit of resumption)")
    g.add_argument("--magpie-max-tokens", type=int, default=128)
    g.add_argument("--magpie-temperature", type=float, default=1.0)
    g.add_argument("--magpie-top-p", type=float, default=0.95)
    g.add_argument(
        "--magpie-steered",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="share of the Magpie shards whose messages start with a steer's opener (0..1, default 0)",
    )
    g.add_argument(
        "--magpie-families",
        default="writing",
        metavar="F,F",
        help="steer families the steered shards take in turn: writing, qa, summary, chat, code, math (default writing)",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="Magpie sampling, the training prompts' shuffle, generate's sampled prompts"
    )
    g = p.add_argument_group("generate")
    g.add_argument("--max-new-tokens", type=int, default=None, help="generate: 256, eval: 128")
    g.add_argument("--gen-batch", type=int, default=256)
    g.add_argument("--shard-size", type=int, default=1024)
    g.add_argument("--limit", type=int, default=None, help="generate/features: prompts; eval: prompts per set")
    g.add_argument(
        "--generator",
        choices=("engine", "model"),
        default="engine",
        help="greedy responses through the serving engine (continuous batching over min(--gen-batch, 64) "
        "slots, CUDA graphs on a GPU) or the plain batched model loop",
    )
    g.add_argument(
        "--sample-share",
        type=float,
        default=GenerateConfig.sample_share,
        metavar="S",
        help="share of the prompts answered by sampling (chosen by prompt index and --seed; the engine generator "
        "only), the rest greedily; shards record each row's temperature (default 0: all greedy)",
    )
    g.add_argument(
        "--sample-temperature",
        type=float,
        default=GenerateConfig.sample_temperature,
        help="the sampled prompts' temperature (top-p 1)",
    )
    g = p.add_argument_group("train")
    g.add_argument("--draft-vocab", type=int, default=8192, help="the draft vocabulary's size")
    g.add_argument(
        "--total-steps",
        type=int,
        default=None,
        help="the schedule's optimizer steps over every stage; given once, recorded in the training state",
    )
    g.add_argument(
        "--total-train-minutes",
        type=float,
        default=None,
        help="the schedule's training minutes over every stage (the schedule follows time); given once, recorded",
    )
    g.add_argument(
        "--train-steps",
        type=int,
        default=None,
        help="steps of this stage (without a total and a saved state: also the total, TrainConfig.steps if neither)",
    )
    g.add_argument(
        "--train-minutes",
        type=float,
        default=None,
        help="training minutes of this stage (without a total and a saved state: also the total, by time)",
    )
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--max-len", type=int, default=768)
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--ttt-steps", type=int, default=6)
    g.add_argument(
        "--source-weights",
        type=source_weights_arg,
        default=(),
        help="SOURCE=COPIES,...: each epoch holds COPIES copies of a source's sequences and the draft vocabulary "
        "counts their tokens as often (e.g. sharegpt=3: most of the code is in ShareGPT); other sources once",
    )
    g.add_argument("--save-every", type=int, default=200)
    g.add_argument("--log-every", type=int, default=20)
    g.add_argument("--offline-features", action="store_true", help="train on stored features instead of online")
    g.add_argument(
        "--vocab-swap-ratio",
        type=float,
        default=3.0,
        help="with --init-head: keep a draft token unless one outside the vocabulary is more than this many times as "
        "frequent in the responses (1: the most frequent tokens; default 3)",
    )
    g.add_argument(
        "--init-head",
        type=Path,
        default=None,
        help="continue training from this EAGLE-3 head folder (e.g. models/eagle3-smollm2); its draft vocabulary "
        "follows the responses (--vocab-swap-ratio; of another --draft-vocab size: the most frequent tokens), the rows "
        "of the tokens it keeps are its own, new ones start from the base's lm_head",
    )
    g.add_argument(
        "--extra-gen",
        type=Path,
        nargs="+",
        default=[],
        help="more generated shards to train on, after W/gen's: another workdir's gen folder (e.g. Magpie code and "
        "math requests built with `prompts --sources=` and generated there)",
    )
    g = p.add_argument_group("eval")
    g.add_argument("--head", type=Path, default=None, help="EAGLE-3 head folder (default: W/head)")
    g.add_argument(
        "--sets",
        default="sharegpt,humaneval,writingbench",
        help="eval sets, comma-separated: sharegpt, humaneval, writingbench (the prompts stage's), heldout-CATEGORY "
        "(bench.load.HELDOUT's chat, code, math, qa, summarization or writing prompts, 24 each; never trained "
        "on) or heldout (all six, and their pooled figure as heldout-all)",
    )
    g.add_argument("--eval-batch", type=int, default=16)
    g.add_argument("--eval-limit", type=int, default=None, help="prompts per eval set (default: --limit)")
    g.add_argument(
        "--out", type=Path, default=None, help="eval: JSON results (default: W/eval.json); pack: the folder to write"
    )
    g.add_argument(
        "--check-equal",
        action="store_true",
        help="compare with plain greedy decoding; exit status 1 if any output differs",
    )
    g.add_argument(
        "--eval-temperature",
        type=float,
        default=EvalConfig.temperature,
        help="eval: 0 greedy (default); else every request samples at it (prompt i of a set with seed i)",
    )
    g.add_argument("--eval-top-p", type=float, default=EvalConfig.top_p, help="eval: the sampled requests' top-p")
    g.add_argument("--eval-max-new-tokens", type=int, default=128, help="all: eval's max new tokens")
    g.add_argument(
        "--eval-reserve-minutes", type=float, default=2.0, help="all: run eval only if this much of the budget is left"
    )
    g = p.add_argument_group("pack / unpack (training/carry.py)")
    g.add_argument("--what", default="all", help="sections: all (those the workdir has) or train,gen,prompts")
    g.add_argument("--from", dest="sources", type=Path, nargs="+", default=None, help="unpack: the pack's folders")
    g.add_argument(
        "--moments",
        choices=tuple(MOMENTS),
        default=next(iter(MOMENTS)),
        help="pack: AdamW's moments in the packed training state (the weights stay float32)",
    )
    g.add_argument("--max-file-mib", type=float, default=PackLimits.max_file_bytes / MiB, help="pack: one file")
    g.add_argument(
        "--max-files", type=int, default=PackLimits.max_files, help="pack: files in one call folder, manifest included"
    )
    g.add_argument(
        "--max-call-mib",
        type=float,
        default=PackLimits.max_call_bytes / MiB,
        help="pack: one call folder (what one call brings back, and what the next carries in beside the repository)",
    )
    return p


class Context:
    """Lazily loaded shared objects (the checkpoint is loaded once per invocation)."""

    def __init__(self, args: argparse.Namespace, start: float | None = None) -> None:
        """start: when the invocation began (time.time(); default now), which --minutes counts from."""
        self.args = args
        self.device = torch.device(args.device)
        self.dtype_name = args.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        self.start = time.time() if start is None else start
        self.deadline = None if args.minutes is None else self.start + args.minutes * 60 - 20
        self._ckpt: Checkpoint | None = None
        self._model: LlamaModel | None = None
        self._tok = None

    def left_s(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.time()

    @property
    def ckpt(self) -> Checkpoint:
        if self._ckpt is None:
            self._ckpt = load_checkpoint(self.args.model)
        return self._ckpt

    @property
    def tokenizer(self):
        if self._tok is None:
            from common.tokenizer import Tokenizer

            self._tok = Tokenizer(self.ckpt.path)
        return self._tok

    @property
    def model(self) -> LlamaModel:
        if self._model is None:
            from common.engine.verifier import torch_dtype

            self._model = LlamaModel.loaded(
                self.ckpt.config, self.ckpt.state_dict, self.device, torch_dtype(self.dtype_name)
            )
        return self._model


def magpie_config(a: argparse.Namespace) -> MagpieConfig | None:
    """The Magpie settings of the command line; None without --magpie."""
    from training.magpie import MagpieConfig

    if a.magpie <= 0:
        if a.magpie_steered > 0:
            raise ValueError("--magpie-steered needs Magpie prompts (--magpie N)")
        return None
    return MagpieConfig(
        count=a.magpie,
        batch_size=a.magpie_batch,
        shard_size=a.magpie_shard,
        max_new_tokens=a.magpie_max_tokens,
        temperature=a.magpie_temperature,
        top_p=a.magpie_top_p,
        seed=a.seed,
        steered_share=a.magpie_steered,
        steer_families=tuple(f.strip() for f in a.magpie_families.split(",") if f.strip()),
    )


def prompts_request(a: argparse.Namespace, mcfg: MagpieConfig | None) -> dict:
    """What a prompt build answers, as its manifest records it: the training sources, every Magpie setting
    (mcfg = magpie_config(a), steers included) and the seed, as JSON reads them back (the families as a list). A
    build is reused only for an equal request."""
    from training.sources import TRAIN_SOURCES

    sources = list(TRAIN_SOURCES) if a.sources == "all" else [s.strip() for s in a.sources.split(",") if s.strip()]
    magpie = None if mcfg is None else json.loads(json.dumps(asdict(mcfg)))
    return {"sources": sources, "magpie": magpie, "seed": a.seed}


def built_request(manifest: Path) -> dict | None:
    """The request a prompt build's manifest records."""
    return json.loads(manifest.read_text()).get("request")


def stage_prompts(ctx: Context) -> bool:
    """Magpie shards first (when asked for; stops with False when the budget runs out), then the prompt files.
    Finished when the manifest records the same request (prompts_request)."""
    from training.magpie import finished_items, magpie_stage, read_shards, steer_counts, steer_prefixes
    from training.prompts import MANIFEST, PromptConfig, build_prompts

    a, w = ctx.args, ctx.args.workdir
    mcfg = magpie_config(a)
    request = prompts_request(a, mcfg)
    if (w / MANIFEST).exists():
        if built_request(w / MANIFEST) == request:
            log.info("prompts: already built (%s)", w / MANIFEST)
            return True
        log.info("prompts: %s was built for another request; rebuilding", w / MANIFEST)
        if (w / GEN_DIR).exists():
            log.warning("prompts: %s holds responses to the previous prompt files: remove it", w / GEN_DIR)
    cfg = PromptConfig(
        max_prompt_tokens=a.max_prompt_tokens, heldout=a.heldout, max_train=a.max_train_prompts, seed=a.seed
    )
    extra, meta = {}, {"request": request}
    if mcfg is not None:
        tok = ctx.tokenizer
        prefixes = steer_prefixes(tok.encode_turn_prefix("user"), tok.encode_prompt, mcfg.steers())
        if not magpie_stage(
            ctx.model, prefixes, tok.decode, w / MAGPIE_DIR, mcfg, tok.eos_token_id, ctx.device, ctx.deadline, a.part
        ):
            return False
        if a.part is not None:  # the launcher builds the prompt files once every part is done
            return True
        rows = read_shards(w / MAGPIE_DIR, mcfg)
        extra["magpie"] = finished_items(rows)
        meta["magpie"] = {"generated": len(rows), "finished": len(extra["magpie"]), "by_steer": steer_counts(rows)}
    build_prompts(w, ctx.tokenizer, cfg, request["sources"], extra, meta)
    return True


def stage_generate(ctx: Context) -> bool:
    from training.generate import GenerateConfig, generate_stage
    from training.prompts import TRAIN_FILE, read_prompts

    a, w = ctx.args, ctx.args.workdir
    done = w / GEN_DIR / "DONE"
    cfg = GenerateConfig(
        max_new_tokens=a.max_new_tokens or 256,
        batch_size=a.gen_batch,
        shard_size=a.shard_size,
        limit=a.limit,
        sample_share=a.sample_share,
        sample_temperature=a.sample_temperature,
        seed=a.seed,
    )
    sampled = {"sample_share": cfg.sample_share, "sample_temperature": cfg.sample_temperature, "seed": cfg.seed}
    if done.exists():  # finished here or carried in (unpack): its shards stand only for this call's sampling
        recorded = json.loads(done.read_text())
        theirs = {k: recorded.get(k, 0.0 if k == "sample_share" else v) for k, v in sampled.items()}  # none: greedy
        if theirs["sample_share"] != cfg.sample_share or (cfg.sample_share > 0 and theirs != sampled):
            raise ValueError(
                f"{done} records responses generated with {theirs}, this call asks for {sampled}: remove {GEN_DIR}, "
                "or pass the settings it was made with"
            )
        log.info("generate: already done (%s)", done.read_text().strip())
        return True
    if cfg.sample_share > 0 and a.generator != "engine":
        raise ValueError("--sample-share needs --generator engine (the model loop samples a whole batch alike)")
    rows = read_prompts(w / TRAIN_FILE)
    eos = ctx.ckpt.config.eos_token_id
    if a.generator == "engine":  # the serving engine: CUDA graphs on a GPU, continuous batching
        from common.engine.factory import make_verifier
        from common.engine.verifier import VerifierConfig
        from training.generate import engine_generate

        longest = max((len(r["prompt_ids"]) for r in rows), default=1)
        vcfg = VerifierConfig(
            max_sequences=min(a.gen_batch, 64),
            max_context=longest + cfg.max_new_tokens + 1,
            dtype=ctx.dtype_name,
            device=str(ctx.device),
        )
        engine = functools.cache(lambda: make_verifier(ctx.ckpt, vcfg, graphs=True))  # not when every shard exists

        def generate(prompts: list[list[int]], sampling: list) -> list[list[int]]:
            return engine_generate(engine(), prompts, cfg.max_new_tokens, eos, sampling=sampling)
    else:
        from training.generate import generate_batch

        def generate(prompts: list[list[int]], sampling: list) -> list[list[int]]:
            return generate_batch(ctx.model, prompts, cfg.max_new_tokens, eos, ctx.device)

    ok = generate_stage(generate, rows, w / GEN_DIR, cfg, ctx.deadline, a.part)
    if ok and a.part is None:
        n = len(rows) if cfg.limit is None else min(cfg.limit, len(rows))
        done.write_text(json.dumps({"prompts": n, "max_new_tokens": cfg.max_new_tokens, **sampled}) + "\n")
    return ok


def stage_features(ctx: Context) -> bool:
    from training.features import features_stage
    from training.generate import load_sequences

    a, w = ctx.args, ctx.args.workdir
    seqs = load_sequences(w / GEN_DIR)
    return features_stage(
        ctx.model,
        seqs,
        w / FEAT_DIR,
        ctx.device,
        batch_size=a.batch_size,
        max_len=a.max_len,
        limit=a.limit,
        deadline=ctx.deadline,
    )


def stage_train(ctx: Context) -> bool:
    from training.features import StoredFeatures
    from training.generate import load_sequences
    from training.train import StageBudget, TrainConfig, Trainer

    a, w = ctx.args, ctx.args.workdir
    if (w / "train" / "DONE").exists():
        log.info("train: already done (%s)", (w / "train" / "DONE").read_text().strip())
        return True
    if a.total_steps is not None and a.total_train_minutes is not None:
        raise ValueError("give one total: --total-steps or --total-train-minutes")
    given = a.total_steps is not None or a.total_train_minutes is not None
    if given:
        steps, minutes = a.total_steps or TrainConfig.steps, a.total_train_minutes
    else:  # one stage, or a saved state's recorded total (Trainer: total_given=False)
        steps, minutes = a.train_steps or TrainConfig.steps, a.train_minutes
    cfg = TrainConfig(
        draft_vocab=a.draft_vocab,
        steps=steps,
        minutes=minutes,
        batch_size=a.batch_size,
        max_len=a.max_len,
        lr=a.lr,
        ttt_steps=a.ttt_steps,
        source_weights=a.source_weights,
        vocab_swap_ratio=a.vocab_swap_ratio,
        save_every=a.save_every,
        log_every=a.log_every,
    )
    if a.offline_features and a.extra_gen:
        raise ValueError("--offline-features are W/gen's alone: train --extra-gen online")
    seqs = load_sequences(w / GEN_DIR, *a.extra_gen)
    feats = StoredFeatures(w / FEAT_DIR) if a.offline_features else None
    group = Group.from_env(ctx.device)  # the --workers launcher's ranks, or None
    try:
        trainer = Trainer(ctx.model, seqs, w, cfg, ctx.device, feats, a.init_head, given, group)
        return trainer.run(ctx.deadline, StageBudget(steps=a.train_steps, minutes=a.train_minutes))
    finally:
        if group is not None:
            group.close()


def stage_pack(ctx: Context) -> bool:
    from training.carry import MiB, PackLimits, pack

    a = ctx.args
    if a.out is None:
        raise ValueError("pack needs --out DIR (an empty folder; on the GPU machine a folder on its disk, see docs)")
    limits = PackLimits(
        max_file_bytes=int(a.max_file_mib * MiB), max_files=a.max_files, max_call_bytes=int(a.max_call_mib * MiB)
    )
    manifest = pack(a.workdir, a.out, a.what, limits, a.moments)
    for k, names in enumerate(manifest["folders"], 1):
        size = sum(manifest["files"][n]["bytes"] for n in names)
        log.info("pack: call folder %s: %s (%.1f MiB)", a.out / str(k), ", ".join(names), size / MiB)
    return True


def stage_unpack(ctx: Context) -> bool:
    from training.carry import unpack

    a = ctx.args
    if not a.sources:
        raise ValueError("unpack needs --from DIR [DIR ...]: the folders the pack's call folders were carried into")
    unpack(a.workdir, a.sources, a.what)
    return True


def stage_eval(ctx: Context, max_new_tokens: int | None = None) -> bool:
    """Returns False when --check-equal found an output that differs from plain greedy decoding."""
    from common.engine.draft import Eagle3Drafter
    from common.engine.verifier import Verifier, VerifierConfig, torch_dtype
    from common.model.eagle3_io import load_eagle3
    from training.evaluate import EvalConfig, evaluate_set, format_table, pooled
    from training.prompts import EVAL_FILES, HELDOUT_SETS, heldout_prompts, read_prompts
    from training.sources import package_versions
    from training.train import HEAD_INFO

    a, w = ctx.args, ctx.args.workdir
    head_dir = a.head or (w / "head")
    sets = [x for s in a.sets.split(",") if s.strip() for x in HELDOUT_SETS.get(s.strip(), [s.strip()])]
    unknown = [s for s in sets if s not in EVAL_FILES and s not in HELDOUT_SETS["heldout"]]
    if unknown:
        names = ", ".join([*EVAL_FILES, *HELDOUT_SETS])
        raise ValueError(f"unknown eval set {unknown[0]!r}: choose from {names}")
    cfg = EvalConfig(
        max_new_tokens=max_new_tokens or a.max_new_tokens or 128,
        batch_size=a.eval_batch,
        limit=a.eval_limit if a.eval_limit is not None else a.limit,
        temperature=a.eval_temperature,
        top_p=a.eval_top_p,
        check_equal=a.check_equal,
    )
    heldout = heldout_prompts(ctx.tokenizer) if any(s.startswith("heldout-") for s in sets) else {}
    prompts = {
        s: heldout[s] if s in heldout else [r["prompt_ids"] for r in read_prompts(w / EVAL_FILES[s])] for s in sets
    }
    longest = max((len(p) for ps in prompts.values() for p in ps[: cfg.limit]), default=16)
    vcfg = VerifierConfig(
        max_sequences=cfg.batch_size,
        max_context=longest + cfg.max_new_tokens + 16,
        max_tree_nodes=64,
        dtype=ctx.dtype_name,
        device=str(ctx.device),
    )
    verifier = Verifier(ctx.ckpt, vcfg)
    head, hcfg = load_eagle3(head_dir, device=ctx.device, dtype=torch_dtype(ctx.dtype_name))

    def make_drafter(dcfg):
        return Eagle3Drafter(head, verifier.model.embed_tokens, dcfg, cfg.batch_size, vcfg.max_context, ctx.device)

    eos = ctx.ckpt.config.eos_token_id
    results = {}
    for s in sets:
        results[s] = evaluate_set(verifier, make_drafter, prompts[s], cfg, eos, s)
    categories = [s for s in sets if s.startswith("heldout-")]
    if len(categories) > 1:
        results["heldout-all"] = pooled([results[s] for s in categories])
    out = a.out or (w / "eval.json")
    head_info = head_dir / HEAD_INFO  # a head the train stage exported: the step and minutes it was trained
    meta = {
        "head": str(head_dir),
        "head_training": json.loads(head_info.read_text()) if head_info.exists() else None,
        "device": str(ctx.device),
        "dtype": ctx.dtype_name,
        "max_new_tokens": cfg.max_new_tokens,
        "limit": cfg.limit,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "packages": package_versions(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)  # a workdir of held-out sets alone has no prompts stage before
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    sys.stdout.write(format_table(results))
    sys.stdout.write(f"results written to {out}\n")
    differing = [
        f"{s}/{t}"
        for s, r in results.items()
        for t, v in r.items()
        if isinstance(v, dict) and v.get("equal_to_greedy") is False
    ]
    if differing:
        sys.stdout.write(f"CHECK FAILED: outputs differ from plain greedy decoding in {', '.join(differing)}\n")
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    start = time.time()
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    tag = f" [part {args.part.index}/{args.part.count}]" if args.part else ""
    if "WORLD_SIZE" in os.environ:  # a rank of train --workers
        tag = f" [rank {os.environ.get('RANK')}/{os.environ['WORLD_SIZE']}]"
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s %(levelname)s %(name)s{tag}: %(message)s")
    if args.workers < 1:
        raise SystemExit(f"--workers takes 1 or more processes, got {args.workers}")
    if args.workers > 1:
        if args.stage not in PARALLEL_STAGES:
            raise SystemExit(f"--workers: only the stages {', '.join(PARALLEL_STAGES)} run in several processes")
        rest = without_workers(argv)
        cuda = torch.device(args.device).type == "cuda"
        code = launch(rest, args.workers, cuda, distributed=args.stage == "train")
        if code != 0 or args.stage == "train":
            return code
        # the parts have ended: this process finishes the stage, within what is left of --minutes (the shards of parts
        # stopped by the budget are left to the next invocation)
        args = build_parser().parse_args(rest)
    ctx = Context(args, start)
    runners = {
        "prompts": stage_prompts,
        "generate": stage_generate,
        "features": stage_features,
        "train": stage_train,
        "eval": stage_eval,
        "pack": stage_pack,
        "unpack": stage_unpack,
    }
    if args.stage == "eval":
        return 0 if stage_eval(ctx) else 1
    if args.stage != "all":
        ok = runners[args.stage](ctx)
        if args.part is not None:  # the launcher's own run says whether the stage is finished
            log.info("%s: part %d/%d ends", args.stage, args.part.index, args.part.count)
        elif not ok:
            log.info("%s: stopped by the time budget; run the same command again to continue", args.stage)
        return 0
    for name in ("prompts", "generate", "train"):
        if not runners[name](ctx):
            log.info("all: stopped in %s by the time budget; run the same command again to continue", name)
            return 0
    if (args.workdir / "eval.json").exists() and args.out is None:
        log.info("all: eval already done (%s)", args.workdir / "eval.json")
        return 0
    if ctx.left_s() < args.eval_reserve_minutes * 60:
        log.info("all: %.0fs left, less than the eval reserve; run the same command again to evaluate", ctx.left_s())
        return 0
    return 0 if stage_eval(ctx, args.eval_max_new_tokens) else 1


def without_workers(argv: list[str]) -> list[str]:
    """argv less its --workers option: ['train', '--workers', '4', '--lr', '1'] -> ['train', '--lr', '1']."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--workers":
            skip = True
        elif not a.startswith("--workers="):
            out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
