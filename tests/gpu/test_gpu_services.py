"""The three services on a GPU: CUDA IPC between draft and verifier, chained rounds (the verifier sends each
outcome to the draft), graphs captured by each service. In float32, speculative output equals plain greedy
decoding token for token, with one and two round groups, prompts prefilled in chunks, and the draft in the
verifier's process (--draft-here).

    PYTHONPATH=. python -m pytest -q tests/gpu -m gpu
"""

from __future__ import annotations

import pytest
import torch

from services.stack import Stack
from tests.conftest import CHAT_PROMPTS
from tests.helpers import chat, complete_many

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

COMMON = ["--max-context", "512", "--max-sequences", "8", "--dtype", "float32", "--device", "cuda"]


@pytest.mark.parametrize(
    "gateway_args, colocate",
    [
        (["--policy", "fixed"], False),
        (["--round-groups", "2", "--prefill-chunk", "8"], False),
        (["--policy", "fixed"], True),  # the draft in the verifier's process: its buffer read in place
    ],
)
def test_ipc_chained_speculative_equals_plain_float32(gateway_args, colocate) -> None:
    prompts = CHAT_PROMPTS[:6]
    with Stack(common_args=COMMON, gateway_args=gateway_args, colocate=colocate) as s:
        spec = [chat(p, max_tokens=48, ignore_eos=True) for p in prompts]
        for r in spec:
            r.tree.depth, r.tree.nodes = 6, 60
        spec = complete_many(s.gateway, spec)
        plain = complete_many(s.gateway, [chat(p, max_tokens=48, ignore_eos=True, speculative=False) for p in prompts])
        gateway_log = (s.log_dir / "gateway.log").read_text()
    for p, a, b in zip(prompts, spec, plain):
        assert list(a.token_ids) == list(b.token_ids), p
        assert a.speculation.rounds > 0 and a.speculation.mean_acceptance_length > 1.5, p
    assert "hidden states between verifier and draft: CUDA IPC" in gateway_log
    assert "draft failed" not in gateway_log  # every chained tree came back
