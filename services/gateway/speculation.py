"""Trees a request may pin: within what the verifier's drafter drafts (its InfoResponse)."""

from __future__ import annotations

from common.errors import InvalidRequest
from common.policy import Shape


def check_tree(shape: Shape, info) -> None:
    """A tree a request pins, within the drafter's (info: the verifier's InfoResponse). InvalidRequest."""
    if info is None or not info.drafter:
        raise InvalidRequest("this deployment has no draft: a tree cannot be pinned")
    k, steps, size = info.drafting_top_k, info.drafting_steps, info.verify_tree_size
    drafted = k + (shape.depth - 1) * k * k
    if shape.depth > steps or shape.nodes > min(size, drafted):
        raise InvalidRequest(
            f"tree {shape} is beyond the draft's: depth at most {steps}, nodes at most {size} "
            f"(and {drafted} at depth {shape.depth} with top-k {k})"
        )
