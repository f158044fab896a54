"""services.engine_runner: an engine call's steps (common.engine.base.Steps) on the event loop give the loop
back at each wait for the device, keep the engine theirs until they end, and end even when their caller
goes away. The device is played by hand: an event that completes when the test says so."""

from __future__ import annotations

import asyncio

import pytest

from services.engine_runner import EngineRunner


class HandEvent:
    """A device wait: query() is False until the test sets done; synchronize() blocks until done (here: sets it)."""

    def __init__(self) -> None:
        self.done = False
        self.queries = 0
        self.synchronized = False

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def synchronize(self) -> None:
        self.synchronized = self.done = True


def two_waits(log: list[str], events: list[HandEvent]):
    """An engine call that launches, waits, reads and launches again, waits, reads."""
    log.append("launch 1")
    yield events[0]
    log.append("read 1, launch 2")
    yield events[1]
    log.append("read 2")
    return "result"


async def device(runner: EngineRunner, log: list[str], events: list[HandEvent]) -> None:
    """Other work on the loop: it runs while the call waits (the call has polled its event), with the engine
    still held by the call, and then completes the device's work."""
    for i, e in enumerate(events):
        while not e.queries:
            await asyncio.sleep(0)
        log.append(f"other work during wait {i + 1}, engine held: {runner._engine.locked()}")
        e.done = True


def test_steps_give_the_loop_back_while_the_device_works():
    async def main():
        runner, log, events = EngineRunner("test", inline=True), [], [HandEvent(), HandEvent()]
        call = asyncio.create_task(runner.steps(two_waits, log, events))
        other = asyncio.create_task(device(runner, log, events))
        assert await call == "result"
        await other
        assert not runner._engine.locked()
        runner.close()
        return log, events

    log, events = asyncio.run(main())
    assert log == [
        "launch 1",
        "other work during wait 1, engine held: True",
        "read 1, launch 2",
        "other work during wait 2, engine held: True",
        "read 2",
    ]
    assert not any(e.synchronized for e in events)  # polled, never blocked on


def test_blocking_runner_holds_the_loop_until_the_call_ends():
    async def main():
        runner, log, events = EngineRunner("test", inline=True, poll=False), [], [HandEvent(), HandEvent()]
        other = asyncio.create_task(asyncio.sleep(0))  # ready to run: it cannot before the call has ended
        assert await runner.steps(two_waits, log, events) == "result"
        log.append(f"other task done: {other.done()}")
        runner.close()
        return log, events

    log, events = asyncio.run(main())
    assert log == ["launch 1", "read 1, launch 2", "read 2", "other task done: False"]
    assert all(e.synchronized for e in events)


def test_a_busy_engine_runs_the_steps_on_its_thread_after_the_call_in_progress():
    async def main():
        runner, log, events = EngineRunner("test", inline=True), [], [HandEvent(), HandEvent()]
        runner._engine.acquire()  # a prefill in progress on the engine thread
        call = asyncio.create_task(runner.steps(two_waits, log, events))
        await asyncio.sleep(0.05)
        log.append("prefill over")
        runner._engine.release()
        assert await call == "result"
        runner.close()
        return log, events

    log, events = asyncio.run(main())
    assert log == ["prefill over", "launch 1", "read 1, launch 2", "read 2"]
    assert all(e.synchronized for e in events)  # the thread blocks at its waits


def test_a_call_whose_caller_goes_away_still_ends_before_the_engine_is_free():
    async def main():
        runner, log, events = EngineRunner("test", inline=True), [], [HandEvent(), HandEvent()]
        call = asyncio.create_task(runner.steps(two_waits, log, events))
        while not events[0].queries:
            await asyncio.sleep(0)
        call.cancel()  # e.g. its gRPC call was cancelled while the device works
        with pytest.raises(asyncio.CancelledError):
            await call
        locked = runner._engine.locked()
        runner.close()
        return log, events, locked

    log, events, locked = asyncio.run(main())
    assert log == ["launch 1", "read 1, launch 2", "read 2"]  # the engine's state follows its launched work
    assert all(e.synchronized for e in events)
    assert not locked


def test_a_second_inline_call_waits_on_the_loop_and_runs_inline_after_the_first():
    """Two round groups' verifies: the second finds the first's steps holding the engine, waits for them on
    the loop (not on the engine thread) and then runs inline too: its waits are polled, not blocked on."""

    async def main():
        runner, log, log_a, log_b = EngineRunner("test", inline=True), [], [], []
        first, second = [HandEvent(), HandEvent()], [HandEvent(), HandEvent()]
        a = asyncio.create_task(runner.steps(two_waits, log_a, first))
        b = asyncio.create_task(runner.steps(two_waits, log_b, second))
        for e in first + second:  # the device completes each wait once it is polled
            async with asyncio.timeout(2):  # never polled: blocked on (the engine thread's way)
                while not e.queries and not e.synchronized:
                    await asyncio.sleep(0)
            log.append(("a" if e in first else "b", len(log_a), len(log_b)))
            e.done = True
        assert await a == await b == "result"
        runner.close()
        return log, first + second

    log, events = asyncio.run(main())
    # (whose wait completed, a's progress, b's progress): b starts only after a has read its results
    assert log == [("a", 1, 0), ("a", 2, 0), ("b", 3, 1), ("b", 3, 2)]
    assert not any(e.synchronized for e in events)


def test_between_runs_on_the_loop_after_the_inline_call_holding_the_engine():
    """A prefill `between` the rounds' calls (--prefill-between): it waits for the inline steps call holding
    the engine, then runs on the event loop's thread with the engine held; the same call on a runner that is
    not inline (CPU) runs on the engine thread."""
    import threading

    def prefill(log: list[str], runner: EngineRunner) -> str:
        log.append(
            f"prefill on the loop: {threading.current_thread() is threading.main_thread()}, engine held: "
            f"{runner._engine.locked()}"
        )
        return "prefilled"

    async def main():
        runner, log, events = EngineRunner("test", inline=True), [], [HandEvent(), HandEvent()]
        call = asyncio.create_task(runner.steps(two_waits, log, events))
        await asyncio.sleep(0)  # the call holds the engine, waiting for the device
        between = asyncio.create_task(runner.between(prefill, log, runner))
        other = asyncio.create_task(device(runner, log, events))
        assert await call == "result" and await between == "prefilled"
        await other
        thread = EngineRunner("cpu", inline=False)
        assert await thread.between(prefill, log, thread) == "prefilled"
        runner.close()
        thread.close()
        return log

    log = asyncio.run(main())
    assert log.index("read 2") < log.index("prefill on the loop: True, engine held: True")
    assert log[-1] == "prefill on the loop: False, engine held: True"
