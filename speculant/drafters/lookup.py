"""Prompt lookup as a proposer: a drafter wrapper that copies what followed the latest earlier
occurrence of the context's last tokens, and otherwise asks the wrapped drafter (or, with none,
proposes nothing: the cycle is a plain target step).

A copy costs no forward, so it is offered as :meth:`propose_free`, before the verifier decides
whether drafting pays this cycle. Its drafts say ``source = LOOKUP``: adaptive width policies,
which model the drafter, verify copies whole and learn nothing from them. The wrapped drafter
still commits every cycle, copies included, so its context stays complete.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Sequence

from speculant.core.config import LookupConfig
from speculant.core.interfaces import Backend, Drafter
from speculant.core.lookup import DEFAULT_BLOCK_SIZE, PromptLookup
from speculant.core.types import Draft, DrafterInfo, DraftRequest, DraftSource, ForwardOutput


class LookupProposer(Drafter):
    """``drafter.lookup``: copies from the context first, then ``inner`` (None: lookup on its own)."""

    def __init__(self, inner: Drafter | None, config: LookupConfig, backend: Backend) -> None:
        self.inner = inner
        self.only_free = inner is None
        self.backend = backend
        self.config = config
        self.index = PromptLookup(config.min_match, config.max_match)
        self.info = inner.info if inner is not None else DrafterInfo(
            kind="lookup", default_block_size=DEFAULT_BLOCK_SIZE, uses_target_embedding=False,
            uses_target_lm_head=False)
        # (history length, copy or None) of the last lookup: the batch plan and the proposal ask
        # twice a cycle, and a copy's first k' tokens are the copy for k' (a miss misses for any k)
        self._last: tuple[int, list[int] | None] | None = None

    @property
    def fast_path(self) -> str:
        inner = "" if self.inner is None else f"; {self.inner.info.kind}: {self.inner.fast_path}"
        return f"prompt lookup (no forward){inner}"

    def fork(self) -> "LookupProposer":
        """A token history of its own, over a fork of the wrapped drafter (weights shared)."""
        other = copy.copy(self)
        other.inner = None if self.inner is None else self.inner.fork()
        other.index = PromptLookup(self.config.min_match, self.config.max_match)
        other._last = None
        return other

    def prefill(self, prompt_ids: Sequence[int], output: ForwardOutput, first_token_id: int) -> None:
        self.index.reset([*prompt_ids, first_token_id])
        self._last = None
        if self.inner is not None:
            self.inner.prefill(prompt_ids, output, first_token_id)

    def rejoin(self, history: Sequence[int]) -> bool:
        """Lookup on its own reads only tokens: its index is rebuilt from ``history``."""
        if self.inner is not None:
            return False
        self.index.reset(history)
        self._last = None
        return True

    def propose_free(self, request: DraftRequest) -> Draft | None:
        n, k = len(self.index.history), request.num_tokens
        if k < 1:
            return None
        last = self._last
        if last is not None and last[0] == n and (last[1] is None or k <= len(last[1])):
            copied = None if last[1] is None else last[1][:k]
        else:
            copied = self.index.propose(k)
            self._last = (n, copied)
        if copied is None:
            return None
        return Draft(self.backend.int_array(copied), len(copied), source=DraftSource.LOOKUP)

    def propose_beside(self, request: DraftRequest, copy: Draft) -> Draft | None:
        if self.inner is None:
            return None
        drafted = self.inner.propose(request)
        if drafted is None or drafted.logits is None:
            return None  # nothing for a tree to grow from: the copy is verified as a chain
        return replace(drafted, branch_ids=tuple(self.backend.ops.to_list(copy.token_ids)))

    def propose(self, request: DraftRequest) -> Draft | None:
        copy = self.propose_free(request)
        if copy is not None or self.inner is None:
            return copy
        return self.inner.propose(request)

    def propose_rows(self, drafters: Sequence[Drafter], requests: Sequence[DraftRequest]) -> list[Draft | None]:
        """Each row's copy where it has one, as :meth:`propose`; the wrapped drafters propose for the
        other rows together (one forward where they can)."""
        drafts = [d.propose_free(r) for d, r in zip(drafters, requests)]
        asking = [i for i, draft in enumerate(drafts) if draft is None and drafters[i].inner is not None]
        if asking:
            drafted = self.inner.propose_rows([drafters[i].inner for i in asking], [requests[i] for i in asking])
            for i, draft in zip(asking, drafted):
                drafts[i] = draft
        return drafts

    def commit(self, output: ForwardOutput, num_rows: int, token_ids: Sequence[int]) -> None:
        self.index.extend(token_ids)
        if self.inner is not None:
            self.inner.commit(output, num_rows, token_ids)
