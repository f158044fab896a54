"""Start-up plumbing: the port file tests read (services/launch.py) and where the stack puts the draft
(services/stack.py --colocate)."""

from __future__ import annotations

import argparse

import pytest

from services.launch import write_port_file


def test_the_port_file_is_written_whole(tmp_path) -> None:
    """A reader polling for the file sees it absent or complete, never empty: written beside it, then renamed."""
    path = tmp_path / "verifier.port"
    write_port_file(str(path), 41234)
    assert path.read_text() == "41234" and [p.name for p in tmp_path.iterdir()] == ["verifier.port"]
    write_port_file(None, 1)  # no port file asked for: nothing written


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
