"""Shared fixtures: the embedded model (loaded once) and the services as real processes."""

from __future__ import annotations

import os

import pytest
import torch

# Triton reads TRITON_INTERPRET once, when something first imports it (torch.compile's machinery does, via
# the training tests' TTT kernels), so on a CPU the interpreter tests/test_kernels.py needs is chosen here,
# before any test module runs, whatever their order.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from services.stack import Stack  # noqa: E402

# Small context keeps the CPU KV caches small; everything else is the real model in float32.
COMMON = ["--max-context", "512", "--max-sequences", "8", "--dtype", "float32", "--device", "cpu"]

CHAT_PROMPTS = [
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for learning to cook.",
    "What is the capital of France and why is it famous?",
    "Write a Python function that reverses a string.",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines work?",
]


@pytest.fixture(scope="session")
def checkpoint():
    from common.weights import load_checkpoint

    return load_checkpoint()


def _stack(*draft_args: str, gateway_args: tuple[str, ...] = ()):
    s = Stack(common_args=COMMON, draft_args=list(draft_args), gateway_args=list(gateway_args))
    s.start()
    return s


@pytest.fixture(scope="session")
def stack():
    """The default deployment: the shipped EAGLE-3 head."""
    s = _stack()
    yield s
    s.stop()
