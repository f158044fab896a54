"""The verifier's host path in batches, pinned against the per-item rules it replaced: the trees of a Verify
read and checked in one numpy pass (the same trees, the same error for the first bad one), the hidden rows
of many sequences written into the exported buffer in one copy (where one write each puts them), the verify
block packed at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.engine.base import VerifyInput
from common.engine.verifier import Verifier
from common.errors import InvalidRequest
from common.ipc import HiddenExport
from common.tree import DraftQ, Tree
from services.tree_wire import BATCH_FROM, draft_tree, tree_msg, tree_of, trees_of
from specdec.v1 import internal_pb2 as pb

VOCAB = 10


def _q_tree(ids_shift: int = 0) -> pb.DraftTree:
    """A sampled tree: q at the root and at node 0 (tests/test_sampling_rule.py's example)."""
    q = DraftQ(
        rows=np.array([0, 1]),
        ids=np.array([[7, 9, 3], [4, 7, 8]]) + ids_shift,
        probs=np.array([[0.5, 0.3, 0.2], [0.6, 0.4, 0]]),
    )
    msg = pb.DraftTree()
    tree_msg(Tree(np.array([9, 7, 4]), np.array([-1, -1, 0]), np.array([0.3, 0.5, 0.6]), q), msg)
    return msg


GOOD = [
    draft_tree([1, 2, 3], [-1, 0, 0], [0.5, 0.25, 0.125]),
    draft_tree([4], [-1]),  # no probabilities: all 1
    draft_tree([], []),
    draft_tree([5, 6, 7, 8], [-1, -1, 0, 2], [1, 1, 1, 1]),
    _q_tree(),
]
BAD = [
    draft_tree([5, 6], [-1, 7]),  # parent out of range
    draft_tree([5, 6, 7], [-1, 2, 1]),  # parent does not precede
    draft_tree([5, 6], [-1, 1]),  # self loop
    draft_tree([5, 10], [-1, 0]),  # token outside the vocabulary
    draft_tree([-3, 1], [-1, 0]),  # negative token
    draft_tree([5] * 9, [-1] * 9),  # over max_nodes
    draft_tree([5, 6], [-1]),  # fewer parents than tokens
    draft_tree([5, 6], [-1, 0], [0.5]),  # wrong number of probabilities
    pb.DraftTree(token_ids=b"\0" * 6, parents=b"\0" * 6),  # not whole int32 values
    _q_tree(ids_shift=1),  # children not drawn from q
]


def _message(msg: pb.DraftTree) -> str:
    with pytest.raises(InvalidRequest) as e:
        tree_of(msg, max_nodes=8, vocab_size=VOCAB)
    return str(e.value)


def _same_tree(a: Tree, b: Tree) -> None:
    for x, y in ((a.tokens, b.tokens), (a.parents, b.parents), (a.probs, b.probs)):
        assert x.dtype == y.dtype and x.tolist() == y.tolist()
    assert (a.q is None) == (b.q is None)
    if a.q is not None:
        assert a.q.rows.tolist() == b.q.rows.tolist() and a.q.ids.tolist() == b.q.ids.tolist()


def test_trees_of_reads_the_trees_tree_of_reads() -> None:
    """Every good tree, in batches below and above BATCH_FROM, comes back as tree_of returns it (dtypes too)."""
    for batch in (GOOD[:2], GOOD * 3):
        got = trees_of(batch, max_nodes=8, vocab_size=VOCAB)
        assert len(got) == len(batch)
        for msg, tree in zip(batch, got):
            _same_tree(tree, tree_of(msg, max_nodes=8, vocab_size=VOCAB))


def test_trees_of_raises_tree_of_message_for_the_first_bad_tree() -> None:
    """Each bad tree, at the start, middle or end of a batch of good ones and before another bad one,
    raises exactly tree_of's message for it."""
    assert len(GOOD) + 2 >= BATCH_FROM  # the batched pass runs
    for i, bad in enumerate(BAD):
        want = _message(bad)
        later = BAD[(i + 1) % len(BAD)]
        for at in (0, 2, len(GOOD)):
            batch = [*GOOD[:at], bad, *GOOD[at:], later]
            with pytest.raises(InvalidRequest) as e:
                trees_of(batch, max_nodes=8, vocab_size=VOCAB)
            assert str(e.value) == want, (i, at)


def test_write_many_lands_where_one_write_each_does() -> None:
    """The docstring's example: 4 rows a region, a in region 2 from row 1 (2 rows), b in region 0 (1 row)
    -> hidden rows [a0, a1, b0] at flat rows [9, 10, 0]; the same buffer, offsets and write counts as
    write() once per sequence."""
    hidden = torch.arange(9, dtype=torch.float32).reshape(3, 3)  # [a0, a1, b0], width 3
    exports = [HiddenExport(4, 4, 3, torch.float32, torch.device("cpu")) for _ in range(2)]
    for e in exports:  # b takes region 0, then x region 1, a region 2
        for s in ("b", "x", "a"):
            e.write(s, torch.zeros(1, 3))
    batched, single = exports
    placed = batched.write_many(["a", "b"], hidden, [2, 1], [1, 0])
    row_bytes = 3 * 4
    assert placed == [(9 * row_bytes, 2), (0, 2)]
    assert placed == [single.write("a", hidden[:2], 1), single.write("b", hidden[2:], 0)]
    assert torch.equal(batched.buffer, single.buffer)
    assert torch.equal(batched.flat[[9, 10, 0]], hidden)


def test_write_many_checks_every_range_before_writing() -> None:
    export = HiddenExport(4, 4, 2, torch.float32, torch.device("cpu"))
    export.write("a", torch.zeros(1, 2))
    with pytest.raises(InvalidRequest, match=r"hidden rows \[3, 5\) exceed the exported region of 4"):
        export.write_many(["a", "new"], torch.ones(3, 2), [1, 2], [0, 3])
    assert not export.buffer.any() and len(export.table) == 1  # nothing written, no region taken
    with pytest.raises(ValueError, match="twice"):
        export.write_many(["a", "a"], torch.ones(2, 2), [1, 1])


def test_pack_trees_worked_example() -> None:
    """_pack_trees' docstring: trees [a, b] (parents [-1, 0]) and [c] ([-1]) in a block of tb = 4 rows."""
    a, b, c = 11, 12, 13
    items = [
        VerifyInput("s", Tree(np.array([a, b]), np.array([-1, 0]), np.ones(2, np.float32))),
        VerifyInput("t", Tree(np.array([c]), np.array([-1]), np.ones(1, np.float32))),
    ]
    block = np.zeros((2, 2 * 4 + 3), dtype=np.int64)
    block[:, 4:8] = np.arange(4)  # padding rows name themselves
    Verifier._pack_trees(block, items, np.array([2, 1]))
    assert block[:, :4].tolist() == [[0, a, b, 0], [0, c, 0, 0]]
    assert block[:, 4:8].tolist() == [[0, 0, 1, 3], [0, 0, 2, 3]]
