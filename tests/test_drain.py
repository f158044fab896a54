"""SIGTERM through `python -m services.stack` (what `make serve` runs): the signal reaches the three
services, health turns NOT_SERVING at once, new requests are refused, the generations in flight finish,
and every child has exited when the stack does. kill -9 of the stack leaves no orphan either."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from tests.conftest import CHAT_PROMPTS
from tests.faults import Streams, complete, figures, health, wait_for
from tests.helpers import chat, free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _start_stack(tmp_path: Path, grace: float) -> tuple[subprocess.Popen, str]:
    addr = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "GATEWAY_ADDR": addr, "PYTHONPATH": str(ROOT)}
    log = open(tmp_path / "stack.log", "w")  # noqa: SIM115 - closed with the process
    p = subprocess.Popen(
        [sys.executable, "-m", "services.stack", "--drain-grace", str(grace)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    wait_for(lambda: health(addr) == "SERVING" or p.poll() is not None, timeout=300, interval=0.2)
    assert p.poll() is None, (tmp_path / "stack.log").read_text()[-3000:]
    return p, addr


def test_sigterm_drains_in_flight_and_leaves_no_orphans(tmp_path):
    stack, addr = _start_stack(tmp_path, grace=60)
    children = _children(stack.pid)
    try:
        assert len(children) == 3
        streams = Streams(addr, [chat(p, max_tokens=48, ignore_eos=True) for p in CHAT_PROMPTS[:4]])
        streams.wait_tokens(2)
        stack.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert wait_for(lambda: health(addr) == "NOT_SERVING", timeout=5) < 5
        with pytest.raises(grpc.RpcError) as e:
            complete(addr, chat("Hi", max_tokens=4))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        outcomes = streams.join()
        assert not streams.failed, [str(o.error) for o in streams.failed]
        assert all(len(o.tokens) == 48 for o in outcomes)
        stack.wait(timeout=60)
        exited = time.monotonic() - t0
        assert not [c for c in children if _alive(c)]
        figures(
            "sigterm-drain",
            sent=len(outcomes),
            failed=len(streams.failed),
            completed=len(outcomes),
            exit_after_s=exited,
            orphans=0,
        )
    finally:
        for c in children:
            if _alive(c):
                os.kill(c, signal.SIGKILL)
        if stack.poll() is None:
            stack.kill()


def test_stack_killed_leaves_no_orphans(tmp_path):
    stack, addr = _start_stack(tmp_path, grace=5)
    children = _children(stack.pid)
    try:
        stack.kill()
        stack.wait(timeout=10)
        gone = wait_for(lambda: not [c for c in children if _alive(c)], timeout=15)
        figures("stack-kill-9", children=len(children), orphans_after_s=gone)
    finally:
        for c in children:
            if _alive(c):
                os.kill(c, signal.SIGKILL)
