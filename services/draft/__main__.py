"""python -m services.draft: the EAGLE-3 draft head (or a test oracle) and its own KV cache, in a process of its
own; the verifier calls it (its --draft flag). On a GPU the draft usually runs inside the verifier's process
instead (python -m services.verifier --draft-here)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.config import DraftingKnobs, EngineKnobs, Serving, knob, parse

if TYPE_CHECKING:  # the CLI's --help stays free of torch
    from common.config import DraftingConfig
    from common.engine.base import Drafter

log = logging.getLogger("services.draft")
DEFAULT_HEAD = Path(__file__).resolve().parents[2] / "models" / "eagle3-smollm2"


@dataclass(frozen=True)
class DraftServiceConfig(Serving, EngineKnobs, DraftingKnobs):
    addr: str = knob("127.0.0.1:50052", "where the draft service listens", env="DRAFT_ADDR")

    def __post_init__(self) -> None:
        Serving.__post_init__(self)
        EngineKnobs.__post_init__(self)


@dataclass(frozen=True)
class Built:
    drafter: Drafter
    drafting: DraftingConfig
    hidden_width: int  # 3 * the base model's hidden size: the features the verifier sends
    vocab_size: int  # the base model's vocabulary: the token ids the draft accepts
    max_sequences: int  # sequences it holds (0: no limit, the oracles)


def build_drafter(cfg: EngineKnobs | DraftingKnobs, max_sequences: int = 0) -> Built:
    """The drafter named by cfg.drafter, with the base model parts it needs. max_sequences 0: cfg's (auto)."""
    import torch

    from common.config import DraftingConfig
    from common.engine.capacity import KVShape, auto_sequences
    from common.engine.factory import make_drafter, pick_dtype
    from common.engine.verifier import torch_dtype
    from common.model.llama import LlamaModel
    from common.model_path import default_model_path
    from common.weights import load_checkpoint

    drafting = DraftingConfig(
        top_k=cfg.top_k,
        steps=cfg.steps,
        verify_tree_size=cfg.verify_tree_size,
        sampling_rule=cfg.sampling_rule,
        q_width=cfg.q_width,
    )
    ckpt = load_checkpoint(cfg.model or default_model_path())
    device, dtype = torch.device(cfg.device), torch_dtype(pick_dtype(cfg.device, cfg.dtype))
    width, vocab = 3 * ckpt.config.hidden_size, ckpt.config.vocab_size
    if cfg.drafter in ("oracle-greedy", "oracle-wrong"):  # the test oracles run the whole base model
        from common.engine.oracle import GreedyOracleDrafter, WrongOracleDrafter

        base = LlamaModel.loaded(ckpt.config, ckpt.state_dict, device, dtype)
        oracle = GreedyOracleDrafter if cfg.drafter == "oracle-greedy" else WrongOracleDrafter
        return Built(oracle(base, drafting.steps, device), drafting, width, vocab, 0)
    # the EAGLE-3 head needs only the base model's token embeddings
    embed = torch.nn.Embedding.from_pretrained(ckpt.state_dict["embed_tokens.weight"]).to(device=device, dtype=dtype)
    from common.model.eagle3 import Eagle3Config, Eagle3Head

    head_dir = Path(cfg.head) if cfg.head else DEFAULT_HEAD
    if (head_dir / "config.json").exists():
        from common.model.eagle3_io import load_eagle3

        head, _ = load_eagle3(head_dir)
        log.info("loaded EAGLE-3 head from %s", head_dir)
    else:
        if cfg.head:
            raise FileNotFoundError(f"no EAGLE-3 head at {head_dir} (config.json missing)")
        log.warning("no trained head at %s: using a randomly initialised EAGLE-3 head (low acceptance)", head_dir)
        torch.manual_seed(0)
        head = Eagle3Head(Eagle3Config.for_base(ckpt.config, draft_vocab_size=min(8192, ckpt.config.vocab_size)))
        head.set_vocab_map(torch.arange(head.cfg.draft_vocab_size))
    head.to(device=device, dtype=dtype).eval()
    c = head.cfg
    kv = KVShape(
        layers=1,
        positions=cfg.max_context + drafting.steps * (drafting.top_k + 1) + 1,
        kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        itemsize=torch.finfo(dtype).bits // 8,
    )
    n = max_sequences or auto_sequences(cfg.max_sequences, cfg.device, kv, cfg.gpu_memory_fraction)
    # CUDA graphs on a GPU, eager on CPU
    drafter = make_drafter(head, embed, drafting, n, cfg.max_context, device, graphs=cfg.graphs)
    return Built(drafter, drafting, width, vocab, n)


async def main(cfg: DraftServiceConfig) -> None:
    import torch

    from services.draft.server import DraftServicer
    from services.launch import serve
    from services.local_link import LinkServer, socket_name
    from specdec.v1 import internal_pb2_grpc

    b = build_drafter(cfg)
    servicer = DraftServicer(
        b.drafter, b.drafting, b.hidden_width, b.vocab_size, torch.device(cfg.device), b.max_sequences
    )
    link = None
    try:
        link = LinkServer(socket_name(servicer.instance_id), servicer.link_call)
        servicer.link_socket = link.name
        log.info("Propose and Release from this host also on the abstract Unix socket %s", link.name)
    except OSError as e:
        log.warning("no same-host link (%s): a verifier on this host calls through gRPC", e)
    try:
        await serve(
            cfg.addr,
            [(internal_pb2_grpc.add_DraftServicer_to_server, servicer)],
            ["specdec.v1.Draft"],
            cfg.port_file,
            servicer.drain,
            cfg.drain_grace,
        )
    finally:
        if link is not None:
            link.close()
        servicer.close()


def cli() -> None:
    asyncio.run(main(parse(DraftServiceConfig, "python -m services.draft", __doc__)))


if __name__ == "__main__":
    cli()
