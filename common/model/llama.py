"""Llama-family decoder in PyTorch (RMSNorm, RoPE, GQA, SwiGLU) over a static, slotted KV cache.

Every call writes the new tokens' K/V into the cache first and then attends over the cache with a
prefix-and-window mask (Batch), so prefill, single-token decoding and tree verification are one code
path: the caller decides positions, where K/V land, and who sees whom. The fused operations come from
common.kernels (Triton on a GPU, PyTorch elsewhere). The model does not know whether it is being
captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from common import kernels
from common.config import LlamaConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.add_rms_norm(x, None, self.weight, self.eps)[0]

    def add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one kernel on a GPU; residual None is zero."""
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


def rope_tables(head_dim: int, max_position: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_position, head_dim] in the rotate-half layout of Hugging Face Llama."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float(), emb.sin().float()


def _fused_weight(owner: nn.Module, attr: str, parts: tuple[nn.Linear, ...]) -> torch.Tensor:
    """The row-concatenation of parts' weights, for one matmul instead of len(parts).

    The parts stay the registered parameters (Hugging Face names for loading, saving, training), but
    after fusing their .data are row views of one buffer, so the fused weight costs no memory and sees
    every in-place update (load_state_dict, optimizer steps, copy_). When a parameter was replaced
    (module.to(), param.data = ...) the views no longer match and the buffer is rebuilt. With autograd
    on the parameters the concatenation is done per forward (torch.cat: one kernel, differentiable)."""
    ws = [m.weight for m in parts]
    fused = owner.__dict__.get(attr)
    if fused is not None and _is_fused(fused, ws):
        if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
            return torch.cat(ws)
        return fused
    if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
        return torch.cat(ws)
    if fused_capture_guard(ws[0]):
        raise RuntimeError(
            "fused weights must be built before CUDA graph capture: call model.fuse() "
            "(or run one eager forward) after loading weights and moving the model"
        )
    fused = torch.cat([w.detach() for w in ws])
    off = 0
    for w in ws:
        n = w.shape[0]
        w.data = fused[off : off + n]
        off += n
    owner.__dict__[attr] = fused
    return fused


def _is_fused(fused: torch.Tensor, ws: list[torch.Tensor]) -> bool:
    ptr, step = fused.data_ptr(), fused.stride(0) * fused.element_size()
    off = 0
    for w in ws:
        if (
            w.dtype != fused.dtype
            or w.device != fused.device
            or w.data_ptr() != ptr + off * step
            or w.stride() != fused.stride()
        ):
            return False
        off += w.shape[0]
    return off == fused.shape[0]


def fused_capture_guard(w: torch.Tensor) -> bool:
    return w.is_cuda and torch.cuda.is_current_stream_capturing()


def fuse(module: nn.Module) -> nn.Module:
    """Build the fused q|k|v and gate|up weights of every Attention/MLP in module now (call after loading
    weights and moving to the device, before CUDA graph capture). Idempotent; returns module."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (Attention, MLP)):
                m.fused_weight()
    return module


@dataclass
class KVCache:
    """Static K/V storage for `slots` sequences of up to `capacity` positions each.

    K and V of a layer live interleaved in one tensor, kv [L, slots, capacity, 2, kv_heads, head_dim],
    so one index_put writes both and one gather reads both; `k` and `v` are (strided) views of it."""

    kv: torch.Tensor  # [L, slots, capacity, 2, kv_heads, head_dim]

    @classmethod
    def allocate(
        cls,
        layers: int,
        slots: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        return cls(kv=torch.zeros((layers, slots, capacity, 2, kv_heads, head_dim), dtype=dtype, device=device))

    @property
    def k(self) -> torch.Tensor:  # [L, slots, capacity, kv_heads, head_dim] view
        return self.kv[:, :, :, 0]

    @property
    def v(self) -> torch.Tensor:  # [L, slots, capacity, kv_heads, head_dim] view
        return self.kv[:, :, :, 1]

    @property
    def capacity(self) -> int:
        return self.kv.shape[2]


@dataclass
class Batch:
    """Where a forward's tokens sit and what they see.

    Row t of sequence b sees cache positions [0, prefix_len[b]) and, beyond them, position
    prefix_len[b] + w wherever window[b, t, w]. Decoding: prefix_len = n, window [[1]]. Verifying a tree
    written at n, n + 1, ...: prefix_len = n, window = the tree's ancestor mask. Prefill: prefix_len 0,
    window causal. Any dense mask is prefix_len 0 with the mask as window (Batch.masked).
    Attention then costs prefix_len + W positions, whatever the cache's capacity.
    """

    input_ids: torch.Tensor  # [B, T] token ids
    positions: torch.Tensor  # [B, T] RoPE positions
    slots: torch.Tensor  # [B] KV cache slot of each sequence
    write_pos: torch.Tensor  # [B, T] cache position each token's K/V is written to
    prefix_len: torch.Tensor  # [B] cache positions every row sees
    window: torch.Tensor  # [B, T, W] bool: row t also sees position prefix_len + w
    # the PyTorch attention's mask, shared by the layers of one forward (filled by the models; None on
    # the Triton path, which reads prefix_len and window directly), or a TTTPlan set by training-time test
    plan: kernels.AttentionPlan | kernels.TTTPlan | None = None

    @classmethod
    def masked(
        cls,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        write_pos: torch.Tensor,
        mask: torch.Tensor,
    ) -> Batch:
        """A batch with a dense mask [B, 1, T, K] or [B, T, K] over cache positions [0, K)."""
        window = mask[:, 0] if mask.dim() == 4 else mask
        b = input_ids.shape[0]
        window = window.expand(b, *window.shape[1:])
        zeros = torch.zeros(b, dtype=torch.long, device=input_ids.device)
        return cls(
            input_ids=input_ids, positions=positions, slots=slots, write_pos=write_pos, prefix_len=zeros, window=window
        )

    def planned(self, witness: torch.Tensor, groups: int) -> Batch:
        """This batch with its attention plan for one forward (witness: a tensor of the forward's device and
        compute dtype; groups: query heads per KV head). A TTTPlan, chosen by the caller, is kept."""
        if isinstance(self.plan, kernels.TTTPlan):
            return self
        return replace(self, plan=kernels.attention_plan(witness, self.prefix_len, self.window, groups))


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, in_dim: int | None = None) -> None:
        super().__init__()
        d = in_dim or cfg.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def fused_weight(self) -> torch.Tensor:
        """[(H + 2 KVH) * D, d]: q|k|v rows (see _fused_weight)."""
        return _fused_weight(self, "_qkv_weight", (self.q_proj, self.k_proj, self.v_proj))

    def forward(
        self, x: torch.Tensor, batch: Batch, rope_cos: torch.Tensor, rope_sin: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        """x: [B, T, d]; rope_cos, rope_sin: [max_position, D] float32 tables;
        kv: [slots, capacity, 2, kv_heads, head_dim], one layer of KVCache.kv. Returns [B, T, hidden]."""
        qkv = F.linear(x, self.fused_weight())  # [B, T, (H + 2 KVH) * D]
        out = kernels.rope_attention(
            qkv, rope_cos, rope_sin, batch.positions, batch.slots, batch.write_pos, kv, batch.prefix_len,
            batch.window, self.num_heads, self.num_kv_heads, batch.plan,
        )  # fmt: skip
        return self.o_proj(out)  # [B, T, hidden]


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def fused_weight(self) -> torch.Tensor:
        """[2 I, H]: gate|up rows (see _fused_weight)."""
        return _fused_weight(self, "_gate_up_weight", (self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.swiglu(F.linear(x, self.fused_weight())))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: Batch,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        kv: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The residual stream entering the layer is x + residual (residual None: x alone). Returns
        (mlp output, residual, the stream entering the layer): the next layer's input is their sum, which
        it adds inside its first norm kernel."""
        h, stream = self.input_layernorm.add(x, residual)
        h, residual = self.post_attention_layernorm.add(self.self_attn(h, batch, rope_cos, rope_sin, kv), stream)
        return self.mlp(h), residual, stream


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [B, T, H] final hidden states after the last norm (feed lm_head)
    aux: torch.Tensor  # [B, T, 3H] inputs of the three EAGLE layers, concatenated low|mid|high


class Float32RopeTables(nn.Module):
    """Modules holding `rope_cos`/`rope_sin` buffers: they follow .to(device) but stay float32 under
    .to(dtype), so positions are exact whatever dtype the weights run in."""

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.rope_cos, self.rope_sin = self.rope_cos.float(), self.rope_sin.float()
        return self


class LlamaModel(Float32RopeTables):
    """Parameter names follow Hugging Face's LlamaForCausalLM, so HF checkpoints load as they are."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_position, D]
        self.register_buffer("rope_sin", sin, persistent=False)  # [max_position, D]
        self.aux_layers = cfg.eagle_layers()

    @classmethod
    def loaded(
        cls, cfg: LlamaConfig, state_dict: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
    ) -> LlamaModel:
        """A model of cfg with a checkpoint's weights (common.weights.Checkpoint.state_dict: names as above, the
        rope tables not among them), on device in dtype, in eval mode, no gradients."""
        m = cls(cfg)
        m.load_state_dict(state_dict, strict=False)
        return m.to(device=device, dtype=dtype).eval().requires_grad_(False)

    def forward(self, batch: Batch, cache: KVCache) -> ForwardOutput:
        x, residual = self.embed_tokens(batch.input_ids), None
        batch = batch.planned(x, self.cfg.num_heads // self.cfg.num_kv_heads)
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x, residual, stream = layer(x, residual, batch, self.rope_cos, self.rope_sin, cache.kv[i])
            if i in self.aux_layers:
                taps[i] = stream
        hidden, _ = self.norm.add(x, residual)
        # a small model may name one layer twice (6 layers -> (2, 3, 3)): still 3 * H wide
        return ForwardOutput(hidden=hidden, aux=torch.cat([taps[i] for i in self.aux_layers], dim=-1))

    def fuse(self) -> LlamaModel:
        """Build the fused projection weights now (see fuse); call before CUDA graph capture."""
        return fuse(self)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] in float32."""
        return self.lm_head(hidden).float()

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> argmax token ids [...]: the argmax of the logits in the compute dtype, which
        is the argmax of their float32 copy (the cast is exact), without the cast's kernel."""
        return self.lm_head(hidden).argmax(-1)
