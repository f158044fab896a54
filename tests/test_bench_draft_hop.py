"""bench.draft_hop: its statistics by hand, and a run on CPU against a real draft service process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.draft_hop import SKIP, kept, main, spread, timed
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


def draft_hop(proposes: int, out, timeout: float, per_sequence: int = 100) -> subprocess.CompletedProcess:
    args = ["--device", "cpu", "--proposes", str(proposes), "--per-sequence", str(per_sequence), "--out", str(out)]
    return subprocess.run(
        [sys.executable, "-m", "bench.draft_hop", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--proposes", "150"], "--proposes takes a multiple of --per-sequence (100)"),
        (["--proposes", "20", "--per-sequence", "10"], f"--per-sequence takes more than the {SKIP}"),
    ],
)
def test_proposes_must_be_whole_sequences(tmp_path, capsys, args, says):
    with pytest.raises(SystemExit) as stop:
        main(["--device", "cpu", "--out", str(tmp_path), *args])
    assert stop.value.code == 2 and says in capsys.readouterr().err


def test_run_on_cpu_against_a_draft_service(tmp_path):
    done = draft_hop(40, tmp_path, 240, per_sequence=20)  # two sequences of 20, the first 10 of each left out
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads((tmp_path / "draft_hop.json").read_text())
    f = got["figures"]
    assert got["transport"] == "inline bytes, calls on the same-host link"  # no CUDA IPC off a GPU
    assert list(f) == ["in process", "remote", "round trip", "draft compute", "transport", "Info"]
    proposes = ("in process", "remote", "round trip", "draft compute", "transport")
    assert all(f[k]["n"] == 2 * (20 - SKIP) for k in proposes)
    assert f["Info"]["n"] == 40 - SKIP
    # the parts nest: the remote propose holds its round trip, which holds the service's compute
    assert f["remote"]["median"] >= f["round trip"]["median"] > f["draft compute"]["median"] > 0
    assert 0 < f["transport"]["median"] < f["round trip"]["median"]
    assert f["draft compute"]["median"] == pytest.approx(f["round trip"]["median"] - f["transport"]["median"], rel=0.5)
    md = (tmp_path / "draft_hop.md").read_text()
    assert md == done.stdout and "| in process |" in md and "/ in process |" in md
