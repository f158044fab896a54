"""SIGTERM through `python -m services.stack` (what `make serve` runs): the signal reaches every child, health
turns NOT_SERVING at once, new requests are refused, the generations in flight finish within the drain grace, and
every child has exited when the stack does. kill -9 of the stack leaves no orphan either."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest

from tests.conftest import CHAT_PROMPTS
from tests.faults import ServedStack, Streams, complete, figures, health, wait_for
from tests.helpers import chat

pytestmark = pytest.mark.slow
GRACE = 30.0


def test_sigterm_drains_in_flight_and_leaves_no_process(tmp_path):
    s = ServedStack.launch(tmp_path, grace=GRACE)
    try:
        pids = {name: child["pid"] for name, child in s.state().items()}
        assert set(pids) == {"draft", "verifier", "gateway"}
        streams = Streams(s.gateway, [chat(p, max_tokens=32, ignore_eos=True) for p in CHAT_PROMPTS[:4]])
        streams.wait_tokens(2)
        s.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        not_serving = wait_for(lambda: health(s.gateway) == "NOT_SERVING", timeout=5, interval=0.05)
        with pytest.raises(grpc.RpcError) as e:
            complete(s.gateway, chat("Hi", max_tokens=4))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        outcomes = streams.join(timeout=GRACE + 10)
        finished = max(o.done_at for o in outcomes) - t0
        code = s.proc.wait(timeout=GRACE + 20)
        exited = time.monotonic() - t0
        left = s.children_left()
        figures(
            "sigterm-drain",
            sent=len(outcomes),
            failed=len(streams.failed),
            completed=sum(len(o.tokens) == 32 for o in outcomes),
            not_serving_after_s=not_serving,
            in_flight_done_s=finished,
            exit_after_s=exited,
            exit_status=code,
            processes_left=len(left),
        )
        assert not streams.failed, [str(o.error) for o in streams.failed]
        assert all(len(o.tokens) == 32 for o in outcomes)
        assert finished < GRACE and code == 0 and not left, s.logs()
    finally:
        s.close()


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _execd(pid: int) -> bool:
    """Whether the stack's child `pid` runs its service: past the exec, so past the stack's preexec_fn that binds it to
    the stack (a kill between a fork and that prctl leaves an orphan: services/stack.py's bind_to_parent does not
    check whether the parent is still there)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    return b"\0services." in cmdline and b"\0services.stack" not in cmdline


def test_stack_killed_leaves_no_orphans(tmp_path):
    """kill -9 of the stack while it starts (the draft serving, the verifier loading): its children get SIGTERM from
    the kernel (PR_SET_PDEATHSIG, set for every child alike) and exit."""
    s = ServedStack.launch(tmp_path, wait=False)
    try:
        wait_for(
            lambda: s.proc.poll() is not None or sum(map(_execd, _children(s.proc.pid))) >= 2,
            timeout=120,
            interval=0.02,
        )
        children = _children(s.proc.pid)
        s.seen.update({pid: "child" for pid in children})  # for close(), should this test fail
        s.proc.kill()
        s.proc.wait(timeout=10)
        gone = wait_for(lambda: not s.children_left(), timeout=60)
        figures("stack-kill-9", children=len(children), orphans_after_s=gone)
        assert len(children) == 2
    finally:
        s.close()
