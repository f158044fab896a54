"""bench.fault_load without ghz or a stack: ghz's timestamps, the figures of a synthetic details list around a kill
(values worked out by hand), the policy's rounds from GetModelInfo, ghz's command line and the report's text."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fault_load import Span, analyse, ghz_command, markdown, parse_time, policy_choices

KILLED_AT = 1_700_000_000.0  # 2023-11-14T22:13:20Z
RESTARTED = "rpc error: code = Unavailable desc = the verifier restarted while this request was running (x)"


def detail(timestamp: str, latency_s: float, error: str = "") -> dict:
    """One entry of ghz's `details`: stamped at the call's end, latency in ns."""
    return {
        "timestamp": timestamp,
        "latency": round(latency_s * 1e9),
        "error": error,
        "status": "Unavailable" if error else "OK",
    }


# Calls as (start, end) in seconds from the kill, numbered as in the comments below:
#   1 (-4.0, -3.0) OK              ends before the kill
#   2 (-2.0, -0.5) OK              ends before the kill
#   3 (-1.0, +0.5) UNAVAILABLE     in flight at the kill: had tokens, failed
#   4 (-0.5, +4.0) OK              in flight at the kill: no tokens yet, held for the restart
#   5 (+1.0, +6.0) OK              started after the kill
#   6 (+2.0, +5.5) OK              started after the kill: the first OK one to end (+5.5)
#   7 (-3.0, +0.2) UNAVAILABLE     in flight at the kill
#   8 (+5.5, +7.0) OK
DETAILS = [
    detail("2023-11-14T22:13:17Z", 1.0),
    detail("2023-11-14T22:13:19.5Z", 1.5),
    detail("2023-11-14T23:13:20.5+01:00", 1.5, RESTARTED),  # the same instant written with an offset
    detail("2023-11-14T22:13:24Z", 4.5),
    detail("2023-11-14T22:13:26Z", 5.0),
    detail("2023-11-14T22:13:25.5Z", 3.5),
    detail("2023-11-14T22:13:20.200000000Z", 3.2, RESTARTED),  # nanoseconds, as Go writes them
    detail("2023-11-14T22:13:27Z", 1.5),
]


def test_parse_time_takes_go_rfc3339_with_nanoseconds_and_offsets():
    assert parse_time("2023-11-14T22:13:20Z") == KILLED_AT
    assert parse_time("2023-11-14T23:13:20.5+01:00") == KILLED_AT + 0.5
    assert parse_time("2023-11-14T22:13:20.123456789Z") == pytest.approx(KILLED_AT + 0.123456789, abs=1e-6)
    with pytest.raises(ValueError, match="not an RFC 3339 time"):
        parse_time("22:13:20")


def test_the_figures_of_a_kill_under_load():
    # ghz started at -4.5 (0.5 s before its first call) and exited at +8.0
    a = analyse(DETAILS, KILLED_AT, Span(-4.5, 8.0))
    assert (a.requests, a.ok, a.failed) == (8, 6, 2)
    assert a.statuses == {"OK": 6, "Unavailable": 2}
    assert a.errors == {RESTARTED: 2}
    assert (a.in_flight_at_kill, a.in_flight_ok, a.failed_started_after_kill) == (3, 1, 0)  # calls 3, 4, 7
    assert a.first_ok_after_kill_s == pytest.approx(5.5)  # call 6
    assert a.first_ok_end_after_kill_s == pytest.approx(4.0)  # call 4, held for the restart
    assert a.ok_per_s_before == pytest.approx(2 / 4.5)  # calls 1, 2 over -4.5 .. 0
    assert a.ok_per_s_after == pytest.approx(4 / 8.0)  # calls 4, 5, 6, 8 over 0 .. +8
    # [-5, 0): 1, 2 over 4.5 s; [0, 5): 7, 3 failed, 4 OK; [5, 10): 6, 5, 8 over 3 s (ghz exited at +8)
    got = [(w.start, w.end, round(w.seconds, 6), w.ok, w.failed, w.ok_per_s) for w in a.windows]
    assert got == [
        (-5.0, 0.0, 4.5, 2, 0, pytest.approx(2 / 4.5)),
        (0.0, 5.0, 5.0, 1, 2, pytest.approx(0.2)),
        (5.0, 10.0, 3.0, 3, 0, pytest.approx(1.0)),
    ]


def test_without_a_span_the_windows_run_from_the_first_start_to_the_last_end_and_short_ones_have_no_rate():
    a = analyse(DETAILS, KILLED_AT)
    assert (a.span.start, a.span.end) == (pytest.approx(-4.0), pytest.approx(7.0))
    assert [round(w.seconds, 6) for w in a.windows] == [4.0, 5.0, 2.0]
    tail = analyse(DETAILS, KILLED_AT, Span(-4.5, 10.5)).windows[-1]  # [10, 15) covered 0.5 s: no rate
    assert (tail.start, tail.ok, tail.ok_per_s) == (10.0, 0, None)
    assert analyse([], KILLED_AT).windows == []


def test_policy_choices_read_json_format_int64_strings_and_plain_as_depth_zero():
    info = {"policy_choices": [{"tree": {"depth": 6, "nodes": 60}, "rounds": "12"}, {"tree": {}, "rounds": "40"}]}
    assert policy_choices(info) == {"6x60": 12, "plain": 40}
    assert policy_choices({}) == {}


def test_ghz_runs_for_a_duration_waits_for_calls_in_flight_and_reports_json():
    cmd = ghz_command("ghz", "127.0.0.1:5", Path("d.json"), 16, 40, 120)
    assert cmd[0] == "ghz" and cmd[-3:] == ["-D", "d.json", "127.0.0.1:5"]
    line = " ".join(cmd)
    for flag in ("-c 16", "-z 40s", "--duration-stop wait", "-t 120s", "--format json"):
        assert flag in line


def test_the_report_groups_failures_and_says_whether_speculation_resumed():
    a = analyse(DETAILS, KILLED_AT, Span(-4.5, 8.0))
    meta = {
        "title": "t",
        "command": "c",
        "stack": "s",
        "ghz_version": "v0.120.0",
        "ghz_command": "ghz ...",
        "verifier_pid": 42,
        "kill_after_s": 4.5,
        "sending_until_s": 7.5,
    }
    after = {
        "state": {"verifier": {"restarts": 1}},
        "policy_choices": {"6x60": 3},
        "pinned": {"tokens": 8, "rounds": 2, "acceptance": 3.5},
    }
    md = markdown(a, after, meta)
    assert f"- 2 x `{RESTARTED}`" in md
    assert "| 8 | 6 | 2 | 3 | 1 | 0 | +4.0 s | +5.5 s |" in md
    assert "restarts verifier 1" in md and "speculation resumed: yes" in md
    md = markdown(a, {"why": "the gateway did not serve"}, meta)
    assert "speculation resumed: unknown (the gateway did not serve)" in md
