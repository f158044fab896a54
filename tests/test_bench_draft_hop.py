"""bench.draft_hop: its statistics by hand, and a run on CPU against a real draft service process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.draft_hop import SKIP, kept, spread, timed
from bench.load import ROOT


def test_spread_median_and_p90_rank():
    assert spread([5, 1, 4, 2, 3]) == {"median": 3, "p90": 5, "n": 5}
    # 20 samples 1..20: p90 is the sample at rank 18 of 0..19, i.e. 19; the median is (10 + 11) / 2
    assert spread(list(range(20, 0, -1))) == {"median": 10.5, "p90": 19, "n": 20}


def test_kept_drops_each_sequences_first_proposes():
    assert kept([[1.0] * (SKIP + 2), [2.0] * (SKIP + 1), [3.0] * SKIP]) == [1.0, 1.0, 2.0]


def test_timed_calls_in_order_and_times_each():
    seen = []
    out = timed(3, seen.append)
    assert seen == [0, 1, 2] and len(out) == 3 and all(t >= 0 for t in out)


def draft_hop(proposes: int, out, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.draft_hop", "--device", "cpu", "--proposes", str(proposes), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_proposes_must_be_whole_hundreds(tmp_path):
    done = draft_hop(150, tmp_path, 60)
    assert done.returncode == 2 and "--proposes takes a multiple of 100" in done.stderr


def test_run_on_cpu_against_a_draft_service(tmp_path):
    done = draft_hop(100, tmp_path, 240)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads((tmp_path / "draft_hop.json").read_text())
    f = got["figures"]
    assert got["transport"] == "inline bytes"  # no CUDA IPC off a GPU
    assert list(f) == ["in process", "remote", "round trip", "draft compute", "transport", "Info"]
    assert all(f[k]["n"] == 100 - SKIP for k in ("in process", "remote", "round trip", "draft compute", "transport"))
    assert f["Info"]["n"] == 100 - SKIP
    # the parts nest: the remote propose holds its round trip, which holds the service's compute
    assert f["remote"]["median"] >= f["round trip"]["median"] > f["draft compute"]["median"] > 0
    assert 0 < f["transport"]["median"] < f["round trip"]["median"]
    assert f["draft compute"]["median"] == pytest.approx(f["round trip"]["median"] - f["transport"]["median"], rel=0.5)
    md = (tmp_path / "draft_hop.md").read_text()
    assert md == done.stdout and "| in process |" in md and "/ in process |" in md
