"""EAGLE-3 draft head: one decoder layer fed by the token embedding and the fused hidden states of
three base layers, predicting over a reduced draft vocabulary mapped back with d2t.

Parameter names follow the EAGLE reference checkpoints (fc, midlayer.*, norm, lm_head, d2t, t2d).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from common import kernels
from common.config import LlamaConfig
from common.model.llama import MLP, Attention, Batch, Float32RopeTables, KVCache, RMSNorm, fuse, rope_tables


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the base model's vocabulary
    draft_vocab_size: int  # the head's reduced vocabulary
    target_hidden_size: int  # the base model's hidden size (fc input is 3x this)
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 2048

    def __post_init__(self) -> None:
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in (0, {self.vocab_size}]")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @classmethod
    def for_base(cls, base: LlamaConfig, draft_vocab_size: int) -> Eagle3Config:
        return cls(
            hidden_size=base.hidden_size,
            intermediate_size=base.intermediate_size,
            num_heads=base.num_heads,
            num_kv_heads=base.num_kv_heads,
            head_dim=base.head_dim,
            vocab_size=base.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=base.hidden_size,
            rms_eps=base.rms_eps,
            rope_theta=base.rope_theta,
            max_position=base.max_position,
        )

    def as_llama(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rms_eps=self.rms_eps,
            max_position=self.max_position,
        )


class Eagle3Layer(nn.Module):
    """The reference `midlayer`: attention over [norm(embedding) | norm(hidden)] (2H wide)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        lc = cfg.as_llama()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(lc, in_dim=2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)


@dataclass
class DraftOutput:
    hidden: torch.Tensor  # [B, T, H] the layer's output before the final norm (fed back as next hidden)
    logp: torch.Tensor  # [B, T, draft_vocab] log-probabilities over the draft vocabulary (float32)


@dataclass
class DraftTopK:
    hidden: torch.Tensor  # [B, T, H] the layer's output before the final norm
    logp: torch.Tensor  # [B, T, k] the k best draft log-probabilities, descending (float32)
    ids: torch.Tensor  # [B, T, k] their draft-vocabulary ids


class Eagle3Head(Float32RopeTables):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # d2t[i]: offset so that draft id i is base id i + d2t[i]; t2d[j]: base id j is in the draft vocab
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def set_vocab_map(self, draft_to_base: torch.Tensor) -> None:
        """draft_to_base [draft_vocab]: the base id of each draft id (ascending)."""
        self.d2t.copy_(draft_to_base - torch.arange(draft_to_base.shape[0]))
        self.t2d.zero_()
        self.t2d[draft_to_base] = True

    def fuse(self) -> Eagle3Head:
        """Build the fused projection weights now (see common.model.llama.fuse); call before capture."""
        return fuse(self)

    def to_base_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def base_ids(self) -> torch.Tensor:
        """[draft_vocab] the base ids of the draft vocabulary, ascending (draft id i is base id base_ids()[i])."""
        return self.to_base_ids(torch.arange(self.d2t.shape[0], device=self.d2t.device))

    def hidden_and_normed(
        self, embeds: torch.Tensor, hidden: torch.Tensor, batch: Batch, cache: KVCache, layer_cache: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [B, T, H] token embeddings; hidden [B, T, 3*H_target] base features or [B, T, H] the
        head's own earlier output (fed back while drafting and in training-time test).
        Returns (the layer's output [B, T, H], fed back as the next hidden; its final norm [B, T, H],
        the lm_head's input)."""
        if hidden.shape[-1] != self.cfg.hidden_size:
            hidden = self.fc(hidden)
        layer = self.midlayer
        x = kernels.rms_norm_cat(
            embeds, layer.input_layernorm.weight, hidden, layer.hidden_norm.weight, layer.input_layernorm.eps
        )  # [B, T, 2H]
        batch = batch.planned(x, self.cfg.num_heads // self.cfg.num_kv_heads)
        attn = layer.self_attn(x, batch, self.rope_cos, self.rope_sin, cache.kv[layer_cache])
        normed, h = layer.post_attention_layernorm.add(attn, hidden)
        normed, h = self.norm.add(layer.mlp(normed), h)
        return h, normed

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, batch: Batch, cache: KVCache, layer_cache: int = 0
    ) -> DraftOutput:
        """Full log-probabilities over the draft vocabulary (training and evaluation)."""
        h, normed = self.hidden_and_normed(embeds, hidden, batch, cache, layer_cache)
        return DraftOutput(hidden=h, logp=torch.log_softmax(self.lm_head(normed).float(), dim=-1))

    def top_k(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: Batch, cache: KVCache, k: int) -> DraftTopK:
        """The k best children of every row (drafting): one fused log-softmax + top-k on a GPU."""
        h, normed = self.hidden_and_normed(embeds, hidden, batch, cache)
        logp, ids = kernels.topk_logprobs(self.lm_head(normed), k)
        return DraftTopK(hidden=h, logp=logp, ids=ids)
