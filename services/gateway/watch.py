"""The gateway's background duties toward the services it uses: holding its lease on its sequences,
and health that tells the truth (see services/gateway/health.py for the rules)."""

from __future__ import annotations

import asyncio
import logging
import time

from common.rpc import Server
from services.clients import DraftClient, VerifierClient
from services.gateway.health import Capacity, HealthConfig
from services.gateway.scheduler import Scheduler

log = logging.getLogger(__name__)


class Leaseholder:
    """Takes this instance's lease at start-up (freeing the sequences of earlier instances of its name)
    and renews it every ttl / 3 on both services. A service that restarted, or that was down, simply
    grants a new lease on the next renewal."""

    def __init__(self, instance_id: str, name: str, services: list[VerifierClient | DraftClient]) -> None:
        self.instance_id, self.name, self.services = instance_id, name, services
        self.interval_s = 5.0  # until a service tells its ttl

    async def take_over(self) -> None:
        for s in self.services:
            try:
                r = await s.lease(self.instance_id, self.name, takeover=True)
            except Exception as e:  # noqa: BLE001 - a draft that is down gets the lease when it is back
                log.warning("lease on the %s: %s", s.service, e)
                continue
            self.interval_s = min(self.interval_s, r.ttl_s / 3)
            log.info(
                "lease on the %s taken as %s (%s); %d sequence(s) of a predecessor freed",
                s.service,
                self.instance_id,
                self.name,
                r.freed,
            )

    async def renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            for s in self.services:
                try:
                    r = await s.lease(self.instance_id, self.name, takeover=False)
                    self.interval_s = min(self.interval_s, r.ttl_s / 3)
                except Exception as e:  # noqa: BLE001 - renewal goes on; the health probe reports an outage
                    log.debug("lease renewal on the %s failed: %s", s.service, e)


class HealthMonitor:
    """Probes the verifier (and the draft) every interval and sets the gateway's health: NOT_SERVING while
    the verifier does not answer or capacity has been exhausted for too long."""

    def __init__(
        self,
        server: Server,
        scheduler: Scheduler,
        verifier: VerifierClient,
        draft: DraftClient | None,
        cfg: HealthConfig,
    ) -> None:
        self.server, self.scheduler, self.verifier, self.draft, self.cfg = server, scheduler, verifier, draft, cfg
        self.capacity = Capacity(cfg.capacity_timeout_s)
        self.serving = True

    async def run_forever(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.cfg.interval_s)

    async def check(self) -> None:
        now = time.monotonic()
        reason = await self._verifier_problem(now)
        if self.draft is not None:
            try:
                await self.draft.info(timeout=self.cfg.probe_timeout_s)
                self.scheduler.draft_link.probed(True, now)
            except Exception:  # noqa: BLE001 - any failure of the probe means unreachable
                self.scheduler.draft_link.probed(False, now)
        self.scheduler.metrics.degraded.set(1 if self.scheduler.speculation_degraded else 0)
        serving = reason is None
        if serving != self.serving:
            log.warning("health: %s", "SERVING" if serving else f"NOT_SERVING ({reason})")
            self.serving = serving
        await self.server.set_serving(serving)

    async def _verifier_problem(self, now: float) -> str | None:
        try:
            info = await self.verifier.info(timeout=self.cfg.probe_timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure of the probe means the verifier is down
            return f"verifier unreachable: {e}"
        # a full verifier is fine while our own sequences fill it (they finish and make room); full with
        # none of ours is stuck: slots leaked or held by someone else
        self.capacity.observe(info.active_sequences < info.max_sequences or bool(self.scheduler.active), now)
        if self.capacity.stalled(now):
            return (
                f"no free capacity for {now - self.capacity.exhausted_since:.0f} s: "
                f"{info.active_sequences}/{info.max_sequences} verifier slots held"
            )
        return None
