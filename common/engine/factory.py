"""Pick the engine classes: CUDA-graph engines on a GPU when asked for, the eager ones otherwise."""

from __future__ import annotations

import logging

import torch

from common.config import DraftingConfig
from common.engine.cuda_graphs import GraphConfig
from common.engine.torch_draft import Eagle3Drafter
from common.engine.torch_verifier import TorchVerifier, VerifierConfig
from common.model.eagle3 import Eagle3Head
from common.weights import Checkpoint

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")


def pick_dtype(device: str | torch.device, requested: str | None = None) -> str:
    """The dtype name to run in: `requested` when given (and not "auto"), else bfloat16 on CUDA and
    float32 elsewhere.  ("cuda:0", None) -> "bfloat16";  ("cpu", None) -> "float32"."""
    if requested and requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or auto, got {requested!r}")
        return requested
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def _graphs_wanted(device: str | torch.device, graphs: bool) -> bool:
    if not graphs:
        return False
    if torch.device(device).type != "cuda":
        log.info("CUDA graphs requested on %s: using the eager engines", device)
        return False
    return True


def make_verifier(ckpt: Checkpoint, cfg: VerifierConfig, graphs: bool,
                  graph_cfg: GraphConfig | None = None) -> TorchVerifier:
    """GraphVerifier on CUDA when graphs is True, TorchVerifier otherwise (same API, same results)."""
    if _graphs_wanted(cfg.device, graphs):
        from common.engine.graph_verifier import GraphVerifier

        return GraphVerifier(ckpt, cfg, graph_cfg)
    return TorchVerifier(ckpt, cfg)


def make_drafter(head: Eagle3Head, embed: torch.nn.Embedding, drafting: DraftingConfig, max_sequences: int,
                 max_context: int, device: str | torch.device, graphs: bool,
                 graph_cfg: GraphConfig | None = None) -> Eagle3Drafter:
    """GraphEagle3Drafter on CUDA when graphs is True, Eagle3Drafter otherwise (same trees)."""
    device = torch.device(device)
    if _graphs_wanted(device, graphs):
        from common.engine.graph_draft import GraphEagle3Drafter

        return GraphEagle3Drafter(head, embed, drafting, max_sequences, max_context, device, graph_cfg)
    return Eagle3Drafter(head, embed, drafting, max_sequences, max_context, device)
