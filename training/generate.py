"""Regenerate responses with the base model itself. Greedy responses go through the serving engine
(engine_generate: common.engine.verifier.Verifier with continuous batching, batched prefill and chained
decode steps, CUDA graphs on a GPU); generate_batch is the plain model loop (sampling, for Magpie prompts,
and the engine's reference in the tests), batched decoding on LlamaModel + KVCache.

Each batch row owns one cache slot. Prompts are left-padded to the batch's longest prompt so that one
prefill forward covers the batch and every decode step writes all rows at the same cache column; RoPE
positions stay per-row (0 at each prompt's first real token) and padding columns are masked out.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.config import SamplingConfig
from common.engine.base import PrefillInput
from common.model.llama import Batch, KVCache, LlamaModel
from training.parallel import Part

log = logging.getLogger(__name__)
GEN_DIR = "gen"  # a workdir's regenerated responses: gen-KKKKK.npz shards and DONE


@dataclass(frozen=True)
class GenerateConfig:
    max_new_tokens: int = 256
    batch_size: int = 256
    shard_size: int = 1024  # prompts per output shard (the unit of resumption)
    limit: int | None = None  # cap on training prompts
    sample_share: float = 0.0  # share of the prompts answered by sampling (chosen by prompt index and seed)
    sample_temperature: float = 0.7  # their temperature (top-p 1); the other prompts are answered greedily
    seed: int = 0  # which prompts are sampled, and their draws

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {self.shard_size}")
        if not 0.0 <= self.sample_share <= 1.0:
            raise ValueError(f"sample_share must be in [0, 1], got {self.sample_share}")
        if not self.sample_temperature > 0:
            raise ValueError(f"sample_temperature must be > 0, got {self.sample_temperature}")


def row_sampling(index: int, cfg: GenerateConfig) -> SamplingConfig:
    """How training prompt `index` (its row in the prompt file) is answered: sampled at cfg.sample_temperature, with a
    seed of its own, when a hash of (cfg.seed, index) falls in the first cfg.sample_share of [0, 1); greedy otherwise.
    The choice depends on neither the shard size nor the batch, so a resumed or repeated stage makes the same one."""
    digest = hashlib.sha256(f"{cfg.seed}:{index}".encode()).digest()
    if int.from_bytes(digest[:8], "little") / 2**64 >= cfg.sample_share:
        return SamplingConfig()
    return SamplingConfig(temperature=cfg.sample_temperature, seed=int.from_bytes(digest[8:16], "little") >> 1)


@dataclass(frozen=True)
class Sampling:
    """Temperature and nucleus (top-p) sampling; `seed` makes a batch's draws reproducible."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use no Sampling for greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample_top_p(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """logits [B, V] -> token ids [B]: draw from the smallest set of most likely tokens whose mass reaches top_p.

    Example: probabilities [0.5, 0.3, 0.2], top_p 0.7 -> mass before each token [0, 0.5, 0.8]: tokens 0 and 1 stay.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V]
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [B, V]
    keep = sorted_p.cumsum(dim=-1) - sorted_p < top_p  # the first token always stays
    choice = torch.multinomial(torch.where(keep, sorted_p, 0.0), 1, generator=generator)  # [B, 1]
    return order.gather(-1, choice)[:, 0]


@torch.inference_mode()
def generate_batch(
    model: LlamaModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int,
    device: torch.device,
    sampling: Sampling | None = None,
) -> list[list[int]]:
    """Continuation of each prompt, greedy when `sampling` is None; a response ends with eos_id when it stopped by
    itself."""
    cfg = model.cfg
    b = len(prompts)
    p = max(len(x) for x in prompts)
    cap = p + max_new_tokens
    dtype = next(model.parameters()).dtype
    cache = KVCache.allocate(cfg.num_layers, b, cap, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    lens = torch.tensor([len(x) for x in prompts], device=device)  # [B]
    ids = torch.zeros(b, p, dtype=torch.long, device=device)  # [B, P] left-padded
    for i, x in enumerate(prompts):
        ids[i, p - len(x) :] = torch.tensor(x, device=device)
    col = torch.arange(cap, device=device)  # [cap]
    start = p - lens  # [B] first real column
    valid = col[None, :] >= start[:, None]  # [B, cap] real key columns
    pos = (torch.arange(p, device=device)[None, :] - start[:, None]).clamp(min=0)  # [B, P]
    q = torch.arange(p, device=device)
    causal = col[None, :p] <= q[:, None]  # [P, P]
    eye = col[None, :p] == q[:, None]  # padding rows see themselves
    mask = (causal[None] & valid[:, None, :p]) | eye[None]  # [B, P, P]
    slots = torch.arange(b, device=device)
    write = torch.arange(p, device=device)[None, :].expand(b, p)
    gen_rng = None if sampling is None else torch.Generator(device=device).manual_seed(sampling.seed)

    def pick(logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B]
        if sampling is None:
            return logits.argmax(-1)
        return sample_top_p(logits, sampling.temperature, sampling.top_p, gen_rng)

    out = model(Batch.masked(input_ids=ids, positions=pos, slots=slots, write_pos=write, mask=mask), cache)
    nxt = pick(model.logits(out.hidden[:, -1]))  # [B]
    gen = torch.zeros(b, max_new_tokens, dtype=torch.long, device=device)  # [B, N]
    done = torch.zeros(b, dtype=torch.bool, device=device)  # [B]
    n_steps = max_new_tokens
    for t in range(max_new_tokens):
        gen[:, t] = nxt
        done |= nxt == eos_id
        if t == max_new_tokens - 1:
            break
        if t % 16 == 15 and bool(done.all()):  # one host sync every 16 steps
            n_steps = t + 1
            break
        c = p + t
        batch = Batch.masked(
            input_ids=nxt[:, None],
            positions=(lens + t)[:, None],
            slots=slots,
            write_pos=torch.full((b, 1), c, device=device, dtype=torch.long),
            mask=valid[:, None, None, : c + 1],
        )
        out = model(batch, cache)
        nxt = torch.where(done, eos_id, pick(model.logits(out.hidden[:, 0])))
    gen_np = gen[:, :n_steps].cpu().numpy()
    responses = []
    for row in gen_np:
        stop = np.nonzero(row == eos_id)[0]
        responses.append(row[: stop[0] + 1].tolist() if stop.size else row.tolist())
    return responses


def _response(tokens: list[int], max_new_tokens: int, eos_id: int) -> list[int]:
    """Cut at the first eos_id (kept) and at max_new_tokens."""
    out = tokens[:max_new_tokens]
    return out[: out.index(eos_id) + 1] if eos_id in out else out


def engine_generate(
    verifier,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int,
    steps: int = 16,
    sampling: list[SamplingConfig] | None = None,
):
    """Continuation of each prompt through the serving engine, greedy as generate_batch gives it, or as
    sampling[i] says for prompt i (the verifier samples per sequence, on the device, from the request's seed):
    every slot of the engine holds a prompt, a finished one's slot takes the next prompt at once (continuous
    batching), new prompts are prefilled together (Verifier.prefill_batch) and decoding runs `steps` tokens per
    call on the device (steps past a stop are cut off). The engine's max_context must hold prompt + max_new_tokens.
    Returns [len(prompts)] responses, each ending with eos_id when it stopped by itself."""
    if sampling is not None and len(sampling) != len(prompts):
        raise ValueError(f"{len(sampling)} sampling settings for {len(prompts)} prompts")
    out: list[list[int] | None] = [None] * len(prompts)
    queue = iter(range(len(prompts)))
    active: dict[str, tuple[int, list[int]]] = {}  # engine sequence id -> (prompt index, tokens so far)
    slots = verifier.info.max_sequences
    while True:
        new = [i for _, i in zip(range(slots - len(active)), queue)]
        if new:
            inputs = [
                PrefillInput(f"gen-{i}", prompts[i], SamplingConfig() if sampling is None else sampling[i]) for i in new
            ]
            for i, pre in zip(new, verifier.prefill_batch(inputs)):
                active[f"gen-{i}"] = (i, [pre.next_token])
        finished = [s for s, (_, r) in active.items() if r[-1] == eos_id or len(r) >= max_new_tokens]
        for s in finished:
            i, r = active.pop(s)
            out[i] = _response(r, max_new_tokens, eos_id)
        verifier.release(finished)
        if finished and len(active) < slots:
            continue  # fill the freed slots before the next decode
        if not active:
            return out
        ids = list(active)
        n = min(steps, min(max_new_tokens - len(active[s][1]) for s in ids))
        for s, tokens in zip(ids, verifier.decode_many(ids, n).tokens):
            active[s][1].extend(tokens)


def shard_path(outdir: Path, k: int) -> Path:
    return outdir / f"gen-{k:05d}.npz"


def save_shard(
    path: Path,
    prompt_ids: list[list[int]],
    responses: list[list[int]],
    ids: list[str],
    temperature: list[float] | None = None,
) -> None:
    """tokens: all sequences (prompt + response) concatenated; offsets [N+1]; prompt_len [N]; ids [N]; temperature
    [N] (0: the response is greedy, else sampled at it), absent in shards written before sampled responses."""
    seqs = [a + r for a, r in zip(prompt_ids, responses, strict=False)]
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in seqs])
    tokens = np.fromiter((t for s in seqs for t in s), dtype=np.int32, count=int(offsets[-1]))
    arrays = {
        "tokens": tokens,  # [total] int32
        "offsets": offsets,  # [N+1] int64
        "prompt_len": np.array([len(a) for a in prompt_ids], dtype=np.int64),  # [N]
        "ids": np.array(ids),  # [N] str
    }
    if temperature is not None:
        arrays["temperature"] = np.asarray(temperature, dtype=np.float32)  # [N]
    write_shard(path, arrays)


def write_shard(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """A shard's arrays (save_shard's) to path, atomically."""
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def shard_temperature(z) -> np.ndarray:
    """A shard's per-row temperature [N] float32 (0: greedy); a shard without the array (as in
    data/regenerated-smollm2-sharegpt.tgz) is all greedy."""
    if "temperature" in z.files:
        return z["temperature"]
    return np.zeros(len(z["prompt_len"]), dtype=np.float32)


@dataclass
class Sequences:
    tokens: np.ndarray  # [total] int32 concatenated prompt+response tokens
    offsets: np.ndarray  # [N+1] int64
    prompt_len: np.ndarray  # [N] int64
    ids: np.ndarray | None = None  # [N] str: the prompts' ids (training.sources.source_of names their source)

    def __len__(self) -> int:
        return int(self.prompt_len.shape[0])

    def get(self, i: int) -> tuple[np.ndarray, int]:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]], int(self.prompt_len[i])


def load_sequences(gendir: Path, *more: Path) -> Sequences:
    """The generated shards of gendir, then those of each folder of `more`, as one set."""
    files = []
    for d in (gendir, *more):
        found = [f for f in sorted(d.glob("gen-*.npz")) if ".tmp" not in f.name]
        if not found:
            raise FileNotFoundError(f"no generated shards in {d}: run the generate stage first")
        files += found
    toks, offs, plen, ids, base = [], [np.zeros(1, dtype=np.int64)], [], [], 0
    for f in files:
        z = np.load(f)
        toks.append(z["tokens"])
        offs.append(z["offsets"][1:] + base)
        plen.append(z["prompt_len"])
        ids.append(z["ids"] if "ids" in z.files else None)
        base += int(z["offsets"][-1])
    tokens, offsets = np.concatenate(toks), np.concatenate(offs)
    all_ids = None if any(i is None for i in ids) else np.concatenate(ids)  # a shard without ids: no source weights
    return Sequences(tokens=tokens, offsets=offsets, prompt_len=np.concatenate(plen), ids=all_ids)


def missing_shards(
    paths: list[Path],
    deadline: float | None,
    stage: str,
    check: Callable[[int, Path], None] | None = None,
    part: Part | None = None,
) -> Iterator[tuple[int, Path]]:
    """(k, path) of the shards not written yet, in order, until the time budget is spent; the stage is finished
    when every path exists afterwards (finished shards are never redone: that is what makes stages resumable).
    check(k, path) is called for each shard found (it raises when the shard is not what shard k would be).
    part: only the shards it owns (another process writes the others): 5 paths, Part(1, 2) -> shards 1 and 3."""
    for k, path in enumerate(paths):
        if part is not None and not part.owns(k):
            continue
        if path.exists():
            if check is not None:
                check(k, path)
            continue
        if deadline is not None and time.time() > deadline:
            log.info("%s: time budget spent before shard %d/%d", stage, k, len(paths))
            return
        yield k, path


def generate_stage(
    generate: Callable[[list[list[int]], list[SamplingConfig]], list[list[int]]],
    rows: list[dict],
    outdir: Path,
    cfg: GenerateConfig,
    deadline: float | None = None,
    part: Part | None = None,
) -> bool:
    """Generate responses (generate(prompts, sampling) -> responses, sampling[i] = row_sampling of prompt i's row)
    shard by shard, skipping finished shards; a shard found must hold shard k's prompts (ids) answered as cfg says
    (temperatures), else ValueError, so that a shard carried in from another run never stands for other prompts.
    Returns True when all are done; part: this process writes only the shards the part owns."""
    outdir.mkdir(parents=True, exist_ok=True)
    if cfg.limit is not None:
        rows = rows[: cfg.limit]
    n_shards = (len(rows) + cfg.shard_size - 1) // cfg.shard_size
    paths = [shard_path(outdir, k) for k in range(n_shards)]
    sampling = [row_sampling(i, cfg) for i in range(len(rows))] if cfg.sample_share > 0 else None

    def temperatures(k: int) -> np.ndarray:  # [rows of shard k] float32
        ks = range(k * cfg.shard_size, min((k + 1) * cfg.shard_size, len(rows)))
        return np.array([0.0 if sampling is None else sampling[i].temperature for i in ks], dtype=np.float32)

    def check(k: int, path: Path) -> None:
        with np.load(path) as z:
            got, temps = z["ids"].tolist(), shard_temperature(z)
        first = k * cfg.shard_size
        want = [r["id"] for r in rows[first : first + cfg.shard_size]]
        if got != want:
            raise ValueError(
                f"{path} holds responses to other prompts than rows {first}..{first + len(want) - 1} of the prompt "
                f"file ({len(got)} rows, first id {got[:1]}, expected {want[:1]}): remove it, or generate with the "
                "prompt files it was generated from"
            )
        if not np.array_equal(temps, temperatures(k)):
            raise ValueError(
                f"{path} was generated with other sampling settings than this call's (--sample-share "
                f"{cfg.sample_share}, --sample-temperature {cfg.sample_temperature}, --seed {cfg.seed}): remove it, "
                "or pass the settings it was made with"
            )

    for k, path in missing_shards(paths, deadline, "generate", check, part):
        part = rows[k * cfg.shard_size : (k + 1) * cfg.shard_size]
        first = k * cfg.shard_size
        order = sorted(range(len(part)), key=lambda i: len(part[i]["prompt_ids"]))  # similar lengths together
        responses: list[list[int] | None] = [None] * len(part)
        t0 = time.time()
        for s in range(0, len(order), cfg.batch_size):
            idx = order[s : s + cfg.batch_size]
            rows_sampling = [SamplingConfig() if sampling is None else sampling[first + i] for i in idx]
            outs = generate([part[i]["prompt_ids"] for i in idx], rows_sampling)
            for i, r in zip(idx, outs, strict=False):
                responses[i] = r
        n_tok = sum(len(r) for r in responses)
        temps = temperatures(k).tolist() if sampling is not None else None
        save_shard(path, [r["prompt_ids"] for r in part], responses, [r["id"] for r in part], temps)
        dt = time.time() - t0
        log.info(
            "generate: shard %d/%d, %d prompts, %d response tokens in %.1fs (%.0f tok/s)",
            k + 1,
            n_shards,
            len(part),
            n_tok,
            dt,
            n_tok / max(dt, 1e-9),
        )
    return all(p.exists() for p in paths)
