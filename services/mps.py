"""CUDA MPS for the stack: when several of its processes share one GPU, the MPS control daemon lets their kernels
run side by side instead of taking turns (started if none runs, quit at exit if the stack started it)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("services.stack")


MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_DIRS = {"CUDA_MPS_PIPE_DIRECTORY": "pipe", "CUDA_MPS_LOG_DIRECTORY": "log"}  # variable: folder under a temp dir
MPS_START_S = 5.0  # the daemon forks: its pipe appears shortly after -d returns


def control(exe: str, environ: Mapping[str, str], command: str, timeout: float = 5.0) -> str | None:
    """What the control binary prints for one command on stdin (get_server_list, quit, ...), with the pipe directory
    `environ` names; None when it fails or no daemon answers there."""
    try:
        r = subprocess.run(
            [exe], input=command + "\n", env=dict(environ), capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def mps_wanted(choice: str, device: str, colocate: bool) -> bool:
    """Whether the stack sees to a CUDA MPS daemon: more than one of its processes on one CUDA GPU.
    Example: ("auto", "cuda", False) -> True; ("auto", "cuda", True) -> False (one process on the GPU);
    ("auto", "cpu", False) -> False; ("off", "cuda", False) -> False."""
    if choice not in ("auto", "off"):
        raise ValueError(f"mps must be auto or off, got {choice!r}")
    return choice == "auto" and device.startswith("cuda") and not colocate


@dataclass
class Mps:
    """The CUDA MPS control daemon the stack's GPU processes connect to. The GPU's compute mode is never touched."""

    exe: str
    env: dict[str, str]  # MPS_DIRS for the children (empty: they find a daemon already running by themselves)
    started: bool  # by this stack, which quits it at exit
    environ: dict[str, str] = field(default_factory=dict)  # the stack's environment (without `env`)

    @staticmethod
    def answers(exe: str, environ: Mapping[str, str]) -> bool:
        """Whether a control daemon answers at the pipe directory `environ` names (or the default one)."""
        return control(exe, environ, "get_server_list") is not None

    @classmethod
    def start(cls, environ: Mapping[str, str]) -> Mps | None:
        """Use the daemon running, or start one (its pipe and log folders from `environ`, else under a new
        temporary folder); None, with a warning, when there is no daemon to be had."""
        exe = shutil.which(MPS_CONTROL, path=environ.get("PATH"))
        if exe is None:
            log.warning("no %s on PATH: the GPU processes take turns at the GPU (no MPS)", MPS_CONTROL)
            return None
        if cls.answers(exe, environ):
            where = environ.get("CUDA_MPS_PIPE_DIRECTORY", "its default pipe directory")
            log.info("CUDA MPS: a control daemon is running (%s): the GPU processes share it", where)
            return cls(exe, env={}, started=False, environ=dict(environ))
        tmp = None if all(environ.get(k) for k in MPS_DIRS) else Path(tempfile.mkdtemp(prefix="specdec-mps-"))
        env = {k: environ.get(k) or str(tmp / leaf) for k, leaf in MPS_DIRS.items()}
        for d in env.values():
            Path(d).mkdir(parents=True, exist_ok=True)
        mps = cls(exe, env=env, started=True, environ=dict(environ))
        try:
            r = subprocess.run([exe, "-d"], env={**environ, **env}, capture_output=True, text=True, timeout=10)
            why = f"exit status {r.returncode}: {(r.stderr or r.stdout).strip()[-500:]}" if r.returncode else ""
        except (OSError, subprocess.TimeoutExpired) as e:
            why = str(e)
        if not why and not mps.answering(within=MPS_START_S):
            why = f"it did not answer within {MPS_START_S:g} s"
        if why:
            log.warning("CUDA MPS: could not start %s -d (%s): the GPU processes take turns at the GPU", exe, why)
            mps.stop()
            return None
        log.info("CUDA MPS: started the control daemon (pipes in %s, logs in %s)", *env.values())
        return mps

    def answering(self, within: float) -> bool:
        deadline = time.monotonic() + within
        while self._control("get_server_list") is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def _control(self, command: str, timeout: float = 5.0) -> str | None:
        """control() at this daemon's pipe directory."""
        return control(self.exe, {**self.environ, **self.env}, command, timeout)

    def _ask(self, command: str) -> list[int]:
        """The pids a control command prints ([] when the daemon does not answer)."""
        return [int(x) for x in (self._control(command) or "").split() if x.isdigit()]

    def clients(self) -> set[int]:
        """The pids of the processes connected through the daemon (each server's clients): a GPU process of the
        stack missing from them takes turns at the GPU."""
        return {c for server in self._ask("get_server_list") for c in self._ask(f"get_client_list {server}")}

    def stop(self) -> None:
        """Quit the daemon this stack started (its servers exit once their clients have)."""
        if not self.started:
            return
        if self._control("quit", timeout=10) is not None:
            log.info("CUDA MPS: control daemon stopped")
