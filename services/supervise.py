"""The stack's supervision: a child that exits on its own is started again after a backoff while the others keep
serving; one that keeps dying stops the stack (services/stack.py runs it). The bookkeeping (Restarts) is plain
arithmetic; the Supervisor drives any `Children` (the stack's processes, or stand-ins in tests)."""

from __future__ import annotations

import argparse
import collections
import contextlib
import enum
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Protocol

log = logging.getLogger("services.stack")
EXIT_CHILD_FAILED = 3  # the stack's exit status when a child fails at start or keeps dying


def exit_status(code: int) -> str:
    """A child's return code in words. Example: -9 -> "killed by SIGKILL", 1 -> "exit status 1"."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit status {code}"


class ChildFailed(RuntimeError):
    """A child could not be kept serving: it failed while the stack started, or died too often since."""


@dataclass(frozen=True)
class RestartPolicy:
    """When the stack restarts a child that exited, and when it gives up. Each field is a flag, --restart-<name>.
    Example (the defaults): deaths at t=0, 2, 5, 9 s are followed by restarts 0.5, 1, 2 and 4 s later; a fifth
    death before t=60 stops the stack. A child that served 30 s since its last restart is restarted 0.5 s after
    its next death."""

    backoff: float = field(default=0.5, metadata={"help": "seconds before a child's first restart"})
    backoff_max: float = field(default=8.0, metadata={"help": "the backoff doubles at each restart up to this"})
    reset_after: float = field(default=30.0, metadata={"help": "seconds of serving after which the backoff resets"})
    limit: int = field(default=5, metadata={"help": "deaths of one child within the window that stop the stack"})
    window: float = field(default=60.0, metadata={"help": "seconds over which deaths are counted"})

    def __post_init__(self) -> None:
        if not 0 < self.backoff <= self.backoff_max:
            raise ValueError(f"need 0 < backoff <= backoff_max, got {self.backoff} and {self.backoff_max}")
        if self.reset_after <= 0 or self.window <= 0:
            raise ValueError(f"reset_after and window must be > 0, got {self.reset_after} and {self.window}")
        if self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            flag = f"--restart-{f.name.replace('_', '-')}"
            p.add_argument(flag, type=type(f.default), default=f.default, help=f"{f.metadata['help']} (%(default)s)")

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> RestartPolicy:
        return cls(**{f.name: getattr(a, f"restart_{f.name}") for f in fields(cls)})


@dataclass
class Restarts:
    """One child's deaths and the backoff of its next restart (plain bookkeeping, times in seconds).
    Example (defaults): died(0) -> 0.5, died(2) -> 1.0, died(5) -> 2.0, died(9) -> 4.0, died(20) -> None (five
    deaths within 60 s: give up). Another child: died(0) -> 0.5, served(30), died(40) -> 0.5 (the backoff starts
    over), died(100) -> 1.0 (0 and 40 have left the window: one death in it)."""

    policy: RestartPolicy
    deaths: collections.deque = field(default_factory=collections.deque)  # [deaths within the window] times
    delay: float = 0.0  # the next restart's backoff; 0 until the first death

    def died(self, now: float) -> float | None:
        """Seconds to wait before restarting; None when the child died `limit` times within the window."""
        self.deaths.append(now)
        while self.deaths[0] <= now - self.policy.window:
            self.deaths.popleft()
        if len(self.deaths) >= self.policy.limit:
            return None
        self.delay = min(self.delay * 2, self.policy.backoff_max) if self.delay else self.policy.backoff
        return self.delay

    def served(self, seconds: float) -> None:
        """The child has served `seconds` since its last start: past reset_after, its backoff starts over."""
        if seconds >= self.policy.reset_after:
            self.delay = 0.0


class Phase(enum.Enum):
    """A supervised child's life: STARTING -> SERVING -> WAITING (dead, restart due) -> STARTING ...; STARTING ->
    WAITING when it dies before it serves."""

    STARTING = "starting"
    SERVING = "serving"
    WAITING = "waiting"


class Children(Protocol):
    """What the Supervisor needs of the processes it watches (Stack; tests: stand-ins)."""

    names: tuple[str, ...]
    ports: dict[str, int]

    def spawn(self, name: str) -> None: ...
    def serving(self, name: str) -> bool: ...
    def exit_status(self, name: str) -> int | None: ...
    def pids(self) -> dict[str, int]: ...
    def log_path(self, name: str) -> Path: ...


@dataclass
class Child:
    restarts: Restarts
    phase: Phase = Phase.SERVING
    since: float = 0.0  # when it entered its phase (time.monotonic())
    restart_at: float = 0.0  # when WAITING: when it is started again
    count: int = 0  # restarts so far


@dataclass
class Supervisor:
    """Restarts the stack's children as RestartPolicy says and keeps `state_file` (JSON, written atomically)
    telling each child's pid, port, phase, restarts and log: {"draft": {"pid": 4242, "port": 41234, ...}, ...}."""

    stack: Children
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    state_file: Path | None = None
    children: dict[str, Child] = field(default_factory=dict)

    def __post_init__(self) -> None:
        now = time.monotonic()
        self.children = {n: Child(Restarts(self.policy), since=now) for n in self.stack.names}
        self.write_state()

    def run(self, interval: float = 0.1) -> None:
        """Supervise until a child keeps dying (ChildFailed) or a signal handler raises."""
        while True:
            self.step(time.monotonic())
            time.sleep(interval)

    def step(self, now: float) -> None:
        for name, c in self.children.items():
            if c.phase is Phase.WAITING:
                if now >= c.restart_at:
                    self.stack.spawn(name)
                    self._enter(c, Phase.STARTING, now)
                continue
            code = self.stack.exit_status(name)
            if code is not None:
                self._died(name, c, code, now)
            elif c.phase is Phase.STARTING and self.stack.serving(name):
                log.info("%s serving again (pid %d)", name, self.stack.pids()[name])
                self._enter(c, Phase.SERVING, now)
            elif c.phase is Phase.SERVING:
                c.restarts.served(now - c.since)

    def _died(self, name: str, c: Child, code: int, now: float) -> None:
        how, logfile = exit_status(code), self.stack.log_path(name)
        delay = c.restarts.died(now)
        if delay is None:
            raise ChildFailed(
                f"{name} died {self.policy.limit} times within {self.policy.window:g} s (last: {how}; its log: "
                f"{logfile}): stopping the stack so that its supervisor takes over"
            )
        c.count += 1
        c.restart_at = now + delay
        was = "while starting" if c.phase is Phase.STARTING else f"after serving {now - c.since:.1f} s"
        log.warning("%s exited (%s) %s; restart %d in %.1f s (its log: %s)", name, how, was, c.count, delay, logfile)
        self._enter(c, Phase.WAITING, now)

    def _enter(self, c: Child, phase: Phase, now: float) -> None:
        c.phase, c.since = phase, now
        self.write_state()

    def write_state(self) -> None:
        if self.state_file is None:
            return
        pids, ports = self.stack.pids(), self.stack.ports
        state = {
            n: {
                "pid": pids.get(n),
                "port": ports.get(n),
                "phase": c.phase.value,
                "restarts": c.count,
                "log": str(self.stack.log_path(n)),
            }
            for n, c in self.children.items()
        }
        tmp = self.state_file.with_name(f".{self.state_file.name}.tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.state_file)
