"""python -m services.draft: the EAGLE-3 draft head (or a test oracle) and its own KV cache."""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.launch import common_arguments, engine_arguments, parse_and_log, serve

if TYPE_CHECKING:  # the CLI's --help stays free of torch
    from common.config import DraftingConfig
    from common.engine.base import Drafter

log = logging.getLogger("services.draft")

DEFAULT_HEAD = Path(__file__).resolve().parents[2] / "models" / "eagle3-smollm2"
DRAFTERS = ("eagle3", "oracle-greedy", "oracle-wrong")


@dataclass(frozen=True)
class Built:
    drafter: Drafter
    drafting: DraftingConfig
    hidden_width: int  # 3 * the base model's hidden size: the features the verifier sends
    vocab_size: int  # the base model's vocabulary: the token ids the draft accepts


def build_drafter(args: argparse.Namespace) -> Built:
    """The drafter named by --drafter, with the base model parts it needs."""
    import torch

    from common.config import DraftingConfig
    from common.engine.factory import make_drafter, pick_dtype
    from common.engine.verifier import torch_dtype
    from common.model.llama import LlamaModel
    from common.weights import load_checkpoint

    drafting = DraftingConfig(
        top_k=args.top_k,
        steps=args.steps,
        verify_tree_size=args.verify_tree_size,
        sampling_rule=args.sampling_rule,
        q_width=args.q_width,
    )
    ckpt = load_checkpoint(args.model)
    device, dtype = torch.device(args.device), torch_dtype(pick_dtype(args.device, args.dtype))
    if args.drafter in ("oracle-greedy", "oracle-wrong"):  # the test oracles run the whole base model
        from common.engine.oracle import GreedyOracleDrafter, WrongOracleDrafter

        base = LlamaModel(ckpt.config)
        base.load_state_dict(ckpt.state_dict, strict=False)
        base.to(device=device, dtype=dtype).eval()
        oracle = GreedyOracleDrafter if args.drafter == "oracle-greedy" else WrongOracleDrafter
        return Built(
            oracle(base, drafting.steps, device), drafting, 3 * ckpt.config.hidden_size, ckpt.config.vocab_size
        )
    # the EAGLE-3 head needs only the base model's token embeddings
    embed = torch.nn.Embedding.from_pretrained(ckpt.state_dict["embed_tokens.weight"]).to(device=device, dtype=dtype)
    from common.model.eagle3 import Eagle3Config, Eagle3Head

    head_dir = Path(args.head) if args.head else DEFAULT_HEAD
    if (head_dir / "config.json").exists():
        from common.model.eagle3_io import load_eagle3

        head, _ = load_eagle3(head_dir)
        log.info("loaded EAGLE-3 head from %s", head_dir)
    else:
        if args.head:
            raise FileNotFoundError(f"no EAGLE-3 head at {head_dir} (config.json missing)")
        log.warning("no trained head at %s: using a randomly initialised EAGLE-3 head (low acceptance)", head_dir)
        torch.manual_seed(0)
        head = Eagle3Head(Eagle3Config.for_base(ckpt.config, draft_vocab_size=min(8192, ckpt.config.vocab_size)))
        head.set_vocab_map(torch.arange(head.cfg.draft_vocab_size))
    head.to(device=device, dtype=dtype).eval()
    from common.engine.capacity import KVShape, auto_sequences

    c = head.cfg
    kv = KVShape(
        layers=1,
        positions=args.max_context + drafting.steps * (drafting.top_k + 1) + 1,
        kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        itemsize=torch.finfo(dtype).bits // 8,
    )
    args.max_sequences = auto_sequences(args.max_sequences, args.device, kv, args.gpu_memory_fraction)
    drafter = make_drafter(
        head, embed, drafting, args.max_sequences, args.max_context, device, graphs=args.graphs
    )  # CUDA graphs on a GPU, eager on CPU
    return Built(drafter, drafting, 3 * head.cfg.target_hidden_size, ckpt.config.vocab_size)


def draft_service(args: argparse.Namespace, local_buffers=None) -> tuple:
    """The draft service to serve: (add_servicer, servicer, service name). local_buffers: see DraftServicer
    (when both engines share this process)."""
    import torch

    from services.draft.server import DraftServicer
    from specdec.v1 import internal_pb2_grpc

    b = build_drafter(args)
    servicer = DraftServicer(
        b.drafter,
        b.drafting,
        b.hidden_width,
        b.vocab_size,
        torch.device(args.device),
        lease_ttl=args.lease_ttl,
        max_sequences=args.max_sequences,
        local_buffers=local_buffers,
        poll=not args.block_on_device,
    )
    return internal_pb2_grpc.add_DraftServicer_to_server, servicer, "specdec.v1.Draft"


async def main(args: argparse.Namespace) -> None:
    await serve(args.addr, [draft_service(args)], args.port_file, args.drain_grace)


def draft_arguments(p: argparse.ArgumentParser) -> None:
    """The drafter's flags (this service's, and the verifier's with --draft-here)."""
    from common.config import SAMPLING_RULES, DraftingConfig

    p.add_argument("--drafter", default="eagle3", choices=DRAFTERS)
    p.add_argument("--head", default=None, help=f"EAGLE-3 head folder (default: {DEFAULT_HEAD})")
    p.add_argument("--top-k", type=int, default=10, help="drafting_top_k")
    p.add_argument("--steps", type=int, default=6, help="drafting_steps")
    p.add_argument("--verify-tree-size", type=int, default=60)
    p.add_argument(
        "--sampling-rule",
        default=DraftingConfig.sampling_rule,
        choices=SAMPLING_RULES,
        help="sampled requests: onehot (top-k tree, one-hot acceptance) or q (children drawn from the "
        "draft's q, recursive rejection sampling; the verifier follows the tree)",
    )
    p.add_argument("--q-width", type=int, default=DraftingConfig.q_width, help="tokens of q per node (q rule)")


def cli() -> None:
    p = argparse.ArgumentParser(prog="python -m services.draft", description=__doc__)
    common_arguments(p, "DRAFT_ADDR", "127.0.0.1:50052")
    engine_arguments(p)
    draft_arguments(p)
    a = parse_and_log(p)
    asyncio.run(main(a))


if __name__ == "__main__":
    cli()
