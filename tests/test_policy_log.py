"""bench.policy_log on a hand-written pair of logs: runs found from bench.load's lines, the verifier's DEBUG lines
cut by them, and the figures worked out by hand."""

from __future__ import annotations

from bench.load import RUN_DONE
from bench.load import Run as LoadRun
from bench.policy_log import main, report, runs, stamped

BENCH = """\
2026-11-29 13:25:00,000 bench.load warm-up, untimed: default, 4 requests
2026-11-29 13:25:10,000 bench.load phase 1, c=64, default, n=100: 100/100 OK, 20.00 req/s, p50 200 ms
2026-11-29 13:25:20,000 bench.load phase 1, c=64, plain, n=100: 100/100 OK, 10.00 req/s, p50 400 ms
"""
# the default's run: 13:25:05-13:25:10 (100 / 20 = 5 s); the plain run: 13:25:10-13:25:20
VERIFIER = """\
2026-11-29 13:25:04,000 common.engine.core DEBUG cost sample: 3x8, 64 sequences, 4 rounds of 9.000 ms, 1 steps
2026-11-29 13:25:06,000 common.engine.core DEBUG cost sample: 3x8, 64 sequences, 4 rounds of 2.000 ms, 1 steps
2026-11-29 13:25:06,500 common.engine.core DEBUG cost sample: 3x8, 60 sequences, 2 rounds of 5.000 ms, 1 steps
2026-11-29 13:25:07,000 common.engine.core DEBUG cost sample: 3x8, 20 sequences, 4 rounds of 1.000 ms, 1 steps
2026-11-29 13:25:07,500 core DEBUG cost sample: plain, 64 sequences (sampling), 1 rounds of 10.000 ms, 8 steps
2026-11-29 13:25:08,000 common.engine.core DEBUG choice: plain at 64 sequences; tok/s plain 50,000, 3x8 49,000
Traceback line without a stamp
2026-11-29 13:25:12,000 common.engine.core DEBUG cost sample: plain, 64 sequences, 1 rounds of 9.000 ms, 8 steps
"""


def test_runs_and_their_samples_by_hand(tmp_path, caplog):
    """The default's run holds three samples at 33 or more sequences (the 9 ms one came before it, the 20-sequence
    one is below --min-batch): 3x8 at 2 ms x 4 rounds and 5 ms x 2: median 3.5, round-weighted (8 + 10) / 6 = 3.0;
    plain sampling 10 ms. Its switch 3.0 s into the run, with the last samples' medians (window 1: 3x8 5 ms). The
    plain run holds the 9 ms plain sample."""
    found = runs(BENCH)
    assert [(r.phase, r.kind, r.start.second, r.end.second) for r in found] == [
        (1, "default", 5, 10),
        (1, "plain", 10, 20),
    ]
    lines = stamped(VERIFIER)
    assert len(lines) == 7
    text = "\n".join(report(found[0], lines, 33, switches=True, window=1))
    assert "| 3x8 | no | 2 | 3.500 | 3.000 |" in text
    assert "| plain | yes | 1 | 10.000 | 10.000 |" in text
    assert "- +3.00 s: choice: plain at 64 sequences; tok/s plain 50,000, 3x8 49,000" in text
    assert "3x8 5.000; plain sampling 10.000)" in text
    assert "| plain | no | 1 | 9.000 | 9.000 |" in "\n".join(report(found[1], lines, 33, switches=False))
    (tmp_path / "v.log").write_text(VERIFIER)
    (tmp_path / "b.log").write_text(BENCH)
    caplog.set_level("INFO", logger="bench.policy_log")
    assert main(["--verifier-log", str(tmp_path / "v.log"), "--bench-log", str(tmp_path / "b.log")]) == 0
    assert "### phase 1, c=64, plain" in caplog.text


def test_the_bench_line_it_reads_is_the_one_bench_load_writes():
    """bench.load's own run line (its RUN_DONE with its Run, after its log format's time and logger name) is found:
    100 requests at 25 req/s end at 13:25:10 and began 4 s before."""
    line = "2026-11-29 13:25:10,000 bench.load " + RUN_DONE % (LoadRun(2, 16, "3x8", 100), 100, 100, 25.0, "90")
    (found,) = runs(line)
    assert (found.phase, found.concurrency, found.kind, found.start.second, found.end.second) == (2, 16, "3x8", 6, 10)
