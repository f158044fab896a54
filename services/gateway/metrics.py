"""Prometheus metrics in vLLM's style, served over HTTP when --metrics-port is given: latencies, load, tokens,
the speculation counters, and what the verifier's speculation policy believes (refreshed from its Info)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

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
    def __init__(self) -> None:
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
        self.running = Gauge("specdec_num_requests_running", "Generations in the verifier's rounds", registry=r)
        self.waiting = Gauge("specdec_num_requests_waiting", "Generations waiting for a slot", registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of the requests admitted", registry=r)
        self.generation_tokens = Counter("specdec_generation_tokens", "Generated tokens", registry=r)
        self.drafts = Counter("specdec_spec_decode_num_drafts", "Verification rounds (one per sequence)", registry=r)
        self.draft_tokens = Counter("specdec_spec_decode_num_draft_tokens", "Drafted tree nodes", registry=r)
        self.accepted_tokens = Counter("specdec_spec_decode_num_accepted_tokens", "Accepted drafted tokens", registry=r)
        self.accepted_per_pos = Counter(
            "specdec_spec_decode_num_accepted_tokens_per_pos",
            "Verification rounds that accepted more than this many drafted tokens",
            ["position"],
            registry=r,
        )
        self.degraded = Gauge(
            "specdec_speculation_degraded", "1 while the draft is down and requests run by plain decoding", registry=r
        )
        self.policy_rate = Gauge(
            "specdec_policy_tokens_per_second",
            "The speculation policy's estimate of committed tokens/s for a round of this batch bucket and tree "
            "(depth 0: plain decoding); it picks the highest",
            ["batch", "tree", "band"],
            registry=r,
        )
        self.policy_rounds = Gauge(
            "specdec_policy_rounds", "Rounds the policy ran per tree since the verifier started", ["tree"], registry=r
        )
        self.engine_time = Gauge(
            "specdec_engine_seconds",
            "Seconds the verifier's engine thread spent per phase since it started (GetModelInfo.engine_time)",
            ["phase"],
            registry=r,
        )
        self.engine_calls = Gauge(
            "specdec_engine_calls",
            "The verifier's speculative rounds ('rounds'), plain decoding calls ('plain_calls') and the policy's "
            "switches of a batch between plain decoding and trees ('switches') since it started "
            "(GetModelInfo.engine_calls)",
            ["kind"],
            registry=r,
        )
        self._per_pos: list = []  # label children, resolved once

    def serve(self, port: int, addr: str) -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def verified(self, rounds: int, drafted: int, accepted: int) -> None:
        self.drafts.inc(rounds)
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)

    def accepted_at(self, counts: list[int]) -> None:
        """counts[p]: rounds that accepted more than p drafted tokens (GenerateOut.accepted_at)."""
        while len(self._per_pos) < len(counts):
            self._per_pos.append(self.accepted_per_pos.labels(position=str(len(self._per_pos))))
        for child, n in zip(self._per_pos, counts):
            if n:
                child.inc(n)

    def policy(self, info) -> None:
        """The verifier's Info: its policy's estimates and choices, where its engine's time went, and whether the
        draft is down."""
        self.degraded.set(1 if info.speculation_degraded else 0)
        for e in info.policy_estimates:
            if e.HasField("tokens_per_s"):
                self.policy_rate.labels(batch=str(e.batch), tree=_tree(e.tree), band=e.band).set(e.tokens_per_s)
        for c in info.policy_choices:
            self.policy_rounds.labels(tree=_tree(c.tree)).set(c.rounds)
        for phase, v in info.engine_time.items():
            self.engine_time.labels(phase=phase).set(v)
        for kind, n in info.engine_calls.items():
            self.engine_calls.labels(kind=kind).set(n)


def _tree(t) -> str:
    return "plain" if t.depth == 0 else f"{t.depth}x{t.nodes}"
