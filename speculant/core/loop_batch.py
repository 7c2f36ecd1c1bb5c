"""What a request's loop (core/loop.py) does in a batch (core/scheduler.py): joining it, moving
in and out of it, the room the batch plan may give it, and trees as wide as its padded block."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Hashable

from speculant.core import batch_move
from speculant.core.tree_cycle import trees_allowed
from speculant.core.types import Capture, DraftRequest, ForwardOutput

if TYPE_CHECKING:
    from speculant.core.batch import BatchedTarget, Join
    from speculant.core.loop import Proposal
    from speculant.core.prefix_cache import CacheSnapshot


# A prefill costs far less a token than a decoding step (SmolLM2 on a 2-core CPU: 758 tokens/s
# prefilling 300, 25 decoding), so a context up to this many times the tokens left is worth
# capturing again for a drafter: about a quarter of a step per token left.
RECAPTURE_CONTEXT = 8


class BatchedLoop:
    """The batch half of :class:`~speculant.core.loop.Loop` (its state is the loop's)."""

    def into_batch(self, rows: "BatchedTarget", key: Hashable, capture: Capture) -> list[int]:
        """Verify in batch ``rows`` as row ``key`` from now on (core/scheduler.py; ``capture``: the
        rows its forwards capture); drafting ahead ends for this request, and trees where the batch
        verifies none. A new request joins from the longest stored prefix of its prompt
        (prefix_request.py) and returns its first token; one that ran alone moves its caches in
        (core/batch_move.py), its prefix store's recording going on from its row."""
        self._batched(rows)
        if not self.produced:
            return self._started(self.prefix.join(rows, key, capture))
        batch_move.into_batch(self.e.target, rows, key, self._context(), capture, self.stats)
        self.prefix.moved_into(rows, key)
        return []

    def planned_join(self, rows: "BatchedTarget", key: Hashable) -> "Join | None":
        """How this new request joins ``rows`` as row ``key`` beside others (``rows.join_many``, the
        output then to :meth:`joined`); None where it joins alone through :meth:`into_batch`."""
        planned = None if self.produced else self.prefix.planned_join(rows, key)
        if planned is not None:
            self._batched(rows)
        return planned

    def joined(self, out: ForwardOutput) -> list[int]:
        """The first token of the request from its :meth:`planned_join`'s output."""
        return self._started(self.prefix.joined(out))

    def _batched(self, rows: "BatchedTarget") -> None:
        self.batched, self.draft_ahead = True, False
        self.trees = self.trees and rows.tree_problem() is None
        self.verifier.batched(True)

    def out_of_batch(self, snapshot: "CacheSnapshot | None") -> None:
        """Back on the target's own cache, the last of a batch, from its row's ``snapshot``
        (core/batch_move.py); drafting ahead and trees may resume."""
        self.prefix.left_batch()
        self.verifier.batched(False)
        self.rejoin("alone")
        batch_move.out_of_batch(self.e.target, snapshot, self._context(), self.stats)
        self.draft_ahead = self.speculating and self._may_draft_ahead()
        self.trees = self.speculating and trees_allowed(self.e)

    def stop_for_batch(self, note: str) -> None:
        """The batch turns this request's drafting off (``note``, in its stats, says why) until
        :meth:`rejoin`."""
        self.speculating, self.batch_stopped = False, True
        self.stats.batch_note = note

    def stopped_by_batch(self) -> bool:
        """Whether the batch turned this request's drafting off and its context is still short
        enough to draft (the verifier's ``max_context``)."""
        return self.batch_stopped and (self.limit is None or self.position < self.limit)

    def rejoin(self, where: str) -> bool:
        """Draft again after the batch turned drafting off, where the tokens left are worth it: a
        drafter that needs only the tokens from them (``Drafter.rejoin``), one that reads the
        target's hidden states (DFlash, MTP) from one prefill of the context that captures them,
        run on the target's own cache (unused while batched; restored from the row when alone)."""
        if not self.stopped_by_batch():
            return False
        context, left, how = self._context(), self.max_new - len(self.produced), ""
        if not self.drafter.rejoin([*context, self.produced[-1]]):
            if len(context) > RECAPTURE_CONTEXT * left:
                return False
            target = self.e.target
            target.reset()
            self.drafter.prefill(context, target.prefill(context, self.drafter.info.capture), self.produced[-1])
            target.reset()
            how = f", after a prefill of its {len(context)} tokens"
        self.speculating, self.batch_stopped, self.plain_streak = True, False, 0
        self.stats.batch_note = f"{self.stats.batch_note}; drafted again from token {len(self.produced)}, {where}{how}"
        return True

    def _context(self) -> list[int]:
        """What the caches hold between cycles: the prompt and the emitted tokens but the last (the next anchor)."""
        return list(self.prompt_ids) + self.produced[:-1]

    def as_tree(self, chain: "Proposal", budget: int) -> "Proposal":
        """``chain`` as a tree of at most ``budget`` drafted nodes, where this request verifies
        trees and its verifier builds one (a batch: as wide as its padded block)."""
        tree = self.verifier.tree(self.e.backend.ops, chain.draft, chain.anchor, budget) \
            if self.trees and chain.draft is not None and budget > 0 else None
        return chain if tree is None else replace(chain, tree=tree)

    def room_now(self) -> int:
        """Drafts this cycle could verify, for the batch plan: the room left, or, for a drafter that
        only copies, its copy's length (0 where the context offers none: drafting would gain nothing)."""
        k = max(0, self._room(self.position)) if self.speculating else 0
        if k and self.drafter.only_free:
            free = self.drafter.propose_free(DraftRequest(self.produced[-1], self.position, k, self.sampling,
                                                          self.draft_rng))
            k = 0 if free is None else free.num_tokens
        return k
