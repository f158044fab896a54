"""python -m services.gateway: the public service, in front of a draft and a verifier service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from common.model_path import default_model_path
from common.policy import DEFAULT_MENU, Shape
from common.rounds import MAX_ROUNDS_PER_CALL
from services.gateway.health import HealthConfig
from services.gateway.speculation import POLICIES
from services.launch import common_arguments, freeze_heap, parse_and_log, serve_forever, write_port_file

log = logging.getLogger("services.gateway")
GPU_ROUNDS_PER_CALL = 4  # the default on a GPU: the gateway's hop (about 1.2 ms on an H100) paid once per 4 rounds


@dataclass(frozen=True)
class GatewayConfig:
    address: str  # where the public API listens
    verifier: str  # verifier service address
    draft: str  # draft service address ("" = plain decoding only)
    model: Path  # GGUF file or HF folder the tokenizer is read from
    max_active: int = 0  # sequences per round; 0 = as many as the verifier and the draft hold
    plain_steps: int = 8  # plain decoding tokens per verifier call
    park_after: int = 0  # plain rounds after which the draft stops following a sequence (0: never; scheduler.py)
    prefill_chunk: int = 512  # prompt tokens prefilled between two rounds (0 = every prompt whole)
    groups: int = 1  # round groups run concurrently (2: one verifies while the other drafts)
    max_waiting: int = 64
    connect_timeout: float = 120.0
    metrics_port: int = 0  # Prometheus /metrics (0 = off)
    metrics_addr: str = "127.0.0.1"  # where /metrics listens (0.0.0.0 in a pod, for the scraper)
    ipc: bool = True  # use CUDA IPC when draft and verifier share host and GPU
    name: str = "gateway"  # stable across restarts: a restarted gateway frees its predecessor's sequences
    max_request_bytes: int = 4 << 20  # larger requests are refused (RESOURCE_EXHAUSTED) before parsing
    drain_grace: float = 20.0  # seconds in-flight generations get after SIGTERM
    draft_timeout: float = 10.0  # a propose not answered within this falls back to plain decoding
    health: HealthConfig = field(default_factory=HealthConfig)
    policy: str = "adaptive"  # speculation policy: adaptive (per round), fixed, cycle (tests)
    tree: str = ""  # the fixed policy's tree, DEPTHxNODES ("" = the draft's own)
    menu: str = ""  # the adaptive policy's trees, comma-separated DEPTHxNODES ("" = common.policy.DEFAULT_MENU)
    # the draft's address as the verifier reaches it, for chained rounds ("" = `draft`; "none" = no chaining:
    # the gateway proposes every tree itself, one more hop a round)
    verifier_draft: str = ""
    # rounds one Verify may run (the verifier chains them with the draft by itself); 0 = auto:
    # GPU_ROUNDS_PER_CALL on a CUDA verifier, 1 on a CPU (a round there is long: streaming in steps of one)
    rounds_per_call: int = 0
    # a Verify is sent before the last one is answered (the verifier goes from one to the next without the
    # gateway's hop and host work in between: services/gateway/scheduler.py, Scheduler._round)
    queue_calls: bool = True
    # a sequence that a Verify of several rounds stops by its token rules is answered after that round, not
    # the call's last (VerifyRequest.early). Off by default: no gain measured (docs/benchmarks.md, session 18)
    early_answers: bool = False

    @property
    def chain_address(self) -> str:
        if not self.draft or self.verifier_draft == "none":
            return ""
        return self.verifier_draft or self.draft

    def __post_init__(self) -> None:
        if not self.address or not self.verifier:
            raise ValueError("gateway needs its own address and the verifier's")
        if self.max_active < 0:
            raise ValueError(f"max_active must be >= 0 (0 = auto), got {self.max_active}")
        if not 1 <= self.plain_steps <= 64:
            raise ValueError(f"plain_steps must be in [1, 64], got {self.plain_steps}")
        if self.park_after < 0:
            raise ValueError(f"park_after must be >= 0 (0: never), got {self.park_after}")
        if not self.name:
            raise ValueError("name must not be empty (it prefixes sequence ids)")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.drain_grace < 0 or self.draft_timeout <= 0:
            raise ValueError("drain_grace must be >= 0 and draft_timeout > 0")
        if not 0 <= self.rounds_per_call <= MAX_ROUNDS_PER_CALL:
            raise ValueError(
                f"rounds_per_call must be in [0, {MAX_ROUNDS_PER_CALL}] (0 = auto), got {self.rounds_per_call}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        self.shapes()  # ValueError on a malformed tree or menu

    def shapes(self) -> tuple[Shape | None, tuple[Shape, ...]]:
        """The fixed tree (None: the draft's own) and the adaptive menu."""
        tree = Shape.parse(self.tree) if self.tree else None
        menu = tuple(Shape.parse(t) for t in self.menu.split(",")) if self.menu else DEFAULT_MENU
        return tree, menu

    def rounds_for(self, device: str) -> int:
        """rounds_per_call, with auto resolved for a verifier on `device` (its InfoResponse.device); each round
        group's calls go on a Verify stream of their own (VerifierClient.lane)."""
        if self.rounds_per_call:
            return self.rounds_per_call
        return GPU_ROUNDS_PER_CALL if device.startswith("cuda") else 1


async def main(cfg: GatewayConfig, port_file: str | None) -> None:
    import grpc

    from common.rpc import start_server
    from common.tokenizer import Tokenizer
    from services.clients import DraftClient, VerifierClient, connect_ipc
    from services.gateway.metrics import Metrics
    from services.gateway.scheduler import Scheduler, SchedulerConfig
    from services.gateway.server import GenerationServicer
    from services.gateway.speculation import build_policy
    from services.gateway.watch import HealthMonitor, Leaseholder
    from specdec.v1 import generation_pb2_grpc

    instance_id = f"{cfg.name}.{uuid.uuid4().hex[:12]}"  # sequence ids are "<instance_id>-<n>": unique across restarts
    tok = Tokenizer(cfg.model)
    verifier = VerifierClient(cfg.verifier)
    draft = DraftClient(cfg.draft, timeout=cfg.draft_timeout) if cfg.draft else None
    await asyncio.wait_for(verifier.channel.channel_ready(), cfg.connect_timeout)
    vinfo = await verifier.info()
    dinfo = None
    if draft is not None:
        await asyncio.wait_for(draft.channel.channel_ready(), cfg.connect_timeout)
        dinfo = await draft.info()
        if dinfo.verify_tree_size > vinfo.max_tree_nodes:
            raise ValueError(
                f"draft proposes {dinfo.verify_tree_size} nodes; the verifier takes at most {vinfo.max_tree_nodes}"
            )
        if cfg.ipc:
            try:
                on = await connect_ipc(verifier, draft, vinfo, dinfo)
            except grpc.aio.AioRpcError as e:
                log.warning("CUDA IPC set-up failed (%s): hidden states travel inline", e.details())
                on = False
            log.info("hidden states between verifier and draft: %s", "CUDA IPC" if on else "inline bytes")
    leaseholder = Leaseholder(instance_id, cfg.name, [verifier] + ([draft] if draft else []))
    await leaseholder.take_over()
    metrics = Metrics()
    if cfg.metrics_port:
        metrics.serve(cfg.metrics_port, cfg.metrics_addr)
    held = [vinfo.max_sequences] + ([dinfo.max_sequences] if dinfo and dinfo.max_sequences else [])
    max_active = min(held + ([cfg.max_active] if cfg.max_active else []))
    log.info(
        "sequences per round: at most %d (verifier holds %d%s)",
        max_active,
        vinfo.max_sequences,
        f", draft {dinfo.max_sequences}" if dinfo and dinfo.max_sequences else "",
    )
    tree, menu = cfg.shapes()
    policy = build_policy(cfg.policy, vinfo, dinfo, menu, tree)
    log.info("speculation policy: %s; rounds per Verify: %d", policy.name, cfg.rounds_for(vinfo.device))
    sched = Scheduler(
        verifier,
        draft,
        SchedulerConfig(
            max_active=max_active,
            plain_steps=cfg.plain_steps,
            park_after=cfg.park_after,
            groups=cfg.groups,
            max_waiting=cfg.max_waiting,
            instance_id=instance_id,
            draft_retry_s=cfg.health.draft_retry_s,
            draft_address=cfg.chain_address,
            prefill_chunk=cfg.prefill_chunk,
            rounds_per_call=cfg.rounds_for(vinfo.device),
            queue_calls=cfg.queue_calls,
            early_answers=cfg.early_answers,
        ),
        policy,
        metrics,
    )
    sched.start()
    servicer = GenerationServicer(sched, tok, vinfo, dinfo)
    freeze_heap()
    server = await start_server(
        cfg.address,
        [(generation_pb2_grpc.add_GenerationServicer_to_server, servicer)],
        ["specdec.v1.Generation"],
        max_request_bytes=cfg.max_request_bytes,
    )
    monitor = HealthMonitor(server, sched, verifier, draft, cfg.health)
    loop = asyncio.get_running_loop()
    background = [loop.create_task(leaseholder.renew_forever()), loop.create_task(monitor.run_forever())]
    write_port_file(port_file, server.port)

    async def drain() -> None:
        try:
            await sched.drain()
        finally:
            await sched.stop()  # past the grace: what is left fails with UNAVAILABLE, its sequences released

    try:
        await serve_forever(server, drain, cfg.drain_grace)
    finally:
        for t in background:
            t.cancel()
        await sched.stop()
        servicer.close()
        await verifier.close()
        if draft:
            await draft.close()


def cli() -> None:
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    common_arguments(p, "GATEWAY_ADDR", "127.0.0.1:50051")
    p.add_argument("--verifier", default=os.environ.get("VERIFIER_ADDR", "127.0.0.1:50053"))
    p.add_argument(
        "--draft",
        default=os.environ.get("DRAFT_ADDR", "127.0.0.1:50052"),
        help="draft service address; empty for plain decoding only",
    )
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file or HF folder for the tokenizer (default: $SPECDEC_GGUF or the embedded SmolLM2)",
    )
    p.add_argument(
        "--max-active", type=int, default=0, help="sequences per round (0 = as many as the verifier and the draft hold)"
    )
    p.add_argument(
        "--round-groups",
        type=int,
        default=1,
        help="groups of sequences whose rounds run concurrently (2: one group is verified while the other's "
        "trees are drafted)",
    )
    p.add_argument(
        "--plain-steps",
        type=int,
        default=8,
        help="plain decoding tokens per verifier call (tokens past a stop are discarded)",
    )
    p.add_argument(
        "--park-after",
        type=int,
        default=0,
        help="plain rounds in a row after which the draft stops following a speculative sequence, which then "
        "catches up (its whole context recomputed) when a tree is chosen again; 0: never (the default: 16 "
        "catch-ups at ~700 tokens held every stream 1.3 s on an H100). Bounds the features a long plain stretch "
        "keeps pending without CUDA IPC",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        help="prompt tokens prefilled between two rounds; a longer prompt goes in chunks so that the running "
        "requests wait for one chunk at a time (0 = every prompt in one call)",
    )
    p.add_argument("--max-waiting", type=int, default=64)
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("METRICS_PORT", "0")),
        help="serve Prometheus metrics on this port (0 = off)",
    )
    p.add_argument(
        "--metrics-addr",
        default=os.environ.get("METRICS_ADDR", "127.0.0.1"),
        help="interface the metrics listen on (0.0.0.0 for a scraper outside the pod)",
    )
    p.add_argument("--no-ipc", action="store_true", help="always send hidden states as inline bytes")
    p.add_argument(
        "--name",
        default=os.environ.get("GATEWAY_NAME") or socket.gethostname(),
        help="stable name of this gateway (default: the host or pod name); a restarted gateway "
        "frees the sequences its predecessor of the same name left on the services",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=int(os.environ.get("MAX_REQUEST_BYTES", 4 << 20)),
        help="largest request accepted (bytes); larger ones get RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--draft-timeout",
        type=float,
        default=10.0,
        help="seconds a propose may take before its round falls back to plain decoding",
    )
    p.add_argument(
        "--capacity-timeout",
        type=float,
        default=30.0,
        help="seconds without free capacity (every verifier slot held, none by us) before health says NOT_SERVING",
    )
    p.add_argument("--health-interval", type=float, default=0.5, help="seconds between probes of the services")
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="adaptive",
        help="speculation policy: adaptive (tree or plain per round, from measured costs and acceptance), "
        "fixed (--tree every round), cycle (every shape in turn, for tests)",
    )
    p.add_argument("--tree", default="", help="the fixed policy's tree, DEPTHxNODES (default: the draft's own)")
    p.add_argument("--policy-menu", default="", help="trees the adaptive policy chooses from, e.g. 1x1,2x4,4x16,6x60")
    p.add_argument(
        "--verifier-draft",
        default=os.environ.get("VERIFIER_DRAFT", ""),
        help="the draft's address as the verifier reaches it (default: --draft); the verifier sends each "
        "round's outcome there and keeps the next tree (one gateway hop a round); 'none' = the gateway "
        "proposes every tree itself",
    )
    p.add_argument(
        "--rounds-per-call",
        type=int,
        default=0,
        help="rounds one Verify may run: the verifier takes each next tree from the draft itself and answers "
        f"once (one gateway hop per call); 1 while requests wait to join; 0 = {GPU_ROUNDS_PER_CALL} on a GPU "
        "with one round group, else 1",
    )
    p.add_argument(
        "--queue-calls",
        choices=("on", "off"),
        default=os.environ.get("QUEUE_CALLS", "on"),
        help="send each Verify before the last one is answered, while the verifier chains the trees: it goes "
        "from one call to the next without waiting for this gateway (on), or one call at a time (off)",
    )
    p.add_argument(
        "--early-answers",
        choices=("on", "off"),
        default=os.environ.get("EARLY_ANSWERS", "off"),
        help="a sequence that a Verify of several rounds stops (a stop token, its max_tokens) streams its last "
        "tokens after that round (on), or when the call's last round is over (off; session 18's H100 runs "
        "measured no gain in tokens/s per request and a longer queue at full slots with on)",
    )
    a = parse_and_log(p)
    cfg = GatewayConfig(
        address=a.addr,
        verifier=a.verifier,
        draft=a.draft,
        model=Path(a.model) if a.model else default_model_path(),
        max_active=a.max_active,
        plain_steps=a.plain_steps,
        park_after=a.park_after,
        prefill_chunk=a.prefill_chunk,
        groups=a.round_groups,
        max_waiting=a.max_waiting,
        metrics_port=a.metrics_port,
        metrics_addr=a.metrics_addr,
        ipc=not a.no_ipc,
        name=a.name,
        max_request_bytes=a.max_request_bytes,
        drain_grace=a.drain_grace,
        draft_timeout=a.draft_timeout,
        health=HealthConfig(interval_s=a.health_interval, capacity_timeout_s=a.capacity_timeout),
        policy=a.policy,
        tree=a.tree,
        menu=a.policy_menu,
        verifier_draft=a.verifier_draft,
        rounds_per_call=a.rounds_per_call,
        queue_calls=a.queue_calls == "on",
        early_answers=a.early_answers == "on",
    )
    asyncio.run(main(cfg, a.port_file))


if __name__ == "__main__":
    cli()
