"""The engine services' start-up flags (services/launch.py)."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

from services.launch import common_arguments, engine_arguments, parse_and_log, parse_cpus


def test_cpu_lists_as_taskset_takes_them() -> None:
    assert parse_cpus("3") == {3}
    assert parse_cpus("2-4,8") == {2, 3, 4, 8}
    assert parse_cpus("0, 1") == {0, 1}
    for bad in ("", "a", "4-2", "1,,2", "-3", "2-"):
        with pytest.raises(ValueError, match="CPU list"):
            parse_cpus(bad)


def test_cpu_affinity_pins_the_process(monkeypatch) -> None:
    """--cpu-affinity N: the service's thread runs on CPU N only (here the test's own thread, restored after)."""
    before = os.sched_getaffinity(0)
    cpu = max(before)
    p = argparse.ArgumentParser()
    common_arguments(p, "NO_SUCH_ENV", "127.0.0.1:0")
    engine_arguments(p)
    monkeypatch.setattr(sys, "argv", ["verifier", "--cpu-affinity", str(cpu)])
    try:
        parse_and_log(p)
        assert os.sched_getaffinity(0) == {cpu}
    finally:
        os.sched_setaffinity(0, before)
    for bad in ("x", "100000"):  # malformed; a CPU the machine does not have
        monkeypatch.setattr(sys, "argv", ["verifier", "--cpu-affinity", bad])
        with pytest.raises(SystemExit):  # argparse's error: exit status 2 with the message
            parse_and_log(p)
        assert os.sched_getaffinity(0) == before


def test_the_stack_puts_the_draft_in_the_verifiers_process_on_a_gpu() -> None:
    """services.stack --colocate: auto (the default) colocates on a CUDA device only; on and off decide."""
    from services.stack import colocated

    assert colocated("auto", "cuda") and colocated("auto", "cuda:1")
    assert not colocated("auto", "cpu")
    assert colocated("on", "cpu") and not colocated("off", "cuda")
    with pytest.raises(ValueError, match="auto, on or off"):
        colocated("yes", "cuda")


def test_the_colocate_flag_defaults_to_auto_and_bare_means_on() -> None:
    """services.stack.colocate_argument, shared by the stack and the load benchmarks: bare --colocate (a switch
    before session 21) still means on."""
    from services.stack import colocate_argument

    p = argparse.ArgumentParser()
    colocate_argument(p)
    assert [p.parse_args(a).colocate for a in ([], ["--colocate"], ["--colocate", "off"])] == ["auto", "on", "off"]
    with pytest.raises(SystemExit):
        p.parse_args(["--colocate", "maybe"])
