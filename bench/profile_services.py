"""Where a round's host time goes: the three services under a closed-loop load, each profiled by py-spy
(sampling, no instrumentation), with the gateway's round breakdown from its metrics.

    python -m bench.profile_services --out DIR [--device cuda] [--concurrency 1] [--seconds 6]
                                     [--rounds-per-call K] [--colocate [auto|on|off]] [--block-on-device]
    python -m bench.profile_services --report DIR     # the tables again from DIR's spy-*.txt

The "where the time goes" table counts, per service, the samples whose stack holds each of a few frames (the
main thread's event loop, the engine calls inline on it, the verify and the proposal), so a frame's share of
the seconds recorded is its samples / (seconds x 250).

Needs the `py-spy` binary (PyPI package py-spy) on PATH or next to the interpreter. Writes
DIR/spy-{gateway,draft,verifier}.txt (py-spy's raw format: one line per stack, samples at the end) and
DIR/profile.md with the round breakdown and the ten hottest frames of each service, excluding idle waits.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.engine_bench import QUESTIONS
from bench.services_bench import closed_loop, free_port, per_round, scrape_rounds
from services.stack import Stack, colocate_argument, colocated

log = logging.getLogger("bench.profile_services")
IDLE = ("select", "epoll", "_worker", "wait", "poll", "sleep", "_bootstrap")
RATE = 250  # py-spy samples per second
# frames as py-spy names them ("function (file:line)"), matched by function and file: the event loop's
# turn (busy, not idle), the engine calls (steps inline on it, or calls on the engine thread), the chain's
# call, and within them the verify, the draft's proposal, a prefill, and the draft's calls from the gateway
FRAMES = (
    "_run (asyncio/events.py",
    "_stepped (services/engine_runner.py",
    "_locked (services/engine_runner.py",
    "verify (services/verifier/chain.py",
    "verify_steps (common/engine/verifier.py",
    "propose_steps (common/engine/draft.py",
    "_prefill (services/verifier/server.py",
    "ProposeStream (services/draft/server.py",
)
MAIN = "_run_module_as_main"  # the first frame of the main thread's stacks (the event loop's thread)


def hottest(raw: Path, n: int = 10) -> list[tuple[int, str]]:
    """The n leaf frames with most samples in a py-spy raw file, idle waits left out."""
    counts: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        leaf = stack.split(";")[-1]
        if not any(word in leaf for word in IDLE):
            counts[leaf] += int(samples)
    return [(c, frame) for frame, c in counts.most_common(n)]


def inclusive(raw: Path, frames: tuple[str, ...] = FRAMES) -> dict[str, tuple[int, int]]:
    """Samples whose stack holds each frame (FRAMES: function and file, any line), on the main thread and on
    the others: {frame: (main, other)}; idle samples are absent from the raw file (py-spy records active
    threads only), and "" counts every sample. Example: a stack "a (x.py:1);b (y.py:2)" of 3 samples on the
    main thread adds 3 to "" and to "b (y.py" (main)."""
    counts = {f: [0, 0] for f in ("", *frames)}
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        held = stack.split(";")
        col = 0 if held[0].startswith(MAIN) else 1
        for f in counts:
            if not f or any(frame.startswith(f) for frame in held):
                counts[f][col] += int(samples)
    return {f: (m, o) for f, (m, o) in counts.items()}


def report(out: Path, seconds: float) -> list[str]:
    """Markdown tables of each spy-*.txt in `out`: where the time goes (inclusive samples of FRAMES, and their
    share of seconds x RATE), then the hottest leaf frames."""
    lines = []
    for raw in sorted(out.glob("spy-*.txt")):
        name = raw.stem.removeprefix("spy-")
        lines += [f"## {name}", "", f"Where the time goes ({seconds:g} s at {RATE} Hz):", ""]
        lines += ["| frame | main thread samples | share | other threads |", "|---|---:|---:|---:|"]
        lines += [
            f"| `{f or 'any (busy)'}` | {m} | {m / (seconds * RATE):.0%} | {o} |"
            for f, (m, o) in inclusive(raw).items()
            if m or o
        ]
        lines += ["", "| samples | frame |", "|---:|---|"]
        lines += [f"| {c} | `{frame[:140]}` |" for c, frame in hottest(raw)] + [""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="where the profiles go (required unless --report)")
    ap.add_argument("--report", metavar="DIR", help="only print the tables of DIR's spy-*.txt (a finished run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--policy", default="fixed", help="the gateway's --policy (fixed: every round drafts the default tree)"
    )
    ap.add_argument("--rounds-per-call", type=int, default=0, help="the gateway's --rounds-per-call (0: its default)")
    colocate_argument(ap)  # the stack's default: the draft in the verifier's process on a GPU
    ap.add_argument(
        "--block-on-device",
        action="store_true",
        help="the engine services' --block-on-device: a wait for the device shows as the engine call's own frame "
        "(synchronize), not as the event loop's turns polling it",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.report:
        log.info("\n%s", "\n".join(report(Path(args.report), args.seconds)))
        return
    if not args.out:
        ap.error("--out is required")
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mport = free_port()
    engines = ["--block-on-device"] if args.block_on_device else []  # the verifier's and the draft's flags
    # requests to last the recording at any concurrency: the load stops starting new ones when it ends (a
    # fixed 64 ran out after one wave at c=64, leaving most of session 11's c=64 profile idle)
    prompts = [QUESTIONS[i % len(QUESTIONS)] for i in range(64 * max(args.concurrency, 1) * args.seconds)]
    here = colocated(args.colocate, args.device)
    with Stack(
        common_args=["--device", args.device, "--max-context", "1024"],
        gateway_args=["--metrics-port", str(mport), "--policy", args.policy]
        + (["--rounds-per-call", str(args.rounds_per_call)] if args.rounds_per_call else []),
        colocate=here,
        verifier_args=engines,
        draft_args=engines,
    ) as stack:
        asyncio.run(closed_loop(stack.gateway, prompts[:2], 16, 1))  # warm-up
        before = scrape_rounds(mport)
        spies = [
            subprocess.Popen(
                [
                    spy,
                    "record",
                    "-r",
                    "250",
                    "-d",
                    str(args.seconds),
                    "-f",
                    "raw",
                    "--nonblocking",
                    "-o",
                    str(out / f"spy-{name}.txt"),
                    "-p",
                    str(proc.pid),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for name, proc in stack.procs.items()
        ]
        until = time.perf_counter() + args.seconds
        load = threading.Thread(
            target=lambda: asyncio.run(
                closed_loop(stack.gateway, prompts, args.max_new_tokens, args.concurrency, until=until)
            )
        )
        load.start()
        for s in spies:
            _, err = s.communicate(timeout=args.seconds + 60)
            if s.returncode:
                log.warning("py-spy failed: %s", err.decode()[-300:])
        load.join()
        phases = per_round(before, scrape_rounds(mport))
    lines = [
        f"# Round profile ({args.device}, concurrency {args.concurrency}, rounds per call "
        f"{args.rounds_per_call or 'default'}{', draft in the verifier' if here else ''})",
        "",
        "ms per round: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if not k.startswith("stage:")),
        "ms per request stage: " + ", ".join(f"{k[6:]} {v:.2f}" for k, v in phases.items() if k.startswith("stage:")),
        "",
    ]
    text = "\n".join(lines + report(out, args.seconds))
    (out / "profile.md").write_text(text + "\n")
    log.info("\n%s", text)


if __name__ == "__main__":
    main()
