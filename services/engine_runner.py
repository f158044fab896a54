"""What the draft and verifier servicers share: engine calls one at a time, behind the service's error
boundary.

Most calls run on the engine thread, off the event loop, so that health checks and new connections are
answered while a long forward pass (a prefill) runs. The per-round calls (propose, verify, decode) take a few
milliseconds on a GPU, and there the hop to the engine thread and back costs more than it saves (session 16,
H200: 1,050 against 1,390 tok/s per request at c=1, docs/benchmarks.md). So on a GPU they run on the event
loop whenever the engine is free, as steps (common.engine.base.Steps): the call launches its device work,
then the loop answers other calls, polling the call's event between them, until the device is done, and the
call reads its results. (Before session 16 the loop blocked in the call: under load a Prefill call waited
12 ms at c=16 for the loop's turn.) On the engine thread when the engine is busy (a lock keeps the engine to
one caller at a time). On CPU a call can take a second, long enough to hold up lease renewals and health
checks: there they stay on the engine thread. A GPU verifier's Prefill runs `between` the per-round calls on
the loop (a few milliseconds, holding it): on the engine thread beside them it contended with their inline
steps for the interpreter lock and the GPU (session 18, H100: the rounds, the prefills and TTFT all faster).
Releases (bookkeeping only, no device work) run `between` the calls too: on the engine thread a release holds
the engine's lock while it waits there for the interpreter lock, and the per-round call that finds the lock
taken runs whole on the engine thread, blocking at its waits (`thread_calls` counts those)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc

from common.engine.base import Steps, finish
from common.errors import SpecdecError
from common.rpc import describe, status_for
from specdec.v1 import internal_pb2 as pb

T = TypeVar("T")


class EngineRunner:
    """inline: per-round calls (`steps`) run on the event loop when the engine is free (a GPU engine's; a CPU
    engine's stay on the engine thread). poll: inline steps give the event loop back while the device works
    (else the loop blocks in them)."""

    def __init__(self, name: str, inline: bool = False, poll: bool = True) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._engine = threading.Lock()  # held by whoever runs an engine call
        self.inline, self.poll = inline, poll
        self._stepping: asyncio.Event | None = None  # set when the inline call holding the engine ends
        self.inline_calls = self.thread_calls = 0  # `steps` calls of an inline runner: on the loop / the thread
        self.unlocked_calls = 0
        self.log = logging.getLogger(f"services.{name}")

    async def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the engine thread, after the call in progress."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._locked, fn, *args)

    async def steps(self, fn: Callable[..., Steps[T]], *args) -> T:
        """The result of fn(*args)'s steps. Inline and with the engine free, on the event loop: at each of
        the call's waits for the device the loop runs other callbacks, polling the wait's event between them
        (poll; else it blocks); the engine stays the call's until it returns. An inline call that finds
        another inline call's steps holding the engine (two round groups' calls) waits for them on the loop
        and then runs inline. Else on the engine thread, blocking at its waits, after the call in progress
        (a prefill there)."""
        if self.inline:
            while self._stepping is not None:
                await self._stepping.wait()
            if self._engine.acquire(blocking=False):
                self.inline_calls += 1
                self._stepping = asyncio.Event()
                try:
                    return await self._stepped(fn(*args)) if self.poll else finish(fn(*args))
                finally:
                    self._engine.release()
                    self._stepping, ended = None, self._stepping
                    ended.set()
            self.thread_calls += 1  # the engine is the engine thread's (a long Prefill, Features)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._locked, _finished, fn, *args)

    async def between(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) between the per-round calls: as `steps` of a call with no wait for the device, so inline
        (a GPU engine's) it runs once the inline call holding the engine is over, on the event loop, which it
        holds until it returns (nothing runs beside it, as in a process that prefills between its rounds);
        else on the engine thread after the call in progress."""
        return await self.steps(_whole, fn, *args)

    async def unlocked(self, fn: Callable[..., Steps[T]], *args) -> T:
        """The result of fn(*args)'s steps on the event loop, without the engine (its waits polled as `steps`
        polls them): for a call that touches nothing the lock guards, such as reading what a launch copied out
        of the graphs' buffers (services/draft/server.py, read_here)."""
        self.unlocked_calls += 1
        return await self._stepped(fn(*args))

    @contextlib.contextmanager
    def free(self) -> Iterator[bool]:
        """Whether the engine is free now, never waiting; when it is, it stays this block's: for work that
        another engine's call queues on this one (the verifier's device chain into the draft of its process)."""
        got = self._engine.acquire(blocking=False)
        try:
            yield got
        finally:
            if got:
                self._engine.release()

    async def _stepped(self, steps: Steps[T]) -> T:
        try:
            while True:
                event = steps.send(None)
                try:
                    while not event.query():
                        await asyncio.sleep(0)  # one turn of the loop: its sockets polled, its ready callbacks run
                except asyncio.CancelledError:
                    # the caller is gone, but the engine's state must follow the work it launched: the call
                    # ends here, blocking, before the engine is free again
                    try:
                        event.synchronize()
                        finish(steps)
                    except Exception:  # noqa: BLE001 - nobody is left to answer: logged
                        self.log.exception("an engine call whose caller went away failed")
                    raise
        except StopIteration as done:
            return done.value

    def _locked(self, fn: Callable[..., T], *args) -> T:
        with self._engine:
            return fn(*args)

    async def guarded(self, fn: Callable[..., T], *args) -> tuple[T | None, tuple[grpc.StatusCode, str] | None]:
        """The service's error boundary: (response, None), or (None, (code, details)) when fn raised.
        Our exception types map to specific codes; anything else is INTERNAL and logged once.
        A coroutine function runs on the event loop (it does its own bookkeeping there and hands the
        engine work to `run`); a plain function runs on the engine thread."""
        try:
            if inspect.iscoroutinefunction(fn):
                return await fn(*args), None
            return await self.run(fn, *args), None
        except Exception as e:  # noqa: BLE001 - the boundary
            code = status_for(e)
            if code == grpc.StatusCode.INTERNAL and not isinstance(e, SpecdecError):
                self.log.exception("internal error", exc_info=e)
            return None, (code, describe(e))

    async def unary(self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args) -> T:
        """Unary calls: a failure ends the call with its status."""
        resp, err = await self.guarded(fn, *args)
        if err is not None:
            await context.abort(*err)
        return resp

    async def answer(self, fn: Callable, request, response_type):
        """One call on a stream: a failure answers with `error` (the status the unary call would end
        with) instead of ending the stream."""
        resp, err = await self.guarded(fn, request)
        if err is not None:
            return response_type(error=pb.CallError(code=err[0].value[0], message=err[1]))
        return resp

    def close(self) -> None:
        if self.inline:
            self.log.info(
                "inline engine calls: %d on the event loop, %d on the engine thread (the engine was busy there)",
                self.inline_calls,
                self.thread_calls,
            )
        if self.unlocked_calls:
            self.log.info(
                "%d engine calls without the engine's lock (reads of launches behind a verify)", self.unlocked_calls
            )
        self._pool.shutdown(wait=False, cancel_futures=True)


def _whole(fn: Callable[..., T], *args) -> Steps[T]:
    """fn(*args) as an engine call's steps with no wait for the device: all of it runs at the first step."""
    yield from ()
    return fn(*args)


def _finished(fn: Callable[..., Steps[T]], *args) -> T:
    return finish(fn(*args))
