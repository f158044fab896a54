"""bench.load without ghz or a stack: the held-out prompts and the data files built from them, the order of the
runs, and the table's figures from a canned ghz JSON report (values worked out by hand)."""

from __future__ import annotations

import json
import shlex
from collections import Counter
from pathlib import Path

import pytest

from bench.load import (
    CATEGORIES,
    KINDS,
    Ghz,
    Row,
    Run,
    add_ratios,
    add_tokens,
    engine_line,
    engine_spent,
    failed_row,
    markdown,
    mean_tokens,
    read_prompts,
    requests,
    row_from_report,
    schedule,
)


def test_the_held_out_file_has_eight_prompts_of_each_category_interleaved():
    prompts = read_prompts()
    assert len(prompts) == 48 and len({p.text for p in prompts}) == 48
    assert Counter(p.category for p in prompts) == dict.fromkeys(CATEGORIES, 8)
    assert [p.category for p in prompts[:12]] == list(CATEGORIES) * 2
    for p in prompts:
        if p.category == "summarization":  # an instruction, a blank line, then the text to summarise
            instruction, text = p.text.split("\n\n", 1)
            assert 80 <= len(text.split()) <= 200, instruction


def test_read_prompts_interleaves_and_refuses_an_unknown_category(tmp_path: Path):
    f = tmp_path / "p.jsonl"
    rows = [("chat", "c1"), ("chat", "c2"), ("math", "m1"), ("writing", "w1")]
    f.write_text("".join(json.dumps({"category": c, "prompt": t}) + "\n" for c, t in rows))
    assert [p.text for p in read_prompts(f)] == ["c1", "m1", "w1", "c2"]
    f.write_text(json.dumps({"category": "poetry", "prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="p.jsonl:1: category 'poetry'"):
        read_prompts(f)


def test_each_kinds_data_file_is_the_prompts_as_requests_in_round_robin_order():
    prompts = read_prompts()[:3]
    msgs = {k: requests(KINDS[k], prompts, 128) for k in KINDS}
    assert all(
        len(m) == 3 and [x["messages"][0]["content"] for x in m] == [p.text for p in prompts] for m in msgs.values()
    )
    assert msgs["default"][0] == {"messages": [{"role": "user", "content": prompts[0].text}], "max_tokens": 128}
    assert msgs["plain"][1]["speculative"] is False
    assert msgs["6x60"][2]["tree"] == {"depth": 6, "nodes": 60} and msgs["3x8"][0]["tree"] == {"depth": 3, "nodes": 8}
    for kind in ("default-0.7", "plain-0.7"):  # per-prompt seeds, the same for both
        assert [(m["temperature"], m["top_p"], m["seed"]) for m in msgs[kind]] == [(0.7, 0.9, i) for i in range(3)]
    assert "speculative" not in msgs["default-0.7"][0] and msgs["plain-0.7"][0]["speculative"] is False
    # mixed: the odd prompts sample (as default-0.7), the even ones are greedy default requests
    assert [m.get("temperature") for m in msgs["mixed"]] == [None, 0.7, None]
    assert msgs["mixed"][1] == msgs["default-0.7"][1] and KINDS["mixed"].baseline == "default"
    assert not any("ignore_eos" in m for ms in msgs.values() for m in ms)  # EOS stops every request
    msgs["6x60"][0]["tree"]["depth"] = 1  # a message's tree is its own, not the kind's
    assert KINDS["6x60"].fields["tree"]["depth"] == 6


def test_phases_rotate_the_kinds_and_size_each_run():
    runs = schedule([1, 16, 64, 1], ["a", "b", "c", "d"], prompts=48)
    order = ["".join(r.kind for r in runs if r.phase == p) for p in (1, 2, 3, 4)]
    assert order == ["abcd", "bcda", "cdab", "dabc"]
    assert [r.requests for r in runs if r.kind == "a"] == [48, 512, 2048, 48]  # max(48, 32 x c)
    assert [r.requests for r in schedule([1, 2], ["a"], prompts=4, requests=4)] == [4, 4]
    assert [r.requests for r in schedule([8], ["a"], prompts=4, requests=4)] == [8]  # ghz needs n >= c


def test_ghz_command_line():
    ghz = Ghz("/x/ghz", "127.0.0.1:5", request_timeout=120, run_timeout=300, connections=4)
    cmd = ghz.command(Path("d/plain.json"), c=2, n=48)
    assert shlex.join(cmd) == (
        "/x/ghz --insecure --call specdec.v1.Generation.Complete --disable-template-data -c 2 -n 48 "
        "--connections 2 -t 120s --format json -D d/plain.json 127.0.0.1:5"
    )


# ghz --format json, trimmed: 48 requests in 2.4 s, 46 OK (durations in ns)
REPORT = {
    "count": 48,
    "total": 2_400_000_000,
    "average": 50_000_000,
    "rps": 20.0,
    "statusCodeDistribution": {"OK": 46, "Unavailable": 2},
    "errorDistribution": {"rpc error: code = Unavailable desc = draining": 2},
    "latencyDistribution": [
        {"percentage": 10, "latency": 30_000_000},
        {"percentage": 50, "latency": 45_000_000},
        {"percentage": 99, "latency": 91_200_000},
    ],
}


def test_the_table_from_a_ghz_report():
    """req/s = 46 OK / 2.4 s = 19.17; p50 45 ms, p99 91.2 ms; the plain row of the same phase from a report of
    48 OK in 3.0 s (16 req/s): ratio 19.17 / 16 = 1.198; tok/s with tokens [100, 60] over 48 requests: mean 80."""
    default = row_from_report(Run(1, 1, "default", 48), REPORT)
    assert (default.ok, default.errors) == (46, 2)
    assert default.req_s == pytest.approx(46 / 2.4) and default.p50_ms == 45.0 and default.p99_ms == 91.2
    plain = row_from_report(Run(1, 1, "plain", 48), {**REPORT, "total": 3e9, "statusCodeDistribution": {"OK": 48}})
    later = row_from_report(Run(2, 16, "default", 64), REPORT)  # no plain row in phase 2: no ratio
    rows = [default, plain, later]
    add_ratios(rows)
    add_tokens(rows, {"default": [100, 60], "plain": [100, 60]})
    assert default.ratio == pytest.approx((46 / 2.4) / 16) and plain.ratio == 1.0 and later.ratio is None
    assert default.tok_s == pytest.approx(46 / 2.4 * 80) and plain.tok_s == pytest.approx(16 * 80)
    counted = {"default": {"tokens": [100, 60], "mean": 80.0, "finish": {"eos": 1, "length": 1}, "acceptance": 3.2}}
    md = markdown(rows, counted, {"title": "t", "command": "c", "stack": "s", "ghz_version": "v0.120.0"})
    assert "| 1 | 1 | default | 48 | 46 | 2 | 19.17 | 1,533 | 45 | 91 | 1.20x |" in md
    assert "| 2 | 16 | default | 64 | 46 | 18 | 19.17 | 1,533 | 45 | 91 | - |" in md
    assert "| default | 2 | 80.0 | eos 1, length 1 | 3.20 |" in md


def test_mean_tokens_follows_round_robin():
    assert mean_tokens([10, 20, 30], 4) == 17.5
    assert mean_tokens([10, 20, 30], 3) == 20.0


def test_a_run_without_a_report_is_a_row_of_errors():
    r = failed_row(Run(2, 64, "3x8", 256), "ghz ran past 330 s")
    assert (r.ok, r.errors, r.req_s, r.failure) == (0, 256, 0.0, "ghz ran past 330 s")
    assert isinstance(r, Row)


def test_the_engine_table_from_two_reads_of_engine_time():
    """engine_time before {idle 5, verify 1}, after {idle 6, setup 1, verify 3, commit 1, plain 0}; engine_calls
    {rounds 10, switches 3} -> {rounds 20, switches 5}: the run spent idle 1, setup 1, verify 2, commit 1 (busy 4 s,
    idle left out: 25% / 50% / 25%) in 10 rounds, (2 + 1) s / 10 = 300 ms a round; no plain call; 2 switches."""
    spent = engine_spent(
        {"idle": 5.0, "verify": 1.0}, {"idle": 6.0, "setup": 1.0, "verify": 3.0, "commit": 1.0, "plain": 0.0}
    )
    assert spent == {"idle": 1.0, "setup": 1.0, "verify": 2.0, "commit": 1.0}
    r = failed_row(Run(3, 64, "default", 256), "x")
    r.engine, r.calls = spent, engine_spent({"rounds": 10, "switches": 3}, {"rounds": 20, "switches": 5})
    line = "| 3 | 64 | default | 4.00 | 25% | 0% | 0% | 50% | 25% | 0% | 0% | 10 | 300.00 | 0 | - | 2 |"
    assert engine_line(r) == line
    md = markdown([r], {}, {"title": "t", "command": "c", "stack": "s", "ghz_version": "v"})
    assert engine_line(r) in md
    r.engine = {"idle": 2.0}  # an idle run: no line
    assert engine_line(r) is None
    assert engine_spent({}, {"verify": 3.0}) == {} and engine_spent({"verify": 1.0}, {}) == {}  # a read failed
