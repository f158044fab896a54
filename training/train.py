"""Train an EAGLE-3 head on regenerated sequences with training-time test, resumable across calls."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from common.model.eagle3 import Eagle3Config, Eagle3Head
from common.model.eagle3_io import save_eagle3
from common.model.llama import LlamaModel
from training.features import StoredFeatures, base_features, pad_batch
from training.generate import Sequences
from training.parallel import Group
from training.sources import SOURCE_NAMES, source_of
from training.ttt import FusedAttention, StepAttention, TTTResult, TTTTargets, make_targets, ttt_forward

log = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
LOG_FILE = "train_log.jsonl"
HEAD_INFO = "training.json"  # beside the exported head's weights: the step and minutes it was exported at


@dataclass(frozen=True)
class TrainConfig:
    draft_vocab: int = 8192
    steps: int = 2000  # the schedule's total optimizer steps, over every stage (ignored when minutes is set)
    minutes: float | None = None  # the schedule's total training wall-clock time, over every stage
    batch_size: int = 16  # sequences per step
    max_len: int = 768  # tokens per sequence (prompt + response), longer ones are cut
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_steps: int = 6
    step_weight: float = 0.8  # loss weight of TTT step j is step_weight ** j (EAGLE-3 reference)
    compile: bool = True  # torch.compile each TTT step's head forward and loss on CUDA (CPU runs eagerly)
    save_every: int = 200
    log_every: int = 20
    seed: int = 0
    # a batch's TTT rows (T - 1) padded to a multiple of this: TorchInductor guards a compiled step on the rows'
    # divisibility by 8 (aligned loads), and unpadded batches of other lengths would compile the six steps again
    # until dynamo's recompile limit (8), then run eagerly; padded rows are masked out of the loss
    rows_multiple: int = 8
    # (source, copies): each epoch holds that many copies of the named source's sequences (0 leaves it out), and the
    # draft vocabulary counts their tokens that many times; sources not named appear once (training.sources)
    source_weights: tuple[tuple[str, int], ...] = ()
    # a head continued from a saved one (--init-head) keeps a draft token unless a token outside its vocabulary is more
    # than this many times as frequent in these responses (kept_vocab; 1: the most frequent tokens; 3 was chosen on
    # the eval sets' responses, docs/training.md "Session 24")
    vocab_swap_ratio: float = 3.0

    def __post_init__(self) -> None:
        for name in ("draft_vocab", "steps", "batch_size", "ttt_steps", "save_every", "log_every", "rows_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name, copies in self.source_weights:
            if name not in SOURCE_NAMES or copies < 0:
                raise ValueError(f"source_weights: {name}={copies} (a source of {SOURCE_NAMES}, copies >= 0)")
        if self.ttt_steps < 1 or self.ttt_steps > 16:
            raise ValueError(f"ttt_steps must be in [1, 16], got {self.ttt_steps}")
        if self.max_len < 4:
            raise ValueError(f"max_len must be >= 4, got {self.max_len}")
        if not self.vocab_swap_ratio >= 1:
            raise ValueError(f"vocab_swap_ratio must be >= 1, got {self.vocab_swap_ratio}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.minutes is not None and not self.minutes > 0:
            raise ValueError(f"minutes must be positive, got {self.minutes}")


# The TrainConfig fields a later stage must share with the state it continues: the schedule (its total and its
# shape) and what the batches are made of. compile, save_every and log_every may change from stage to stage.
RESUME_FIELDS = (
    "draft_vocab",
    "steps",
    "minutes",
    "batch_size",
    "max_len",
    "lr",
    "min_lr_ratio",
    "warmup",
    "weight_decay",
    "grad_clip",
    "ttt_steps",
    "step_weight",
    "seed",
    "source_weights",
)


@dataclass(frozen=True)
class StageBudget:
    """How much one call (a stage) trains before it saves its state and stops; the schedule's total is the
    TrainConfig's (steps or minutes). None: no bound of that kind."""

    steps: int | None = None  # optimizer steps this stage
    minutes: float | None = None  # training wall-clock minutes this stage

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"stage steps must be >= 1, got {self.steps}")
        if self.minutes is not None and not self.minutes > 0:
            raise ValueError(f"stage minutes must be positive, got {self.minutes}")


def resume_config(cfg: TrainConfig, saved: dict, total_given: bool = True) -> TrainConfig:
    """The config a stage continues a saved state with: cfg, with the state's total (steps or minutes) when this
    call gave none (total_given False). ValueError when a RESUME_FIELDS field differs from the state's (steps only
    counts for a step schedule), so that a later stage cannot silently change the schedule.
    Example: saved {"minutes": 24.0, "batch_size": 64, ...}, cfg minutes None, total_given False -> minutes 24.0."""
    if not total_given:
        cfg = replace(cfg, steps=saved.get("steps", cfg.steps), minutes=saved.get("minutes"))
    timed = saved.get("minutes") is not None and cfg.minutes is not None
    differ = [
        f"{f} {saved[f]!r} (this call: {getattr(cfg, f)!r})"
        for f in RESUME_FIELDS
        if f in saved and not (f == "steps" and timed) and saved[f] != getattr(cfg, f)
    ]
    if differ:
        raise ValueError(
            "the training state was started with " + ", ".join(differ) + ": a later stage continues the same "
            "schedule; pass the state's values (or leave out the total, which the state records)"
        )
    return cfg


def read_state(path: Path) -> dict:
    """A training state (Trainer.save_state's dict) from its file."""
    return torch.load(str(path), map_location="cpu", weights_only=True)


def write_state(path: Path, state: dict) -> None:
    """Write a training state atomically (a call killed while writing leaves the previous one)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, str(tmp))
    tmp.replace(path)


def sequence_copies(seqs: Sequences, weights: tuple[tuple[str, int], ...]) -> np.ndarray:
    """[N] int64: the copies of each sequence an epoch holds (TrainConfig.source_weights; 1 for a source not named).
    Sources "5laNzPs_36" (ShareGPT), "gsm8k-3", "magpie-00001-00002" with sharegpt=3, magpie=0 -> [3, 1, 0]."""
    copies = np.ones(len(seqs), dtype=np.int64)
    if not weights:
        return copies
    if seqs.ids is None:
        raise ValueError("source weights need the prompts' ids, which these sequences lack")
    by_source = dict(weights)
    for i, pid in enumerate(seqs.ids):
        copies[i] = by_source.get(source_of(str(pid)), 1)
    return copies


def response_counts(
    seqs: Sequences, vocab_size: int, rows: range | None = None, copies: np.ndarray | None = None
) -> np.ndarray:
    """[vocab_size] int64: how often each token occurs in the responses of `rows` (default: every sequence), each
    sequence counted copies[i] times (default once)."""
    rows = range(len(seqs)) if rows is None else rows
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i in rows:
        s, p = seqs.get(i)
        counts += np.bincount(s[p:], minlength=vocab_size) * (1 if copies is None else int(copies[i]))
    return counts


def top_tokens(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent tokens of counts [vocab], ties by lower id, ascending: counts [0, 5, 5, 9], size 2
    -> [1, 3] (9, then the lower of the two 5s)."""
    if size > counts.shape[0]:
        raise ValueError(f"draft vocab {size} exceeds the base vocabulary {counts.shape[0]}")
    order = np.lexsort((np.arange(counts.shape[0]), -counts))  # by count desc, then id asc
    return np.sort(order[:size])


def draft_vocab(seqs: Sequences, size: int, vocab_size: int, copies: np.ndarray | None = None) -> torch.Tensor:
    """The `size` most frequent response tokens (ties and shortfall filled by lowest id), ascending, each sequence
    counted copies[i] times (default once). Returns draft_to_base [size] int64."""
    counts = response_counts(seqs, vocab_size, copies=copies)
    chosen = top_tokens(counts, size)
    covered = counts[chosen].sum() / max(counts.sum(), 1)
    log.info("draft vocab: %d tokens cover %.2f%% of response tokens", size, 100 * covered)
    return torch.from_numpy(chosen.astype(np.int64))


def kept_vocab(counts: np.ndarray, saved: np.ndarray, ratio: float) -> np.ndarray:
    """A trained head's vocabulary (saved: base ids) brought to new token counts [vocab]: the most frequent tokens
    outside it replace its least frequent ones, pair by pair, while the incoming token's count is more than `ratio`
    times the outgoing one's (at least 1). Ratio 1 gives the most frequent tokens (ties aside); a larger one keeps the
    tokens the head was trained on unless the new data clearly prefers others. Ascending base ids. Counts [10, 1, 8, 3,
    2], saved [1, 3]: ratio 2 -> [0, 2] (10 > 2 x 1, 8 > 2 x 3); ratio 3 -> [0, 3] (8 < 3 x 3 stops the swaps)."""
    inside = np.zeros(counts.shape[0], dtype=bool)
    inside[saved] = True
    outside = np.flatnonzero(~inside)
    incoming = outside[np.lexsort((outside, -counts[outside]))]  # count descending, then id ascending
    outgoing = saved[np.lexsort((-saved, counts[saved]))]  # count ascending, then id descending
    m = min(incoming.size, outgoing.size)
    swap = counts[incoming[:m]] > ratio * np.maximum(counts[outgoing[:m]], 1)  # [m] true up to the first that fails
    n = m if swap.all() else int(np.argmin(swap))
    return np.sort(np.concatenate((outgoing[n:], incoming[:n])))


@torch.no_grad()
def init_head(head: Eagle3Head, base: LlamaModel, draft_to_base: torch.Tensor, seed: int = 0) -> None:
    """lm_head/norm from the base's head rows of the draft vocab; midlayer from the base's last layer
    (the 2H-wide q/k/v get half of the base weight on each input half); fc picks the high layer's
    features (identity block) plus small noise."""
    g = torch.Generator().manual_seed(seed)
    head.set_vocab_map(draft_to_base)
    d2b = draft_to_base.to(base.lm_head.weight.device)
    head.lm_head.weight.copy_(base.lm_head.weight[d2b].float())
    head.norm.weight.copy_(base.norm.weight.float())
    last = base.layers[-1]
    m = head.midlayer
    if base.cfg.hidden_size == head.cfg.hidden_size and base.cfg.intermediate_size == head.cfg.intermediate_size:
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(m.mlp, name).weight.copy_(getattr(last.mlp, name).weight.float())
        m.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight.float())
        m.input_layernorm.weight.copy_(last.input_layernorm.weight.float())
        m.hidden_norm.weight.copy_(last.input_layernorm.weight.float())
        if (base.cfg.num_heads, base.cfg.num_kv_heads, base.cfg.head_dim) == (
            head.cfg.num_heads,
            head.cfg.num_kv_heads,
            head.cfg.head_dim,
        ):
            for name in ("q_proj", "k_proj", "v_proj"):
                w = getattr(last.self_attn, name).weight.float()
                getattr(m.self_attn, name).weight.copy_(torch.cat((0.5 * w, 0.5 * w), dim=1))
            m.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight.float())
    h, ht = head.cfg.hidden_size, head.cfg.target_hidden_size
    fc = torch.randn(h, 3 * ht, generator=g) * (0.02 / math.sqrt(3))
    if h == ht:
        fc[:, 2 * ht :] += torch.eye(h)
    head.fc.weight.copy_(fc)


@torch.no_grad()
def regrow_vocab(head: Eagle3Head, saved: Eagle3Head, base: LlamaModel, draft_to_base: torch.Tensor) -> int:
    """head takes a trained head's weights with the draft vocabulary draft_to_base [size] (ascending base ids; of any
    size): an lm_head row of a token in both vocabularies is the saved head's, a new token's row is the base lm_head's
    (as init_head starts every row), a token only the saved head had is dropped; the rest is the saved head's.
    Returns how many rows were kept. Saved vocabulary (base ids) [3, 7, 9], new [3, 5, 9, 11]: rows [saved[0],
    base[5], saved[2], base[11]], 2 kept."""
    kept = {k: v for k, v in saved.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    head.load_state_dict(kept, strict=False)
    head.set_vocab_map(draft_to_base)
    old = saved.base_ids()  # [saved size]
    saved_row = torch.zeros(saved.t2d.shape[0], dtype=torch.int64)  # [base vocab] base id -> its saved row
    saved_row[old] = torch.arange(old.shape[0])
    both = saved.t2d[draft_to_base]  # [size] bool: the token was in the saved vocabulary
    rows = base.lm_head.weight[draft_to_base.to(base.lm_head.weight.device)].float().cpu()  # [size, H]
    rows[both] = saved.lm_head.weight[saved_row[draft_to_base[both]]].float()
    head.lm_head.weight.copy_(rows)
    return int(both.sum())


def lr_at(cfg: TrainConfig, step: int, elapsed: float) -> float:
    progress = step / cfg.steps
    if cfg.minutes is not None:
        progress = elapsed / (cfg.minutes * 60)
    progress = min(max(progress, 0.0), 1.0)
    warm = min(1.0, (step + 1) / cfg.warmup)
    cos = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * warm * cos


def epoch_batches(lengths: np.ndarray, batch_size: int, seed: int, epoch: int) -> list[np.ndarray]:
    """Shuffled batches of similar-length sequences (sorted within chunks of 64 batches)."""
    rng = np.random.default_rng(seed * 1000003 + epoch)
    perm = rng.permutation(len(lengths))
    chunk = batch_size * 64
    batches = []
    for c in range(0, len(perm), chunk):
        part = perm[c : c + chunk]
        part = part[np.argsort(lengths[part], kind="stable")]
        batches += [part[i : i + batch_size] for i in range(0, len(part), batch_size)]
    rng.shuffle(batches)
    return batches


@dataclass
class TTTInputs:
    """One batch, ready for training-time test (rows predict x_{r+2}, see training.ttt)."""

    embeds: torch.Tensor  # [B, T, H] float32 embed(x_{r+1})
    aux: torch.Tensor  # [B, T, 3H_target] float32 base features a_r
    targets: TTTTargets


@dataclass
class StepOutcome:
    result: TTTResult
    grad_norm: float  # before clipping


def optimize_step(
    head: Eagle3Head,
    opt: torch.optim.Optimizer,
    inputs: TTTInputs,
    cfg: TrainConfig,
    lr: float,
    attention: StepAttention = FusedAttention(),
    group: Group | None = None,
) -> StepOutcome:
    """One optimizer step: the TTT forward (bf16 autocast and, with cfg.compile, torch.compile on a GPU),
    backward, the gradients averaged over the group's ranks (data-parallel), clipping, AdamW. The Trainer and
    training.ttt_step both run this."""
    for g in opt.param_groups:
        g["lr"] = lr
    device = inputs.embeds.device
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        res = ttt_forward(
            head,
            inputs.embeds,
            inputs.aux,
            inputs.targets,
            cfg.ttt_steps,
            cfg.step_weight,
            attention=attention,
            compile=cfg.compile and device.type == "cuda",  # CPU runs eagerly: compiling costs it minutes
        )
    opt.zero_grad(set_to_none=True)
    res.loss.backward()
    if group is not None:
        group.average([p.grad for p in head.parameters() if p.grad is not None])
    # a non-finite gradient stops training before the step (RuntimeError), not minutes of NaN weights later
    gnorm = torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip, error_if_nonfinite=True)
    opt.step()
    return StepOutcome(result=res, grad_norm=float(gnorm))


def make_optimizer(head: Eagle3Head, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the head's trainable parameters (place the head on its device first: on CUDA the
    optimizer is the fused single-kernel one)."""
    params = [p for p in head.parameters() if p.requires_grad]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=fused)


class Trainer:
    def __init__(
        self,
        base: LlamaModel,
        seqs: Sequences,
        workdir: Path,
        cfg: TrainConfig,
        device: torch.device,
        features: StoredFeatures | None = None,
        init_from: Path | None = None,
        total_given: bool = True,
        group: Group | None = None,
    ) -> None:
        """A saved state in workdir/train is continued (resume_config: with its recorded total when total_given is
        False, refused when cfg changes its schedule); otherwise the head starts from init_from or from the base.
        group: data-parallel ranks (training.parallel): each step takes the epoch's next `world` batches, rank r the
        r-th; every rank starts from the same weights and state, rank 0 alone writes the log, the state and the
        head."""
        self.dir = workdir / "train"
        self.dir.mkdir(parents=True, exist_ok=True)
        state_path = self.dir / STATE_FILE
        st = read_state(state_path) if state_path.exists() else None
        if st is not None:
            cfg = resume_config(cfg, st.get("config", {}), total_given)
        self.base, self.seqs, self.cfg, self.device, self.features = base, seqs, cfg, device, features
        self.group = group
        self.rank, self.world = (0, 1) if group is None else (group.rank, group.world)
        self.head_dir = workdir / "head"
        copies = sequence_copies(seqs, cfg.source_weights)  # [N]
        keep = [i for i in range(len(seqs)) if seqs.get(i)[0].shape[0] - seqs.get(i)[1] >= 2]
        # sequences with a response to learn from, each as often as its source's weight says
        self.index = np.repeat(np.array(keep, dtype=np.int64), copies[keep])
        if self.index.size == 0:
            raise ValueError("no sequence has a response of 2 tokens or more (of a source given 1 copy or more)")
        if -(-self.index.size // cfg.batch_size) < self.world:
            raise ValueError(f"{self.index.size} sequences make fewer batches than the {self.world} ranks")
        self.lengths = np.array([min(len(seqs.get(int(i))[0]), cfg.max_len) for i in self.index])
        self.hcfg = Eagle3Config.for_base(base.cfg, cfg.draft_vocab)
        torch.manual_seed(cfg.seed)
        self.head = Eagle3Head(self.hcfg)
        self.step, self.epoch, self.pos, self.elapsed = 0, 0, 0, 0.0
        self.samples = 0  # sequences trained on, across resumes
        if st is not None:
            self.head.load_state_dict(st["head"])
            self.step, self.epoch, self.pos, self.elapsed = st["step"], st["epoch"], st["pos"], st["elapsed"]
            self.samples = st.get("samples", 0)  # absent in states saved before it was counted
            if st.get("sequences", self.index.size) != self.index.size:
                log.warning(
                    "train: the state was trained on %d sequences, this call has %d: the epoch's order changes from "
                    "its position on",
                    st["sequences"],
                    self.index.size,
                )
            log.info("train: resumed at step %d (%.1f min trained)", self.step, self.elapsed / 60)
        elif init_from is not None:  # continue from a saved head (fresh optimizer and schedule)
            from common.model.eagle3_io import load_eagle3

            saved, saved_cfg = load_eagle3(init_from)
            if saved_cfg.draft_vocab_size == cfg.draft_vocab:  # the vocabulary follows this data (kept_vocab)
                counts = response_counts(seqs, base.cfg.vocab_size, copies=copies)
                old = saved.base_ids().numpy()
                d2b = torch.from_numpy(kept_vocab(counts, old, cfg.vocab_swap_ratio).astype(np.int64))
            else:  # another size: the most frequent tokens
                d2b = draft_vocab(seqs, cfg.draft_vocab, base.cfg.vocab_size, copies)
            kept = regrow_vocab(self.head, saved.float(), base, d2b)
            log.info(
                "train: starting from the head in %s: %d of its %d draft tokens kept, %d new",
                init_from,
                kept,
                saved_cfg.draft_vocab_size,
                cfg.draft_vocab - kept,
            )
        else:
            d2b = draft_vocab(seqs, cfg.draft_vocab, base.cfg.vocab_size, copies)
            init_head(self.head, base, d2b, cfg.seed)
        self.head.to(device)
        self.head.train()
        self.draft_to_base = self.head.base_ids()
        self.opt = make_optimizer(self.head, cfg)
        if st is not None:
            self.opt.load_state_dict(st["opt"])
        self._epoch_cache: tuple[int, list[np.ndarray]] | None = None

    def done(self) -> bool:
        if self.cfg.minutes is not None:
            return self.elapsed >= self.cfg.minutes * 60
        return self.step >= self.cfg.steps

    def save_state(self) -> None:
        """train/train_state.pt: the head, the optimizer, the schedule's position (step, epoch and position in
        it, elapsed training time, samples) and the config, whose total and schedule later stages keep."""
        state = {
            "head": self.head.state_dict(),
            "opt": self.opt.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "pos": self.pos,
            "elapsed": self.elapsed,
            "samples": self.samples,
            "sequences": int(self.index.size),  # the training set the epochs' order is drawn over
            "ranks": self.world,  # batches per step (a later stage may run on another number of GPUs)
            "config": asdict(self.cfg),
        }
        write_state(self.dir / STATE_FILE, state)

    def export(self) -> list[Path]:
        """The head in the public layout (W/head, bf16) and HEAD_INFO beside it: the step it was exported at."""
        files = save_eagle3(self.head, self.hcfg, self.head_dir, aux_layers=self.base.aux_layers)
        info = {
            "step": self.step,
            "elapsed_min": round(self.elapsed / 60, 3),
            "samples": self.samples,
            "finished": self.done(),
        }
        (self.head_dir / HEAD_INFO).write_text(json.dumps(info) + "\n")
        return [*files, self.head_dir / HEAD_INFO]

    def _batches(self) -> list[np.ndarray]:
        if self._epoch_cache is None or self._epoch_cache[0] != self.epoch:
            self._epoch_cache = (
                self.epoch,
                epoch_batches(self.lengths, self.cfg.batch_size, self.cfg.seed, self.epoch),
            )
        return self._epoch_cache[1]

    def _next_batch(self) -> np.ndarray:
        """This rank's batch of the step: with 2 ranks, step 1 takes the epoch's batches 0 (rank 0) and 1 (rank 1),
        step 2 batches 2 and 3; an epoch's last batches that do not make a whole step are left to the next epoch's
        order."""
        if self.pos + self.world > len(self._batches()):
            self.epoch, self.pos = self.epoch + 1, 0
        b = self._batches()[self.pos + self.rank]
        self.pos += self.world
        return self.index[b]

    def train_step(self) -> dict:
        cfg = self.cfg
        idx = self._next_batch()
        pb = pad_batch([self.seqs.get(int(i)) for i in idx], cfg.max_len, self.device, cfg.rows_multiple)
        ids = pb.ids  # [B, T]
        b, t = ids.shape
        if self.features is not None:
            feats = self.features.batch([int(i) for i in idx], t, self.device)
        else:
            feats = base_features(self.base, ids)
        r = torch.arange(t - 1, device=self.device)[None, :]
        # row r predicts x_{r+2}: a real position (r + 1 < len) holding a response token (r + 2 >= prompt_len)
        valid = (r + 1 < pb.lengths[:, None]) & (r + 2 >= pb.prompt_len[:, None])  # [B, T-1]
        targets = make_targets(
            lambda h: self.base.lm_head(h.to(self.base.lm_head.weight.dtype)),
            feats.hidden[:, 1:],
            self.draft_to_base,
            self.head.t2d,
            valid,
        )
        with torch.no_grad():
            embeds = self.base.embed_tokens(ids[:, 1:]).float()  # [B, T-1, H] embed(x_{r+1})
        aux = feats.aux[:, :-1].float()  # [B, T-1, 3H] a_r
        lr = lr_at(cfg, self.step, self.elapsed)
        inputs = TTTInputs(embeds=embeds, aux=aux, targets=targets)
        done = optimize_step(self.head, self.opt, inputs, cfg, lr, group=self.group)
        self.step += 1
        res = done.result
        return {
            "step": self.step,
            "lr": lr,
            "loss": float(res.loss.detach()),
            "grad_norm": done.grad_norm,
            "step_loss": res.step_loss,
            "step_acc": res.step_acc,
            "tokens": int(valid.sum()),  # this rank's
            "samples": b * self.world,
        }

    def run(self, deadline: float | None = None, budget: StageBudget | None = None) -> bool:
        """Train until the schedule's total is reached, the deadline passes or this stage's budget is spent; saves
        the state on the way out and exports the head (W/head) when this call trained. True when training finished.
        With a group, rank 0's clock decides for every rank (when to stop, each step's time in the schedule)."""
        cfg = self.cfg
        budget = budget or StageBudget()
        lead = self.group is None or self.group.lead
        first_step, first_elapsed = self.step, self.elapsed
        window: list[dict] = []
        t_last = time.time()
        with (self.dir / LOG_FILE).open("a") if lead else contextlib.nullcontext() as logf:
            while not self.done():
                stage_spent = (budget.steps is not None and self.step - first_step >= budget.steps) or (
                    budget.minutes is not None and self.elapsed - first_elapsed >= budget.minutes * 60
                )
                late = deadline is not None and time.time() > deadline
                if self.group is not None:  # the deadline is each rank's clock: rank 0's decides
                    late = bool(self.group.from_lead([late])[0])
                if stage_spent or late:
                    if window and lead:  # the steps since the last log line, so that the log covers every stage
                        logf.write(json.dumps(summarize(window) | {"elapsed_min": round(self.elapsed / 60, 2)}) + "\n")
                    self._finish_stage(exported=self.step > first_step)
                    why = "this stage's budget" if stage_spent else "the time budget"
                    log.info(
                        "train: %s spent at step %d (%.1f min trained); state saved", why, self.step, self.elapsed / 60
                    )
                    return False
                rec = self.train_step()
                now = time.time()
                rec["seconds"] = now - t_last
                if self.group is not None:
                    rec["seconds"] = self.group.from_lead([rec["seconds"]])[0]
                self.elapsed += rec["seconds"]
                self.samples += rec["samples"]
                t_last = now
                window.append(rec)
                if self.step % cfg.log_every == 0 or self.done():
                    avg = summarize(window)
                    avg["elapsed_min"] = round(self.elapsed / 60, 2)
                    if lead:
                        logf.write(json.dumps(avg) + "\n")
                        logf.flush()
                    log.info(
                        "train step %d lr %.2e loss %.3f acc/step %s (%.1f samples/s, %.1f min)",
                        self.step,
                        rec["lr"],
                        avg["loss"],
                        " ".join(f"{a:.2f}" for a in avg["step_acc"]),
                        avg["samples_per_s"],
                        self.elapsed / 60,
                    )
                    window = []
                if self.step % cfg.save_every == 0 and lead:
                    self.save_state()
        self._finish_stage(exported=True)
        if lead:
            done = {
                "step": self.step,
                "elapsed_min": self.elapsed / 60,
                "samples": self.samples,
                # the throughput for the model card: sequences per second of training wall time (batching,
                # features, forward, backward, optimizer and the periodic saves), over every rank
                "samples_per_s": self.samples / max(self.elapsed, 1e-9),
                "batch_size": self.cfg.batch_size,
                "ranks": self.world,
                "max_len": self.cfg.max_len,
                "ttt_steps": self.cfg.ttt_steps,
                "device": str(self.device),
            }
            (self.dir / "DONE").write_text(json.dumps(done) + "\n")
        return True

    def _finish_stage(self, exported: bool) -> None:
        """The stage's end: rank 0 saves the state (and exports the head when this stage trained), then every rank
        checks that its weights are rank 0's (Group.check_same)."""
        if self.group is None or self.group.lead:
            self.save_state()
            if exported:
                self.export()
        if self.group is not None:
            self.group.check_same(list(self.head.parameters()))
            log.info("train: the %d ranks hold the same weights at step %d", self.world, self.step)


def summarize(recs: list[dict]) -> dict:
    n = len(recs)
    return {
        "step": recs[-1]["step"],
        "loss": sum(r["loss"] for r in recs) / n,
        "step_loss": [sum(r["step_loss"][j] for r in recs) / n for j in range(len(recs[0]["step_loss"]))],
        "step_acc": [sum(r["step_acc"][j] for r in recs) / n for j in range(len(recs[0]["step_acc"]))],
        "tokens": sum(r["tokens"] for r in recs),
        "samples": sum(r["samples"] for r in recs),
        "samples_per_s": sum(r["samples"] for r in recs) / max(sum(r["seconds"] for r in recs), 1e-9),
    }
