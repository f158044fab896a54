"""The gateway's link to the verifier: one Generate stream (generations in, their tokens out), opened again when
the verifier comes back after a failure. It knows nothing of requests: services/gateway/router.py decides what
a lost stream means for each one.

    connect (Info answers, the stream opens) -> up: on_up(info); send() goes out on the stream
    the stream breaks -> down: on_down(why); sends wait; connect again every backoff (100 ms .. 1 s)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from common.rpc import CHANNEL_OPTIONS
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
BACKOFF_S = (0.1, 1.0)  # first and longest wait between connection attempts
PROBE_TIMEOUT_S = 2.0


class VerifierLink:
    def __init__(
        self,
        address: str,
        on_out: Callable[[pb.GenerateOut], None],
        on_up: Callable[[pb.InfoResponse], None],
        on_down: Callable[[str], None],
    ) -> None:
        self.address = address
        self.on_out, self.on_up, self.on_down = on_out, on_up, on_down
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.VerifierStub(self.channel)
        self.info: pb.InfoResponse | None = None
        self.up = False
        self._outbox: asyncio.Queue | None = None  # GenerateIn parts for the open stream; None: not open
        self._task: asyncio.Task | None = None

    async def first_info(self, timeout_s: float) -> pb.InfoResponse:
        """The verifier's Info, waiting up to timeout_s for it to serve (start-up)."""
        await asyncio.wait_for(self.channel.channel_ready(), timeout_s)
        self.info = await self.stub.Info(pb.InfoRequest(), timeout=timeout_s)
        return self.info

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def probe(self) -> pb.InfoResponse | None:
        """The verifier's Info now, or None when it does not answer (health, metrics, GetModelInfo)."""
        try:
            self.info = await self.stub.Info(pb.InfoRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return None
        return self.info

    def send(self, add: list[pb.NewGeneration] = (), abort: list[int] = ()) -> bool:
        """Queue generations and aborts for the stream; False while it is down (nothing was queued)."""
        if self._outbox is None:
            return False
        self._outbox.put_nowait((list(add), list(abort)))
        return True

    async def _run(self) -> None:
        wait = BACKOFF_S[0]
        while True:
            info = await self.probe()
            if info is None or info.draining:
                await asyncio.sleep(wait)
                wait = min(wait * 2, BACKOFF_S[1])
                continue
            wait = BACKOFF_S[0]
            why = await self._stream(info)
            self.up = False
            self._outbox = None
            log.warning("the stream to the verifier at %s ended: %s", self.address, why)
            self.on_down(why)

    async def _stream(self, info: pb.InfoResponse) -> str:
        """One stream, from its opening to its end: why it ended."""
        outbox: asyncio.Queue = asyncio.Queue()

        async def requests():
            while True:
                add, abort = await outbox.get()
                while not outbox.empty():  # what queued meanwhile goes in the same message
                    more_add, more_abort = outbox.get_nowait()
                    add += more_add
                    abort += more_abort
                yield pb.GenerateIn(add=add, abort=abort)

        call = self.stub.Generate(requests())
        self._outbox = outbox
        self.up = True
        self.on_up(info)
        try:
            async for out in call:
                self.on_out(out)
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {e.details()}"
        finally:
            call.cancel()
        return "the verifier closed it"

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.channel.close()
