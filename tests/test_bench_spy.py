"""bench.spy's reading of py-spy's raw stacks: the engine thread's samples and each place's share, by hand."""

from __future__ import annotations

import pytest

from bench.spy import frame_name, parse_raw, summarize

ENGINE = "_bootstrap (threading.py:1030);_run (services/verifier/server.py:121);step (common/engine/core.py:185)"
VERIFY = ENGINE + ";_round (common/engine/core.py:382);verify_rounds_steps (common/engine/verifier.py:401)"
RAW = "\n".join(
    [
        ENGINE + ";_prefill (common/engine/core.py:236);prefill_batch (common/engine/verifier.py:187) 3",
        VERIFY + ";launch_after (common/engine/draft.py:447) 4",
        "",  # a blank line between stacks: left out
        VERIFY + ";_chained_block (common/engine/verifier.py:466);chained_block (common/kernels/reference.py:418) 2",
        VERIFY + ";synchronize (/usr/lib/python3/site-packages/torch/cuda/streams.py:88) 1",
        "_bootstrap (threading.py:1030);serve (grpc/_server.py:1200);wait (threading.py:600) 5",
        " 7",  # a sample without a Python frame (py-spy 0.4 writes them so): no thread's, left out
        "",
    ]
)


def test_a_frame_loses_its_line_and_its_site_packages_path():
    assert frame_name("step (common/engine/core.py:185)") == "step (common/engine/core.py)"
    assert frame_name("wait (/usr/lib/python3/site-packages/torch/cuda/streams.py:9)") == "wait (torch/cuda/streams.py)"
    assert frame_name("<module>") == "<module>"


def test_the_engine_threads_shares_by_hand():
    """10 of the 15 samples with frames pass through EngineCore.step (the grpc thread's 5 do not): prefill 3/10, the
    verify call 7/10, of which launch_after 4, the chained block 2 (on the reference: 2), the device wait 1;
    launch_after's frame the most often on top (4)."""
    s = summarize(parse_raw(RAW))
    assert s["samples"] == 10
    sh = s["shares"]
    assert sh["admission: prefill"] == pytest.approx(0.3)
    assert sh["verify call"] == pytest.approx(0.7)
    assert sh["  drafting launched behind a verify"] == pytest.approx(0.4)
    assert sh["  chained block"] == pytest.approx(0.2)
    assert sh["PyTorch reference kernels"] == pytest.approx(0.2)
    assert sh["waiting for the device"] == pytest.approx(0.1)
    assert sh["plain call"] == 0.0 and sh["release"] == 0.0
    assert s["self"][0] == ("launch_after (common/engine/draft.py)", pytest.approx(0.4))
    assert summarize(parse_raw(""))["samples"] == 0


def test_a_line_that_is_not_py_spys_is_refused():
    with pytest.raises(ValueError, match="not a py-spy raw line"):
        parse_raw("step (common/engine/core.py:1) many")
