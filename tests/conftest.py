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
    """The embedded model, parsed once per worker (6-7 s on the 2-core machine): every in-process engine is built from
    it, and none writes to it (a Verifier copies its tensors into its model)."""
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


# `make test` hands the test files to two workers (--dist loadfile). Alone, xdist hands them out in order of their
# number of tests, so a long file taken late can keep one worker busy while the other idles, and the files that share
# the session's `stack` can land on both workers and start it twice. Here they are one unit, and the long units go
# first, longest first. Seconds of one worker on the 2-core machine under the full suite (--durations); the rest take
# under 15 s each.
LONG_UNITS = {
    "session stack": 145,  # tests/test_api.py, test_e2e.py and test_hostile_input.py with the stack they share
    "tests/test_faults.py": 115,
    "tests/test_kernels.py": 50,
    "tests/test_engine_steps.py": 42,
    "tests/test_sampling_rule.py": 42,
    "tests/test_training.py": 65,
    "tests/test_drain.py": 55,
    "tests/test_core.py": 37,
    "tests/test_training_parallel.py": 26,
    "tests/test_bench_draft_hop.py": 25,
    "tests/test_tokenizer.py": 20,
    "tests/test_model.py": 20,
    "tests/test_engines.py": 17,
    "tests/test_training_carry.py": 17,
}
SESSION_STACK = ("tests/test_api.py", "tests/test_e2e.py", "tests/test_hostile_input.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with the files sharing the session's stack in one unit and the long units first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongUnitsFirst(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "session stack" if path in SESSION_STACK else path

        def _assign_work_unit(self, node) -> None:
            # the first call comes once the queue is whole; moving a unit to the front is idempotent afterwards
            for unit in sorted(LONG_UNITS, key=LONG_UNITS.get):
                if unit in self.workqueue:
                    self.workqueue.move_to_end(unit, last=False)
            super()._assign_work_unit(node)

    return LongUnitsFirst(config, log)
