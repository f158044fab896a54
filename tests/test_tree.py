"""Tree bookkeeping against hand-computed expectations (worked example in common/tree.py)."""

import numpy as np
import pytest

from common.errors import InvalidRequest
from common.tree import (
    ancestor_mask,
    children_lists,
    depths,
    malformed_trees,
    node_positions,
    path_to_root,
    select_top_nodes,
    validate_tree,
)

PARENTS = np.array([-1, -1, 0, 1])  # r -> a, b; a -> c; b -> d


def test_depths_children_and_paths():
    assert depths(PARENTS).tolist() == [1, 1, 2, 2]
    assert children_lists(PARENTS) == [[0, 1], [2], [3], [], []]
    assert path_to_root(PARENTS, 3) == [1, 3]
    assert path_to_root(PARENTS, 0) == [0]


def test_ancestor_mask_worked_example():
    expected = np.array(
        [
            [1, 0, 0, 0, 0],  # r
            [1, 1, 0, 0, 0],  # a
            [1, 0, 1, 0, 0],  # b
            [1, 1, 0, 1, 0],  # c: r, a, c
            [1, 0, 1, 0, 1],  # d: r, b, d
        ],
        dtype=bool,
    )
    assert (ancestor_mask(PARENTS) == expected).all()


@pytest.mark.parametrize(
    "parents, message",
    [
        ([-1, 5], "outside"),  # parent index out of range
        ([-1, -2], "outside"),
        ([1, -1], "does not precede"),  # forward reference: a cycle 0 -> 1 -> 0 is impossible to express
        ([-1, 1], "does not precede"),  # self loop
    ],
)
def test_validate_rejects_malformed(parents, message):
    with pytest.raises(InvalidRequest, match=message):
        validate_tree(np.array([5, 6]), np.array(parents), np.array([]), max_nodes=8, vocab_size=100)


def test_validate_rejects_size_and_vocab():
    with pytest.raises(InvalidRequest, match="more than the limit"):
        validate_tree(np.arange(5), np.full(5, -1), np.array([]), max_nodes=4, vocab_size=100)
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        validate_tree(np.array([1, 100]), np.array([-1, 0]), np.array([]), max_nodes=4, vocab_size=100)
    with pytest.raises(InvalidRequest, match="parent indices"):
        validate_tree(np.array([1, 2]), np.array([-1]), np.array([]), max_nodes=4, vocab_size=100)


def test_node_positions_worked_example():
    tree, local = node_positions(np.array([2, 3]))
    assert tree.tolist() == [0, 0, 1, 1, 1]
    assert local.tolist() == [0, 1, 0, 1, 2]
    tree, local = node_positions(np.array([0, 2, 0]))  # empty trees own no nodes
    assert tree.tolist() == [1, 1] and local.tolist() == [0, 1]


def test_malformed_trees_flags_what_validate_tree_refuses():
    # the docstring's example: node 1 of the second tree names node 2, which does not precede it
    sizes = np.array([2, 3])
    assert malformed_trees(np.array([5, 6, 7, 8, 9]), np.array([-1, 0, -1, 2, 0]), sizes, 10).tolist() == [False, True]
    # one tree per fault, among good ones: token too large, negative token, parent -2, parent past the tree,
    # self loop, and a parent index that is valid in the batch but not in its own tree (node 0 naming 0)
    trees = [
        ([1, 2], [-1, 0], False),
        ([1, 10], [-1, 0], True),
        ([-1, 2], [-1, 0], True),
        ([1, 2], [-1, -2], True),
        ([1, 2], [-1, 5], True),
        ([1, 2], [-1, 1], True),
        ([3], [0], True),
        ([], [], False),
        ([4, 5, 6], [-1, -1, 1], False),
    ]
    tokens = np.concatenate([np.array(t, dtype=np.int64) for t, _, _ in trees])
    parents = np.concatenate([np.array(p, dtype=np.int64) for _, p, _ in trees])
    sizes = np.array([len(t) for t, _, _ in trees])
    assert malformed_trees(tokens, parents, sizes, 10).tolist() == [bad for _, _, bad in trees]
    for t, p, bad in trees:  # validate_tree agrees on each
        if bad:
            with pytest.raises(InvalidRequest):
                validate_tree(np.array(t), np.array(p), np.array([]), max_nodes=8, vocab_size=10)
        else:
            validate_tree(np.array(t), np.array(p), np.array([]), max_nodes=8, vocab_size=10)


def test_select_top_nodes_keeps_parents_and_reindexes():
    # candidates in creation order: 0:a(-0.1) 1:b(-2.0) 2:c child of a(-0.5) 3:d child of b(-3.0) 4:e child of c(-0.6)
    scores = np.array([-0.1, -2.0, -0.5, -3.0, -0.6])
    parents = np.array([-1, -1, 0, 1, 2])
    kept, new_parents = select_top_nodes(scores, parents, 3)
    assert kept.tolist() == [0, 2, 4]  # a, c, e: the best three form a chain
    assert new_parents.tolist() == [-1, 0, 1]  # [a, c, e] -> parents [root, a, c]


def test_select_top_nodes_tie_prefers_parent():
    # child with log-probability 0 ties with its parent: the earlier-created parent must win the last place
    scores = np.array([-1.0, -1.0, -0.5])
    parents = np.array([-1, 0, -1])
    kept, new_parents = select_top_nodes(scores, parents, 2)
    assert kept.tolist() == [0, 2]
    assert new_parents.tolist() == [-1, -1]


def test_start_shift_pairs_hidden_states_with_the_tokens_they_produced() -> None:
    """The EAGLE one-token shift (common/rounds.py), its worked example."""
    from common.rounds import start_shift

    assert start_shift([5, 6, 7], 8) == ([6, 7, 8], [5])
    assert start_shift([5], 8) == ([8], [5])


def test_row_sets_worked_examples():
    """The sets the sampled acceptance follows (common.tree.row_sets' docstring): a one-hot tree's rows hold
    their children's distinct tokens in node order (a repeated token takes its first's position), a q tree's
    rows its q, padded to the batch's rows and width; widest counts a row's children."""
    from common.tree import DraftQ, Tree, row_sets, widest

    hot = Tree(np.array([7, 9, 7, 5]), np.array([-1, -1, -1, 0]), np.ones(4, np.float32))
    q = DraftQ(
        rows=np.array([0, 1]), ids=np.array([[9, 7, 3], [4, 7, 8]]), probs=np.array([[0.5, 0.3, 0.2], [0.6, 0.4, 0]])
    )
    drawn = Tree(np.array([7, 9, 7]), np.array([-1, -1, 0]), np.ones(3, np.float32), q)
    none = Tree(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))
    sets = row_sets([hot, drawn, none], 6, 4)
    assert sets.ids[0, :2].tolist() == [[7, 9, 0, 0], [5, 0, 0, 0]] and sets.q[0, :2].tolist() == [
        [1, 1, 0, 0],
        [1, 0, 0, 0],
    ]
    assert sets.pos.tolist() == [[0, 0, 1, 0, 0, 0], [0, 1, 0, 1, 0, 0], [0] * 6]
    assert sets.ids[1, :2].tolist() == [[9, 7, 3, 0], [4, 7, 8, 0]]
    np.testing.assert_allclose(sets.q[1, 1], [0.6, 0.4, 0, 0])
    assert not sets.ids[2].any() and widest([hot, drawn]) == 3 and widest([none]) == 0


def test_q_must_name_each_token_once():
    from common.tree import DraftQ

    q = DraftQ(rows=np.array([0]), ids=np.array([[4, 4, 5]]), probs=np.array([[0.5, 0.3, 0.2]]))
    with pytest.raises(InvalidRequest, match="twice"):
        validate_tree(np.array([4]), np.array([-1]), np.ones(1), max_nodes=4, vocab_size=10, q=q)
    unheld = DraftQ(rows=np.array([0]), ids=np.array([[4, 5, 5]]), probs=np.array([[0.8, 0.2, 0.0]]))
    validate_tree(np.array([4]), np.array([-1]), np.ones(1), max_nodes=4, vocab_size=10, q=unheld)  # 0: no matter
