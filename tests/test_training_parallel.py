"""Stages over several processes (training/parallel.py): shards split between parts, and `train --workers 2` in
real processes, whose steps equal one process averaging the two ranks' gradients by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.generate import GenerateConfig, generate_stage, load_sequences, missing_shards
from training.parallel import Part
from training.pipeline import main, without_workers
from training.train import TrainConfig, Trainer

from .test_training import CFG as TINY
from .test_training import CPU, make_workdir, tiny_base


def test_a_part_owns_every_nth_shard():
    assert Part.parse("1/4") == Part(1, 4)
    assert [k for k in range(10) if Part(1, 4).owns(k)] == [1, 5, 9]
    for bad in ("4/4", "-1/2", "1", "a/b"):
        with pytest.raises(ValueError):
            Part.parse(bad)
    paths = [Path(f"/nonexistent/s{k}") for k in range(5)]
    assert [k for k, _ in missing_shards(paths, None, "t", part=Part(1, 2))] == [1, 3]
    assert without_workers(["train", "--workers", "4", "--lr", "1", "--workers=2"]) == ["train", "--lr", "1"]
    for argv, says in ((["eval", "--workers", "2"], "only the stages"), (["train", "--workers", "0"], "1 or more")):
        with pytest.raises(SystemExit, match=says):
            main([*argv, "--workdir", "/nonexistent"])


def test_parts_write_disjoint_shards_and_the_whole_run_finds_them(tmp_path):
    rows = [{"id": str(i), "prompt_ids": [5, 6, i]} for i in range(10)]
    cfg = GenerateConfig(max_new_tokens=2, batch_size=4, shard_size=3)  # 4 shards: 3, 3, 3, 1 rows
    asked: list[list[int]] = []

    def generate(prompts, sampling):
        asked.append([p[-1] for p in prompts])
        return [[7, 8] for _ in prompts]

    assert not generate_stage(generate, rows, tmp_path, cfg, part=Part(0, 2))  # shards 0 and 2: rows 0-2, 6-8
    assert sorted(sum(asked, [])) == [0, 1, 2, 6, 7, 8]
    assert generate_stage(generate, rows, tmp_path, cfg, part=Part(1, 2))  # shards 1 and 3: the rest, then all done
    assert sorted(sum(asked, [])) == list(range(10))
    asked.clear()
    assert generate_stage(generate, rows, tmp_path, cfg) and asked == []  # the launcher's own run generates nothing
    assert len(load_sequences(tmp_path)) == 10


class HandGroup:
    """The reference's stand-in for a group of two, in one process: the recorder keeps its gradients, the other
    replaces its own by the mean of both (world: how many batches a step of it takes)."""

    def __init__(self, records: bool, recorded: list[torch.Tensor], world: int = 2) -> None:
        self.rank, self.world, self.lead, self.records, self.recorded = 0, world, True, records, recorded

    def average(self, grads):
        if self.records:
            self.recorded[:] = [g.clone() for g in grads]
        else:
            for g, other in zip(grads, self.recorded, strict=True):
                g.copy_((g + other) / 2)


def tiny_model_folder(path: Path) -> Path:
    """tiny_base() as a Hugging Face folder, the --model of a pipeline process."""
    from safetensors.torch import save_file

    path.mkdir()
    sd = {k: v.clone() for k, v in tiny_base().state_dict().items() if not k.startswith(("rope", "lm_head"))}
    save_file(sd, str(path / "model.safetensors"))
    c = TINY
    hf = {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size}
    hf |= {"num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads}
    hf |= {"head_dim": c.head_dim, "max_position_embeddings": c.max_position, "tie_word_embeddings": c.tie_embeddings}
    (path / "config.json").write_text(json.dumps(hf))
    return path


def test_train_workers_step_on_the_mean_of_the_ranks_gradients(tmp_path):
    """`train --workers 2` on CPU: two processes (gloo), rank 0 writes the state; each step equals one process
    stepping on the mean of the two batches' gradients, computed here by hand (HandGroup)."""
    (tmp_path / "w").mkdir()
    w = make_workdir(tmp_path / "w", tiny_base(), n=32)  # 8 batches of 4: the steps take (0, 1), (2, 3), (4, 5)
    cmd = [sys.executable, "-m", "training.pipeline", "train", "--workdir", str(w), "--workers", "2"]
    cmd += ["--model", str(tiny_model_folder(tmp_path / "model")), "--train-steps", "3", "--batch-size", "4"]
    cmd += ["--max-len", "24", "--lr", "3e-3", "--draft-vocab", "128", "--ttt-steps", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[rank 1/2]" in run.stderr and "the 2 ranks hold the same weights at step 3" in run.stderr
    state = torch.load(w / "train" / "train_state.pt", weights_only=True)
    assert (state["step"], state["pos"], state["samples"], state["ranks"]) == (3, 6, 3 * 4 * 2, 2)
    assert json.loads((w / "train" / "DONE").read_text())["ranks"] == 2

    # the reference in one process: each step, rank 1's gradients at rank 0's weights on its batch, then rank 0's
    # step on the mean of both (clipping and AdamW after the mean, as in the group)
    cfg = TrainConfig(draft_vocab=128, steps=3, batch_size=4, max_len=24, lr=3e-3, ttt_steps=2)
    seqs, recorded = load_sequences(w / "gen"), []
    rank0 = Trainer(tiny_base(), seqs, tmp_path / "ref0", cfg, CPU, group=HandGroup(False, recorded))  # 0, 2, 4
    rank1 = Trainer(tiny_base(), seqs, tmp_path / "ref1", cfg, CPU, group=HandGroup(True, recorded, world=1))
    for s in range(3):
        rank1.head.load_state_dict(rank0.head.state_dict())
        rank1.pos = 2 * s + 1  # the epoch's batch 1, 3, 5
        rank1.train_step()
        rank0.train_step()
    for k, v in rank0.head.state_dict().items():
        torch.testing.assert_close(state["head"][k], v, rtol=0, atol=2e-6, msg=k)

    # 32 sequences make 8 batches of 4: 9 ranks could not each take one
    with pytest.raises(ValueError, match="32 sequences make fewer batches than the 9 ranks"):
        Trainer(tiny_base(), seqs, tmp_path / "ref9", cfg, CPU, group=HandGroup(False, recorded, world=9))
