"""What the draft and verifier servicers share about sequence ownership: the lease table (common/leases.py)
kept on the event loop, the Lease call, a reaper that frees expired sequences on the engine thread, and
draining (no new sequences; wait until the held ones are released)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from common.errors import InvalidRequest, PeerUnavailable
from common.leases import LeaseTable
from services.engine_runner import EngineRunner
from specdec.v1 import internal_pb2 as pb

log = logging.getLogger(__name__)


class SequenceLeases:
    """`free(seq_ids)` releases sequences in the engine; it runs between the engine's other calls
    (EngineRunner.between). Every method here runs on the event loop, so the table needs no lock."""

    def __init__(
        self,
        ttl_s: float,
        free: Callable[[list[str]], object],
        runner: EngineRunner,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table = LeaseTable(ttl_s)
        self._free, self._runner, self._clock = free, runner, clock
        self.draining = False
        self._reaper: asyncio.Task | None = None

    async def lease(self, request: pb.LeaseRequest) -> pb.LeaseResponse:
        now = self._clock()
        if not request.instance_id:
            raise InvalidRequest("a lease needs the gateway's instance id")
        if request.takeover:
            freed = self.table.connect(request.instance_id, request.name, now)
            if freed:
                log.info(
                    "instance %s (%s) took over: freeing %d sequence(s) of its predecessor",
                    request.instance_id,
                    request.name,
                    len(freed),
                )
                await self._runner.between(self._free, freed)
        else:
            self.table.renew(request.instance_id, now, request.name)
            freed = []
        return pb.LeaseResponse(ttl_s=self.table.ttl_s, freed=len(freed))

    def admit(self, new: int) -> None:
        """Before creating `new` sequences: refused while draining (UNAVAILABLE)."""
        if new and self.draining:
            raise PeerUnavailable("the service is shutting down and takes no new sequences")

    def added(self, seq_ids: list[str], owner: str) -> None:
        now = self._clock()
        for s in seq_ids:
            self.table.add(s, owner, now)

    def touch(self, seq_ids: list[str]) -> None:
        self.table.touch(seq_ids, self._clock())

    def removed(self, seq_ids: list[str]) -> None:
        self.table.remove(seq_ids)

    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.table.ttl_s / 4)
            freed = self.table.expired(self._clock())
            if freed:
                log.warning("freeing %d sequence(s) whose owner's lease ran out: %s", len(freed), freed[:8])
                try:
                    await self._runner.between(self._free, freed)
                except Exception:  # noqa: BLE001 - the reaper must outlive one failed release
                    log.exception("releasing expired sequences failed")

    async def drain(self) -> None:
        """No new sequences from now on; return once every held sequence is released (or expired)."""
        self.draining = True
        while len(self.table):
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
