"""bench.load_diff on hand-written load.json pairs: the rows both runs of a pair measured, after over before, and
the means worked out by hand."""

from __future__ import annotations

import json

import pytest

from bench.load_diff import compare, main


def _run(path, rows):
    """rows: (phase, concurrency, kind, req/s, p50 ms, p99 ms); req/s None: a failed run."""
    keys = ("phase", "concurrency", "kind", "req_s", "p50_ms", "p99_ms")
    path.write_text(json.dumps({"meta": {}, "rows": [dict(zip(keys, r)) for r in rows]}))
    return path


def test_ratios_of_the_rows_both_runs_measured(tmp_path, capsys):
    """Pair 1: plain at 64 100 -> 103 req/s (p50 200 -> 180, p99 300 -> 330), default 200 -> 220 (p50 and p99
    equal); the before run's 16 row has no after row, the after run's default at 16 failed. Pair 2: plain at 64
    100 -> 99 (p50 200 -> 220, p99 300 -> 300). At 64: plain (1.03 + 0.99) / 2 = 1.01, p50 (0.9 + 1.1) / 2 = 1.0,
    p99 (1.1 + 1.0) / 2 = 1.05; default 1.1; over the three rows mean (1.03 + 1.1 + 0.99) / 3 = 1.04, median 1.03."""
    b1 = _run(
        tmp_path / "b1.json",
        [
            (1, 64, "plain", 100, 200, 300),
            (1, 64, "default", 200, 100, 150),
            (2, 16, "default", 50, 100, 100),
            (2, 16, "plain", 40, 100, 100),
        ],
    )
    a1 = _run(
        tmp_path / "a1.json",
        [(1, 64, "plain", 103, 180, 330), (1, 64, "default", 220, 100, 150), (2, 16, "default", None, 0, 0)],
    )
    b2 = _run(tmp_path / "b2.json", [(1, 64, "plain", 100, 200, 300)])
    a2 = _run(tmp_path / "a2.json", [(1, 64, "plain", 99, 220, 300)])
    out = compare([(b1, a1), (b2, a2)])
    assert list(out) == [64]
    s = out[64]
    assert s["n"] == 3
    assert s["mean"] == pytest.approx(1.04) and s["median"] == pytest.approx(1.03)
    assert (s["min"], s["max"]) == (pytest.approx(0.99), pytest.approx(1.1))
    plain = s["kinds"]["plain"]
    assert plain["n"] == 2 and plain["each"] == [pytest.approx(1.03), pytest.approx(0.99)]
    assert (plain["req_s"], plain["p50"], plain["p99"]) == (
        pytest.approx(1.01),
        pytest.approx(1.0),
        pytest.approx(1.05),
    )
    assert s["kinds"]["default"]["req_s"] == pytest.approx(1.1)

    written = tmp_path / "diff.json"
    assert main(["--pair", str(b1), str(a1), "--pair", str(b2), str(a2), "--out", str(written)]) == 0
    printed = capsys.readouterr().out
    assert "c=64: 3 rows, req/s after / before mean 1.040, median 1.030, 0.990-1.100" in printed
    assert "plain        n=2 req/s 1.010 p50 1.000 p99 1.050 (1.030, 0.990)" in printed
    assert json.loads(written.read_text())["64"]["n"] == 3


def test_pairs_with_nothing_in_common_are_an_error(tmp_path):
    b = _run(tmp_path / "b.json", [(1, 64, "plain", 100, 200, 300)])
    a = _run(tmp_path / "a.json", [(1, 16, "plain", 100, 200, 300)])
    with pytest.raises(SystemExit) as e:
        main(["--pair", str(b), str(a)])
    assert e.value.code == 2
