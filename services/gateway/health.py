"""What the gateway's health says, and the state of its link to the draft. Plain Python: no gRPC, no torch.

The gateway is SERVING only while it can serve: the verifier answers, and it has not been without free
capacity for longer than `capacity_timeout_s` (every slot taken while none of them is ours making
progress: leaked, or held by someone else). A draft that is down is not an outage: requests go on by
plain decoding and the speculation is reported degraded (metrics, GetModelInfo).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HealthConfig:
    interval_s: float = 0.5  # how often the verifier and the draft are probed
    probe_timeout_s: float = 2.0  # a probe not answered within this counts as down
    capacity_timeout_s: float = 30.0  # this long without free capacity -> NOT_SERVING
    draft_retry_s: float = 0.5  # after a draft failure, speculation is retried no sooner than this

    def __post_init__(self) -> None:
        for name in ("interval_s", "probe_timeout_s", "capacity_timeout_s", "draft_retry_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class Capacity:
    """Tracks since when the gateway has had no free capacity.
    Example (timeout 30): exhausted at t=0 and t=20, ok at t=25 -> never stalled; exhausted at t=30, 50,
    61 -> stalled at 61 (exhausted since 30)."""

    timeout_s: float
    exhausted_since: float | None = None

    def observe(self, has_room: bool, now: float) -> None:
        if has_room:
            self.exhausted_since = None
        elif self.exhausted_since is None:
            self.exhausted_since = now

    def stalled(self, now: float) -> bool:
        return self.exhausted_since is not None and now - self.exhausted_since > self.timeout_s


@dataclass
class DraftLink:
    """Whether speculation is on. A failed propose (or probe) turns it off; a retry is allowed `retry_s`
    later, and a successful propose (or probe) turns it back on.
    Example (retry 0.5): failed(10.0) -> degraded, may_try(10.2) False, may_try(10.6) True."""

    retry_s: float
    degraded: bool = False
    retry_at: float = 0.0
    failures: int = 0  # propose failures since start

    def failed(self, now: float) -> None:
        self.degraded = True
        self.retry_at = now + self.retry_s
        self.failures += 1

    def probed(self, reachable: bool, now: float) -> None:
        """A probe of the draft outside the rounds: it also tells when it is back while no round runs."""
        if reachable:
            self.degraded = False
        else:
            self.degraded, self.retry_at = True, max(self.retry_at, now + self.retry_s)

    def succeeded(self) -> None:
        self.degraded = False

    def may_try(self, now: float) -> bool:
        return now >= self.retry_at
