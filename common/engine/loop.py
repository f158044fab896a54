"""The in-process speculative loop, once: prefill, then rounds of propose and verify for a batch of
sequences, each leaving when its caller says it is done. The benchmarks and the training evaluation drive
it; the gateway runs the same steps over gRPC (services/gateway/scheduler.py), with the same one-token
shift (common.rounds). A round's drafting is launched on the device behind the verify before it
(common.engine.base.Drafter's device chain) when the drafter can: the host then waits for the device once
for the verify's outcome and once for the trees, with the commits in between overlapping the drafting."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from common.config import SamplingConfig
from common.engine.base import (
    Drafter,
    LaunchAfter,
    PrefillInput,
    ProposeAfter,
    ProposeInput,
    VerifierEngine,
    VerifyInput,
    finish,
)


@dataclass(frozen=True)
class Round:
    """One round of the loop."""

    draft_s: float  # wall seconds of the trees' reading (launched after the last verify) and any propose call
    verify_s: float  # wall seconds of the verify call (launching the next drafting after it)
    host_s: float  # wall seconds of the bookkeeping after it (commits, releases)
    committed: list[int]  # [sequences in the round] tokens committed per sequence (accepted + the bonus)
    prefill_s: float = 0.0  # wall seconds of the prefill of the sequences that joined after it (`more`)
    # device seconds of the drafting of the trees it verified when that was launched behind the verify before
    # (the device chain; Drafter.seconds_after); None when they were proposed
    draft_device_s: float | None = None


def speculative_loop(
    verifier: VerifierEngine,
    drafter: Drafter,
    prompts: dict[str, list[int]],
    tree_size: int,
    commit: Callable[[str, list[int]], bool],
    on_round: Callable[[Round], None] | None = None,
    sampling: dict[str, SamplingConfig] | None = None,
    more: Callable[[int], dict[str, list[int]]] | None = None,
) -> None:
    """Prefill every prompt (seq id -> prompt ids, in one batched call), then run rounds until every sequence is done.
    commit(seq_id, new_tokens) receives each sequence's tokens as they come (the prefill's first token,
    then each round's) and returns whether the sequence goes on; a finished one is released on both
    engines. on_round sees each round's timing and committed counts. sampling: seq id -> how it samples
    (absent: greedy). more(n): after a round in which n sequences finished, the prompts that start now (a
    closed loop: each finished request replaced by the next), prefilled in one call and in the next round.
    Example, 2 in flight, more = the next prompt for each finished one: a finishes in round 5 -> c is
    prefilled after round 5 and proposes in round 6 beside b."""

    def start(new: dict[str, list[int]]) -> dict[str, ProposeInput]:
        cfgs = {sid: (sampling or {}).get(sid, SamplingConfig()) for sid in new}
        outs = verifier.prefill_batch([PrefillInput(sid, p, cfgs[sid]) for sid, p in new.items()])
        going = {}
        for (sid, prompt), out in zip(new.items(), outs):
            if commit(sid, [out.next_token]):
                going[sid] = ProposeInput.after_prefill(sid, prompt, out, tree_size, cfgs[sid])
            else:
                verifier.release([sid])
        return going

    # the next round's drafting: proposes from inputs (after a prefill, or a verify the drafter could not
    # follow on the device), and trees launched after the last verify (its handle and the rows that go on)
    inputs = start(prompts)
    after: tuple[object, dict[str, int]] | None = None
    while inputs or after:
        t_a = time.perf_counter()
        trees = dict(zip(after[1], drafter.read_after(after[0], list(after[1].values())))) if after else {}
        device_s = drafter.seconds_after(after[0]) if after else None
        if inputs:
            trees.update(zip(inputs, drafter.propose(list(inputs.values()))))
        t_b = time.perf_counter()
        ids = list(trees)
        launch = LaunchAfter(drafter, [ProposeAfter(sid, tree_size) for sid in ids])  # the next trees' drafting
        results = finish(verifier.verify_steps([VerifyInput(sid, trees[sid]) for sid in ids], launch))
        t_c = time.perf_counter()
        going = {sid: row for row, (sid, res) in enumerate(zip(ids, results)) if commit(sid, res.tokens)}
        done = [sid for sid in ids if sid not in going]
        verifier.release(done)
        drafter.release(done)
        t_d = time.perf_counter()
        if launch.handle is not None:
            after, inputs = ((launch.handle, going) if going else None), {}
        else:  # sampling sequences, or the drafter could not follow on the device
            after = None
            inputs = {sid: ProposeInput.after_verify(sid, results[row], tree_size) for sid, row in going.items()}
        joining = more(len(done)) if more is not None and done else {}
        if joining:
            inputs.update(start(joining))
        if on_round is not None:
            on_round(
                Round(
                    draft_s=t_b - t_a,
                    verify_s=t_c - t_b,
                    host_s=t_d - t_c,
                    committed=[len(r.tokens) for r in results],
                    prefill_s=time.perf_counter() - t_d,
                    draft_device_s=device_s,
                )
            )
