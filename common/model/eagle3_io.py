"""Save and load EAGLE-3 heads in the public checkpoint layout.

Layout (as in yuhuili/EAGLE3-LLaMA3.1-Instruct-8B and SpecForge/SGLang-trained heads):
  config.json  Hugging Face LlamaConfig-style dict with architectures ["LlamaForCausalLMEagle3"],
               num_hidden_layers 1, vocab_size (base) and draft_vocab_size
  weights      fc.weight, midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight,
               midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight,
               norm.weight, lm_head.weight, d2t [draft_vocab] int64, t2d [vocab] bool
               in model.safetensors, or model-0000k-of-0000n.safetensors + model.safetensors.index.json
               when larger than max_shard_bytes, or (reading only) pytorch_model.bin.
Keys we do not use (embed_tokens.weight, which some heads carry) are ignored on load; vLLM-style names
(layers.0.*, model.*) are mapped back to the reference names.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from common.model.eagle3 import Eagle3Config, Eagle3Head

log = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
IGNORED_KEYS = ("embed_tokens.weight",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def config_to_json(cfg: Eagle3Config, dtype: str, aux_layers: tuple[int, ...] | None = None) -> dict:
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    if aux_layers is not None:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers), "use_aux_hidden_state": True}
    return out


def config_from_json(d: dict) -> Eagle3Config:
    heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    vocab = int(d["vocab_size"])
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        vocab_size=vocab,
        draft_vocab_size=int(d.get("draft_vocab_size") or vocab),
        target_hidden_size=int(d.get("target_hidden_size") or hidden),
        rms_eps=float(d.get("rms_norm_eps", 1e-5)),
        rope_theta=float(d.get("rope_theta", 10000.0)),
        max_position=int(d.get("max_position_embeddings", 2048)),
    )


def head_state(head: Eagle3Head, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The persistent tensors under their reference names; floating weights cast to dtype."""
    out = {}
    for k, v in head.state_dict().items():
        v = v.detach().cpu()
        # clone: fused projections make q/k/v (gate/up) views of one buffer, and safetensors refuses
        # tensors that share memory
        out[k] = (v.to(dtype) if v.is_floating_point() else v).contiguous().clone()
    return out


def save_eagle3(
    head: Eagle3Head,
    cfg: Eagle3Config,
    out_dir: str | os.PathLike,
    max_shard_bytes: int = 15 * 2**20,
    dtype: str = "bfloat16",
    aux_layers: tuple[int, ...] | None = None,
) -> list[Path]:
    """Write config.json and the weights; returns the files written. Shards stay under max_shard_bytes
    (a single tensor larger than that is an error, so every file respects the limit)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("model*.safetensors")) + [out / INDEX_FILE]:
        old.unlink(missing_ok=True)
    state = head_state(head, DTYPES[dtype])
    sizes = {k: v.numel() * v.element_size() for k, v in state.items()}
    # safetensors adds a JSON header (~100 bytes per tensor); leave room for it
    budget = max_shard_bytes - 1024 - 256 * len(state)
    too_big = [k for k, s in sizes.items() if s > budget]
    if too_big:
        raise ValueError(f"tensor {too_big[0]} ({sizes[too_big[0]]} bytes) exceeds max_shard_bytes {max_shard_bytes}")
    meta = {"format": "pt"}
    (out / "config.json").write_text(json.dumps(config_to_json(cfg, dtype, aux_layers), indent=2) + "\n")
    written = [out / "config.json"]
    if sum(sizes.values()) <= budget:
        save_file(state, str(out / SINGLE_FILE), metadata=meta)
        written.append(out / SINGLE_FILE)
        _readable(written)
        log.info("saved EAGLE-3 head to %s (%d bytes)", out / SINGLE_FILE, sum(sizes.values()))
        return written
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for k in sorted(state):
        if used + sizes[k] > budget and shards[-1]:
            shards.append({})
            used = 0
        shards[-1][k] = state[k]
        used += sizes[k]
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(out / name), metadata=meta)
        written.append(out / name)
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    written.append(out / INDEX_FILE)
    _readable(written)
    log.info("saved EAGLE-3 head to %s in %d shards", out, n)
    return written


def _readable(files: list[Path]) -> None:
    """safetensors writes 0600 files; a serving container may run as another user."""
    for f in files:
        f.chmod(0o644)


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / INDEX_FILE).exists():
        index = json.loads((folder / INDEX_FILE).read_text())
        sd: dict[str, torch.Tensor] = {}
        for name in sorted(set(index["weight_map"].values())):
            sd.update(load_file(str(folder / name)))
        return sd
    if (folder / SINGLE_FILE).exists():
        return load_file(str(folder / SINGLE_FILE))
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        sd = {}
        for b in bins:
            sd.update(torch.load(str(b), map_location="cpu", weights_only=True))
        return sd
    others = sorted(folder.glob("*.safetensors"))
    if others:
        sd = {}
        for f in others:
            sd.update(load_file(str(f)))
        return sd
    raise FileNotFoundError(f"no model.safetensors, shard index or pytorch_model.bin in {folder}")


def _normalize_key(key: str) -> str:
    key = key.removeprefix("model.")
    if key.startswith("layers.0."):
        key = "midlayer." + key.removeprefix("layers.0.")
    return key


def load_eagle3(
    folder: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[Eagle3Head, Eagle3Config]:
    """Build an Eagle3Head from a public-layout folder. Float weights keep their stored dtype unless
    dtype is given. A head without d2t/t2d (full vocabulary) gets the identity map."""
    p = Path(folder)
    cfg_json = json.loads((p / "config.json").read_text())
    archs = cfg_json.get("architectures") or []
    if archs and ARCHITECTURE not in archs:
        log.warning("%s: architectures %s, expected %s; loading anyway", p, archs, ARCHITECTURE)
    raw = _read_weights(p)
    sd = {_normalize_key(k): v for k, v in raw.items() if _normalize_key(k) not in IGNORED_KEYS}
    if "fc.weight" in sd and "target_hidden_size" not in cfg_json:
        cfg_json = {**cfg_json, "target_hidden_size": sd["fc.weight"].shape[1] // 3}
    cfg = config_from_json(cfg_json)
    head = Eagle3Head(cfg)
    if "d2t" not in sd:
        head.set_vocab_map(torch.arange(cfg.draft_vocab_size))
    else:
        sd["d2t"] = sd["d2t"].long()
        if "t2d" not in sd:
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[sd["d2t"] + torch.arange(cfg.draft_vocab_size)] = True
            sd["t2d"] = t2d
        sd["t2d"] = sd["t2d"].bool()
    missing, unexpected = head.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k not in ("d2t", "t2d")]
    if missing:
        raise ValueError(f"{p}: checkpoint lacks {', '.join(missing)}")
    if unexpected:
        log.warning("%s: ignoring unknown keys %s", p, ", ".join(sorted(unexpected)))
    float_dtypes = {v.dtype for k, v in sd.items() if v.is_floating_point()}
    target = dtype or (float_dtypes.pop() if len(float_dtypes) == 1 else torch.float32)
    head.to(device=device, dtype=target)
    head.eval()
    return head, cfg
