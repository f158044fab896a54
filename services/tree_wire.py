"""Draft trees on the wire: common.tree.Tree <-> pb.DraftTree, whose arrays are packed little-endian bytes.

One numpy conversion each way: a repeated scalar field costs a Python object per element on both sides (for 64
sequences with 60-node trees, building, serializing, parsing and converting the trees took 0.97 ms with repeated
fields and 0.36 ms with packed bytes on the 2-core CPU of this workplace). The draft service packs (tree_msg), the
verifier's RemoteDrafter unpacks and checks (trees_of: all of a call's trees in one numpy pass); draft_tree builds
a message from plain lists (tests, tools)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress

import numpy as np

from common.errors import InvalidRequest
from common.tree import DraftQ, Tree, malformed_trees, validate_tree
from specdec.v1 import internal_pb2 as pb

# trees_of reads fewer trees one by one: its pass over the batch costs about 25 us however few there are,
# tree_of about 10 us a tree (a 60-node tree on the 2-core CPU of this workplace)
BATCH_FROM = 4


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


def trees_of(msgs: Sequence[pb.DraftTree], max_nodes: int, vocab_size: int) -> list[Tree]:
    """tree_of of each message: the same trees, and the same InvalidRequest for the first bad one.

    The common case, top-k trees whose arrays have whole values, agree in length and stay within
    max_nodes, is read for all trees at once (one frombuffer per array) and checked in one numpy pass
    (common.tree.malformed_trees). Every other tree (a sampled one, one of wrong lengths, one that pass
    refuses) goes through tree_of on its own, in item order: the first bad tree raises tree_of's message.
    Example: trees of 2, 1 and 3 nodes, the second sampled -> the first and third read as one [5] array,
    their trees its views [0:2] and [2:5]; the second from tree_of.
    """
    k = len(msgs)
    if k < BATCH_FROM:
        return [tree_of(m, max_nodes, vocab_size) for m in msgs]
    tokens_b = [m.token_ids for m in msgs]
    parents_b = [m.parents for m in msgs]
    probs_b = [m.draft_probs for m in msgs]
    token_bytes = np.fromiter(map(len, tokens_b), dtype=np.int64, count=k)  # [K]
    parent_bytes = np.fromiter(map(len, parents_b), dtype=np.int64, count=k)  # [K]
    prob_bytes = np.fromiter(map(len, probs_b), dtype=np.int64, count=k)  # [K]
    top_k = np.fromiter((m.q_width == 0 for m in msgs), dtype=bool, count=k)  # [K]
    fast = (
        top_k & (token_bytes % 4 == 0) & (token_bytes <= 4 * max_nodes) & (parent_bytes == token_bytes)
    )  # [K] read at once
    fast &= (prob_bytes == token_bytes) | (prob_bytes == 0)
    sizes = token_bytes[fast] // 4  # [F] nodes of each fast tree
    tokens = np.frombuffer(b"".join(compress(tokens_b, fast)), dtype="<i4").astype(np.int64)  # [N]
    parents = np.frombuffer(b"".join(compress(parents_b, fast)), dtype="<i4").astype(np.int64)  # [N]
    probs = np.ones(tokens.shape[0], dtype=np.float32)  # [N]: 1 where a tree sends none
    sent = np.repeat(prob_bytes[fast] > 0, sizes)  # [N] nodes whose tree sent its probabilities
    probs[sent] = np.frombuffer(b"".join(compress(probs_b, fast & (prob_bytes > 0))), dtype="<f4")
    good = fast.copy()  # [K] read at once and well formed
    good[fast] = ~malformed_trees(tokens, parents, sizes, vocab_size)
    ends = np.cumsum(sizes)
    spans = zip((ends - sizes).tolist(), ends.tolist())  # each fast tree's nodes, in item order
    out = []
    for msg, read, ok in zip(msgs, fast.tolist(), good.tolist()):
        a, b = next(spans) if read else (0, 0)
        out.append(
            Tree(tokens=tokens[a:b], parents=parents[a:b], probs=probs[a:b])
            if ok
            else tree_of(msg, max_nodes, vocab_size)
        )
    return out
