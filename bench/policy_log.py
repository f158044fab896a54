"""What the policy saw in each run of a bench.load: the verifier's DEBUG lines cut by the runs' times.

    python -m bench.load ... --stack-arg=--engine-arg=--log-level=DEBUG --stack-arg=--log-dir=DIR 2> BENCH.log
    python -m bench.policy_log --verifier-log DIR/verifier.log --bench-log BENCH.log [--min-batch 33] [--switches]

A run ends at bench.load's line "phase P, c=C, KIND, n=N: K/N OK, R req/s, ..." and began N / R seconds before
(ghz's total time: req/s is OK requests over it; exact when every request is OK). For each run, the engine core's
`cost sample:` lines (common/engine/core.py: EngineCore._observe) at batches of at least --min-batch sequences, by
shape and whether the batch sampled: their count, median and round-weighted mean (ms a round, or a plain call), and
with --switches its `choice:` lines (each switch between plain and trees, with the rates the policy compared),
each with its seconds into the run and the median of each shape's last --window samples before it (what the
policy's cost window held, PolicyConfig.cost_window; samples of the run so far). Prints markdown; writes nothing.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import logging
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("bench.policy_log")
STAMP = "%Y-%m-%d %H:%M:%S,%f"
RUN = re.compile(r"^(\S+ \S+) bench\.load phase (\d+), c=(\d+), (\S+), n=(\d+): (\d+)/\d+ OK, ([\d.]+) req/s")
SAMPLE = re.compile(r"cost sample: (\S+), (\d+) sequences( \(sampling\))?, (\d+) rounds of ([\d.]+) ms, (\d+) steps")
CHOICE = re.compile(r"choice: \S+ at (\d+) sequences")


@dataclass(frozen=True)
class Run:
    phase: int
    concurrency: int
    kind: str
    start: datetime.datetime
    end: datetime.datetime


def runs(bench_log: str) -> list[Run]:
    """The timed runs of a bench.load log. "2026-11-29 13:25:11,241 bench.load phase 1, c=64, plain, n=2048:
    2048/2048 OK, 256.00 req/s, ..." -> Run(1, 64, 'plain', 13:25:03.241, 13:25:11.241) (2048 / 256 = 8 s)."""
    out = []
    for line in bench_log.splitlines():
        m = RUN.match(line)
        if m and float(m.group(7)) > 0:
            end = datetime.datetime.strptime(m.group(1), STAMP)
            seconds = int(m.group(6)) / float(m.group(7))
            start = end - datetime.timedelta(seconds=seconds)
            out.append(Run(int(m.group(2)), int(m.group(3)), m.group(4), start, end))
    return out


def stamped(verifier_log: str) -> list[tuple[datetime.datetime, str]]:
    """The log's timestamped lines (a traceback's continuation lines have none)."""
    out = []
    for line in verifier_log.splitlines():
        try:
            out.append((datetime.datetime.strptime(line[:23], STAMP), line))
        except ValueError:
            continue
    return out


def report(
    run: Run, lines: list[tuple[datetime.datetime, str]], min_batch: int, switches: bool, window: int = 8
) -> list[str]:
    """A run's markdown: its cost samples by (shape, sampling) and, with switches, its choice lines, each followed
    by the median of each shape's last `window` samples (shape 3x8, sampling, ms) before it."""
    samples: dict[tuple[str, bool], list[tuple[float, int]]] = collections.defaultdict(list)  # ms, rounds
    chosen = []
    for t, line in lines:
        if not run.start <= t <= run.end:
            continue
        if (m := SAMPLE.search(line)) and int(m.group(2)) >= min_batch:
            samples[m.group(1), bool(m.group(3))].append((float(m.group(5)), int(m.group(4))))
        elif switches and (m := CHOICE.search(line)) and int(m.group(1)) >= min_batch:
            held = "; ".join(
                f"{shape}{' sampling' if sampled else ''} {statistics.median(ms for ms, _ in got[-window:]):.3f}"
                for (shape, sampled), got in sorted(samples.items())
            )
            at = (t - run.start).total_seconds()
            chosen.append(
                f"- +{at:.2f} s: {line[line.index('choice:') :]} (last {window} samples' medians, ms: {held})"
            )
    out = [f"### phase {run.phase}, c={run.concurrency}, {run.kind}", ""]
    if samples:
        out += ["| shape | sampling | samples | median ms | round-weighted ms |", "|---|---|---:|---:|---:|"]
        for (shape, sampled), got in sorted(samples.items()):
            weighted = sum(ms * n for ms, n in got) / sum(n for _, n in got)
            median = statistics.median(ms for ms, _ in got)
            out.append(f"| {shape} | {'yes' if sampled else 'no'} | {len(got)} | {median:.3f} | {weighted:.3f} |")
    else:
        out.append(f"no cost samples at {min_batch} sequences or more")
    return [*out, *([""] + chosen if chosen else []), ""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.policy_log", description=__doc__)
    p.add_argument("--verifier-log", type=Path, required=True)
    p.add_argument("--bench-log", type=Path, required=True)
    p.add_argument("--min-batch", type=int, default=33, help="batches below it left out (33: bucket 64's)")
    p.add_argument("--switches", action="store_true", help="each run's choice lines too")
    p.add_argument("--window", type=int, default=8, help="samples behind each choice line's medians (cost_window)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    lines = stamped(a.verifier_log.read_text(errors="replace"))
    found = runs(a.bench_log.read_text(errors="replace"))
    if not found:
        p.error(f"no bench.load run lines in {a.bench_log}")
    log.info("%s", "\n".join(x for run in found for x in report(run, lines, a.min_batch, a.switches, a.window)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
