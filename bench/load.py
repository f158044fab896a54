"""The served stack under load: ghz against the gateway's public API, every kind of request in every phase.

    python -m bench.load --out bench-results/load                   # starts `python -m services.stack --device cuda`
    python -m bench.load --gateway 127.0.0.1:50051 --out DIR        # a gateway that is already serving
    python -m bench.load --checkout ../before --out DIR             # the stack of another checkout (before/after)
    python -m bench.load --sampled --out DIR                        # also temperature 0.7, top-p 0.9: default, plain

Workload: the held-out prompts of bench/prompts/heldout-mixed.jsonl (48: eight each of chat, code, math, QA,
summarization and writing, never trained on), interleaved by category, each as one user message, max_tokens 128,
stopped by EOS (no ignore_eos). Each kind is one ghz data file, a JSON array that ghz sends round-robin (request i
gets element i mod 48):
  default      the speculation policy's choice     {}
  plain        no speculation                      {"speculative": false}
  6x60         the draft's default tree, pinned    {"tree": {"depth": 6, "nodes": 60}}
  3x8          a small tree, pinned                {"tree": {"depth": 3, "nodes": 8}}
  default-0.7  (--sampled) temperature 0.7, top-p 0.9, seed = the prompt's index
  plain-0.7    (--sampled) the same, speculative false
  mixed        (--sampled) every other prompt as default-0.7, the others as default: a batch half greedy, half
               sampled (its ratio is over default's, the all-greedy batch)
History: a phase per --concurrency entry (default 1,16,64,1: the last measures c=1 after the bursts). In a phase
every kind runs once, n = max(48, 32 x c) requests with c in flight (RUN_LENGTH x c: a run under a second long
swings by +-15% from run to run), in an order rotated by one from phase to phase
so that drift favours no kind. Before the phases every kind runs untimed (--warm-up 8 requests, 4 in flight), then
a Python client sends each kind's 48 requests once, one at a time, to count their completion tokens (ghz counts
requests only).
Figures: requests/s = OK requests / ghz's total time; p50 / p99 latency of the OK requests; tok/s = requests/s x
the mean completion tokens of the requests the run sent (from that count: greedy output does not depend on the
load, up to bf16 near-ties); and each kind's requests/s over plain's in the same phase (the sampled kinds over
plain-0.7's), the figure of merit. GetModelInfo is saved whole after every phase (the policy's choices so far),
and its engine_time and engine_calls read after every run: where the verifier's engine thread spent that run and
how often the policy switched a batch between plain and trees (a table of its own).
Writes OUT/load.json, OUT/load.md (also printed), OUT/commands.txt (every ghz command line as run), OUT/data/
(the data files) and, with a stack of its own, OUT/stack.log.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.engine.core_parts import PLAIN_PHASES, ROUND_PHASES
from services.stack import bind_to_parent

log = logging.getLogger("bench.load")
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = Path(__file__).resolve().parent / "prompts" / "heldout-mixed.jsonl"  # the load and engine benches' 48
# every prompt never trained on: bench.accept's 144 (24 a category), the prompts training's deduplicator excludes
HELDOUT = (PROMPTS, PROMPTS.with_name("heldout-more.jsonl"))
CATEGORIES = ("chat", "code", "math", "qa", "summarization", "writing")
CALL = "specdec.v1.Generation.Complete"
RUN_DONE = "%s: %d/%d OK, %.2f req/s, p50 %s ms"  # a run's log line (bench.policy_log reads it)
WARM_UP_CONCURRENCY = 4  # each kind's untimed ghz run before the phases: --warm-up requests, at most 4 in flight
SAMPLING = {"temperature": 0.7, "top_p": 0.9}
RUN_LENGTH = 32  # requests a run per request in flight (at least the prompts): 512 at c=16, 2,048 at c=64


@dataclass(frozen=True)
class Kind:
    """A kind of request: the fields it adds to each prompt's message, and the kind its ratio divides by."""

    name: str
    fields: dict
    baseline: str
    seeded: bool = False  # seed = the prompt's index, the same for the default and the plain sampled kinds
    odd: dict = field(default_factory=dict)  # fields the odd-numbered prompts add besides (a mixed workload)


KINDS = {
    k.name: k
    for k in (
        Kind("default", {}, "plain"),
        Kind("plain", {"speculative": False}, "plain"),
        Kind("6x60", {"tree": {"depth": 6, "nodes": 60}}, "plain"),
        Kind("3x8", {"tree": {"depth": 3, "nodes": 8}}, "plain"),
        Kind("default-0.7", dict(SAMPLING), "plain-0.7", seeded=True),
        Kind("plain-0.7", {"speculative": False, **SAMPLING}, "plain-0.7", seeded=True),
        Kind("3x8-0.7", {"tree": {"depth": 3, "nodes": 8}, **SAMPLING}, "plain-0.7", seeded=True),
        Kind("6x60-0.7", {"tree": {"depth": 6, "nodes": 60}, **SAMPLING}, "plain-0.7", seeded=True),
        Kind("mixed", {}, "default", seeded=True, odd=dict(SAMPLING)),
    )
}
GREEDY = ("default", "plain", "6x60", "3x8")
SAMPLED = ("default-0.7", "plain-0.7", "mixed")


@dataclass(frozen=True)
class Prompt:
    category: str
    text: str


def read_prompts(path: Path = PROMPTS) -> list[Prompt]:
    """The file's prompts ({"category", "prompt"} a line), interleaved by category in CATEGORIES' order so that any
    first n of them mix the categories: [chat1, chat2, math1, writing1] -> [chat1, math1, writing1, chat2]."""
    by_category: dict[str, list[Prompt]] = {c: [] for c in CATEGORIES}
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        category, text = row.get("category"), row.get("prompt")
        if category not in by_category:
            raise ValueError(f"{path}:{i}: category {category!r} is not one of {', '.join(CATEGORIES)}")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}:{i}: no prompt text")
        by_category[category].append(Prompt(category, text))
    rounds = max((len(v) for v in by_category.values()), default=0)
    return [v[i] for i in range(rounds) for v in by_category.values() if i < len(v)]


def requests(kind: Kind, prompts: list[Prompt], max_tokens: int) -> list[dict]:
    """The kind's request messages, one per prompt, in ghz's JSON (field names as in generation.proto)."""
    out = []
    for i, p in enumerate(prompts):
        message = {"messages": [{"role": "user", "content": p.text}], "max_tokens": max_tokens}
        message.update(copy.deepcopy(kind.fields))
        if i % 2:
            message.update(copy.deepcopy(kind.odd))
        if kind.seeded:
            message["seed"] = i
        out.append(message)
    return out


@dataclass(frozen=True)
class Run:
    """One timed ghz run: `requests` requests of `kind`, `concurrency` in flight, in phase `phase` (from 1)."""

    phase: int
    concurrency: int
    kind: str
    requests: int

    def __str__(self) -> str:
        return f"phase {self.phase}, c={self.concurrency}, {self.kind}, n={self.requests}"


def schedule(concurrency: list[int], kinds: list[str], prompts: int, requests: int | None = None) -> list[Run]:
    """Every kind once a phase, the order rotated by one from phase to phase: kinds [a, b, c], concurrency
    [1, 16, 1] -> a b c | b c a | c a b. A run sends `requests` (at least c) or max(prompts, RUN_LENGTH x c)."""
    runs = []
    for phase, c in enumerate(concurrency, 1):
        k = (phase - 1) % len(kinds)
        for kind in kinds[k:] + kinds[:k]:
            runs.append(Run(phase, c, kind, max(requests, c) if requests else max(prompts, RUN_LENGTH * c)))
    return runs


def mean_tokens(tokens: list[int], n: int) -> float:
    """Mean completion tokens of requests 0..n-1 sent round-robin over the prompts whose tokens these are:
    tokens [10, 20, 30], n 4 -> (10 + 20 + 30 + 10) / 4 = 17.5."""
    return sum(tokens[i % len(tokens)] for i in range(n)) / n


@dataclass
class Row:
    """One timed run's figures (ms and requests/s from ghz's report; tok_s from the token count)."""

    phase: int
    concurrency: int
    kind: str
    requests: int  # asked for
    ok: int
    errors: int  # asked for and not answered OK (failed, or the run was stopped: see failure)
    seconds: float  # ghz's total time
    req_s: float  # OK requests / seconds
    p50_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    tok_s: float | None = None
    ratio: float | None = None  # req_s over the baseline kind's in the same phase
    failure: str | None = None  # why ghz gave no report
    error_kinds: dict | None = None  # ghz's errorDistribution
    engine: dict | None = None  # the verifier's engine_time over the run (engine_spent), seconds by phase
    calls: dict | None = None  # and its engine_calls (rounds, plain_calls, switches)


def row_from_report(run: Run, report: dict) -> Row:
    """Figures of ghz's JSON report (`--format json`: durations in ns; latencyDistribution over OK requests)."""
    seconds = report["total"] / 1e9
    ok = int(report.get("statusCodeDistribution", {}).get("OK", 0))
    pct = {d["percentage"]: d["latency"] / 1e6 for d in report.get("latencyDistribution") or [] if d["percentage"]}
    return Row(
        phase=run.phase,
        concurrency=run.concurrency,
        kind=run.kind,
        requests=run.requests,
        ok=ok,
        errors=run.requests - ok,
        seconds=seconds,
        req_s=ok / seconds if seconds > 0 else 0.0,
        p50_ms=pct.get(50),
        p99_ms=pct.get(99),
        mean_ms=report["average"] / 1e6 if ok else None,
        error_kinds=report.get("errorDistribution") or None,
    )


def failed_row(run: Run, why: str) -> Row:
    return Row(
        run.phase, run.concurrency, run.kind, run.requests, 0, run.requests, 0.0, 0.0, None, None, None, failure=why
    )


def engine_spent(before: dict, after: dict) -> dict[str, float]:
    """The growth of GetModelInfo.engine_time (or engine_calls) between two reads; {} when either read failed
    ({})."""
    if not before or not after:
        return {}
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def engine_line(r: Row) -> str | None:
    """A run's row of the engine table: busy seconds, each phase's share of them, ms a speculative round and a
    plain call, the policy's switches between plain and trees. {idle 1, setup 1, verify 2, commit 1}, {rounds 10,
    switches 2} -> busy 4.0 s (idle left out), setup 25%, verify 50%, commit 25%, 3 s / 10 = 300 ms a round, 2."""
    e = r.engine
    if not e:
        return None
    busy = sum(v for k, v in e.items() if k != "idle")
    if busy <= 0:
        return None
    got = r.calls or {}
    rounds, calls, switches = got.get("rounds", 0), got.get("plain_calls", 0), got.get("switches", 0)

    def share(*keys: str) -> str:
        return f"{100 * sum(e.get(k, 0.0) for k in keys) / busy:.0f}%"

    per_round = _f(1e3 * sum(e.get(k, 0.0) for k in ROUND_PHASES) / rounds, 2) if rounds else "-"
    per_call = _f(1e3 * sum(e.get(k, 0.0) for k in PLAIN_PHASES) / calls, 2) if calls else "-"
    return (
        f"| {r.phase} | {r.concurrency} | {r.kind} | {busy:.2f} | {share('setup')} "
        f"| {share('choose', 'trees')} | {share('joining')} | {share('verify')} | {share('commit')} "
        f"| {share(*PLAIN_PHASES)} | {share('retire')} | {rounds:.0f} | {per_round} | {calls:.0f} | {per_call} "
        f"| {switches:.0f} |"
    )


def add_ratios(rows: list[Row]) -> None:
    """Each row's requests/s over its kind's baseline in the same phase; None without that row or with none OK."""
    by = {(r.phase, r.kind): r for r in rows}
    for r in rows:
        base = by.get((r.phase, KINDS[r.kind].baseline))
        r.ratio = r.req_s / base.req_s if base is not None and base.req_s > 0 else None


def add_tokens(rows: list[Row], tokens: dict[str, list[int]]) -> None:
    """tok/s of each row whose kind was counted: req/s x the mean tokens of the requests the run sent."""
    for r in rows:
        if tokens.get(r.kind):
            r.tok_s = r.req_s * mean_tokens(tokens[r.kind], r.requests)


def _f(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def markdown(rows: list[Row], counted: dict[str, dict], meta: dict) -> str:
    lines = [
        f"# Load through the gateway: {meta['title']}",
        "",
        f"Command: `{meta['command']}`  ",
        f"Stack: {meta['stack']}  ",
        f"ghz: {meta['ghz_version']}; every command line in commands.txt",
        "",
        "req/s: OK requests / ghz's total time; p50 / p99: latency of the OK requests; tok/s: req/s x the mean",
        "completion tokens of the requests sent (counted once per kind at c=1); / plain: req/s over plain's in the",
        "same phase (sampled kinds: over plain-0.7's; mixed: over default's).",
        "",
        "| phase | c | kind | requests | ok | errors | req/s | tok/s | p50 ms | p99 ms | / plain |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        lines.append(
            f"| {r.phase} | {r.concurrency} | {r.kind} | {r.requests} | {r.ok} | {r.errors} | {_f(r.req_s, 2)} "
            f"| {_f(r.tok_s)} | {_f(r.p50_ms)} | {_f(r.p99_ms)} | {ratio} |"
        )
    engine = [line for r in rows if (line := engine_line(r))]
    if engine:
        lines += [
            "",
            "Where the verifier's engine thread spent each run (GetModelInfo.engine_time before and after it): busy",
            "seconds (idle left out), each phase's share of them (trees: the policy's choice and reading or",
            "proposing the trees; joining: prompts' and catch-ups' proposes; verify: the device's rounds, less the",
            "commits they hid; plain: plain calls and their commits), then the speculative rounds and ms a round (its",
            "call's choose, trees, joining, verify and commit shared by its rounds), the plain calls and ms a call,",
            "and the policy's switches of a batch between plain decoding and trees (tries included).",
            "",
            "| phase | c | kind | busy s | setup | trees | joining | verify | commit | plain | retire "
            "| rounds | ms a round | plain calls | ms a call | switches |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *engine,
        ]
    failures = [r for r in rows if r.failure or r.error_kinds]
    for r in failures:
        lines.append(f"\nPhase {r.phase}, {r.kind}: {r.failure or r.error_kinds}")
    if counted:
        lines += [
            "",
            "Completion tokens a request (Python client, one request at a time, each prompt once, before the phases):",
            "",
            "| kind | requests | mean tokens | finish reasons | mean acceptance length |",
            "|---|---:|---:|---|---:|",
        ]
        for kind, c in counted.items():
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(c["finish"].items()))
            lines.append(f"| {kind} | {len(c['tokens'])} | {_f(c['mean'], 1)} | {reasons} | {_f(c['acceptance'], 2)} |")
    return "\n".join(lines) + "\n"


@dataclass
class Ghz:
    """ghz against one gateway, by reflection; every command line it ran, in order, in `commands`."""

    binary: str
    gateway: str
    request_timeout: int  # ghz -t: seconds a request
    run_timeout: int  # seconds a run, then ghz is stopped (not ghz's -x: with it ghz ignores -n, v0.120.0)
    connections: int = 1
    commands: list[str] = field(default_factory=list)

    def command(self, data: Path, c: int, n: int) -> list[str]:
        """n requests of the data file's messages (round-robin), c in flight."""
        flags = (
            f"--insecure --call {CALL} --disable-template-data -c {c} -n {n} --connections {min(self.connections, c)}"
        )
        flags += f" -t {self.request_timeout}s --format json"
        return [self.binary, *flags.split(), "-D", str(data), self.gateway]

    def run(self, data: Path, c: int, n: int, label: str) -> tuple[dict | None, str | None]:
        """(ghz's JSON report, None), or (None, why there is none)."""
        cmd = self.command(data, c, n)
        self.commands.append(f"# {label}\n{shlex.join(cmd)}")
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=self.run_timeout)
        except subprocess.TimeoutExpired:
            return None, f"ghz ran past --run-timeout {self.run_timeout} s: stopped, no report"
        if done.returncode != 0:
            return None, f"ghz exited with {done.returncode}: {done.stderr.strip()[-500:]}"
        try:
            return json.loads(done.stdout), None
        except json.JSONDecodeError:
            return None, f"ghz printed no JSON report: {(done.stdout + done.stderr).strip()[-500:]}"


def run_phases(ghz: Ghz, client: Client, files: dict[str, Path], runs: list[Run]) -> tuple[list[Row], list[dict]]:
    """The timed runs in order; after each phase, GetModelInfo whole."""
    rows, phases = [], []
    engine = client.engine()
    for phase in sorted({r.phase for r in runs}):
        in_phase = [r for r in runs if r.phase == phase]
        for run in in_phase:
            report, why = ghz.run(files[run.kind], run.concurrency, run.requests, str(run))
            rows.append(failed_row(run, why) if why else row_from_report(run, report))
            before, engine = engine, client.engine()  # the verifier's snapshot is of its last step: no wait
            rows[-1].engine, rows[-1].calls = (engine_spent(a, b) for a, b in zip(before, engine, strict=True))
            log.info(
                RUN_DONE,
                run,
                rows[-1].ok,
                run.requests,
                rows[-1].req_s,
                _f(rows[-1].p50_ms),
            )
        phases.append(
            {
                "phase": phase,
                "concurrency": in_phase[0].concurrency,
                "order": [r.kind for r in in_phase],
                "model_info": client.model_info(),
            }
        )
    return rows, phases


class Client:
    """The gateway's public API from Python: the token count, GetModelInfo, health."""

    def __init__(self, gateway: str) -> None:
        import grpc  # here, not at the top: the tests of this module need neither gRPC nor the stubs

        from specdec.v1 import generation_pb2, generation_pb2_grpc

        self._pb = generation_pb2
        self._channel = grpc.insecure_channel(gateway)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def complete(self, message: dict, timeout: float) -> dict:
        from google.protobuf import json_format

        request = json_format.ParseDict(message, self._pb.GenerateRequest())
        r = self._stub.Complete(request, timeout=timeout)
        return {
            "tokens": r.usage.completion_tokens,
            "finish": self._pb.FinishReason.Name(r.finish_reason).removeprefix("FINISH_REASON_").lower(),
            "rounds": r.speculation.rounds,
            "acceptance": r.speculation.mean_acceptance_length,
        }

    def model_info(self) -> dict:
        from google.protobuf import json_format

        info = self._stub.GetModelInfo(self._pb.ModelInfoRequest(), timeout=30)
        return json_format.MessageToDict(info, preserving_proto_field_name=True)

    def engine(self) -> tuple[dict[str, float], dict[str, int]]:
        """GetModelInfo's engine_time and engine_calls; ({}, {}) when it fails."""
        import grpc

        try:
            info = self._stub.GetModelInfo(self._pb.ModelInfoRequest(), timeout=30)
        except grpc.RpcError as e:  # a verifier down after a run: that run's engine table row is left out
            log.warning("GetModelInfo for the engine's time: %s", e.code().name)
            return {}, {}
        return dict(info.engine_time), dict(info.engine_calls)

    def close(self) -> None:
        self._channel.close()


def serving(gateway: str) -> bool:
    """The gateway's grpc.health.v1 says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(gateway) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.RpcError:
            return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


def count_tokens(client: Client, data: dict[str, list[dict]], timeout: float) -> dict[str, dict]:
    """Each kind's requests once, one at a time: completion tokens, finish reasons, mean acceptance length."""
    counted = {}
    for kind, messages in data.items():
        log.info("counting the completion tokens of %s: %d requests, one at a time", kind, len(messages))
        start = time.monotonic()
        try:
            outs = [client.complete(m, timeout) for m in messages]
        except Exception as e:  # noqa: BLE001 - a kind that fails here runs under load all the same, without tok/s
            log.warning("tokens %s: not counted (%s)", kind, e)
            continue
        accepted = [o["acceptance"] for o in outs if o["rounds"] > 0]
        counted[kind] = {
            "tokens": [o["tokens"] for o in outs],
            "mean": sum(o["tokens"] for o in outs) / len(outs),
            "finish": dict(Counter(o["finish"] for o in outs)),
            "acceptance": sum(accepted) / len(accepted) if accepted else None,
            "seconds": time.monotonic() - start,
        }
        log.info("tokens %s: %.1f a request, acceptance %s", kind, counted[kind]["mean"], counted[kind]["acceptance"])
    return counted


class StackProcess:
    """`python -m services.stack` of a checkout as a child process: the gateway on a free loopback port
    (GATEWAY_ADDR), cwd and PYTHONPATH the checkout, output in `log_path`; stopped with SIGTERM (it drains)."""

    def __init__(self, checkout: Path, python: str, args: list[str], log_path: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.gateway = f"127.0.0.1:{s.getsockname()[1]}"
        self.command = [python, "-m", "services.stack", *args]
        self.checkout, self.log_path = checkout, log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> str:
        env = {**os.environ, "GATEWAY_ADDR": self.gateway}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.checkout), os.environ.get("PYTHONPATH")) if p)
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                self.command,
                cwd=self.checkout,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=bind_to_parent,
            )
        log.info(
            "started %s in %s (gateway %s), waiting for SERVING", shlex.join(self.command), self.checkout, self.gateway
        )
        deadline = time.monotonic() + timeout
        while not serving(self.gateway):
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the stack exited with {self.proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the gateway did not serve within {timeout:.0f} s (log: {self.log_path})")
            time.sleep(1.0)
        return self.gateway

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            log.warning("the stack did not exit within 60 s of SIGTERM: killing it")
            self.proc.kill()
            self.proc.wait()


def write_data(out: Path, data: dict[str, list[dict]]) -> dict[str, Path]:
    """Each kind's requests as ghz's data file (a JSON array, sent round-robin): {kind: out/data/KIND.json}."""
    (out / "data").mkdir(parents=True, exist_ok=True)
    files = {kind: out / "data" / f"{kind}.json" for kind in data}
    for kind, messages in data.items():
        files[kind].write_text(json.dumps(messages, indent=1, ensure_ascii=False) + "\n")
    return files


def find_ghz(given: str | None) -> str:
    """--ghz, else $GHZ, else ghz on PATH, else the workplace's copy (shared/tools/ghz beside or in the checkout)."""
    shared = [str(d / "shared" / "tools" / "ghz") for d in (ROOT.parent, ROOT)]
    for candidate in [given] if given else [os.environ.get("GHZ"), "ghz", *shared]:
        if candidate and (shutil.which(candidate) or Path(candidate).is_file()):
            return shutil.which(candidate) or candidate
    raise SystemExit(f"bench.load: no ghz binary (tried {given or ', '.join(['$GHZ', 'ghz on PATH', *shared])})")


def ghz_version(ghz: str) -> str:
    done = subprocess.run([ghz, "--version"], capture_output=True, text=True)  # v0.120.0 prints it on stderr
    return (done.stdout + done.stderr).strip()


def git_commit(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def stack_options(p: argparse.ArgumentParser) -> None:
    """The options of a bench that starts the stack of a checkout, or takes a gateway already serving."""
    p.add_argument("--gateway", default=None, help="HOST:PORT of a gateway already serving (no stack started)")
    p.add_argument("--checkout", type=Path, default=ROOT, help="start the stack of this checkout (default: this one)")
    p.add_argument("--python", default=sys.executable, help="the interpreter that runs the stack")
    p.add_argument("--device", default="cuda", help="the stack's --device")
    p.add_argument(
        "--stack-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more flag for services.stack, repeatable (--stack-arg=--colocate=off)",
    )
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for the stack to serve")


def open_gateway(
    a: argparse.Namespace, out: Path, stack: contextlib.ExitStack, extra: tuple[str, ...] = ()
) -> tuple[str, str]:
    """a.gateway (stack_options), or the stack of a.checkout started with --device, `extra` and the --stack-arg
    flags, its output in out/stack.log, stopped when `stack` closes: (the gateway, a line saying which stack)."""
    if a.gateway:
        return a.gateway, f"a running gateway at {a.gateway}"
    args = ["--device", a.device, *extra, *a.stack_arg]
    proc = StackProcess(a.checkout.resolve(), a.python, args, out / "stack.log")
    stack.callback(proc.stop)
    gateway = proc.start(a.start_timeout)
    commit = git_commit(proc.checkout)
    return gateway, f"`python {shlex.join(proc.command[1:])}` in {proc.checkout} (commit {commit}), log in stack.log"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.load", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="bench-results/load")
    p.add_argument("--ghz", default=None, help="the ghz binary (default: $GHZ, ghz on PATH, ../shared/tools/ghz)")
    stack_options(p)
    p.add_argument("--concurrency", default="1,16,64,1", help="the phases' concurrency, in order")
    p.add_argument("--kinds", default=",".join(GREEDY), help=f"of {', '.join(KINDS)}")
    p.add_argument("--sampled", action="store_true", help="add " + " and ".join(SAMPLED))
    p.add_argument("--requests", type=int, default=None, help=f"requests a run (default max(prompts, {RUN_LENGTH} c))")
    p.add_argument("--prompts-file", type=Path, default=PROMPTS)
    p.add_argument("--prompts", type=int, default=None, help="the first N prompts only (interleaved by category)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--connections", type=int, default=1, help="ghz --connections (at most c)")
    p.add_argument("--request-timeout", type=int, default=120, help="ghz -t, seconds a request")
    p.add_argument("--run-timeout", type=int, default=300, help="seconds a ghz run may take before it is stopped")
    p.add_argument("--warm-up", type=int, default=8, help="requests of each kind's untimed run first (0: none)")
    p.add_argument(
        "--no-token-count",
        dest="token_count",
        action="store_false",
        help="no Python pass counting each kind's completion tokens (no tok/s)",
    )
    a = p.parse_args(argv)
    a.concurrency = [int(c) for c in a.concurrency.split(",") if c.strip()]
    a.kinds = [k.strip() for k in a.kinds.split(",") if k.strip()] + (list(SAMPLED) if a.sampled else [])
    a.kinds = list(dict.fromkeys(a.kinds))
    if unknown := [k for k in a.kinds if k not in KINDS]:
        p.error(f"unknown kinds {unknown}; known: {', '.join(KINDS)}")
    if not a.concurrency or min(a.concurrency) < 1 or (a.requests is not None and a.requests < 1):
        p.error("--concurrency and --requests take positive integers")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(a.out)
    prompts = read_prompts(a.prompts_file)[: a.prompts]
    data = {k: requests(KINDS[k], prompts, a.max_tokens) for k in a.kinds}
    files = write_data(out, data)
    runs = schedule(a.concurrency, a.kinds, len(prompts), a.requests)
    binary = find_ghz(a.ghz)
    with contextlib.ExitStack() as stack:
        gateway, stack_line = open_gateway(a, out, stack)
        ghz = Ghz(binary, gateway, a.request_timeout, a.run_timeout, a.connections)
        client = Client(gateway)
        stack.callback(client.close)
        info = client.model_info()
        for kind in a.kinds if a.warm_up > 0 else []:
            log.info("warm-up, untimed: %s, %d requests", kind, a.warm_up)
            c = min(WARM_UP_CONCURRENCY, a.warm_up)
            report, why = ghz.run(files[kind], c, a.warm_up, f"warm-up, untimed: {kind}, c={c}, n={a.warm_up}")
            if why or report.get("statusCodeDistribution", {}).get("OK", 0) < a.warm_up:
                log.warning("warm-up %s: %s", kind, why or report.get("errorDistribution"))
        counted = count_tokens(client, data, a.request_timeout) if a.token_count else {}
        rows, phases = run_phases(ghz, client, files, runs)
    add_ratios(rows)
    add_tokens(rows, {k: c["tokens"] for k, c in counted.items()})
    meta = {
        "title": f"{info.get('device', '?')}, {info.get('dtype', '?')}, {len(prompts)} held-out prompts, "
        f"max_tokens {a.max_tokens}, EOS stops",
        "command": "python -m bench.load " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "stack": stack_line,
        "gateway": gateway,
        "ghz_version": ghz_version(ghz.binary),
        "prompts_file": str(a.prompts_file),
        "model_info": info,
    }
    md = markdown(rows, counted, meta)
    (out / "load.md").write_text(md)
    (out / "commands.txt").write_text("\n".join(ghz.commands) + "\n")
    result = {"meta": meta, "tokens": counted, "rows": [asdict(r) for r in rows], "phases": phases}
    (out / "load.json").write_text(json.dumps(result, indent=1) + "\n")
    sys.stdout.write(md)
    return 0 if all(r.failure is None for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
