"""Draft trees on the wire: common.tree.Tree <-> pb.DraftTree, whose arrays are packed little-endian bytes.

One numpy conversion each way. A repeated scalar field costs a Python object per element on both sides:
for a round of 64 sequences with 60-node trees, building, serializing, parsing and converting the
trees took 0.97 ms with repeated fields and 0.36 ms with packed bytes on the 2-core CPU of this
workplace (`python -m bench.tree_wire`), and with chained rounds that work sits between the draft's
proposal and the verification. The draft packs (tree_msg), the verifier unpacks and checks (tree_of);
draft_tree builds a message from plain lists (tests, tools)."""

from __future__ import annotations

import numpy as np

from common.errors import InvalidRequest
from common.tree import DraftQ, Tree, validate_tree
from specdec.v1 import internal_pb2 as pb


def _packed(a, dtype: str) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


def tree_msg(t: Tree, msg: pb.DraftTree) -> None:
    """Fill a DraftTree in place (q, for sampled trees, as well)."""
    msg.token_ids = _packed(t.tokens, "<i4")
    msg.parents = _packed(t.parents, "<i4")
    msg.draft_probs = _packed(t.probs, "<f4")
    if t.q is not None:
        msg.q_width = t.q.ids.shape[1]
        msg.q_rows = _packed(t.q.rows, "<i4")
        msg.q_ids = _packed(t.q.ids, "<i4")
        msg.q_probs = _packed(t.q.probs, "<f4")


def draft_tree(tokens: list[int], parents: list[int], probs: list[float] | None = None) -> pb.DraftTree:
    """A top-k tree message from lists (probs None: none sent, which the verifier reads as all 1)."""
    return pb.DraftTree(
        token_ids=_packed(tokens, "<i4"),
        parents=_packed(parents, "<i4"),
        draft_probs=_packed(probs if probs is not None else [], "<f4"),
    )


def _array(data: bytes, dtype: str, what: str) -> np.ndarray:
    if len(data) % 4:
        raise InvalidRequest(f"tree {what} is {len(data)} bytes, not a whole number of 4-byte values")
    return np.frombuffer(data, dtype=dtype)


def unpack(msg: pb.DraftTree) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens [N] int64, parents [N] int64, probs [N or 0] float32), unchecked."""
    return (
        _array(msg.token_ids, "<i4", "token_ids").astype(np.int64),
        _array(msg.parents, "<i4", "parents").astype(np.int64),
        _array(msg.draft_probs, "<f4", "draft_probs").astype(np.float32),
    )


def size(msg: pb.DraftTree) -> int:
    return len(msg.token_ids) // 4


def draft_q(msg: pb.DraftTree) -> DraftQ | None:
    """A sampled tree's q (checked against the tree by validate_tree), or None for a top-k tree."""
    if msg.q_width == 0:
        return None
    m = msg.q_width
    if m < 0 or len(msg.q_ids) != len(msg.q_probs) or len(msg.q_ids) != 4 * m * (len(msg.q_rows) // 4):
        raise InvalidRequest(f"q bytes do not match q_width {m} and {len(msg.q_rows) // 4} rows")
    if len(msg.q_rows) % 4:
        raise InvalidRequest("q_rows is not a whole number of int32")
    return DraftQ(
        rows=np.frombuffer(msg.q_rows, dtype="<i4").astype(np.int64),
        ids=np.frombuffer(msg.q_ids, dtype="<i4").astype(np.int64).reshape(-1, m),
        probs=np.frombuffer(msg.q_probs, dtype="<f4").astype(np.float32).reshape(-1, m),
    )


def tree_of(msg: pb.DraftTree, max_nodes: int, vocab_size: int) -> Tree:
    """The checked tree of a message (InvalidRequest naming what is wrong)."""
    tokens, parents, probs = unpack(msg)
    return validate_tree(tokens, parents, probs, max_nodes=max_nodes, vocab_size=vocab_size, q=draft_q(msg))
