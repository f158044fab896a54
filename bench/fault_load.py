"""What a client load sees when the verifier process is killed: ghz through the gateway, SIGKILL to the verifier.

    python -m bench.fault_load --out DIR [--device cuda] [--concurrency 16] [--duration 40] [--kill-at 10]
    python -m bench.fault_load --device cpu --concurrency 2 --duration 25 --kill-at 6 --max-tokens 8 --out DIR

Starts `python -m services.stack --device DEVICE --state-file DIR/stack-state.json` (its children's logs in
DIR/logs), sends --warm-up requests untimed, then runs ghz for --duration seconds with --concurrency requests in
flight (then ghz waits for those still running, each at most --request-timeout): the held-out mixed prompts of
bench/prompts/heldout-mixed.jsonl, the `default` kind of bench.load (the speculation policy's choice), max_tokens
128, EOS stops. --kill-at seconds after ghz starts, the verifier (its pid from the state file; a child of this
stack, checked) gets SIGKILL; the stack's supervisor restarts it. The gateway fails the requests that had produced
tokens (UNAVAILABLE, "the verifier restarted while this request was running") and holds the others, and those sent
while the verifier is down, until it is back.

From ghz's per-request details: requests OK and failed, the failures' messages grouped, the requests in flight at
the kill, seconds from the kill to the first OK request that started after it, and OK requests/s in 5-second
windows aligned on the kill. After ghz: the stack's restarts (state file), GetModelInfo's policy choices (rounds
per tree since the verifier's restart) and one request pinning the 6x60 tree: rounds > 0 means speculation
resumed. Writes DIR/fault_load.json, DIR/fault_load.md (also printed), DIR/ghz.json (ghz's report),
DIR/commands.txt, DIR/data/default.json and DIR/stack.log. Exit status 1 when ghz gave no report or no request
completed OK after the kill.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from bench.load import (
    CALL,
    KINDS,
    PROMPTS,
    ROOT,
    WARM_UP_CONCURRENCY,
    Client,
    Ghz,
    StackProcess,
    find_ghz,
    ghz_version,
    read_prompts,
    requests,
    serving,
    write_data,
)

log = logging.getLogger("bench.fault_load")
WINDOW = 5.0  # seconds of each window of the OK rate
MIN_COVERED = 1.0  # seconds of a window the run must cover for its OK rate to be given
_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$")


def parse_time(text: str) -> float:
    """A Go time.Time as JSON marshals it (RFC 3339, up to nanoseconds, trailing zeros cut) in seconds since the
    epoch. Example: "2023-11-14T23:13:20.5+01:00" -> 1700000000.5 (Python's fromisoformat takes 6 digits at most)."""
    m = _TIME.match(text)
    if m is None:
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    whole, fraction, zone = m.groups()
    seconds = datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone)).timestamp()
    return seconds + float(fraction or 0.0)


@dataclass(frozen=True)
class Call:
    """One request of ghz's details, its times in seconds from the kill (negative: before it)."""

    start: float
    end: float
    status: str  # the gRPC code's name: OK, Unavailable, DeadlineExceeded, ...
    error: str  # ghz's error text ("" when OK)

    @property
    def ok(self) -> bool:
        return self.status == "OK" and not self.error


def calls(details: list[dict], killed_at: float) -> list[Call]:
    """ghz's `details` (timestamp, latency in ns, error, status) as Calls relative to `killed_at` (epoch seconds).
    ghz v0.120.0 stamps a call when it ends (runner/stats_handler.go: time.Now() at the stats.End event, latency =
    that minus the call's BeginTime), so a call started at timestamp - latency. Example: killed_at 100.0,
    {"timestamp": 103.0 as RFC 3339, "latency": 5e9} -> Call(start=-2.0, end=3.0)."""
    out = []
    for d in details:
        end = parse_time(d["timestamp"]) - killed_at
        out.append(Call(end - d["latency"] / 1e9, end, d.get("status") or "", d.get("error") or ""))
    return out


@dataclass(frozen=True)
class Window:
    """Requests that ended within [start, end) seconds from the kill; `seconds` of it that the run covered."""

    start: float
    end: float
    seconds: float
    ok: int
    failed: int
    ok_per_s: float | None  # ok / seconds; None when the run covered less than MIN_COVERED of it (no rate)


@dataclass(frozen=True)
class Span:
    """The run's ends in seconds from the kill: ghz started (negative) and exited."""

    start: float
    end: float


def windows(done: list[Call], span: Span, width: float = WINDOW) -> list[Window]:
    """Windows `width` seconds wide, one edge on the kill, over the span; a call counts in the window of its end.
    Example (width 5): span -4 .. 7 s -> [-5, 0) covering 4 s, [0, 5) covering 5 s, [5, 10) covering 2 s."""
    out = []
    for k in range(math.floor(span.start / width), math.floor(span.end / width) + 1):
        lo, hi = k * width, (k + 1) * width
        covered = min(hi, span.end) - max(lo, span.start)
        if covered <= 0:
            continue
        within = [c for c in done if lo <= c.end < hi]
        ok = sum(c.ok for c in within)
        rate = ok / covered if covered >= MIN_COVERED else None
        out.append(Window(lo, hi, covered, ok, len(within) - ok, rate))
    return out


@dataclass
class Analysis:
    """What the load saw, from ghz's details and the kill's time (times in seconds from the kill)."""

    requests: int
    ok: int
    failed: int
    statuses: dict[str, int]  # gRPC code name: requests
    errors: dict[str, int]  # ghz's error text: requests, most frequent first
    in_flight_at_kill: int  # started before the kill, ended after it
    in_flight_ok: int  # of those, OK (they had produced no token: the gateway held them for the restart)
    failed_started_after_kill: int
    first_ok_after_kill_s: float | None  # kill -> the end of the first OK request that started after the kill
    first_ok_end_after_kill_s: float | None  # kill -> the first OK end of any request (those held included)
    ok_per_s_before: float | None  # OK requests ended before the kill / seconds from the run's start to the kill
    ok_per_s_after: float | None  # OK requests ended after the kill / seconds from the kill to the run's end
    span: Span
    windows: list[Window] = field(default_factory=list)


def analyse(details: list[dict], killed_at: float, span: Span | None = None, width: float = WINDOW) -> Analysis:
    """The figures of ghz's details; `span` (from the kill, default: the first call's start to the last one's end)
    is widened to cover every call."""
    done = calls(details, killed_at)
    ok = [c for c in done if c.ok]
    in_flight = [c for c in done if c.start <= 0 < c.end]
    after_ok = [c.end for c in ok if c.start > 0]
    ends_ok = [c.end for c in ok if c.end > 0]
    starts, ends = [c.start for c in done], [c.end for c in done]
    if span is not None:
        starts, ends = [*starts, span.start], [*ends, span.end]
    span = Span(min(starts, default=0.0), max(ends, default=0.0))
    return Analysis(
        requests=len(done),
        ok=len(ok),
        failed=len(done) - len(ok),
        statuses=dict(Counter(c.status for c in done).most_common()),
        errors=dict(Counter(c.error for c in done if not c.ok).most_common()),
        in_flight_at_kill=len(in_flight),
        in_flight_ok=sum(c.ok for c in in_flight),
        failed_started_after_kill=sum(not c.ok for c in done if c.start > 0),
        first_ok_after_kill_s=min(after_ok) if after_ok else None,
        first_ok_end_after_kill_s=min(ends_ok) if ends_ok else None,
        ok_per_s_before=sum(c.end < 0 for c in ok) / -span.start if span.start < 0 else None,
        ok_per_s_after=sum(c.end >= 0 for c in ok) / span.end if span.end > 0 else None,
        span=span,
        windows=windows(done, span, width),
    )


def policy_choices(info: dict) -> dict[str, int]:
    """GetModelInfo's policy_choices (as json_format gives them: int64 as strings, zero fields left out) as
    {"DEPTHxNODES" or "plain": rounds}. Example: [{"tree": {"depth": 6, "nodes": 60}, "rounds": "12"},
    {"tree": {}, "rounds": "40"}] -> {"6x60": 12, "plain": 40}."""
    out = {}
    for c in info.get("policy_choices", []):
        tree = c.get("tree", {})
        name = f"{tree.get('depth', 0)}x{tree.get('nodes', 0)}" if tree.get("depth", 0) else "plain"
        out[name] = out.get(name, 0) + int(c.get("rounds", 0))
    return out


def ghz_command(binary: str, gateway: str, data: Path, c: int, seconds: int, request_timeout: int) -> list[str]:
    """ghz in duration mode: c in flight for `seconds`, the data file's messages round-robin, the JSON report with
    per-request details on stdout. --duration-stop wait: ghz waits for the calls still running when the duration
    ends (each at most -t), so that every request sent is in the report (with close, the default, they would count
    as errors the stack did not cause; with ignore, a request stuck since the kill would go unseen)."""
    flags = f"--insecure --call {CALL} --disable-template-data -c {c} -z {seconds}s --duration-stop wait"
    flags += f" -t {request_timeout}s --format json"
    return [binary, *flags.split(), "-D", str(data), gateway]


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, IndexError, ValueError):
        return None


def read_state(path: Path, timeout: float) -> dict:
    """The stack's state file ({"verifier": {"pid": ..., "restarts": ...}, ...}), waiting up to `timeout` seconds
    for it to name a verifier (the supervisor writes it just after the gateway serves)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            state = json.loads(path.read_text())
            if state.get("verifier", {}).get("pid"):
                return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"no verifier in the stack's state file {path} within {timeout:.0f} s")
        time.sleep(0.1)


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _s(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds:+.1f} s"


def markdown(a: Analysis, after: dict, meta: dict) -> str:
    spec = after.get("pinned") or {}
    if "rounds" in spec:
        resumed = "yes" if spec["rounds"] > 0 else "no (no round drafted)"
    else:
        resumed = f"unknown ({after.get('why', 'no request sent')})"
    lines = [
        f"# The verifier killed under load: {meta['title']}",
        "",
        f"Command: `{meta['command']}`  ",
        f"Stack: {meta['stack']}  ",
        f"ghz: {meta['ghz_version']}; `{meta['ghz_command']}`  ",
        f"Killed: the verifier (pid {meta['verifier_pid']}) with SIGKILL {meta['kill_after_s']:.1f} s after ghz "
        f"started. Times below are seconds from the kill: ghz ran from {a.span.start:+.1f} s, sent requests until "
        f"{meta['sending_until_s']:+.1f} s and waited for those in flight until {a.span.end:+.1f} s.",
        "",
        "| requests | OK | failed | in flight at the kill | of those OK | failed, started after the kill "
        "| first OK end after the kill | first OK started after the kill | OK/s before | OK/s after |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {a.requests} | {a.ok} | {a.failed} | {a.in_flight_at_kill} | {a.in_flight_ok} "
        f"| {a.failed_started_after_kill} | {_s(a.first_ok_end_after_kill_s)} | {_s(a.first_ok_after_kill_s)} "
        f"| {_f(a.ok_per_s_before, 2)} | {_f(a.ok_per_s_after, 2)} |",
        "",
        "Failures, grouped by ghz's error text:",
        "",
    ]
    lines += [f"- {n} x `{e[:300]}`" for e, n in a.errors.items()] or ["- none"]
    lines += [
        "",
        f"Requests by the end of their call, in {WINDOW:g}-second windows from the kill (OK/s over the part of the "
        "window the run covered):",
        "",
        "| window (s) | covered (s) | OK | failed | OK/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for w in a.windows:
        lines.append(f"| {w.start:+g} .. {w.end:+g} | {w.seconds:.1f} | {w.ok} | {w.failed} | {_f(w.ok_per_s, 2)} |")
    restarts = ", ".join(f"{n} {c.get('restarts')}" for n, c in after.get("state", {}).items()) or "unknown"
    choices = ", ".join(f"{k} {v}" for k, v in after.get("policy_choices", {}).items()) or "none"
    lines += [
        "",
        f"After the load: restarts {restarts}; speculation_degraded {after.get('speculation_degraded', '-')}; "
        f"policy rounds since the verifier's restart: {choices}.  ",
        f"One request pinning 6x60: {spec.get('tokens', '-')} tokens, {spec.get('rounds', '-')} rounds, mean "
        f"acceptance {_f(spec.get('acceptance'), 2)}: speculation resumed: {resumed}.",
    ]
    return "\n".join(lines) + "\n"


def kill_verifier(state_file: Path, stack_pid: int) -> int:
    """SIGKILL the verifier the state file names, once it is sure to be a child of this stack; its pid."""
    pid = int(read_state(state_file, 30)["verifier"]["pid"])
    if _parent(pid) != stack_pid:
        raise RuntimeError(f"pid {pid} (the verifier in {state_file}) is not a child of the stack {stack_pid}")
    os.kill(pid, signal.SIGKILL)
    return pid


@dataclass(frozen=True)
class Load:
    """One ghz run with the kill: its JSON report and the times (epoch seconds) of its start, the kill, its exit."""

    report: dict
    verifier_pid: int
    started_at: float
    killed_at: float
    ended_at: float

    @property
    def span(self) -> Span:
        return Span(self.started_at - self.killed_at, self.ended_at - self.killed_at)


def run_load(cmd: list[str], out: Path, kill_at: float, wait: float, state_file: Path, stack_pid: int) -> Load:
    """ghz in the background (report in out/ghz.json), the verifier killed `kill_at` seconds after its start, then
    ghz waited for (up to `wait` seconds, then stopped: RuntimeError)."""
    report_path, err_path = out / "ghz.json", out / "ghz.stderr"
    with report_path.open("wb") as stdout, err_path.open("wb") as stderr:
        started = time.time()
        ghz = subprocess.Popen(cmd, stdout=stdout, stderr=stderr)
    try:
        time.sleep(kill_at)
        if ghz.poll() is not None:
            raise RuntimeError(f"ghz exited ({ghz.returncode}) before the kill: {err_path.read_text()[-500:]}")
        pid = kill_verifier(state_file, stack_pid)
        killed = time.time()
        log.info("killed the verifier (pid %d) %.1f s after ghz started", pid, killed - started)
        code = ghz.wait(timeout=wait)
        ended = time.time()
    finally:
        if ghz.poll() is None:
            log.warning("ghz still runs: stopping it")
            ghz.kill()
            ghz.wait()
    if code != 0:
        raise RuntimeError(f"ghz exited with {code}: {err_path.read_text()[-500:]}")
    return Load(json.loads(report_path.read_text()), pid, started, killed, ended)


def after_load(client: Client, gateway: str, state_file: Path, message: dict, timeout: float) -> dict:
    """The stack's restarts, GetModelInfo's policy rounds and one request pinning 6x60 (`message`: its rounds),
    once the gateway serves again (up to `timeout` seconds)."""
    import grpc  # here, not at the top: the tests of this module need neither gRPC nor the stubs

    out: dict = {"state": read_state(state_file, 10)}
    deadline = time.monotonic() + timeout
    while not serving(gateway):
        if time.monotonic() > deadline:
            out["why"] = f"the gateway did not serve within {timeout:.0f} s after the load"
            return out
        time.sleep(0.5)
    try:
        info = client.model_info()
        out.update(speculation_degraded=info.get("speculation_degraded", False), policy_choices=policy_choices(info))
        out["model_info"] = info
        out["pinned"] = client.complete(message, timeout)
    except grpc.RpcError as e:
        out["why"] = f"{e.code().name}: {e.details()}"
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.fault_load", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="bench-results/fault_load")
    p.add_argument("--ghz", default=None, help="the ghz binary (default: $GHZ, ghz on PATH, ../shared/tools/ghz)")
    p.add_argument("--device", default="cuda", help="the stack's --device")
    p.add_argument(
        "--stack-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more flag for services.stack, repeatable (--stack-arg=--colocate=off)",
    )
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for the stack to serve")
    p.add_argument("--concurrency", type=int, default=16, help="ghz -c: requests in flight")
    p.add_argument("--duration", type=int, default=40, help="ghz -z: seconds of load")
    p.add_argument("--kill-at", type=float, default=10.0, help="seconds after ghz starts that the verifier is killed")
    p.add_argument("--prompts-file", type=Path, default=PROMPTS)
    p.add_argument("--prompts", type=int, default=None, help="the first N prompts only (interleaved by category)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--request-timeout", type=int, default=120, help="ghz -t, seconds a request")
    p.add_argument("--warm-up", type=int, default=8, help="requests sent untimed before the load (0: none)")
    a = p.parse_args(argv)
    if min(a.concurrency, a.duration, a.max_tokens, a.request_timeout) < 1 or a.warm_up < 0:
        p.error("--concurrency, --duration, --max-tokens and --request-timeout take positive integers")
    if not 0 < a.kill_at < a.duration:
        p.error("--kill-at must be within the load: 0 < --kill-at < --duration")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(a.out)
    prompts = read_prompts(a.prompts_file)[: a.prompts]
    data = write_data(out, {"default": requests(KINDS["default"], prompts, a.max_tokens)})["default"]
    binary = find_ghz(a.ghz)
    state_file = (out / "stack-state.json").resolve()
    stack_args = ["--device", a.device, "--state-file", str(state_file), "--log-dir", str((out / "logs").resolve())]
    proc = StackProcess(ROOT, sys.executable, [*stack_args, *a.stack_arg], out / "stack.log")
    with contextlib.ExitStack() as stack:
        stack.callback(proc.stop)
        gateway = proc.start(a.start_timeout)
        client = Client(gateway)
        stack.callback(client.close)
        info = client.model_info()
        warm = Ghz(binary, gateway, a.request_timeout, a.request_timeout + 60)
        if a.warm_up:
            c = min(WARM_UP_CONCURRENCY, a.warm_up)
            log.info("warm-up, untimed: %d requests, %d in flight", a.warm_up, c)
            report, why = warm.run(data, c, a.warm_up, f"warm-up, untimed: c={c}, n={a.warm_up}")
            if why or report.get("statusCodeDistribution", {}).get("OK", 0) < a.warm_up:
                log.warning("warm-up: %s", why or report.get("errorDistribution"))
        cmd = ghz_command(binary, gateway, data, a.concurrency, a.duration, a.request_timeout)
        (out / "commands.txt").write_text("\n".join([*warm.commands, f"# the load\n{shlex.join(cmd)}"]) + "\n")
        log.info("ghz: %d in flight for %d s; the verifier is killed at %.1f s", a.concurrency, a.duration, a.kill_at)
        wait = a.duration + a.request_timeout + 60
        try:
            load = run_load(cmd, out, a.kill_at, wait, state_file, proc.proc.pid)
        except (RuntimeError, TimeoutError, OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
            log.error("no report: %s", e)
            return 1
        log.info("ghz done; checking the stack after the load")
        pinned = requests(KINDS["6x60"], prompts[:1], a.max_tokens)[0]
        after = after_load(client, gateway, state_file, pinned, a.request_timeout)
    analysis = analyse(load.report.get("details") or [], load.killed_at, load.span)
    meta = {
        "title": f"{info.get('device', '?')}, {info.get('dtype', '?')}, {len(prompts)} held-out prompts, "
        f"max_tokens {a.max_tokens}, EOS stops, c={a.concurrency}, {a.duration} s, kill at {a.kill_at:g} s",
        "command": "python -m bench.fault_load " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "stack": f"`python {shlex.join(proc.command[1:])}`, log in stack.log and logs/",
        "ghz_version": ghz_version(binary),
        "ghz_command": shlex.join(cmd),
        "verifier_pid": load.verifier_pid,
        "kill_after_s": load.killed_at - load.started_at,
        "sending_until_s": load.started_at + a.duration - load.killed_at,
        "model_info_before": info,
    }
    md = markdown(analysis, after, meta)
    (out / "fault_load.md").write_text(md)
    result = {
        "meta": meta,
        "analysis": asdict(analysis),
        "after": after,
        "ghz_end_reason": load.report.get("endReason"),
    }
    (out / "fault_load.json").write_text(json.dumps(result, indent=1) + "\n")
    sys.stdout.write(md)
    return 0 if analysis.first_ok_end_after_kill_s is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
