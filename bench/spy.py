"""Where the verifier's engine thread spends a loaded run: py-spy samples of it beside ghz, per kind of request.

    python -m bench.spy --out DIR [--kinds 3x8,plain] [--concurrency 64] [--device cuda] [--seconds 8]
    python -m bench.spy --gateway 127.0.0.1:50051 --pid VERIFIER_PID --out DIR    # a stack already serving

Starts `python -m services.stack --device DEVICE --state-file DIR/stack-state.json` (the verifier's pid from the
state file) unless --gateway and --pid are given. For each kind of bench.load (its data files: the held-out mixed
prompts, max_tokens 128, EOS stops): an untimed ghz run of 2 x c requests, then ghz with c in flight for
--requests (default 60 x c) while `py-spy record --pid PID --duration SECONDS --rate RATE --format raw` samples the
verifier from --delay seconds into the run. GetModelInfo's engine_time before and after gives the run's phases as
bench.load's engine table does; GetModelInfo after the runs (the policy's estimates per batch bucket) goes to
spy.json. py-spy (PyPI `py-spy`, a binary: --py-spy PATH, $PY_SPY or py-spy on the PATH)
needs ptrace permission over the verifier (root, or the stack started by this bench).

The engine thread's samples are the stacks through `EngineCore.step`; summarize() gives each place's share of them
(a place counts a sample once, however deep: PLACES) and the frames that were on top the most (self). A PyTorch
reference kernel on the engine thread of a GPU stack is a kernel dispatcher's quiet fall back: it gets a place of
its own. Writes DIR/spy.md (also printed), DIR/spy.json, DIR/KIND.txt (py-spy's raw stacks), DIR/commands.txt.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.fault_load import read_state
from bench.load import (
    KINDS,
    PROMPTS,
    ROOT,
    Client,
    Ghz,
    Run,
    StackProcess,
    _f,
    engine_spent,
    failed_row,
    find_ghz,
    read_prompts,
    requests,
    row_from_report,
    write_data,
)

log = logging.getLogger("bench.spy")
SPY_RUN_LENGTH = 60  # requests a run per request in flight (at least the prompts): a run outlasts py-spy's seconds
ENGINE = "step (common/engine/core.py)"  # a sample of the engine thread passes through here
# (label, the frame's function and file as py-spy names them): a sample counts for a place when its stack holds it
PLACES = (
    ("admission: prefill", "_prefill (common/engine/core.py)"),
    ("trees: read and proposes", "_trees (common/engine/core_drafts.py)"),
    ("  joiners' and catch-ups' proposes", "_propose (common/engine/core_drafts.py)"),
    ("verify call", "verify_rounds_steps (common/engine/verifier.py)"),
    ("  drafting launched behind a verify", "launch_after (common/engine/draft.py)"),
    ("  chained block", "_chained_block (common/engine/verifier.py)"),
    ("  commit of a round", "commit (common/engine/core.py)"),
    ("plain call", "decode_many_steps (common/engine/verifier.py)"),
    ("waiting for the device", "synchronize (torch/cuda/streams.py)"),
    ("release", "_retire (common/engine/core.py)"),
    ("PyTorch reference kernels", "(common/kernels/reference.py)"),
)
FRAME = re.compile(r"^(.*) \((.*?):\d+\)$")  # "func (path/file.py:LINE)" -> func, path


def frame_name(frame: str) -> str:
    """A py-spy raw frame without its line number: "step (common/engine/core.py:185)" -> "step (common/engine/core.py)";
    a path is cut to what follows a site-packages folder."""
    m = FRAME.match(frame)
    if m is None:
        return frame
    path = m.group(2).split("site-packages/")[-1]
    return f"{m.group(1)} ({path})"


def parse_raw(text: str) -> list[tuple[list[str], int]]:
    """py-spy's raw format (one stack a line, root first, frames separated by ';', then a space and the count) ->
    [(frame names, count)]. "a (x.py:1);b (y.py:2) 3" -> [(["a (x.py)", "b (y.py)"], 3)]; a sample that caught
    no Python frame (" 1": a thread in native code before its first frame) is left out."""
    stacks = []
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not line.strip() or (not stack.strip() and count.isdigit()):
            continue
        if not count.isdigit():
            raise ValueError(f"not a py-spy raw line: {line[:120]!r}")
        stacks.append(([frame_name(f) for f in stack.split(";")], int(count)))
    return stacks


def summarize(stacks: list[tuple[list[str], int]], top: int = 12) -> dict:
    """The engine thread's samples (stacks through ENGINE): their count, each PLACES entry's share of them (a
    place matches a frame equal to its name, or ending with it when it starts with '('), and the `top` frames most
    often on top of the stack with their shares."""
    engine = [(frames, n) for frames, n in stacks if ENGINE in frames]
    total = sum(n for _, n in engine)
    shares, self_time = {}, collections.Counter()
    for label, place in PLACES:
        hit = sum(
            n for frames, n in engine if any(f == place or (place[0] == "(" and f.endswith(place)) for f in frames)
        )
        shares[label] = hit / total if total else 0.0
    for frames, n in engine:
        self_time[frames[-1]] += n
    return {
        "samples": total,
        "shares": shares,
        "self": [(f, n / total) for f, n in self_time.most_common(top)] if total else [],
    }


def markdown(results: dict[str, dict], meta: dict) -> str:
    kinds = list(results)
    lines = [
        f"# Where the engine thread went: {meta['title']}",
        "",
        f"Command: `{meta['command']}`; stack: {meta['stack']}; py-spy {meta['seconds']} s at {meta['rate']} Hz a run.",
        "",
        "| place | " + " | ".join(kinds) + " |",
        "|---|" + "---:|" * len(kinds),
        "| req/s (OK requests) | " + " | ".join(_f(results[k].get("req_s"), 1) for k in kinds) + " |",
        "| errors | " + " | ".join(str(results[k].get("errors", "-")) for k in kinds) + " |",
        "| engine thread samples | " + " | ".join(str(results[k]["samples"]) for k in kinds) + " |",
    ]
    for label, _ in PLACES:
        lines.append(f"| {label} | " + " | ".join(f"{100 * results[k]['shares'][label]:.1f}%" for k in kinds) + " |")
    lines += ["", "Frames most often on top of the engine thread's stack (self):", ""]
    for k in kinds:
        lines.append(f"- {k}: " + "; ".join(f"{f} {100 * s:.1f}%" for f, s in results[k]["self"][:8]))
    lines += ["", "The run's engine phases (GetModelInfo.engine_time, seconds):", ""]
    for k in kinds:
        spent = ", ".join(f"{p} {v:.2f}" for p, v in sorted(results[k].get("engine", {}).items()))
        lines.append(f"- {k}: {spent or 'not read'}")
    return "\n".join(lines) + "\n"


def find_py_spy(given: str | None) -> str:
    for c in (given, os.environ.get("PY_SPY"), shutil.which("py-spy")):
        if c and Path(c).exists():
            return c
    raise FileNotFoundError("py-spy not found: --py-spy PATH, $PY_SPY, or `pip install py-spy` (a binary wheel)")


def _record(done: list, py_spy: str, pid: int, a: argparse.Namespace, out: Path) -> None:
    """py-spy over the verifier from a.delay seconds on, for a.seconds (a thread beside ghz); its process in done."""
    time.sleep(a.delay)
    cmd = [py_spy, "record", "--pid", str(pid), "--duration", str(a.seconds), "--rate", str(a.rate), "--format", "raw"]
    done.append(subprocess.run([*cmd, "--output", str(out)], capture_output=True, text=True, timeout=a.seconds + 60))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.spy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="bench-results/spy")
    p.add_argument("--kinds", default="3x8,plain", help=f"of {', '.join(KINDS)}")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument(
        "--requests", type=int, default=None, help=f"requests a run (default max(prompts, {SPY_RUN_LENGTH} c))"
    )
    p.add_argument("--seconds", type=int, default=8, help="py-spy's duration a run")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples a second")
    p.add_argument("--delay", type=float, default=1.5, help="seconds into a run before py-spy starts")
    p.add_argument("--device", default="cuda", help="the stack's --device")
    p.add_argument("--gateway", default=None, help="HOST:PORT of a gateway already serving (needs --pid)")
    p.add_argument("--pid", type=int, default=None, help="the verifier's pid, with --gateway")
    p.add_argument("--ghz", default=None, help="the ghz binary (default: $GHZ, ghz on PATH, ../shared/tools/ghz)")
    p.add_argument("--py-spy", dest="py_spy", default=None, help="the py-spy binary (default: $PY_SPY, PATH)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    a.kinds = a.kinds.split(",")
    if unknown := [k for k in a.kinds if k not in KINDS]:
        p.error(f"unknown kinds {unknown}: of {', '.join(KINDS)}")
    if (a.gateway is None) != (a.pid is None):
        p.error("--gateway and --pid go together")
    if min(a.concurrency, a.seconds, a.rate, 1 if a.requests is None else a.requests) < 1 or a.delay < 0:
        p.error("--concurrency, --requests, --seconds and --rate take positive integers, --delay >= 0")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    py_spy, binary = find_py_spy(a.py_spy), find_ghz(a.ghz)
    prompts = read_prompts(PROMPTS)
    files = write_data(out, {k: requests(KINDS[k], prompts, 128) for k in a.kinds})
    n = a.requests or max(len(prompts), SPY_RUN_LENGTH * a.concurrency)
    results: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        if a.gateway:
            gateway, pid, stack_line = a.gateway, a.pid, f"a running gateway at {a.gateway}, verifier pid {a.pid}"
        else:
            state = (out / "stack-state.json").resolve()
            args = ["--device", a.device, "--state-file", str(state)]
            proc = StackProcess(ROOT, sys.executable, args, out / "stack.log")
            stack.callback(proc.stop)
            gateway = proc.start(a.start_timeout)
            pid = int(read_state(state, 60)["verifier"]["pid"])
            stack_line = f"`python {shlex.join(proc.command[1:])}`"
        ghz = Ghz(binary, gateway, 120, 600)
        client = Client(gateway)
        stack.callback(client.close)
        info = client.model_info()
        for kind in a.kinds:
            ghz.run(files[kind], a.concurrency, 2 * a.concurrency, f"warm-up, untimed: {kind}")
            before, _ = client.engine()
            raw = out / f"{kind}.txt"
            spy: list[subprocess.CompletedProcess] = []
            th = threading.Thread(target=_record, args=(spy, py_spy, pid, a, raw))
            th.start()
            report, why = ghz.run(files[kind], a.concurrency, n, f"{kind}, c={a.concurrency}, n={n}")
            th.join()
            after, _ = client.engine()
            if not raw.exists():
                log.warning("py-spy wrote nothing for %s: %s", kind, spy[0].stderr.strip()[-300:] if spy else "?")
                continue
            results[kind] = summarize(parse_raw(raw.read_text()))
            run = Run(1, a.concurrency, kind, n)
            row = failed_row(run, why) if report is None else row_from_report(run, report)
            results[kind]["req_s"], results[kind]["errors"] = row.req_s, row.errors  # OK requests a second
            results[kind]["engine"] = engine_spent(before, after)
            if why:
                log.warning("ghz %s: %s", kind, why)
        after_runs = client.model_info()  # the policy's estimates per batch bucket after the runs, for spy.json
    meta = {
        "title": f"{info.get('device', '?')}, {info.get('dtype', '?')}, c={a.concurrency}, {n} requests a run",
        "command": "python -m bench.spy " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "stack": stack_line,
        "seconds": a.seconds,
        "rate": a.rate,
    }
    md = markdown(results, meta)
    (out / "spy.md").write_text(md)
    (out / "spy.json").write_text(
        json.dumps({"meta": meta, "kinds": results, "model_info": after_runs}, indent=1) + "\n"
    )
    (out / "commands.txt").write_text("\n".join(ghz.commands) + "\n")
    sys.stdout.write(md)
    return 0 if len(results) == len(a.kinds) and not any(r["errors"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
