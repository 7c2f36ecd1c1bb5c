"""A draft tree's shape, as the engine, the verifier and the targets read it (no array library).

Node 0 is the root: the cycle's anchor (the last emitted token, not yet in the target's cache).
Every other node is a drafted token; its parent comes earlier in the node order, so a node's
ancestors are all before it and a forward over the nodes in order is well defined.

A tree verify forward runs every node at once: node ``i`` sits at position ``prefix + depth[i]``
and sees the committed prefix plus its own ancestors and itself (:meth:`DraftTree.ancestor_mask`).
That is exactly what running the root-to-``i`` path as its own chain would compute for ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class DraftTree:
    """``tokens[i]`` the token of node ``i``; ``parents[i]`` its parent (-1 for the root)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens or self.parents[0] != -1:
            raise ValueError("a draft tree needs one parent per token and node 0 as its root (parent -1)")
        depths = [0]
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i}'s parent {p} must be an earlier node")
            depths.append(depths[p] + 1)
        object.__setattr__(self, "depths", tuple(depths))

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        """A tree with one branch: ``tokens[0]`` the root, each next token the child of the one before."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    @property
    def size(self) -> int:
        """Nodes, the root included (the verify forward's width)."""
        return len(self.tokens)

    @property
    def num_drafted(self) -> int:
        return len(self.tokens) - 1

    def positions(self, prefix_length: int) -> list[int]:
        """Each node's absolute position when the cache holds ``prefix_length`` positions."""
        return [prefix_length + d for d in self.depths]

    def ancestor_mask(self) -> np.ndarray:
        """``[T, T]`` bool: ``mask[i, j]`` iff node ``j`` is node ``i`` or one of its ancestors."""
        n = self.size
        mask = np.zeros((n, n), dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def visibility(self, cached: int, window: int | None = None) -> np.ndarray:
        """``[T, cached + T]`` bool: what each node attends to when the attention layer holds the
        ``cached`` positions just before the tree and then the tree's own rows. Under a sliding
        ``window`` a cached row is seen only from fewer than ``window`` positions on, as by a
        chain token at the node's position."""
        if window is None:
            before = np.ones((self.size, cached), dtype=bool)
        else:  # cached row r is (cached - r) positions before the root; the node is depth further on
            before = np.asarray(self.depths)[:, None] + np.arange(cached, 0, -1)[None, :] < window
        return np.concatenate([before, self.ancestor_mask()], axis=1)

    def children(self) -> list[dict[int, int]]:
        """Per node, its children by token (a token appears at most once under one parent)."""
        out: list[dict[int, int]] = [{} for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            out[p].setdefault(self.tokens[i], i)
        return out

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root to ``node``, both included."""
        path = [node]
        while self.parents[path[-1]] >= 0:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def leaves(self) -> list[int]:
        has_child = set(self.parents[1:])
        return [i for i in range(self.size) if i not in has_child]


def with_branch(tree: DraftTree, tokens: list[int] | tuple[int, ...]) -> tuple[DraftTree, list[int]]:
    """``tree`` with the path ``tokens`` under its root (a prompt-lookup copy): where the path's
    tokens are already nodes they are shared, the rest are appended in order. Returns the new tree
    and the appended nodes (the ones only the branch proposed)."""
    token_list, parents = list(tree.tokens), list(tree.parents)
    children = tree.children()
    node, added = 0, []
    for token in tokens:
        child = children[node].get(int(token)) if node < len(children) else None
        if child is None:
            child = len(token_list)
            token_list.append(int(token))
            parents.append(node)
            added.append(child)
        node = child
    return DraftTree(tuple(token_list), tuple(parents)), added


TREE_LAYER_KINDS = ("full_attention", "sliding_attention")


def layer_kinds_problem(backend: str, layer_types: tuple[str, ...], family: str,
                        also: tuple[str, ...] = ()) -> str | None:
    """Why ``backend`` cannot verify a tree over these layer kinds in one forward, or None: the
    attention kinds gather a path's rows; ``also`` names the other kinds this backend handles for
    this family (a recurrent state per tree node)."""
    taken = TREE_LAYER_KINDS + also
    refused = [k for k in dict.fromkeys(layer_types or ("full_attention",)) if k not in taken]
    if not refused:
        return None
    return (f"the {backend} backend verifies trees over {', '.join(taken)} layers only here, "
            f"not {', '.join(refused)} (target family {family}: a recurrent state per tree node is not implemented)")


class _Gather:
    """Which tree rows a target's commit keeps (:func:`kept_rows`): a seam for the tests that prove
    the gather matters, which set ``keep(tree, path)`` to return a sibling's rows instead."""

    keep = None


GATHER = _Gather()


def conv_windows(parents: Sequence[int], kernel: int, cached: int) -> list[list[int]]:
    """For a causal convolution of ``kernel`` taps over ``cached`` rows followed by the tree's
    nodes: each node's input rows, oldest first (its ancestors' rows, then the cached ones)."""
    windows = []
    for i in range(len(parents)):
        column, back, node = [], 0, i
        while len(column) < kernel:
            if node >= 0:
                column.append(cached + node)
                node = parents[node]
            else:
                back += 1
                column.append(cached - back)
        windows.append(column[::-1])
    if windows and min(min(w) for w in windows) < 0:
        raise RuntimeError("the cached convolution window is shorter than the kernel")
    return windows


def kept_rows(tree: DraftTree, path: list[int] | tuple[int, ...]) -> list[int]:
    """The tree rows a commit of the accepted ``path`` keeps, in order: the path's own."""
    return list(path) if GATHER.keep is None else GATHER.keep(tree, list(path))
