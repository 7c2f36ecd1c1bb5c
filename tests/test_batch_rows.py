"""core.batch_book.RowBook, the row bookkeeping both backends' batches share (no array library)."""

from __future__ import annotations

import numpy as np
import pytest

from speculant.core.batch_book import RowBook
from speculant.core.batch_join import join_groups, join_plan


def test_rows_keep_their_own_positions_through_blocks_crops_and_compaction():
    book = RowBook(compact_at=1.0)  # compact only when asked
    book.add_row(3)
    book.add_row(1)
    query = book.open_block([2, 4])
    assert query.tolist() == [[3, 4, 5, 6], [1, 2, 3, 4]]
    seen = book.visible(query, None)
    assert seen[0, 1].tolist() == [True] * 5 + [False, False]  # its prompt and block so far, not its padding
    assert seen[1, 0].tolist() == [True, False, False, True, False, False, False]  # its own held column, then itself
    assert not book.crop([4, 1], names=["a", "b"])  # a keeps one of its block, b none
    assert book.lengths.tolist() == [4, 1]
    order = book.compaction()
    assert order.shape == (2, 4)
    assert book.positions[0].tolist() == [0, 1, 2, 3] and book.positions[1, :1].tolist() == [0]
    assert book.valid.tolist() == [[True] * 4, [True, False, False, False]]


def test_a_window_hides_positions_that_far_back():
    book = RowBook()
    book.add_row(5)
    seen = book.visible(book.open_block([1]), window=2)
    assert seen[0, 0].tolist() == [False, False, False, False, True, True]


def test_a_crop_outside_the_last_block_names_the_sequence():
    book = RowBook()
    book.add_row(3)
    with pytest.raises(RuntimeError, match="no block was verified"):
        book.crop([3], names=["a"])
    book.open_block([2])
    with pytest.raises(ValueError, match="sequence 'a': crop to 6 outside its last block"):
        book.crop([6], names=["a"])
    assert book.crop([3], names=["a"]) is True  # two of five cells are holes: past 25 %
    assert np.array_equal(book.compaction(), [[0, 1, 2]])


def test_a_short_rows_unused_tail_does_not_make_plain_steps_compact():
    """A compaction keeps as many columns as the longest row holds, so the columns a short prompt
    never filled are not holes it could free: plain steps beside a long row never compact (a gather
    of every layer's keys and values for nothing), and rejected drafts that leave every row's block
    columns empty do."""
    book = RowBook()
    book.add_row(40)
    book.add_row(3)
    for _ in range(8):
        kept = (book.lengths + 1).tolist()  # each plain step keeps its token
        book.open_block([1, 1])
        assert not book.crop(kept, names=["long", "short"])
    for _ in range(3):
        kept = (book.lengths + 1).tolist()  # every draft rejected: the anchor alone kept
        book.open_block([8, 8])
        compact = book.crop(kept, names=["long", "short"])
    assert compact  # 21 of 72 columns are held by no row


def test_joining_prompts_group_within_the_budget_and_padding_at_most_doubling_the_work():
    # shortest first; a prompt past the budget alone; the other kind of join (0) left out
    assert join_groups([3, 7, 20, 1, 0, 300], budget=512) == [[0, 1, 2], [3], [5]]
    # one-token prompts (a repeated prompt after its stored prefix) group among themselves only
    assert join_groups([1, 5, 1, 4, 1], budget=512) == [[0, 2, 4], [3, 1]]
    assert join_groups([1, 1, 1], budget=2) == [[0, 1], [2]]
    assert join_groups([10, 10, 10], budget=20) == [[0, 1], [2]]
    # 2, 2, 2 then 40: four rows of 40 (160) would be more than twice their 46 real tokens
    assert join_groups([40, 2, 2, 2], budget=512) == [[0], [1, 2, 3]]
    assert join_groups([3, 9, 3, 9], budget=512, equal=True) == [[0, 2], [1, 3]]
    assert join_groups([5, 6], budget=0) == [[0], [1]]  # a batch that prefills each alone


def test_prompts_restoring_stored_prefixes_group_among_themselves_by_what_they_run():
    stored = object()  # (a snapshot: only its restored length counts here)
    joins = [("a", [1] * 5, None), ("b", [1] * 44, (stored, 40)), ("c", [1] * 6, None), ("d", [1] * 39, (stored, 36)),
             ("e", [1] * 41, (stored, 40))]  # run: 5, 4, 6, 3, 1
    assert join_plan(joins, budget=512) == [[0, 2], [3, 1], [4]]
    assert join_plan(joins, budget=512, equal=True) == [[0], [1], [2], [3], [4]]


def test_a_tree_rows_block_sits_at_its_depths_sees_its_ancestors_and_keeps_its_path():
    from speculant.core.tree import DraftTree

    book = RowBook(lengths=[3, 2])
    tree = DraftTree((9, 1, 2, 3, 4), (-1, 0, 0, 1, 2))  # depths 0, 1, 1, 2, 2
    query = book.open_block([5, 2], [tree, None])
    assert query.tolist() == [[3, 4, 4, 5, 5], [2, 3, 4, 5, 6]]
    seen = book.block_visibility()[:, :, -5:]
    assert seen[0, 3].tolist() == [True, True, False, True, False]  # node 3: the root, node 1, itself
    assert seen[1, 1].tolist() == [True, True, False, False, False]  # the chain row: causal
    valid = book.valid.copy()
    with pytest.raises(ValueError, match="'chain' keeps 2 tree nodes for 1 positions"):
        book.crop([6, 3], ["tree", "chain"], [[0, 2, 4], [0, 1]])
    assert (book.valid == valid).all()  # nothing cropped, the tree row's included
    book.crop([6, 3], ["tree", "chain"], [[0, 2, 4], None])
    assert book.block_visibility() is None
    assert book.positions[0, book.held(0)].tolist() == list(range(6))  # the path, in order after the prefix
    assert book.held(0).tolist() == [0, 1, 2, 3, 5, 7]  # its nodes' own columns: nothing moved
    order = book.compaction()
    assert order[0].tolist() == [0, 1, 2, 3, 5, 7] and book.positions[0].tolist() == list(range(6))
