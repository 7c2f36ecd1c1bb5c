"""A planted drafter for rollback tests and benchmarks: it proposes a known continuation of the
prompt (the target's own plain greedy output, computed beforehand) with planted mistakes, so a run
has blocks rejected at chosen positions, partway and accepted whole, on any target, however random.

``drafter.options``: ``script`` — ``[[prompt_ids, continuation_ids], ...]``; ``mistakes`` — the
block position (0 = the first proposal) spoiled in each successive cycle, cycling, ``-1`` for none;
``default_block_size``. Without a script entry for the prompt it proposes ``anchor + 1, + 2, ...``
(mostly rejected at position 0). Register it with :func:`registry_with_planted`.

Its drafts also carry per-position logits (what a tree verifier builds trees from): the proposed
token most likely, and at a spoiled position the right token second, so a tree of width 2 or more
recovers the planted mistake through a branch that the chain does not have.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from speculant.core.interfaces import Backend, Drafter, DrafterFactory, TargetModel
from speculant.core.types import Draft, DrafterInfo, DraftRequest, ForwardOutput, TargetInfo


class PlantedOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    script: list[tuple[list[int], list[int]]] = Field(default_factory=list)
    mistakes: list[int] = Field(default_factory=lambda: [-1])
    default_block_size: int = Field(8, ge=2)
    target_layer_ids: list[int] = Field(default_factory=list)  # target states to capture (tests read them)


class PlantedDrafter(Drafter):
    def __init__(self, info: DrafterInfo, backend: Backend, options: PlantedOptions, vocab: int) -> None:
        self.info = info
        self.backend = backend
        self.options = options
        self.vocab = vocab
        self.scripts = {tuple(prompt): list(continuation) for prompt, continuation in options.script}
        self.prompt_length = 0
        self.continuation: list[int] | None = None
        self.cycle = 0

    def fork(self) -> "PlantedDrafter":
        other = copy.copy(self)
        other.prompt_length, other.continuation, other.cycle = 0, None, 0
        return other

    def prefill(self, prompt_ids: Sequence[int], output: ForwardOutput, first_token_id: int) -> None:
        self.prompt_length = len(prompt_ids)
        self.continuation = self.scripts.get(tuple(int(t) for t in prompt_ids))
        self.cycle = 0

    def propose(self, request: DraftRequest) -> Draft:
        k = request.num_tokens
        logits = np.zeros((k, self.vocab), dtype=np.float32)
        if self.continuation is None:
            ids = [(request.anchor_id + 1 + i) % self.vocab for i in range(k)]
        else:
            start = request.position - self.prompt_length + 1  # the token after the anchor
            ids = (self.continuation[start : start + k] + [0] * k)[:k]
            spoiled = self.options.mistakes[self.cycle % len(self.options.mistakes)]
            if 0 <= spoiled < k:
                logits[spoiled, ids[spoiled]] = 3.0
                ids[spoiled] = (ids[spoiled] + 1) % self.vocab
        logits[np.arange(k), ids] = 4.0
        self.cycle += 1
        return Draft(token_ids=self.backend.int_array(ids), num_tokens=k, logits=self.backend.ops.asarray(logits))

    def commit(self, output: ForwardOutput, num_rows: int, token_ids: Sequence[int]) -> None:
        pass


class PlantedDrafterFactory(DrafterFactory):
    name = "planted"
    backends = ("torch", "mlx")
    options_model = PlantedOptions

    def describe(self, config, target: TargetInfo, backend: str):
        options = PlantedOptions.model_validate(config.options)
        info = DrafterInfo(
            kind=self.name,
            uses_target_embedding=False,
            uses_target_lm_head=False,
            default_block_size=options.default_block_size,
            target_layer_ids=tuple(options.target_layer_ids),
            trained_block_size=64,
            backends=self.backends,
            vocab_size=target.vocab_size,
        )
        return info, []

    def load(self, config, info: DrafterInfo, backend: Backend, target: TargetModel) -> Drafter:
        return PlantedDrafter(info, backend, PlantedOptions.model_validate(config.options), target.info.vocab_size)


def registry_with_planted() -> Any:
    """A fresh plugin registry with the built-ins and ``drafter.kind = "planted"``."""
    from speculant.plugins.manager import Registry

    registry = Registry().load()
    registry.drafters[PlantedDrafterFactory.name] = PlantedDrafterFactory()
    return registry
