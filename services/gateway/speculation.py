"""The gateway's side of the speculation policy (common/policy.py): building it from what the services
measured, the shapes a draft can serve, and keeping the draft in step with sequences that the policy
decodes plainly for a while.

A speculative sequence always has a pending ProposeItem: the tokens committed since the draft last saw it,
each with the base model's feature that produced it. A plain round of such a sequence asks the verifier
for its features too (DecodeItem.want_hidden) and appends them to that item, so that the next round that
drafts starts exactly where a round after verification would:

    pending  token_ids [b, c]        hidden rows [h_a, h_b]          (a verify: b accepted, c bonus)
    plain    tokens    [d, e, f]     features    [h_c, h_d, h_e]     (written after row 2 of the region)
    merged   token_ids [b, c, d, e, f]  hidden [h_a, h_b, h_c, h_d, h_e]

With CUDA IPC the rows lie next to each other in the sequence's region (the verifier wrote them from row
len(token_ids) on), so the merged reference is the same region with more rows; inline bytes are joined.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.errors import InvalidRequest
from common.policy import (
    DEFAULT_MENU,
    PLAIN,
    AdaptivePolicy,
    CostModel,
    CyclePolicy,
    FixedPolicy,
    Policy,
    PolicyConfig,
    Shape,
    StepCost,
)
from specdec.v1 import internal_pb2 as pb

POLICIES = ("adaptive", "fixed", "cycle")
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def largest_tree(dinfo: pb.DraftInfoResponse) -> Shape:
    """The draft's configured tree: its steps and verify size."""
    return Shape(dinfo.drafting_steps, dinfo.verify_tree_size)


def check_tree(shape: Shape, dinfo: pb.DraftInfoResponse | None) -> None:
    """A tree a request pins, or the policy may pick: within what the draft drafts. InvalidRequest."""
    if dinfo is None:
        raise InvalidRequest("this gateway has no draft service: a tree cannot be pinned")
    k, steps, size = dinfo.drafting_top_k, dinfo.drafting_steps, dinfo.verify_tree_size
    drafted = k + (shape.depth - 1) * k * k
    if shape.depth > steps or shape.nodes > min(size, drafted):
        raise InvalidRequest(
            f"tree {shape} is beyond the draft's: depth at most {steps}, nodes at most {size} "
            f"(and {drafted} at depth {shape.depth} with top-k {k})"
        )


def menu_for(dinfo: pb.DraftInfoResponse, menu: Sequence[Shape] = DEFAULT_MENU) -> tuple[Shape, ...]:
    """The shapes of `menu` the draft can serve, and its own largest tree."""
    ok = []
    for s in menu:
        try:
            check_tree(s, dinfo)
        except InvalidRequest:
            continue
        ok.append(s)
    return tuple(sorted(set(ok) | {largest_tree(dinfo)}))


def build_policy(
    kind: str,
    vinfo: pb.InfoResponse,
    dinfo: pb.DraftInfoResponse | None,
    menu: Sequence[Shape] = DEFAULT_MENU,
    fixed: Shape | None = None,
) -> Policy:
    """'adaptive': costs from the services' start-up measurements; 'fixed': one tree (default: the
    draft's own); 'cycle': every shape of the menu and plain in turn, one a round (for tests)."""
    if kind not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {kind!r}")
    if dinfo is None:
        return FixedPolicy(Shape(1, 1))  # never used: without a draft every round is plain
    shapes = menu_for(dinfo, menu)
    if kind == "fixed":
        tree = fixed or largest_tree(dinfo)
        check_tree(tree, dinfo)
        return FixedPolicy(tree)
    if kind == "cycle":
        return CyclePolicy((PLAIN, *shapes))
    costs = [StepCost(c.kind, c.batch, c.size, c.seconds) for c in (*vinfo.step_costs, *dinfo.step_costs)]
    return AdaptivePolicy(PolicyConfig(menu=shapes), CostModel(costs))


def append_plain_round(item: pb.ProposeItem, tokens: Sequence[int], hidden: pb.TensorRef) -> None:
    """Add a plain round's tokens and features to a sequence's pending ProposeItem (module docstring). An item
    with nothing pending (chained: the draft took the last round's outcome from the verifier; the Decode
    dropped its tree) takes the plain round's as they are (the verifier wrote them from row 0)."""
    if not item.token_ids and item.hidden.WhichOneof("payload") is None:
        item.hidden.CopyFrom(hidden)
        item.token_ids.extend(tokens)
        return
    rows = len(item.token_ids)
    if item.hidden.WhichOneof("payload") == "ipc":
        if hidden.WhichOneof("payload") != "ipc" or hidden.ipc.buffer_id != item.hidden.ipc.buffer_id:
            raise ValueError("a plain round's features are not in the region of the pending ones")
        row_bytes = item.hidden.shape[1] * ELEMENT_BYTES[item.hidden.dtype]
        if item.hidden.ipc.offset_bytes + rows * row_bytes != hidden.ipc.offset_bytes:
            raise ValueError("a plain round's features do not follow the pending ones")
        item.hidden.ipc.round = hidden.ipc.round
    else:
        item.hidden.inline_data += hidden.inline_data
    item.hidden.shape[0] += len(tokens)
    item.token_ids.extend(tokens)
