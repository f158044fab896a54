"""Prometheus metrics in vLLM's style, served over HTTP when --metrics-port is given."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# the round breakdown's phases (services/gateway/scheduler.py, Scheduler._time_round)
ROUND_PHASES = ("draft", "verify", "draft_wait", "verifier_host", "starved", "rpc", "orchestration", "stream", "total")
# a request's way into the rounds, each stage observed once per request (services/gateway/scheduler.py):
# queue (arrival -> its first prefill call sent), prefill (-> its first token), first_tree (-> its first
# tree in: the gateway's early propose; 0 when its prefill asked the verifier for it), join (-> the first
# Verify naming it sent), first_call (-> that Verify answered)
REQUEST_STAGES = ("queue", "prefill", "first_tree", "join", "first_call")
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class Metrics:
    def __init__(self, max_depth: int = 32) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "specdec_time_to_first_token_seconds", "Time to first token", registry=r, buckets=LATENCY_BUCKETS
        )
        self.itl = Histogram(
            "specdec_inter_token_latency_seconds",
            "Time per output token after the first",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "specdec_e2e_request_latency_seconds", "End-to-end request latency", registry=r, buckets=LATENCY_BUCKETS
        )
        self.running = Gauge("specdec_num_requests_running", "Sequences in the rounds", registry=r)
        self.waiting = Gauge("specdec_num_requests_waiting", "Requests waiting for a slot", registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prefilled prompt tokens", registry=r)
        self.generation_tokens = Counter("specdec_generation_tokens", "Generated tokens", registry=r)
        self.drafts = Counter("specdec_spec_decode_num_drafts", "Verification rounds (one per sequence)", registry=r)
        self.draft_tokens = Counter("specdec_spec_decode_num_draft_tokens", "Drafted tree nodes", registry=r)
        self.accepted_tokens = Counter("specdec_spec_decode_num_accepted_tokens", "Accepted drafted tokens", registry=r)
        self.accepted_per_pos = Counter(
            "specdec_spec_decode_num_accepted_tokens_per_pos",
            "Rounds that accepted at least this many drafted tokens",
            ["position"],
            registry=r,
        )
        self.degraded = Gauge(
            "specdec_speculation_degraded",
            "1 while the draft is unreachable and requests run by plain decoding",
            registry=r,
        )
        self.draft_failures = Counter(
            "specdec_draft_failures", "Rounds whose propose failed (decoded plainly)", registry=r
        )
        self.round_seconds = Histogram(
            "specdec_round_seconds",
            "One batched round, wall time (a Verify of several rounds: each round its share)",
            ["phase"],
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.request_stage = Histogram(
            "specdec_request_stage_seconds",
            "A request's way to its first rounds (REQUEST_STAGES: queue, prefill, first_tree, join, first_call)",
            ["stage"],
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.prefill_call = Histogram(
            "specdec_prefill_call_seconds",
            "A Prefill call: its whole time at the gateway (call), at the verifier (verifier) and the engine's",
            ["part"],
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.verify_calls = Counter(
            "specdec_verify_calls", "Verify calls to the verifier (one may run several rounds)", registry=r
        )
        self.tree_nodes = Histogram(
            "specdec_policy_tree_nodes",
            "Tree nodes verified per group round, as the speculation policy chose (0: a round without a draft)",
            registry=r,
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128),
        )
        self.tree_depth = Histogram(
            "specdec_policy_tree_depth",
            "Draft depth per group round, as the speculation policy chose (0: a round without a draft)",
            registry=r,
            buckets=(0, 1, 2, 3, 4, 5, 6, 8, 12, 16),
        )
        self.plain_rounds = Counter(
            "specdec_policy_plain_rounds", "Group rounds of speculative requests decoded without a draft", registry=r
        )
        self.max_depth = max_depth
        # Label children resolved once, on first use (labels() takes a lock and hashes on every call,
        # and these run every round); created lazily so the exposition is as before.
        self._phase: dict | None = None
        self._stage: dict | None = None
        self._per_pos: list = []

    @property
    def round_phase(self) -> dict:
        if self._phase is None:
            self._phase = {p: self.round_seconds.labels(p) for p in ROUND_PHASES}
        return self._phase

    def serve(self, port: int, addr: str) -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def stage(self, name: str, seconds: float) -> None:
        """One request's time in one of REQUEST_STAGES."""
        if self._stage is None:
            self._stage = {n: self.request_stage.labels(n) for n in REQUEST_STAGES}
        self._stage[name].observe(seconds)

    def prefill_timed(self, call: float, verifier: float, engine: float) -> None:
        """One Prefill call's seconds at the gateway, at the verifier and in its engine."""
        for part, seconds in (("call", call), ("verifier", verifier), ("engine", engine)):
            self.prefill_call.labels(part).observe(seconds)

    def round_shape(self, depth: int, nodes: int) -> None:
        self.tree_nodes.observe(nodes)
        self.tree_depth.observe(depth)
        if depth == 0:
            self.plain_rounds.inc()

    def verified(self, accepted: Sequence[int], drafted: int) -> None:
        """A round's verifications, counted at once (one update a counter, not one a sequence or a token):
        one per sequence, `drafted` tree nodes in all, and the drafted tokens each sequence accepted.
        Position p counts the sequences that accepted more than p tokens (up to max_depth positions).
        Example: accepted [3, 1, 0] -> drafts +3, accepted tokens +4, positions 0, 1, 2 +2, +1, +1."""
        if not accepted:
            return
        self.drafts.inc(len(accepted))
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(sum(accepted))
        top = min(max(accepted), self.max_depth)
        ends = [0] * (top + 1)  # [top + 1] sequences by the positions they reached: [3, 1, 0] -> [1, 1, 0, 1]
        for n in accepted:
            ends[min(n, top)] += 1
        per_pos = self._per_pos
        while len(per_pos) < top:  # children in position order, as they are first reached
            per_pos.append(self.accepted_per_pos.labels(position=str(len(per_pos))))
        reached = 0
        for pos in range(top - 1, -1, -1):  # [1, 1, 0, 1] -> position 2: 1, 1: 1 + 0, 0: 1 + 0 + 1
            reached += ends[pos + 1]
            per_pos[pos].inc(reached)
