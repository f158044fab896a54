"""bench.sampling_accept --prompts-file: the first n rows' prompt_ids, and clear errors for a short or bad file."""

from __future__ import annotations

import json

import pytest

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
