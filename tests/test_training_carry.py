"""Training that spans several GPU runs: pack / unpack of a workdir (training/carry.py), training in stages
with one schedule, generation with a share of sampled prompts, and sampled evaluation per held-out category.
Tiny models on the CPU, except the sizes of the real head's packed state and of the regenerated shards, and the
evaluation on the embedded model."""

from __future__ import annotations

import json
import logging
import shutil
import tarfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from common.engine.verifier import Verifier, VerifierConfig
from common.model.eagle3 import Eagle3Config, Eagle3Head
from common.weights import Checkpoint
from tests.test_training import CFG, CPU, tiny_base
from training.carry import MANIFEST, MANIFEST_RESERVE, MiB, PackLimits, pack, unpack
from training.generate import (
    GenerateConfig,
    engine_generate,
    generate_batch,
    generate_stage,
    load_sequences,
    row_sampling,
)
from training.train import (
    HEAD_INFO,
    STATE_FILE,
    StageBudget,
    TrainConfig,
    Trainer,
    make_optimizer,
    read_state,
    write_state,
)

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
LR = 3e-3
TINY = TrainConfig(draft_vocab=128, steps=6, batch_size=4, max_len=24, ttt_steps=2, lr=LR, warmup=2, log_every=2)
FIRST = 3  # steps of the first stage; the second does the other TINY.steps - FIRST (16 sequences: 4 batches an epoch)


def prompt_rows(n: int, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {"id": f"p{i}", "prompt_ids": rng.integers(3, 512, size=int(rng.integers(3, 8))).tolist()} for i in range(n)
    ]


def greedy(base):
    return lambda prompts, sampling: generate_batch(base, prompts, 20, eos_id=2, device=CPU)


def heads_differ(a: dict, b: dict) -> float:
    """Largest absolute difference between two head state_dicts' float tensors."""
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point())


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """A workdir after the first stage (FIRST steps of TINY's schedule, shards of 8 prompts), and the state after
    the whole schedule in one go on a copy of its shards."""
    root = tmp_path_factory.mktemp("staged")
    base = tiny_base()
    first = root / "first"
    assert generate_stage(greedy(base), prompt_rows(16), first / "gen", GenerateConfig(shard_size=8, batch_size=8))
    assert not Trainer(base, load_sequences(first / "gen"), first, TINY, CPU).run(budget=StageBudget(steps=FIRST))
    one_go = root / "one-go"
    shutil.copytree(first / "gen", one_go / "gen")
    assert Trainer(base, load_sequences(one_go / "gen"), one_go, TINY, CPU).run()
    return {"base": base, "first": first, "exact": read_state(one_go / "train" / STATE_FILE), "root": root}


def second_stage(staged: dict, workdir: Path) -> dict:
    """The rest of the schedule in workdir, its total taken from the state (this call gives none), the result's
    state."""
    cfg = TrainConfig(**{**asdict(TINY), "steps": 999})  # not the total: total_given=False keeps the state's
    trainer = Trainer(staged["base"], load_sequences(workdir / "gen"), workdir, cfg, CPU, total_given=False)
    assert trainer.step == FIRST and trainer.cfg.steps == TINY.steps
    assert trainer.run()
    return read_state(workdir / "train" / STATE_FILE)


# ---- training in stages, carried ----
def test_two_stages_carried_by_pack_and_unpack_equal_one_go(staged, tmp_path):
    """FIRST steps, pack (train and gen, float32 moments), unpack into a fresh workdir, the other steps: the same
    weights and optimizer state as the whole schedule in one go, exactly (CPU, float32)."""
    info = json.loads((staged["first"] / "head" / HEAD_INFO).read_text())
    assert info == {"step": FIRST, "elapsed_min": info["elapsed_min"], "samples": 4 * FIRST, "finished": False}
    manifest = pack(staged["first"], tmp_path / "out", "train,gen", moments="float32")
    assert manifest["sections"]["train"]["step"] == FIRST and manifest["sections"]["gen"]["shards"] == 2
    unpack(tmp_path / "next", [tmp_path / "out"])
    got = second_stage(staged, tmp_path / "next")
    exact = staged["exact"]
    assert got["step"] == exact["step"] == TINY.steps and (got["epoch"], got["pos"]) == (exact["epoch"], exact["pos"])
    for k, v in exact["head"].items():
        assert torch.equal(got["head"][k], v), k
    for i, per_param in exact["opt"]["state"].items():
        for k, v in per_param.items():
            assert torch.equal(got["opt"]["state"][i][k], v), (i, k)
    lines = [json.loads(x) for x in (tmp_path / "next" / "train" / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [2, 3, 4, 6]  # the first stage's log lines came along


def test_bfloat16_moments_continue_within_their_rounding(staged, tmp_path):
    """Moments packed in bfloat16 come back as the first stage's moments rounded to bfloat16 (the weights exactly);
    the continued training ends within (steps x lr) / 128 of the exact path, while restarting the moments instead
    moves it much further."""
    saved = read_state(staged["first"] / "train" / STATE_FILE)
    manifest = pack(staged["first"], tmp_path / "out", "train,gen")  # the default: bfloat16
    assert manifest["sections"]["train"]["moments"] == "bfloat16"
    unpack(tmp_path / "bf16", [tmp_path / "out"])
    back = read_state(tmp_path / "bf16" / "train" / STATE_FILE)
    for k, v in saved["head"].items():
        assert torch.equal(back["head"][k], v), k
    for i, per_param in saved["opt"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            want = per_param[k].to(torch.bfloat16).float()
            assert back["opt"]["state"][i][k].dtype == torch.float32 and torch.equal(back["opt"]["state"][i][k], want)
    off_bf16 = heads_differ(second_stage(staged, tmp_path / "bf16")["head"], staged["exact"]["head"])
    unpack(tmp_path / "fresh", [tmp_path / "out"])
    st = read_state(tmp_path / "fresh" / "train" / STATE_FILE)
    write_state(tmp_path / "fresh" / "train" / STATE_FILE, {**st, "opt": {**st["opt"], "state": {}}})
    off_fresh = heads_differ(second_stage(staged, tmp_path / "fresh")["head"], staged["exact"]["head"])
    bound = (TINY.steps - FIRST) * LR / 128
    log.info("bfloat16 moments: %.2e off the exact path (bound %.2e); fresh moments: %.2e", off_bf16, bound, off_fresh)
    assert off_bf16 <= bound < off_fresh / 10


def test_a_later_stage_cannot_change_the_schedule(staged, tmp_path):
    """The total and the schedule's shape are the state's: another total or batch size is refused; without a total
    the state's is kept; a stage stops at its own budget with the state saved, and the last one finishes."""
    w = tmp_path / "w"
    shutil.copytree(staged["first"], w)
    seqs = load_sequences(w / "gen")
    with pytest.raises(ValueError, match=r"steps 6 \(this call: 8\)"):
        Trainer(staged["base"], seqs, w, TrainConfig(**{**asdict(TINY), "steps": 8}), CPU)
    with pytest.raises(ValueError, match=r"batch_size 4 \(this call: 8\)"):
        Trainer(staged["base"], seqs, w, TrainConfig(**{**asdict(TINY), "batch_size": 8}), CPU, total_given=False)
    with pytest.raises(ValueError, match="minutes None"):
        Trainer(staged["base"], seqs, w, TrainConfig(**{**asdict(TINY), "minutes": 5.0}), CPU)
    trainer = Trainer(staged["base"], seqs, w, TINY, CPU)
    assert not trainer.run(budget=StageBudget(steps=2)) and read_state(w / "train" / STATE_FILE)["step"] == FIRST + 2
    assert not (w / "train" / "DONE").exists()
    assert Trainer(staged["base"], seqs, w, TINY, CPU).run(budget=StageBudget(steps=5))  # stops at the total
    assert read_state(w / "train" / STATE_FILE)["step"] == TINY.steps and (w / "train" / "DONE").exists()


def test_pipeline_train_records_the_total_once(staged, tmp_path, monkeypatch, capsys):
    """`train --total-steps` is given once: a later call without it continues the recorded total; with another
    one it stops with an error before training. --source-weights is recorded too (the staged ids are ShareGPT's
    form, so every sequence is taken twice), and another weight is refused the same way."""
    from training import pipeline

    w = tmp_path / "w"
    shutil.copytree(staged["first"] / "gen", w / "gen")
    monkeypatch.setattr(pipeline.Context, "model", property(lambda self: staged["base"]))
    flags = ["--batch-size", "4", "--max-len", "24", "--ttt-steps", "2", "--lr", str(LR), "--draft-vocab", "128"]
    flags += ["--source-weights", "sharegpt=2"]

    def train(*extra: str) -> bool:
        args = pipeline.build_parser().parse_args(["train", "--workdir", str(w), *flags, *extra])
        return pipeline.stage_train(pipeline.Context(args))

    assert not train("--total-steps", "5", "--train-steps", "2")
    state = read_state(w / "train" / STATE_FILE)
    assert state["config"]["steps"] == 5 and state["config"]["source_weights"] == (("sharegpt", 2),)
    assert state["sequences"] == 2 * len(load_sequences(w / "gen"))
    with pytest.raises(ValueError, match=r"steps 5 \(this call: 7\)"):
        train("--total-steps", "7")
    with pytest.raises(ValueError, match=r"source_weights"):
        train("--source-weights", "sharegpt=3")
    with pytest.raises(SystemExit):
        train("--source-weights", "sharegpt=two")
    assert "COPIES must be an integer" in capsys.readouterr().err
    assert train("--train-steps", "9")  # the recorded total, 5, ends it
    assert read_state(w / "train" / STATE_FILE)["step"] == 5


def test_pipeline_train_takes_more_generated_shards(staged, tmp_path, monkeypatch):
    """`train --extra-gen DIR`: DIR's shards join W/gen's (here the same ones again: twice the sequences); a folder
    without shards, or stored features beside them, is refused before training."""
    from training import pipeline

    w = tmp_path / "w"
    shutil.copytree(staged["first"] / "gen", w / "gen")
    shutil.copytree(staged["first"] / "gen", tmp_path / "more" / "gen")
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(pipeline.Context, "model", property(lambda self: staged["base"]))
    flags = ["--batch-size", "4", "--max-len", "24", "--ttt-steps", "2", "--lr", str(LR), "--draft-vocab", "128"]

    def train(*extra: str) -> bool:
        args = pipeline.build_parser().parse_args(["train", "--workdir", str(w), *flags, *extra])
        return pipeline.stage_train(pipeline.Context(args))

    with pytest.raises(FileNotFoundError, match="no generated shards in .*empty"):
        train("--total-steps", "2", "--extra-gen", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="--offline-features"):
        train("--total-steps", "2", "--extra-gen", str(tmp_path / "more" / "gen"), "--offline-features")
    assert train("--total-steps", "2", "--extra-gen", str(tmp_path / "more" / "gen"))
    assert read_state(w / "train" / STATE_FILE)["sequences"] == 2 * len(load_sequences(w / "gen"))


# ---- pack / unpack ----
def test_unpack_refuses_a_missing_or_altered_part_before_writing(staged, tmp_path):
    """Small limits split the pack into several call folders (files and bytes within them, a manifest in each);
    carried into two folders it unpacks from both; a missing part or one altered byte is refused with the part's
    name before anything is written."""
    limits = PackLimits(max_file_bytes=64 * 1024, max_files=4, max_call_bytes=MANIFEST_RESERVE + 160 * 1024)
    assert limits.unit == 160 * 1024 // 3
    manifest = pack(staged["first"], tmp_path / "out", "all", limits)
    assert set(manifest["sections"]) == {"train", "gen"}  # no prompt files in this workdir
    folders = sorted((tmp_path / "out").iterdir(), key=lambda d: int(d.name))
    assert len(folders) == len(manifest["folders"]) >= 3
    for d in folders:
        parts = [p for p in d.iterdir() if p.name != MANIFEST]
        assert (d / MANIFEST).exists() and len(parts) <= limits.max_files - 1
        assert sum(p.stat().st_size for p in parts) <= limits.max_call_bytes - MANIFEST_RESERVE
        assert all(p.stat().st_size <= limits.max_file_bytes for p in parts)
    # carried in over two calls: the first folders into one place, the rest into another
    a, b = tmp_path / "carried-a", tmp_path / "carried-b"
    for i, d in enumerate(folders):
        shutil.copytree(d, (a if i < 2 else b) / d.name)
    missing = manifest["folders"][-1][0]
    (b / folders[-1].name / missing).unlink()
    target = tmp_path / "next"
    with pytest.raises(FileNotFoundError, match=f"{missing} \\(call folder {len(folders)} of the pack"):
        unpack(target, [a, b])
    shutil.copy(folders[-1] / missing, b / folders[-1].name / missing)
    victim = a / folders[0].name / manifest["folders"][0][1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{victim} is altered"):
        unpack(target, [a, b])
    assert not target.exists()  # nothing written before every part checked
    shutil.copy(folders[0] / victim.name, victim)
    unpack(target, [a, b])
    assert read_state(target / "train" / STATE_FILE)["step"] == FIRST
    assert len(load_sequences(target / "gen")) == 16
    with pytest.raises(ValueError, match="not empty"):
        pack(staged["first"], tmp_path / "out")


def test_unpacked_shards_are_skipped_by_generate_and_checked(staged, tmp_path):
    """generate on an unpacked workdir generates nothing (its shards are there); a shard that answers other prompts
    than the prompt file's rows, or with other sampling settings, is refused."""
    pack(staged["first"], tmp_path / "out", "gen")
    unpack(tmp_path / "w", [tmp_path / "out"])

    def never(prompts, sampling):
        raise AssertionError("generate ran for a shard the workdir has")

    rows = prompt_rows(16)
    cfg = GenerateConfig(shard_size=8, batch_size=8)
    assert generate_stage(never, rows, tmp_path / "w" / "gen", cfg)
    with pytest.raises(ValueError, match="other prompts than rows 8..15"):
        generate_stage(never, rows[:8] + rows[9:] + rows[8:9], tmp_path / "w" / "gen", cfg)
    sampled = GenerateConfig(shard_size=8, batch_size=8, sample_share=0.5)
    with pytest.raises(ValueError, match="other sampling settings"):
        generate_stage(never, rows, tmp_path / "w" / "gen", sampled)


def test_a_carried_done_generate_stands_only_for_its_own_sampling(staged, tmp_path):
    """`generate` on a workdir whose gen/ was carried in whole (gen/DONE with it) skips the stage when this call asks
    for what DONE records (greedy here), and refuses it, before generating anything, when the call asks for a
    sampled share; unpacking the pack again over a DONE that records other settings is refused."""
    from training import pipeline

    src = tmp_path / "src"
    shutil.copytree(staged["first"] / "gen", src / "gen")
    done = {"prompts": 16, "max_new_tokens": 8, "sample_share": 0.0, "sample_temperature": 0.7, "seed": 0}
    (src / "gen" / "DONE").write_text(json.dumps(done) + "\n")  # as stage_generate writes it
    pack(src, tmp_path / "out", "gen")
    w = tmp_path / "w"
    unpack(w, [tmp_path / "out"])
    assert (w / "gen" / "DONE").exists()

    def generate(*extra: str) -> bool:
        args = pipeline.build_parser().parse_args(["generate", "--workdir", str(w), *extra])
        return pipeline.stage_generate(pipeline.Context(args))

    assert generate()
    assert generate("--seed", "9")  # greedy responses: the seed draws nothing
    with pytest.raises(ValueError, match="records responses generated with"):
        generate("--sample-share", "0.5")
    (w / "gen" / "DONE").write_text(json.dumps({**done, "sample_share": 0.5}) + "\n")
    with pytest.raises(ValueError, match="exists with other content"):  # unpack overwrites no other DONE
        unpack(w, [tmp_path / "out"])


def test_packed_sizes_of_the_real_head_state(checkpoint, tmp_path):
    """The SmolLM2 head (8,192-token draft vocabulary) with AdamW's state after a step: with bfloat16 moments about
    8 bytes a parameter, with float32 moments about 12; every file within 16 MiB, every call folder within 8 files
    and 40 MiB."""
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_base(checkpoint.config, 8192))
    cfg = TrainConfig(batch_size=64, lr=4e-4, minutes=24.0)
    opt = make_optimizer(head, cfg)
    for p in head.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    (tmp_path / "w" / "train").mkdir(parents=True)
    state = {
        "head": head.state_dict(),
        "opt": opt.state_dict(),
        "step": 1,
        "epoch": 0,
        "pos": 1,
        "elapsed": 0.5,
        "samples": 64,
        "config": asdict(cfg),
    }
    write_state(tmp_path / "w" / "train" / STATE_FILE, state)
    n = sum(p.numel() for p in head.parameters())
    sizes = {}
    for moments, per_param in (("bfloat16", 8), ("float32", 12)):
        out = tmp_path / moments
        manifest = pack(tmp_path / "w", out, "train", moments=moments)
        sec = manifest["sections"]["train"]
        assert sec["parameters"] == n and sec["total"] == {"minutes": 24.0}
        files = [p for p in out.rglob("*") if p.is_file()]
        assert all(p.stat().st_size <= 16 * MiB for p in files)
        for d in out.iterdir():
            assert len(list(d.iterdir())) <= 8 and sum(p.stat().st_size for p in d.iterdir()) <= 40 * MiB
        assert per_param * n < sec["bytes"] < per_param * n + MiB
        sizes[moments] = (n, sec["bytes"], len(sec["parts"]), len(manifest["folders"]))
        log.info(
            "packed state, %s moments: %d parameters, %d bytes in %d parts, %d call folders", moments, *sizes[moments]
        )
    assert sizes["bfloat16"][3] == 2 and sizes["float32"][3] == 3


def test_packed_size_of_regenerated_shards(tmp_path):
    """The regenerated responses of data/regenerated-smollm2-sharegpt.tgz (9 shards of SmolLM2's greedy responses):
    token ids as uint16, compressed, under 0.8 bytes a token (int32: 4); unpacked, every array as it was."""
    with tarfile.open(ROOT / "data" / "regenerated-smollm2-sharegpt.tgz") as tar:
        tar.extractall(tmp_path / "w", filter="data")
    manifest = pack(tmp_path / "w", tmp_path / "out", "gen")
    sec = manifest["sections"]["gen"]
    assert sec["shards"] == 9 and "gen/DONE" in sec["members"]
    per_token = sec["bytes"] / sec["tokens"]
    log.info(
        "packed shards: %d responses, %d tokens, %d bytes (%.3f a token)",
        sec["rows"],
        sec["tokens"],
        sec["bytes"],
        per_token,
    )
    assert per_token < 0.8
    unpack(tmp_path / "back", [tmp_path / "out"])
    for src in sorted((tmp_path / "w" / "gen").glob("gen-*.npz")):
        with np.load(src) as a, np.load(tmp_path / "back" / "gen" / src.name) as b:
            assert a.files == b.files and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a.files)


# ---- generation with a temperature mix ----
def test_generate_samples_a_share_of_the_prompts(tmp_path):
    """--sample-share: the rows chosen by (seed, index) are sampled through the engine (per request, reproducibly),
    the others are the greedy responses; the shards record each row's temperature."""
    share = [row_sampling(i, GenerateConfig(sample_share=0.3, seed=5)).temperature > 0 for i in range(4000)]
    assert 0.27 < np.mean(share) < 0.33
    other = [row_sampling(i, GenerateConfig(sample_share=0.3, seed=6)).temperature > 0 for i in range(4000)]
    assert share != other
    base = tiny_base()
    sd = {k: v.clone() for k, v in base.state_dict().items() if not k.startswith("rope")}
    ver = Verifier(
        Checkpoint(name="tiny", config=CFG, state_dict=sd, path=tmp_path),
        VerifierConfig(max_sequences=4, max_context=64, max_tree_nodes=8),
    )
    rows = prompt_rows(12, seed=4)
    cfg = GenerateConfig(max_new_tokens=10, batch_size=4, shard_size=5, sample_share=0.5, sample_temperature=1.5)

    def generate(prompts, sampling):
        return engine_generate(ver, prompts, 10, eos_id=2, steps=3, sampling=sampling)

    for run in ("a", "b"):
        assert generate_stage(generate, rows, tmp_path / run, cfg)
    chosen = np.array([row_sampling(i, cfg).temperature for i in range(12)], dtype=np.float32)
    assert 0 < (chosen > 0).sum() < 12
    temps = np.concatenate([np.load(p)["temperature"] for p in sorted((tmp_path / "a").glob("gen-*.npz"))])
    assert np.array_equal(temps, chosen)
    got = {run: load_sequences(tmp_path / run) for run in ("a", "b")}
    want = generate_batch(base, [r["prompt_ids"] for r in rows], 10, eos_id=2, device=CPU)
    responses = [got["a"].get(i)[0][got["a"].get(i)[1] :].tolist() for i in range(12)]
    assert responses == [got["b"].get(i)[0][got["b"].get(i)[1] :].tolist() for i in range(12)]  # reproducible
    assert all(responses[i] == want[i] for i in range(12) if chosen[i] == 0)
    assert any(responses[i] != want[i] for i in range(12) if chosen[i] > 0)


# ---- evaluation per category, sampled ----
def test_sampled_eval_per_heldout_category(checkpoint, tmp_path, monkeypatch):
    """`eval --sets heldout-chat,heldout-code --eval-temperature 0.7` on the embedded model and the shipped head, one
    prompt a category, 8 tokens: every decode samples (temperature 0.7, top-p 1, prompt i's seed i); each category
    and their pool for both trees, acceptance within [1, steps + 1]."""
    from training import evaluate
    from training.pipeline import Context, build_parser, stage_eval

    asked = []  # the sampling of every request the evaluation decoded
    real = evaluate.speculative
    monkeypatch.setattr(evaluate, "speculative", lambda *a: asked.extend(a[-1]) or real(*a))

    head = ROOT / "models" / "eagle3-smollm2"
    argv = ["eval", "--workdir", str(tmp_path), "--head", str(head), "--sets", "heldout-chat,heldout-code"]
    args = build_parser().parse_args([*argv, "--eval-limit", "1", "--max-new-tokens", "8", "--eval-temperature", "0.7"])
    ctx = Context(args)
    ctx._ckpt = checkpoint  # the session's embedded model, parsed once
    assert stage_eval(ctx)
    assert len(asked) == 4 and {(s.temperature, s.top_p, s.seed) for s in asked} == {(0.7, 1.0, 0)}  # 2 sets x 2 trees
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["meta"]["temperature"] == 0.7
    results = report["results"]
    assert set(results) == {"heldout-chat", "heldout-code", "heldout-all"}
    for name, r in results.items():
        for tree in ("tree", "chain"):
            assert 1.0 <= r[tree]["mean_accept_len"] <= 6 + 1, (name, tree)
            assert r[tree]["sequences"] == (2 if name == "heldout-all" else 1)
    args = build_parser().parse_args([*argv, "--eval-temperature", "0.7", "--check-equal"])
    with pytest.raises(ValueError, match="--eval-temperature at 0"):
        stage_eval(Context(args))
