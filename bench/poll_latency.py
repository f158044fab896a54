"""What polling costs an engine call on the event loop (services/engine_runner.py): a call of steps whose
device wait is played by an event that completes a fixed time after it is made, run n times through
EngineRunner.steps inline, polling (the services' default on a GPU) and blocking (--block-on-device). Prints
how long after the "device" was done each call resumed, and each call's wall over the device time.

    python -m bench.poll_latency [--calls 2000] [--device-us 1000]

An idle event loop: what a c=1 round pays for polling, not what other work on the loop delays a call by."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from services.engine_runner import EngineRunner


class TimedEvent:
    """A device wait that is over `us` microseconds after it is made (query and synchronize as a CUDA event's)."""

    def __init__(self, us: float) -> None:
        self.done_at = time.perf_counter() + us * 1e-6

    def query(self) -> bool:
        return time.perf_counter() >= self.done_at

    def synchronize(self) -> None:
        while not self.query():
            pass


def one_call(us: float, late: list[float]):
    """An engine call's steps: one wait of `us`, then the read (how late it resumed)."""
    event = TimedEvent(us)
    yield event
    late.append(time.perf_counter() - event.done_at)


async def measure(poll: bool, calls: int, us: float) -> tuple[float, float, float]:
    """(median and mean microseconds between the wait's end and the read, microseconds a call over `us`)."""
    runner, late = EngineRunner("poll-latency", inline=True, poll=poll), []
    t0 = time.perf_counter()
    for _ in range(calls):
        await runner.steps(one_call, us, late)
    wall = time.perf_counter() - t0
    runner.close()
    return statistics.median(late) * 1e6, statistics.mean(late) * 1e6, (wall / calls - us * 1e-6) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--device-us", type=float, default=1000.0)
    args = ap.parse_args()
    for poll in (False, True):
        med, mean, over = asyncio.run(measure(poll, args.calls, args.device_us))
        print(
            f"{'polling' if poll else 'blocking'}: resumed {med:.1f} us (median) / {mean:.1f} us (mean) after the "
            f"device was done; {over:.1f} us a call over the device time"
        )


if __name__ == "__main__":
    main()
