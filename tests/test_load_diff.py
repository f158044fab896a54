"""bench.load_diff on hand-written load.json pairs: the clean rows both runs of a pair measured, after over before,
and the means worked out by hand."""

from __future__ import annotations

import json

import pytest

from bench.load_diff import compare, main


def _run(path, phases, rows):
    """phases: each phase's concurrency in order; rows: (phase, kind, req/s, p50 ms, p99 ms, errors), the phase's
    concurrency from `phases`. A failed run as bench.load writes it: req/s 0.0, latencies None."""
    keys = ("phase", "kind", "req_s", "p50_ms", "p99_ms", "errors")
    data = {
        "meta": {},
        "phases": [{"phase": i + 1, "concurrency": c} for i, c in enumerate(phases)],
        "rows": [dict(zip(keys, r), concurrency=phases[r[0] - 1]) for r in rows],
    }
    path.write_text(json.dumps(data))
    return path


def test_ratios_of_the_clean_rows_both_runs_measured(tmp_path, capsys):
    """Pair 1 (phases 64, 16, 64): plain at 64 in phase 1 100 -> 103 req/s (p50 200 -> 180, p99 300 -> 330) and in
    phase 3 200 -> 180 (p50 and p99 100 -> 110): two rows, not one; the default 200 -> 220. Left out: the default at
    16 (the after run failed it: 0 req/s), plain at 16 (the after run had an error), 3x8 at 16 (only before).
    Pair 2 (64): plain 100 -> 99 (p50 200 -> 220, p99 300 -> 300).
    At 64, plain's rows 1.03, 0.9, 0.99: mean 0.973 (a ratio of sums would give 382 / 400 = 0.955), p50 (0.9 + 1.1 +
    1.1) / 3 = 1.033, p99 (1.1 + 1.1 + 1.0) / 3 = 1.067; the default 1.1; over the four rows mean (1.03 + 0.9 + 1.1 +
    0.99) / 4 = 1.005, median (0.99 + 1.03) / 2 = 1.01. Pair 1's mean (1.03 + 1.1 + 0.9) / 3 = 1.01, pair 2's 0.99."""
    b1 = _run(
        tmp_path / "b1.json",
        [64, 16, 64],
        [
            (1, "plain", 100, 200, 300, 0),
            (1, "default", 200, 100, 150, 0),
            (2, "default", 50, 100, 100, 0),
            (2, "plain", 40, 100, 100, 0),
            (2, "3x8", 60, 100, 100, 0),
            (3, "plain", 200, 100, 100, 0),
        ],
    )
    a1 = _run(
        tmp_path / "a1.json",
        [64, 16, 64],
        [
            (1, "plain", 103, 180, 330, 0),
            (1, "default", 220, 100, 150, 0),
            (2, "default", 0.0, None, None, 64),
            (2, "plain", 41, 100, 100, 1),
            (3, "plain", 180, 110, 110, 0),
        ],
    )
    b2 = _run(tmp_path / "b2.json", [64], [(1, "plain", 100, 200, 300, 0)])
    a2 = _run(tmp_path / "a2.json", [64], [(1, "plain", 99, 220, 300, 0)])
    out = compare([(b1, a1), (b2, a2)])
    assert list(out["by_concurrency"]) == [64]
    s = out["by_concurrency"][64]
    assert s["n"] == 4
    assert s["mean"] == pytest.approx(1.005) and s["median"] == pytest.approx(1.01)
    assert (s["min"], s["max"]) == (pytest.approx(0.9), pytest.approx(1.1))
    plain = s["kinds"]["plain"]
    assert plain["n"] == 3 and plain["each"] == [pytest.approx(1.03), pytest.approx(0.9), pytest.approx(0.99)]
    assert plain["req_s"] == pytest.approx(2.92 / 3)
    assert (plain["p50"], plain["p99"]) == (pytest.approx(3.1 / 3), pytest.approx(3.2 / 3))
    assert s["kinds"]["default"]["req_s"] == pytest.approx(1.1)
    p1, p2 = out["pairs"]
    assert (p1["rows"], p1["mean"], p2["rows"], p2["mean"]) == (3, pytest.approx(1.01), 1, pytest.approx(0.99))
    assert p1["left_out"] == [
        "2 c=16 3x8: not in both runs",
        "2 c=16 default: failed",
        "2 c=16 plain: failed",
    ]

    written = tmp_path / "diff.json"
    assert main(["--pair", str(b1), str(a1), "--pair", str(b2), str(a2), "--out", str(written)]) == 0
    printed = capsys.readouterr().out
    assert "c=64: 4 rows, req/s after / before mean 1.005, median 1.010, 0.900-1.100" in printed
    assert "plain        n=3 req/s 0.973 p50 1.033 p99 1.067 (1.030, 0.900, 0.990)" in printed
    assert "  left out: 2 c=16 default: failed" in printed
    assert json.loads(written.read_text())["by_concurrency"]["64"]["n"] == 4


def test_runs_of_other_phases_or_nothing_in_common_are_errors(tmp_path, capsys):
    """A pair whose runs ran other phases (64, 16 against 16, 64) does not compare; nor one with no row in common."""
    b = _run(tmp_path / "b.json", [64, 16], [(1, "plain", 100, 200, 300, 0)])
    a = _run(tmp_path / "a.json", [16, 64], [(2, "plain", 100, 200, 300, 0)])
    with pytest.raises(SystemExit) as e:
        main(["--pair", str(b), str(a)])
    assert e.value.code == 2
    assert "do not compare" in capsys.readouterr().err
    a = _run(tmp_path / "a.json", [64, 16], [(2, "plain", 100, 200, 300, 0)])
    with pytest.raises(SystemExit) as e:
        main(["--pair", str(b), str(a)])
    assert e.value.code == 2
    assert "no clean" in capsys.readouterr().err
