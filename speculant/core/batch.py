"""What a backend offers to verify several live sequences in one target forward (docs/batching.md).

The batch scheduler of issue #39 will stand on this: each cycle it verifies every sequence's
anchor + drafts (ragged widths) in one :meth:`BatchedTarget.verify` and rolls each sequence back to
its own accepted length with one :meth:`BatchedTarget.crop`; sequences join and leave between
cycles. Arrays are the backend's, handled through its ``ArrayOps`` as everywhere in core.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable, Sequence

from speculant.core.types import Capture, ForwardOutput


class BatchedTarget(ABC):
    """The live sequences of one batch over a loaded target; row ``i`` is sequence ``keys[i]``.
    Calls alternate: any joins and leaves, one verify, one crop, then again."""

    keys: list[Hashable]

    @property
    @abstractmethod
    def lengths(self) -> list[int]:
        """Each sequence's cache length (positions held), in row order."""

    @abstractmethod
    def join(self, key: Hashable, token_ids: Sequence[int], capture: Capture = Capture()) -> ForwardOutput:
        """Prefill a new sequence ``key`` and add it as the last row: logits of its last prompt
        position, captured states of every one. Only between cycles."""

    @abstractmethod
    def leave(self, key: Hashable) -> None:
        """Drop sequence ``key`` and its cache rows. Only between cycles."""

    @abstractmethod
    def verify(self, blocks: Sequence[Sequence[int]], capture: Capture = Capture()) -> list[ForwardOutput]:
        """Run ``blocks[i]`` (anchor + drafts of ``keys[i]``, one token or more) after each
        sequence's cache, in one forward; per sequence, the logits and captured states of its rows."""

    @abstractmethod
    def lengths_before_block(self) -> list[int]:
        """Each sequence's cache length before the last verified block."""

    @abstractmethod
    def crop(self, lengths: Sequence[int]) -> None:
        """After :meth:`verify`: keep each sequence's first ``lengths[i]`` positions, between its
        length before the block and that plus the block's width (its own accepted length)."""
