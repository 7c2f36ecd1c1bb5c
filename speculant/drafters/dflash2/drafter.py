"""DFlash2 proposals, written once over a backend's :class:`DFlash2Network`.

The DFlash lifecycle (:class:`~speculant.drafters.dflash.drafter.DFlashDrafter`) computes the
block's hidden rows and draft logits; the network's candidate selector turns them into one
score table, copied to the host in a single transfer, and the host walk
(:mod:`speculant.drafters.dflash2.selector`) picks the path. Greedy rounds give a one-hot
draft; sampled rounds a sparse draft (q [k, K] over candidate ids [k, K]). ``confidence`` is the
walk's probability of each chosen token (temperature 1 when greedy); it comes with the table,
at no extra sync.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from speculant.core.types import Array, Draft, DraftRequest
from speculant.drafters.dflash.drafter import DFlashDrafter, DFlashNetwork
from speculant.drafters.dflash2.selector import ScoreTable, walk


class DFlash2Network(DFlashNetwork, Protocol):
    """A :class:`DFlashNetwork` whose model also holds the candidate selector."""

    def score_table(self, hidden: Array, logits: Array, anchor_id: int) -> tuple[np.ndarray, Array]:
        """The selector's round on the host as one flat float32 vector (see
        :meth:`ScoreTable.from_flat`), and the candidate ids [k, K] left on the device. The
        transfer also completes the cache writes (nothing is left pending on lazy backends)."""


class DFlash2Drafter(DFlashDrafter):
    """DFlash2 proposals over a :class:`DFlash2Network`."""

    net: DFlash2Network

    def propose_ahead(self, output, anchor, request) -> None:
        return None  # the path selector reads the anchor token on the host

    def _draft(self, request: DraftRequest, hidden: Array, logits: Array) -> Draft:
        """The selector's path over the block's draft rows (the path walk and its uniforms are each
        row's own, so :meth:`propose_rows` keeps every request's sampling and rng)."""
        k = request.num_tokens
        flat, candidates = self.net.score_table(hidden, logits, request.anchor_id)
        table = ScoreTable.from_flat(flat, k, self.cfg.selector_top_k)
        path = walk(table, request.sampling, request.rng)
        tokens = self.backend.int_array(path.token_ids)
        if path.q is None:
            return Draft(tokens, k, confidence=path.confidence, logits=logits, path_scores=table)
        return Draft(tokens, k, draft_probs=self.ops.asarray(path.q), candidate_ids=candidates,
                     confidence=path.confidence, logits=logits, path_scores=table)
