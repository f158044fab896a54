"""Load a Llama-family checkpoint: the embedded GGUF (default) or a Hugging Face safetensors folder."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.config import LlamaConfig
from common.model_path import default_model_path  # re-exported: callers import it from here too

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    name: str
    config: LlamaConfig
    state_dict: dict[str, torch.Tensor]  # Hugging Face LlamaForCausalLM names, without "model."
    path: Path  # the GGUF file or the HF folder (also holds the tokenizer)


def load_checkpoint(path: str | os.PathLike | None = None, max_position: int | None = None) -> Checkpoint:
    p = Path(path) if path else default_model_path()
    if p.is_dir():
        return _load_hf(p, max_position)
    if p.suffix == ".gguf":
        return _load_gguf(p, max_position)
    raise ValueError(f"model path {p} is neither a .gguf file nor a Hugging Face folder")


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the RoPE halves of q/k rows; undo it to the HF layout.
    Per head, rows [r0, r1, r2, r3] (pairs) <- HF rows [h0, h2, h1, h3]: view (heads, D/2, 2) -> (heads, 2, D/2)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path, max_position: int | None) -> Checkpoint:
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(key: str):
        return reader.fields[key].contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported (llama only)")
    heads, kv_heads = int(field("llama.attention.head_count")), int(field("llama.attention.head_count_kv"))
    hidden = int(field("llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    cfg = LlamaConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=int(field("llama.feed_forward_length")),
        num_layers=int(field("llama.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rope_theta=float(field("llama.rope.freq_base")),
        rms_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
        max_position=max_position or int(field("llama.context_length")),
        tie_embeddings="output.weight" not in names,
        bos_token_id=int(field("tokenizer.ggml.bos_token_id")),
        eos_token_id=int(field("tokenizer.ggml.eos_token_id")),
    )
    rename = {
        "token_embd": "embed_tokens",
        "output_norm": "norm",
        "output": "lm_head",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        parts = t.name.split(".")
        if parts[0] == "blk":
            kind = parts[2]
            if kind == "attn_q":
                w = _unpermute_qk(w, heads)
            elif kind == "attn_k":
                w = _unpermute_qk(w, kv_heads)
            key = f"layers.{parts[1]}.{rename[kind]}.{parts[3]}"
        else:
            key = f"{rename[parts[0]]}.{parts[1]}"
        sd[key] = torch.from_numpy(np.ascontiguousarray(w))
    name = str(field("general.name")) if "general.name" in reader.fields else path.stem
    log.info("loaded %s from %s (%d tensors)", name, path, len(sd))
    return Checkpoint(name=path.stem, config=cfg, state_dict=sd, path=path)


def _load_hf(folder: Path, max_position: int | None) -> Checkpoint:
    from safetensors.torch import load_file

    hf = json.loads((folder / "config.json").read_text())
    heads = int(hf["num_attention_heads"])
    cfg = LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads", heads)),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rms_eps=float(hf.get("rms_norm_eps", 1e-5)),
        max_position=max_position or int(hf.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=int(hf.get("bos_token_id") or 1),
        eos_token_id=int(_first(hf.get("eos_token_id"), 2)),
    )
    sd: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    for f in files:
        for k, v in load_file(str(f)).items():
            sd[k.removeprefix("model.")] = v.float()
    return Checkpoint(name=folder.name, config=cfg, state_dict=sd, path=folder)


def _first(value, default: int) -> int:
    if isinstance(value, list):
        return int(value[0]) if value else default
    return default if value is None else int(value)
