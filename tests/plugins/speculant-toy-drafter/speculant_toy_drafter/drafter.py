"""Prompt lookup: propose what followed the most recent earlier occurrence of the last n tokens.

Backend-neutral: proposals are host lists turned into backend arrays with
``backend.int_array``, so the same drafter runs on the torch and mlx backends.
"""

from __future__ import annotations

from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from speculant.plugin_api import (
    Backend,
    Draft,
    Drafter,
    DrafterConfig,
    DrafterFactory,
    DrafterInfo,
    DraftRequest,
    ForwardOutput,
    Problem,
    ProposalKind,
    TargetInfo,
    TargetModel,
)


class ToyOptions(BaseModel):
    """``drafter.options`` of the toy drafter."""

    model_config = ConfigDict(extra="forbid")

    ngram_max: int = Field(3, ge=1, description="longest suffix to look up")
    ngram_min: int = Field(1, ge=1, description="shortest suffix to look up")
    default_block_size: int = Field(4, ge=2, description="block (anchor + proposals) when drafter.block_size is unset")


def lookup(history: Sequence[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """``k`` tokens that followed the latest earlier match of the longest suffix of ``history``.

    Tries suffix lengths ``ngram_max`` down to ``ngram_min``; without a match, repeats the
    last token. A continuation shorter than ``k`` is padded with its own last token.
    """
    h = list(history)
    for n in range(min(ngram_max, len(h) - 1), ngram_min - 1, -1):
        pattern = h[-n:]
        for start in range(len(h) - n - 1, -1, -1):
            if h[start : start + n] == pattern:
                proposal = h[start + n : start + n + k]
                return proposal + [proposal[-1]] * (k - len(proposal))
    return [h[-1]] * k


class ToyDrafter(Drafter):
    def __init__(self, info: DrafterInfo, backend: Backend, options: ToyOptions) -> None:
        self.info = info
        self.backend = backend
        self.options = options
        self.history: list[int] = []

    def prefill(self, prompt_ids: Sequence[int], output: ForwardOutput, first_token_id: int) -> None:
        self.history = [int(t) for t in prompt_ids] + [int(first_token_id)]

    def propose(self, request: DraftRequest) -> Draft:
        if not self.history or self.history[-1] != request.anchor_id:
            raise RuntimeError(f"toy drafter out of sync: anchor {request.anchor_id}, history ends {self.history[-1:]}")
        ids = lookup(self.history, request.num_tokens, self.options.ngram_max, self.options.ngram_min)
        return Draft(token_ids=self.backend.int_array(ids), num_tokens=len(ids))

    def commit(self, output: ForwardOutput, num_rows: int, token_ids: Sequence[int]) -> None:
        self.history.extend(int(t) for t in token_ids)


class ToyDrafterFactory(DrafterFactory):
    name = "toy"
    backends = ("torch", "mlx")
    options_model = ToyOptions

    def describe(self, config: DrafterConfig, target: TargetInfo, backend: str) -> tuple[DrafterInfo | None, list[Problem]]:
        problems: list[Problem] = []
        if config.path is not None:
            problems.append(Problem("drafter.path", "the toy drafter reads no checkpoint; drafter.path is ignored",
                                    "remove drafter.path", severity="warning"))
        try:
            options = ToyOptions.model_validate(config.options)
        except ValidationError:  # the validator already reported it under drafter.options
            return None, problems
        info = DrafterInfo(
            kind=self.name,
            uses_target_embedding=False,
            uses_target_lm_head=False,
            trained_block_size=options.default_block_size,
            max_block_size=64,
            backends=self.backends,
            proposal_kinds=(ProposalKind.ONE_HOT,),
            can_sample=False,
            extra={"options": options.model_dump()},
        )
        return info, problems

    def load(self, config: DrafterConfig, info: DrafterInfo, backend: Backend, target: TargetModel) -> ToyDrafter:
        return ToyDrafter(info, backend, ToyOptions.model_validate(config.options))
