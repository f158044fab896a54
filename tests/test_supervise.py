"""The stack's supervision (services/stack.py) without the model: the restart arithmetic, the supervisor restarting
stand-in processes it watches and giving up on one that keeps dying, its state file, its flags, and the CUDA MPS
decisions and commands against a fake nvidia-cuda-mps-control on PATH (no GPU)."""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.mps import Mps, mps_wanted
from services.stack import _parser
from services.supervise import ChildFailed, Phase, RestartPolicy, Restarts, Supervisor, exit_status


def test_restart_backoff_doubles_and_five_deaths_in_a_minute_give_up() -> None:
    """RestartPolicy's defaults, as its docstring and the issue give them: 0.5 s doubling to 8 s, 5 deaths in 60 s."""
    r = Restarts(RestartPolicy())
    assert [r.died(t) for t in (0, 2, 5, 9)] == [0.5, 1.0, 2.0, 4.0]
    assert r.died(20) is None
    capped = Restarts(RestartPolicy(limit=100))
    assert [capped.died(t) for t in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_serving_resets_the_backoff_and_old_deaths_leave_the_window() -> None:
    r = Restarts(RestartPolicy())
    assert r.died(0) == 0.5
    r.served(29.9)
    assert r.died(40) == 1.0  # not served long enough: doubled
    r.served(30)
    assert r.died(80) == 0.5  # served 30 s: starts over
    assert r.died(101) == 1.0 and list(r.deaths) == [80, 101]  # 0 and 40 left the 60 s window


def test_restart_policy_is_validated_and_its_flags_come_from_its_fields() -> None:
    for bad in (dict(backoff=0), dict(backoff=9, backoff_max=8), dict(limit=0), dict(window=0), dict(reset_after=-1)):
        with pytest.raises(ValueError):
            RestartPolicy(**bad)
    a = _parser().parse_args(["--restart-limit", "3", "--restart-backoff-max=2", "--engine-arg=--max-context=512"])
    assert RestartPolicy.from_args(a) == RestartPolicy(limit=3, backoff_max=2.0)
    assert RestartPolicy.from_args(_parser().parse_args([])) == RestartPolicy()
    assert a.engine_arg == ["--max-context=512"] and a.mps == "auto" and a.state_file is None


def test_exit_status_in_words() -> None:
    assert exit_status(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_status(1) == "exit status 1"
    assert exit_status(0) == "exit status 0"


class StandIns:
    """Children for the Supervisor: shell processes that 'serve' once they have written their port file."""

    names = ("draft", "verifier", "gateway")

    def __init__(self, folder: Path) -> None:
        self.folder, self.procs, self.ports, self.started = folder, {}, {}, []
        for n in self.names:
            self.spawn(n)

    def spawn(self, name: str) -> None:
        port_file = self.folder / f"{name}.port"
        port_file.unlink(missing_ok=True)
        p = subprocess.Popen(["sh", "-c", f"echo 4242 > {port_file}; exec sleep 120"])
        self.procs[name] = p
        self.started.append(p)

    def serving(self, name: str) -> bool:
        if (self.folder / f"{name}.port").exists():
            self.ports[name] = 4242
            return True
        return False

    def exit_status(self, name: str) -> int | None:
        return self.procs[name].poll()

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items()}

    def log_path(self, name: str) -> Path:
        return self.folder / f"{name}.log"

    def kill(self, name: str) -> int:
        p = self.procs[name]
        p.kill()
        p.wait()
        return p.pid


@pytest.fixture
def stand_ins(tmp_path):
    s = StandIns(tmp_path)
    yield s
    for p in s.started:  # only what this test started, by its Popen
        if p.poll() is None:
            p.kill()
            p.wait()


def _until(sup: Supervisor, done, timeout: float = 10.0) -> float:
    """Drive the supervisor until done(); seconds taken."""
    t0 = time.monotonic()
    while not done():
        assert time.monotonic() - t0 < timeout, "the supervisor did not get there in time"
        sup.step(time.monotonic())
        time.sleep(0.01)
    return time.monotonic() - t0


def test_a_dead_child_is_restarted_alone_and_the_state_file_follows(stand_ins, tmp_path, caplog) -> None:
    state = tmp_path / "state.json"
    sup = Supervisor(stand_ins, RestartPolicy(backoff=0.2), state)
    others = {n: p for n, p in stand_ins.pids().items() if n != "verifier"}
    assert _until(sup, lambda: all(stand_ins.serving(n) for n in stand_ins.names)) < 5
    first = json.loads(state.read_text())["verifier"]
    assert {k: first[k] for k in ("pid", "phase", "restarts", "log")} == {
        "pid": stand_ins.pids()["verifier"],
        "phase": "serving",
        "restarts": 0,
        "log": str(tmp_path / "verifier.log"),
    }
    old = stand_ins.kill("verifier")

    def back() -> bool:
        return sup.children["verifier"].phase is Phase.SERVING and stand_ins.pids()["verifier"] != old

    with caplog.at_level(logging.WARNING, logger="services.stack"):
        took = _until(sup, back)
    assert took >= 0.2  # the backoff
    assert {n: p for n, p in stand_ins.pids().items() if n != "verifier"} == others
    now = json.loads(state.read_text())["verifier"]
    assert now["pid"] == stand_ins.pids()["verifier"] and now["restarts"] == 1 and now["phase"] == "serving"
    assert now["port"] == 4242
    (line,) = [r.getMessage() for r in caplog.records if "exited" in r.getMessage()]
    assert "verifier exited (killed by SIGKILL)" in line and "restart 1 in 0.2 s" in line and "verifier.log" in line


def test_a_child_that_keeps_dying_stops_the_supervision(stand_ins, tmp_path) -> None:
    sup = Supervisor(stand_ins, RestartPolicy(backoff=0.05, limit=3, window=60))
    for i in range(2):
        old = stand_ins.kill("draft")
        _until(sup, lambda o=old: sup.children["draft"].phase is Phase.SERVING and stand_ins.pids()["draft"] != o)
        assert sup.children["draft"].count == i + 1
    stand_ins.kill("draft")
    with pytest.raises(ChildFailed, match=r"draft died 3 times within 60 s \(last: killed by SIGKILL; its log: "):
        _until(sup, lambda: False)


def test_a_child_that_dies_while_starting_counts_too(tmp_path) -> None:
    """A stand-in that exits at once, every time: restarted with a doubling backoff, then given up."""

    class Crashing(StandIns):
        def spawn(self, name: str) -> None:
            super().spawn(name)
            if name == "gateway" and len(self.started) > 3:
                self.procs[name].kill()

    s = Crashing(tmp_path)
    try:
        sup = Supervisor(s, RestartPolicy(backoff=0.05, limit=4))
        s.kill("gateway")
        t0 = time.monotonic()
        with pytest.raises(ChildFailed, match="gateway died 4 times"):
            _until(sup, lambda: False)
        assert time.monotonic() - t0 >= 0.05 + 0.1 + 0.2
    finally:
        for p in s.started:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_mps_only_for_several_processes_on_a_cuda_gpu() -> None:
    assert mps_wanted("auto", "cuda", colocate=False) and mps_wanted("auto", "cuda:1", colocate=False)
    assert not mps_wanted("auto", "cuda", colocate=True)  # one process on the GPU
    assert not mps_wanted("auto", "cpu", colocate=False)
    assert not mps_wanted("off", "cuda", colocate=False)
    with pytest.raises(ValueError, match="auto or off"):
        mps_wanted("on", "cuda", colocate=False)


FAKE_MPS = """#!/bin/sh
# a stand-in for nvidia-cuda-mps-control: -d 'starts' a daemon (a file in the pipe directory); a command on stdin
# answers as the real client does: get_server_list fails without a daemon, quit stops it
pipe="${CUDA_MPS_PIPE_DIRECTORY:-$FAKE_MPS_DEFAULT_PIPE}"
if [ "$1" = "-d" ]; then
  echo "start pipe=${CUDA_MPS_PIPE_DIRECTORY:-} log=${CUDA_MPS_LOG_DIRECTORY:-}" >> "$FAKE_MPS_RECORD"
  [ -n "$FAKE_MPS_FAIL" ] && { echo "An instance of this daemon is already running" >&2; exit 1; }
  [ -n "$FAKE_MPS_SILENT" ] && exit 0
  touch "$pipe/control"; exit 0
fi
read cmd
echo "$cmd pipe=${CUDA_MPS_PIPE_DIRECTORY:-}" >> "$FAKE_MPS_RECORD"
[ -e "$pipe/control" ] || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
[ "$cmd" = quit ] && rm "$pipe/control"
[ "$cmd" = get_server_list ] && [ -e "$pipe/servers" ] && cat "$pipe/servers"
case "$cmd" in "get_client_list "*) f="$pipe/clients-${cmd#get_client_list }"; [ -e "$f" ] && cat "$f";; esac
exit 0
"""


@pytest.fixture
def fake_mps(tmp_path):
    """An environment whose PATH finds the fake first; its default pipe directory is a folder of the test's."""
    bin_dir, default_pipe = tmp_path / "bin", tmp_path / "default-pipe"
    bin_dir.mkdir()
    default_pipe.mkdir()
    exe = bin_dir / "nvidia-cuda-mps-control"
    exe.write_text(FAKE_MPS)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    record = tmp_path / "record"
    record.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_MPS_RECORD=str(record))
    env["FAKE_MPS_DEFAULT_PIPE"] = str(default_pipe)
    return env, record, default_pipe


def _lines(record: Path) -> list[str]:
    return record.read_text().splitlines()


def test_mps_is_started_under_a_temporary_folder_and_quit_at_exit(fake_mps, caplog) -> None:
    env, record, _ = fake_mps
    with caplog.at_level(logging.INFO, logger="services.stack"):
        mps = Mps.start(env)
    assert mps is not None and mps.started
    pipe, logs = mps.env["CUDA_MPS_PIPE_DIRECTORY"], mps.env["CUDA_MPS_LOG_DIRECTORY"]
    assert Path(pipe).is_dir() and Path(logs).is_dir() and Path(pipe).name == "pipe" and Path(logs).name == "log"
    assert _lines(record) == ["get_server_list pipe=", f"start pipe={pipe} log={logs}", f"get_server_list pipe={pipe}"]
    assert any("started the control daemon" in r.getMessage() and pipe in r.getMessage() for r in caplog.records)
    mps.stop()
    assert _lines(record)[-1] == f"quit pipe={pipe}" and not (Path(pipe) / "control").exists()


def test_mps_lists_the_processes_connected_through_it(fake_mps) -> None:
    """No client before a GPU process connects; each server's clients once some have; none from a daemon that no
    longer answers."""
    env, _, _ = fake_mps
    mps = Mps.start(env)
    assert mps is not None and mps.clients() == set()
    pipe = Path(mps.env["CUDA_MPS_PIPE_DIRECTORY"])
    (pipe / "servers").write_text("4242\n4343\n")
    (pipe / "clients-4242").write_text("11\n12\n")
    (pipe / "clients-4343").write_text("13\n")
    assert mps.clients() == {11, 12, 13}
    mps.stop()
    assert mps.clients() == set()


def test_mps_uses_the_folders_given_in_the_environment(fake_mps, tmp_path) -> None:
    env, record, _ = fake_mps
    env.update(CUDA_MPS_PIPE_DIRECTORY=str(tmp_path / "p"), CUDA_MPS_LOG_DIRECTORY=str(tmp_path / "l"))
    mps = Mps.start(env)
    assert mps is not None and mps.env == {k: env[k] for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")}
    assert _lines(record)[1] == f"start pipe={tmp_path / 'p'} log={tmp_path / 'l'}"
    mps.stop()


def test_a_running_mps_daemon_is_used_and_left_running(fake_mps) -> None:
    env, record, default_pipe = fake_mps
    (default_pipe / "control").touch()  # a daemon at the default pipe directory
    mps = Mps.start(env)
    assert mps is not None and not mps.started and mps.env == {}
    mps.stop()
    assert _lines(record) == ["get_server_list pipe="]  # neither started nor quit
    assert (default_pipe / "control").exists()


def test_no_mps_when_it_cannot_start_or_is_not_installed(fake_mps, caplog, monkeypatch) -> None:
    env, _, _ = fake_mps
    monkeypatch.setattr("services.mps.MPS_START_S", 0.3)
    with caplog.at_level(logging.WARNING, logger="services.stack"):
        assert Mps.start({**env, "FAKE_MPS_FAIL": "1"}) is None
        assert Mps.start({**env, "FAKE_MPS_SILENT": "1"}) is None  # -d succeeds, no daemon answers
        assert Mps.start({**env, "PATH": "/nonexistent"}) is None
    messages = [r.getMessage() for r in caplog.records]
    assert any("could not start" in m and "already running" in m for m in messages), messages
    assert any("could not start" in m and "did not answer within 0.3 s" in m for m in messages), messages
    assert any("no nvidia-cuda-mps-control on PATH" in m for m in messages), messages


def test_the_stack_says_how_it_supervises() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.stack", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    for flag in ("--restart-limit", "--restart-window", "--restart-backoff", "--state-file", "--mps", "--engine-arg"):
        assert flag in out


def test_the_stack_starts_mps_for_three_processes_on_a_gpu_and_quits_it_at_exit(fake_mps, tmp_path) -> None:
    """python -m services.stack --device cuda --colocate off with the fake on PATH: the daemon is started before the
    children and quit when the stack stops (here at once: the draft is given a flag it does not know)."""
    env, record, _ = fake_mps
    env.update(GATEWAY_ADDR="127.0.0.1:0", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    cmd = [sys.executable, "-m", "services.stack", "--device", "cuda", "--colocate", "off", "--log-dir", str(tmp_path)]
    r = subprocess.run([*cmd, "--draft-arg=--no-such-flag"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "CUDA MPS: started the control daemon" in r.stderr and "draft failed to start (exit status 2" in r.stderr
    lines = _lines(record)
    assert lines[1].startswith("start pipe=") and lines[-1].startswith("quit pipe="), lines
