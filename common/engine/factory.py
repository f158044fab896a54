"""Build the engines: CUDA graphs on a GPU when asked for, the same steps eagerly otherwise."""

from __future__ import annotations

import logging

import torch

from common.config import DraftingConfig
from common.engine.cuda_graphs import GraphConfig
from common.engine.draft import Eagle3Drafter
from common.engine.verifier import Verifier, VerifierConfig
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
    if graphs and torch.device(device).type != "cuda":
        log.info("CUDA graphs requested on %s: the steps run eagerly", device)
    return graphs and torch.device(device).type == "cuda"


def make_verifier(
    ckpt: Checkpoint, cfg: VerifierConfig, graphs: bool, graph_cfg: GraphConfig | None = None
) -> Verifier:
    """The verifier engine; its steps are captured as CUDA graphs on a GPU when graphs is True."""
    return Verifier(ckpt, cfg, _graphs_wanted(cfg.device, graphs), graph_cfg)


def make_drafter(
    head: Eagle3Head,
    embed: torch.nn.Embedding,
    drafting: DraftingConfig,
    max_sequences: int,
    max_context: int,
    device: str | torch.device,
    graphs: bool,
    graph_cfg: GraphConfig | None = None,
) -> Eagle3Drafter:
    """The EAGLE-3 drafter; its steps are captured as CUDA graphs on a GPU when graphs is True."""
    return Eagle3Drafter(
        head, embed, drafting, max_sequences, max_context, device, _graphs_wanted(device, graphs), graph_cfg
    )
