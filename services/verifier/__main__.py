"""python -m services.verifier: the base model, its KV cache and the engine core that runs the rounds.

The drafter: with --draft-here, the draft engine in this process (the default on a GPU: the next trees are
drafted on the device behind each verification); with --draft ADDR, a draft service in another process; with
neither, plain decoding only."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.config import DraftingKnobs, EngineKnobs, Serving, knob, parse

if TYPE_CHECKING:  # the CLI's --help stays free of torch
    from common.engine.base import EngineInfo
    from common.engine.core import EngineCore
    from services.verifier.server import DraftLimits

log = logging.getLogger("services.verifier")


@dataclass(frozen=True)
class VerifierServiceConfig(Serving, EngineKnobs, DraftingKnobs):
    addr: str = knob("127.0.0.1:50053", "where the verifier listens", env="VERIFIER_ADDR")
    max_tree_nodes: int = knob(64, "largest draft tree verified")
    draft: str = knob("", "the draft service's address ('' and no --draft-here: plain decoding only)")
    draft_here: bool = knob(False, "run the draft engine in this process (the drafting flags apply)")
    draft_timeout: float = knob(10.0, "seconds a draft call may take before its sequences go on plainly")
    draft_wait: float = knob(120.0, "seconds to wait at start-up for the draft service (then start without it)")
    draft_retry: float = knob(1.0, "seconds between attempts to catch sequences up after the draft failed")
    prefill_chunk: int = knob(512, "prompt tokens prefilled per engine step; longer prompts go in chunks (0: whole)")
    plain_steps: int = knob(8, "decoding steps per host synchronisation when the policy decodes plainly")
    rounds_per_step: int = knob(4, "speculative rounds per engine step (admission, prefill and outputs once a step)")
    call_rounds: int = knob(32, "rounds one verifier call may run on while its batch is all there is")
    prefill_ahead: int = knob(
        -1,
        "prompts prefilled while a verifier call runs, beside its rounds on the GPU (slots beyond the sequences "
        "held at once); -1 = auto: 8 on CUDA, 0 on CPU (where nothing runs beside)",
    )
    policy_menu: str = knob(
        "", "trees the speculation policy chooses from, DEPTHxNODES comma-separated ('' = the default menu)"
    )

    def __post_init__(self) -> None:
        Serving.__post_init__(self)
        EngineKnobs.__post_init__(self)
        if self.draft and self.draft_here:
            raise ValueError("give --draft ADDR or --draft-here, not both")
        if self.draft_timeout <= 0 or self.draft_wait < 0 or self.draft_retry <= 0:
            raise ValueError("draft_timeout and draft_retry must be > 0, draft_wait >= 0")
        if self.prefill_ahead < -1:
            raise ValueError(f"prefill_ahead must be >= 0, or -1 for auto; got {self.prefill_ahead}")


def menu(cfg: VerifierServiceConfig, top_k: int, steps: int, size: int):
    """The policy's trees: the configured menu's that the drafter drafts, and the drafter's own."""
    from common.policy import DEFAULT_MENU, Shape

    shapes = [Shape.parse(t) for t in cfg.policy_menu.split(",")] if cfg.policy_menu else list(DEFAULT_MENU)
    own = Shape(steps, min(size, cfg.max_tree_nodes))
    fits = [s for s in shapes if s.depth <= steps and s.nodes <= min(size, top_k + (s.depth - 1) * top_k * top_k)]
    return tuple(sorted({*fits, own}))


@dataclass(frozen=True)
class Built:
    """The engines and the core a verifier runs (the benchmarks build theirs here too)."""

    core: EngineCore
    info: EngineInfo
    max_sequences: int  # generations at once
    limits: DraftLimits | None  # what the drafter drafts (None: no drafter)
    policy: str


def build(cfg: VerifierServiceConfig) -> Built:
    """The verifier engine, its drafter (here, remote or none), the policy calibrated from both engines' step
    times, and the engine core over them."""
    import torch

    from common.engine.capacity import KVShape, auto_sequences
    from common.engine.core import CoreConfig, EngineCore
    from common.engine.factory import make_verifier, pick_dtype
    from common.engine.verifier import VerifierConfig, torch_dtype
    from common.model_path import default_model_path
    from common.policy import AdaptivePolicy, PolicyConfig, StepCost
    from common.weights import load_checkpoint
    from services.verifier.server import DraftLimits

    dtype = pick_dtype(cfg.device, cfg.dtype)
    ckpt = load_checkpoint(cfg.model or default_model_path())
    mc = ckpt.config
    kv = KVShape(
        layers=mc.num_layers,
        positions=cfg.max_context + 2 * (cfg.max_tree_nodes + 1),
        kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        itemsize=2 if dtype != "float32" else 4,
    )
    n = auto_sequences(cfg.max_sequences, cfg.device, kv, cfg.gpu_memory_fraction)
    # one engine slot beyond n: the spare in which features are recomputed for a drafter catching up
    width = max(cfg.top_k, cfg.q_width) if cfg.sampling_rule == "q" else cfg.top_k  # a sampled tree row's set
    ahead = cfg.prefill_ahead if cfg.prefill_ahead >= 0 else 8 if cfg.device.startswith("cuda") else 0
    engine_cfg = VerifierConfig(
        n + 1, cfg.max_context, cfg.max_tree_nodes, dtype, cfg.device, q_width=width, prefill_ahead=ahead
    )
    engine = make_verifier(ckpt, engine_cfg, graphs=cfg.graphs)  # CUDA graphs on a GPU, eager on CPU
    drafter, limits = None, None
    if cfg.draft_here:
        from services.draft.__main__ import build_drafter

        built = build_drafter(cfg, max_sequences=n + 1)
        drafter, d = built.drafter, built.drafting
        limits = DraftLimits(drafter.name, d.top_k, d.steps, d.verify_tree_size)
    elif cfg.draft:
        from services.verifier.remote_draft import RemoteDrafter

        shape = (n + 1, cfg.max_context + 64, 3 * mc.hidden_size, torch_dtype(dtype))
        drafter = RemoteDrafter(
            cfg.draft, uuid.uuid4().hex[:12], cfg.draft_timeout, torch.device(cfg.device), mc.vocab_size, shape
        )
        info = drafter.connect(cfg.draft_wait)
        if info is not None:
            limits = DraftLimits(info.drafter, info.drafting_top_k, info.drafting_steps, info.verify_tree_size)
        else:  # it is down: the limits it is configured with, as ours are
            limits = DraftLimits(cfg.drafter, cfg.top_k, cfg.steps, cfg.verify_tree_size)
    costs = [StepCost(c.kind, c.batch, c.size, c.seconds) for c in engine.step_costs()]
    shapes = ()
    if drafter is not None:
        costs += [StepCost(c.kind, c.batch, c.size, c.seconds) for c in drafter.step_costs()]
        shapes = menu(cfg, limits.top_k, limits.steps, limits.verify_tree_size)
    policy = AdaptivePolicy(PolicyConfig(menu=shapes) if shapes else PolicyConfig(), costs)
    core_cfg = CoreConfig(
        n, cfg.prefill_chunk, cfg.plain_steps, cfg.rounds_per_step, cfg.draft_retry, cfg.call_rounds, ahead
    )
    core = EngineCore(engine, drafter, policy, core_cfg)
    if cfg.draft and drafter.info is None:
        core.drafter_down()
    log.info(
        "%d sequences at once; drafter: %s; policy %s over %s",
        n,
        "none" if drafter is None else f"{limits.name} ({'in this process' if cfg.draft_here else cfg.draft})",
        policy.name,
        ", ".join(str(s) for s in shapes) or "plain decoding only",
    )
    return Built(core, engine.info, n, limits, policy.name)


async def main(cfg: VerifierServiceConfig) -> None:
    from services.launch import serve
    from services.verifier.server import VerifierServicer
    from specdec.v1 import internal_pb2_grpc

    b = build(cfg)
    servicer = VerifierServicer(b.core, b.info, b.max_sequences, b.limits, b.policy)
    servicer.start()
    try:
        await serve(
            cfg.addr,
            [(internal_pb2_grpc.add_VerifierServicer_to_server, servicer)],
            ["specdec.v1.Verifier"],
            cfg.port_file,
            servicer.drain,
            cfg.drain_grace,
        )
    finally:
        servicer.stop()


def cli() -> None:
    asyncio.run(main(parse(VerifierServiceConfig, "python -m services.verifier", __doc__)))


if __name__ == "__main__":
    cli()
