"""Typed configs shared by the services. Each validates itself and raises ValueError."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-family decoder (SmolLM2, Llama 2/3, ...)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_position: int = 2048
    tie_embeddings: bool = True
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    def eagle_layers(self) -> tuple[int, int, int]:
        """Base layers whose inputs feed an EAGLE-3 head: low, middle, high (EAGLE reference: 2, L/2, L-3)."""
        return (2, self.num_layers // 2, self.num_layers - 3)


SAMPLING_RULES = ("onehot", "q")


@dataclass(frozen=True)
class DraftingConfig:
    """EAGLE-2 dynamic tree: expand the best `top_k` nodes per level for `steps` levels, verify the best
    `verify_tree_size` nodes. Defaults are TensorRT Edge-LLM's (draftingTopK, draftingStep, verifyTreeSize).

    sampling_rule picks how sampled (temperature > 0) sequences are drafted and accepted (greedy ones
    always get the deterministic top-k tree): "onehot" drafts the same top-k tree and the verifier
    treats each child as a point mass (common.acceptance.accept_sampled); "q" draws each node's children
    from the draft's distribution at the request's temperature, truncated to its q_width best tokens,
    and the verifier uses that q (common.acceptance.accept_sampled_q)."""

    top_k: int = 10
    steps: int = 6
    verify_tree_size: int = 60
    sampling_rule: str = "onehot"
    q_width: int = 32  # M: tokens of the draft's q per expanded node under the q rule (top_k if larger)

    def __post_init__(self) -> None:
        if self.sampling_rule not in SAMPLING_RULES:
            raise ValueError(f"sampling_rule must be one of {', '.join(SAMPLING_RULES)}, got {self.sampling_rule!r}")
        if not 1 <= self.q_width <= 256:
            raise ValueError(f"q_width must be in [1, 256], got {self.q_width}")
        if not 1 <= self.top_k <= 64:
            raise ValueError(f"drafting top_k must be in [1, 64], got {self.top_k}")
        if not 1 <= self.steps <= 32:
            raise ValueError(f"drafting steps must be in [1, 32], got {self.steps}")
        if self.verify_tree_size < 1:
            raise ValueError(f"verify_tree_size must be >= 1, got {self.verify_tree_size}")
        if self.verify_tree_size > self.max_candidates():
            raise ValueError(
                f"verify_tree_size {self.verify_tree_size} exceeds the {self.max_candidates()} "
                f"nodes that top_k={self.top_k}, steps={self.steps} can draft"
            )

    @property
    def width(self) -> int:
        """Draft tokens read per expanded node: top_k, or the q rule's q_width when that is larger."""
        return max(self.top_k, self.q_width) if self.sampling_rule == "q" else self.top_k

    def max_candidates(self) -> int:
        """Nodes the expansion creates: top_k at depth 1, then top_k * top_k per further step."""
        return self.top_k + (self.steps - 1) * self.top_k * self.top_k


@dataclass(frozen=True)
class SamplingConfig:
    """How a sequence picks tokens. temperature 0 is greedy; top_k 0 is off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if math.isnan(self.temperature) or self.temperature < 0 or self.temperature > 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if math.isnan(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
