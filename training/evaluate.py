"""Offline acceptance measurement: the engine core in process (Verifier + Eagle3Drafter, every round the
drafter's whole tree), batched over sequences, greedy or sampled (EvalConfig.temperature, one seed per prompt). Reports
mean acceptance length (tokens per verification round, counting the bonus token) and the acceptance rate at each tree
depth."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from common.config import DraftingConfig, SamplingConfig
from common.engine.base import PrefillInput
from common.engine.core import CoreConfig, EngineCore
from common.engine.draft import Eagle3Drafter
from common.engine.verifier import Verifier
from common.policy import FixedPolicy, Shape
from common.sequence import Finish, Request

log = logging.getLogger(__name__)

TREES = {
    "tree": DraftingConfig(top_k=10, steps=6, verify_tree_size=60),
    "chain": DraftingConfig(top_k=1, steps=6, verify_tree_size=6),
}


@dataclass(frozen=True)
class EvalConfig:
    max_new_tokens: int = 128
    batch_size: int = 16  # sequences decoded together
    limit: int | None = None
    temperature: float = 0.0  # 0: greedy; else every request samples at it, prompt i of a set with seed i
    top_p: float = 1.0  # the sampled requests' nucleus
    check_equal: bool = False  # every output compared with plain greedy decoding (at temperature 0 only)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        SamplingConfig(temperature=self.temperature, top_p=self.top_p)  # ValueError when out of range
        if self.check_equal and self.temperature > 0:
            raise ValueError("check_equal compares with greedy decoding: leave --eval-temperature at 0")

    def sampling(self, index: int) -> SamplingConfig:
        """Request `index` of a set: greedy, or sampled with seed index."""
        if self.temperature == 0:
            return SamplingConfig()
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, seed=index)


@dataclass
class AcceptStats:
    rounds: int = 0
    accepted: int = 0  # drafted tokens accepted, all rounds
    reached: list[int] = field(default_factory=list)  # [depth] rounds that accepted more than d drafted tokens
    sequences: int = 0
    wall_s: float = 0.0

    def add(self, rounds: int, accepted: int, accepted_at: list[int]) -> None:
        """A step's rounds of one sequence (common.sequence.SeqOutput's counts)."""
        self.rounds += rounds
        self.accepted += accepted
        if len(self.reached) < len(accepted_at):
            self.reached += [0] * (len(accepted_at) - len(self.reached))
        for d, n in enumerate(accepted_at):
            self.reached[d] += n

    def summary(self, max_depth: int) -> dict:
        """Example: 4 rounds accepting 0, 1, 1 and 3 -> reached [3, 1, 1]: rate by depth [3/4, 1/3, 1/1, 0]."""
        at = np.array(self.reached + [0] * (max_depth + 1 - len(self.reached)), dtype=np.int64)[: max_depth + 1]
        more = np.concatenate(([self.rounds], at))  # [depth + 2] rounds that accepted at least d tokens
        tokens = self.accepted + self.rounds
        depth_rate = [float(more[d] / more[d - 1]) if more[d - 1] else 0.0 for d in range(1, max_depth + 1)]
        return {
            "sequences": self.sequences,
            "rounds": self.rounds,
            "tokens": tokens,
            "mean_accept_len": tokens / self.rounds if self.rounds else 0.0,
            "accept_rate_by_depth": depth_rate,
            "accepted_hist": (more[:-1] - more[1:]).tolist() if self.rounds else [],
            "wall_s": round(self.wall_s, 2),
            "tokens_per_s": tokens / self.wall_s if self.wall_s else 0.0,
        }


def finished(out: list[int], eos: int, max_new: int) -> bool:
    return len(out) >= max_new or eos in out


def clip(out: list[int], eos: int, max_new: int) -> list[int]:
    out = out[:max_new]
    return out[: out.index(eos) + 1] if eos in out else out


def speculative(
    verifier: Verifier,
    drafter: Eagle3Drafter,
    prompts: list[list[int]],
    max_new: int,
    eos: int,
    tree: Shape,
    stats: AcceptStats,
    tag: str,
    sampling: list[SamplingConfig],
) -> list[list[int]]:
    """Decode one batch of prompts together (the engine core, drafting `tree` every round), prompt i as sampling[i]
    says (greedy or sampled); returns each output clipped at EOS / max_new."""
    t0 = time.time()
    outs: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(prompts))}
    core = EngineCore(verifier, drafter, FixedPolicy(tree), CoreConfig(max_sequences=len(prompts), prefill_chunk=0))
    for i, p in enumerate(prompts):
        core.add(Request(f"{tag}-{i}", p, sampling[i], max_new, stop_ids=frozenset({eos})))
    while True:
        for o in core.step():
            if o.finish is Finish.ERROR:
                raise RuntimeError(f"sequence {o.seq_id} failed") from o.error
            outs[o.seq_id] += o.tokens
            stats.add(o.rounds, o.accepted, o.accepted_at)
        if not core.seqs:
            break
    stats.sequences += len(prompts)
    stats.wall_s += time.time() - t0
    return [clip(outs[f"{tag}-{i}"], eos, max_new) for i in range(len(prompts))]


def plain_greedy(verifier: Verifier, prompts: list[list[int]], max_new: int, eos: int, tag: str) -> list[list[int]]:
    outs: dict[str, list[int]] = {}
    live = []
    for i, p in enumerate(prompts):
        sid = f"{tag}-{i}"
        outs[sid] = [verifier.prefill(PrefillInput(sid, p, SamplingConfig())).next_token]
        if finished(outs[sid], eos, max_new):
            verifier.release([sid])
        else:
            live.append(sid)
    while live:
        toks = verifier.decode(live)
        nxt = []
        for sid, t in zip(live, toks, strict=False):
            outs[sid].append(t)
            if finished(outs[sid], eos, max_new):
                verifier.release([sid])
            else:
                nxt.append(sid)
        live = nxt
    return [clip(outs[f"{tag}-{i}"], eos, max_new) for i in range(len(prompts))]


def evaluate_set(
    verifier: Verifier, make_drafter, prompts: list[list[int]], cfg: EvalConfig, eos: int, name: str
) -> dict:
    """Run every drafting config in TREES over the prompts (each output compared with plain greedy decoding when
    cfg.check_equal). make_drafter(DraftingConfig) -> Eagle3Drafter."""
    if cfg.limit is not None:
        prompts = prompts[: cfg.limit]
    result: dict = {"prompts": len(prompts)}
    reference: list[list[int]] | None = None
    if cfg.check_equal:
        t0 = time.time()
        reference = []
        for s in range(0, len(prompts), cfg.batch_size):
            reference += plain_greedy(
                verifier, prompts[s : s + cfg.batch_size], cfg.max_new_tokens, eos, f"{name}-ref{s}"
            )
        n_tok = sum(len(r) for r in reference)
        result["plain"] = {"tokens": n_tok, "wall_s": round(time.time() - t0, 2)}
    for tname, dcfg in TREES.items():
        drafter = make_drafter(dcfg)
        stats = AcceptStats()
        outputs: list[list[int]] = []
        for s in range(0, len(prompts), cfg.batch_size):
            outputs += speculative(
                verifier,
                drafter,
                prompts[s : s + cfg.batch_size],
                cfg.max_new_tokens,
                eos,
                Shape(dcfg.steps, dcfg.verify_tree_size),
                stats,
                f"{name}-{tname}{s}",
                [cfg.sampling(i) for i in range(s, min(s + cfg.batch_size, len(prompts)))],
            )
        summary = summary_with_config(stats.summary(dcfg.steps), dcfg)
        if reference is not None:
            bad = [i for i, (a, b) in enumerate(zip(outputs, reference, strict=True)) if a != b]
            summary["equal_to_greedy"] = not bad
            summary["differs_from_greedy"] = [
                {
                    "prompt": i,
                    "first_token": next(
                        (j for j, (x, y) in enumerate(zip(outputs[i], reference[i], strict=False)) if x != y),
                        min(len(outputs[i]), len(reference[i])),
                    ),
                }
                for i in bad
            ]
            if bad:
                log.error(
                    "%s/%s: %d of %d outputs differ from plain greedy decoding", name, tname, len(bad), len(prompts)
                )
        result[tname] = summary
        log.info(
            "eval %s/%s: mean acceptance length %.3f over %d rounds",
            name,
            tname,
            summary["mean_accept_len"],
            summary["rounds"],
        )
    return result


def summary_with_config(summary: dict, dcfg: DraftingConfig) -> dict:
    return {
        **summary,
        "drafting": {"top_k": dcfg.top_k, "steps": dcfg.steps, "verify_tree_size": dcfg.verify_tree_size},
    }


def pooled(results: list[dict]) -> dict:
    """Several sets' results (evaluate_set's) as one per tree config: their counts summed into one AcceptStats (the
    mean acceptance length over all their rounds, the sets weighed by their rounds; the rate at each depth from the
    summed histogram) and summarised as a set's are. Example: 10 tokens in 4 rounds and 6 in 4 -> 16 / 8 = 2.0."""
    out = {}
    for tname in TREES:
        parts = [r[tname] for r in results if r.get(tname)]
        if not parts:
            continue
        hist = np.zeros(max(len(p["accepted_hist"]) for p in parts), dtype=np.int64)  # [depth + 1] rounds by accepted
        for p in parts:
            hist[: len(p["accepted_hist"])] += p["accepted_hist"]
        stats = AcceptStats(
            rounds=sum(p["rounds"] for p in parts),
            accepted=sum(p["tokens"] - p["rounds"] for p in parts),
            reached=hist[::-1].cumsum()[::-1][1:].tolist(),  # [depth] rounds that accepted more than d
            sequences=sum(p["sequences"] for p in parts),
            wall_s=sum(p["wall_s"] for p in parts),
        )
        out[tname] = stats.summary(len(parts[0]["accept_rate_by_depth"]))
    return out


def format_table(results: dict) -> str:
    lines = [f"{'set':<22}{'config':<8}{'seqs':>6}{'rounds':>8}{'accept_len':>12}  accept rate by depth"]
    for set_name, res in results.items():
        for tname in TREES:
            s = res.get(tname)
            if not s:
                continue
            rates = " ".join(f"{r:.2f}" for r in s["accept_rate_by_depth"])
            lines.append(
                f"{set_name:<22}{tname:<8}{s['sequences']:>6}{s['rounds']:>8}{s['mean_accept_len']:>12.3f}  {rates}"
            )
    return "\n".join(lines) + "\n"
