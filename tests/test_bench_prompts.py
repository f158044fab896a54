"""bench.sampling_accept --prompts-file: the first n rows' prompt_ids, and clear errors for a short or bad file;
bench.engine_bench: a concurrency above the prompts' count still runs one wave of that many sequences, and its
closed loop (speculative_loop's `more`) replaces each finished request between two rounds."""

from __future__ import annotations

import json

import pytest
import torch

from bench import profile_services, services_bench
from bench.engine_bench import filled, waves
from bench.sampling_accept import read_prompts


def write_rows(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_reads_the_first_rows_prompt_ids(tmp_path):
    f = tmp_path / "p.jsonl"
    write_rows(f, [{"id": "a", "prompt_ids": [1, 2, 3]}, {"id": "b", "prompt_ids": [4]}, {"prompt_ids": [5, 6]}])
    assert read_prompts(f, 2) == [[1, 2, 3], [4]]
    assert read_prompts(f, 3) == [[1, 2, 3], [4], [5, 6]]


def test_too_few_or_malformed_rows_raise(tmp_path):
    f = tmp_path / "p.jsonl"
    write_rows(f, [{"prompt_ids": [1, 2]}])
    with pytest.raises(ValueError, match="1 prompts, fewer than --prompts 2"):
        read_prompts(f, 2)
    write_rows(f, [{"prompt_ids": [1, 2]}, {"text": "no ids"}])
    with pytest.raises(ValueError, match="row 2 has no list of integer prompt_ids"):
        read_prompts(f, 2)
    write_rows(f, [{"prompt_ids": ["x"]}])
    with pytest.raises(ValueError, match="row 1"):
        read_prompts(f, 1)


def test_engine_waves_hold_the_concurrency_when_prompts_are_fewer():
    a, b, c = [1], [2, 3], [4]
    assert filled([a, b, c], 7) == [a, b, c, a, b, c, a]
    assert [len(w) for w in waves(filled([a, b, c], 7), 7)] == [7]
    assert filled([a, b, c], 2) == [a, b, c]
    assert [len(w) for w in waves(filled([a, b, c], 2), 2)] == [2, 1]


class _CountingEngines:
    """Fake verifier and drafter for the in-process closed loop: a prefill picks the prompt's last token + 1,
    every round commits the next two tokens of the count-up; the calls are logged."""

    name = "counting"

    def __init__(self) -> None:
        self.log: list = []
        self.last: dict[str, int] = {}

    def prefill_batch(self, items):
        from common.engine.base import PrefillOutput

        self.log.append(("prefill", [it.seq_id for it in items]))
        outs = []
        for it in items:
            self.last[it.seq_id] = it.token_ids[-1] + 1
            outs.append(PrefillOutput(next_token=self.last[it.seq_id], hidden=torch.zeros(len(it.token_ids), 1)))
        return outs

    def propose(self, items):
        self.log.append(("propose", [it.seq_id for it in items]))
        return [None for _ in items]

    def verify(self, items):
        from common.engine.base import VerifyOutput

        outs = []
        for it in items:
            t = self.last[it.seq_id]
            self.last[it.seq_id] = t + 2
            outs.append(VerifyOutput(tokens=[t + 1, t + 2], hidden=torch.zeros(2, 1)))
        return outs

    def verify_steps(self, items, then=None):  # accepts on the host: never calls `then` (no device chain)
        yield from ()
        return self.verify(items)

    def release(self, seq_ids):
        return len(seq_ids)


def test_engine_closed_loop_replaces_each_finished_request_between_rounds():
    """Three requests of 5 tokens at concurrency 2, each round committing 2: a and b run rounds 1-2 (1 + 2 + 2
    tokens) and finish, c is prefilled after round 2 and runs rounds 3-4 alone; every request's tokens are
    its count-up, and c's clock starts when it joined, not at the start."""
    from bench.engine_bench import run_spec_closed

    eng = _CountingEngines()
    prompts = [[10], [20], [30]]
    r = run_spec_closed(eng, eng, prompts, max_new=5, concurrency=2, tree_size=4, requests=3)
    assert r.outputs == [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25], [31, 32, 33, 34, 35]]
    prefills = [e[1] for e in eng.log if e[0] == "prefill"]
    assert prefills == [["closed-0", "closed-1"], ["closed-2"]]
    proposes = [e[1] for e in eng.log if e[0] == "propose"]
    assert proposes == [["closed-0", "closed-1"]] * 2 + [["closed-2"]] * 2
    assert r.rounds == 4 and r.requests == 3 and r.acceptance_length == 2.0


def test_summarize_times_the_first_token_and_the_wait_for_the_next() -> None:
    """bench.engine_bench.summarize by hand: ttft from arrival to the first token; second_ms from the first
    token to the first later one (a first message of two tokens counts once)."""
    from bench.engine_bench import RequestTrace, summarize

    a = RequestTrace(tokens=[1, 2, 3, 4], times=[1.0, 1.0, 1.5, 1.5], arrival=0.5)
    b = RequestTrace(tokens=[5, 6], times=[2.0, 2.1], arrival=2.0)
    r = summarize("x", 2, [a, b], wall=2.0)
    assert r.ttft_ms == pytest.approx(250.0) and r.second_ms == pytest.approx(300.0)


def test_the_services_bench_reads_the_gateways_histograms(monkeypatch) -> None:
    """scrape_rounds, by hand: a round phase, a request stage and a Prefill call part (sum, count) under
    their keys, the verify calls' total; buckets and other series are not read."""
    text = "\n".join(
        [
            "# HELP specdec_round_seconds One batched round",
            'specdec_round_seconds_sum{phase="draft"} 1.5',
            'specdec_round_seconds_count{phase="draft"} 3.0',
            'specdec_round_seconds_bucket{phase="draft",le="0.001"} 0.0',
            'specdec_request_stage_seconds_sum{stage="queue"} 0.2',
            'specdec_request_stage_seconds_count{stage="queue"} 2.0',
            'specdec_prefill_call_seconds_sum{part="engine"} 0.4',
            'specdec_prefill_call_seconds_count{part="engine"} 4.0',
            "specdec_verify_calls_total 7.0",
            "specdec_time_to_first_token_seconds_sum 9.0",
        ]
    )

    class Page:
        def read(self) -> bytes:
            return text.encode()

    monkeypatch.setattr(services_bench.urllib.request, "urlopen", lambda *a, **k: Page())
    assert services_bench.scrape_rounds(1) == {
        "draft": (1.5, 3.0),
        "stage:queue": (0.2, 2.0),
        "stage:prefill_engine": (0.4, 4.0),
        "verify_calls": (7.0, 0.0),
    }


def test_the_profile_report_counts_frames_by_function_and_file_per_thread(tmp_path) -> None:
    """bench.profile_services.inclusive, by hand: a main-thread stack of 3 samples through the chain's verify
    and the engine's steps, an engine-thread stack of 2 through a prefill; a frame counts once per stack."""
    raw = tmp_path / "spy-verifier.txt"
    raw.write_text(
        "_run_module_as_main (<frozen runpy>:198);_run (asyncio/events.py:88);verify (services/verifier/chain.py:9);"
        "_stepped (services/engine_runner.py:72);verify_steps (common/engine/verifier.py:387);"
        "verify_steps (common/engine/verifier.py:389) 3\n"
        "_bootstrap (threading.py:1030);_locked (services/engine_runner.py:96);"
        "_prefill (services/verifier/server.py:7) 2\n"
    )
    counts = profile_services.inclusive(raw)
    assert counts[""] == (3, 2)
    assert counts["verify (services/verifier/chain.py"] == (3, 0)
    assert counts["verify_steps (common/engine/verifier.py"] == (3, 0)
    assert counts["_stepped (services/engine_runner.py"] == (3, 0)
    assert counts["_locked (services/engine_runner.py"] == (0, 2)
    assert counts["_prefill (services/verifier/server.py"] == (0, 2)
    assert counts["propose_steps (common/engine/draft.py"] == (0, 0)
