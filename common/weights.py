"""Load a Llama-family checkpoint: the embedded GGUF (default) or a Hugging Face safetensors folder.

A GGUF file is parsed and dequantized once (about 7 s on a CPU core for the embedded model, most of it the gguf
package's reader walking the tokenizer's arrays) and its float32 weights cached as safetensors under
$XDG_CACHE_HOME/specdec/checkpoints/ (common.model_path.cache_root), keyed by the file's path, size and mtime; later
loads, a restarted service's among them, read the cache (under a second). A cache that cannot be written or read is
skipped with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from common.config import LlamaConfig
from common.model_path import cache_root, default_model_path  # default_model_path re-exported: callers import it here

log = logging.getLogger(__name__)
CACHE_FORMAT = 1  # part of the GGUF cache's key: bump when what _read_gguf produces changes


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


def gguf_cache_file(path: Path) -> Path:
    """cache_root()/checkpoints/<stem>-<key>.safetensors: the key changes with the file's resolved path, size and
    mtime and CACHE_FORMAT."""
    path = path.resolve()
    st = path.stat()
    key = hashlib.sha256(f"{CACHE_FORMAT}\0{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "checkpoints" / f"{path.stem}-{key}.safetensors"


def _load_gguf(path: Path, max_position: int | None) -> Checkpoint:
    """The GGUF checkpoint from its cache when there is one (written on first load); max_position, when given,
    replaces the file's context length."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    cached = gguf_cache_file(path)
    ckpt = None
    if cached.with_suffix(".json").is_file():  # written after the weights: they are whole
        try:
            meta = json.loads(cached.with_suffix(".json").read_text())
            ckpt = Checkpoint(meta["name"], LlamaConfig(**meta["config"]), load_file(str(cached)), path)
            log.info("loaded %s from %s (cached from %s)", ckpt.name, cached, path)
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
            log.warning("the cached checkpoint %s is unreadable (%s): reading %s", cached, e, path)
    if ckpt is None:
        ckpt = _read_gguf(path)
        try:  # the weights, then the config beside them: a config is only there once its weights are whole
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f"{cached.stem}.{os.getpid()}.tmp")
            save_file(ckpt.state_dict, str(tmp))
            tmp.replace(cached)
            meta_tmp = tmp.with_suffix(".json.tmp")
            meta_tmp.write_text(json.dumps({"name": ckpt.name, "config": asdict(ckpt.config)}))
            meta_tmp.replace(cached.with_suffix(".json"))
        except OSError as e:
            log.warning("could not cache the checkpoint in %s (%s): the next load reads the GGUF file again", cached, e)
    if max_position:
        ckpt = replace(ckpt, config=replace(ckpt.config, max_position=max_position))
    return ckpt


def _read_gguf(path: Path) -> Checkpoint:
    """Parse and dequantize a GGUF file (float32 weights, Hugging Face names)."""
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
        max_position=int(field("llama.context_length")),
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
