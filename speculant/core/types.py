"""Small value types that flow between the engine, targets, drafters and verifiers."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Protocol

Array = Any  # a backend array (torch.Tensor, mlx.core.array, numpy.ndarray)


class ProposalKind(str, Enum):
    """How a drafter proposes tokens, which decides what a verifier must handle."""

    ONE_HOT = "one_hot"  # deterministic (argmax) proposals; q is a point mass
    DENSE = "dense"  # sampled from a full-vocabulary distribution q [k, V]
    SPARSE = "sparse"  # sampled from q [k, C] over candidate ids [k, C]


class DraftSource(str, Enum):
    """Where a draft came from: a drafter's model, or a copy out of the context (prompt lookup).
    Adaptive width policies model the drafter, so they verify copies whole and learn nothing from them."""

    MODEL = "model"
    LOOKUP = "lookup"


@dataclass(frozen=True)
class SamplingParams:
    """The target's sampling settings; temperature 0 means greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0


class PathScores(Protocol):
    """Host float32 scores of a block's candidates given the candidate before them (DFlash2's
    selector table): ``first`` [K] the row-0 candidates after the anchor; ``pairs`` [k-1, K, K],
    ``pairs[t-1, i, j]`` candidate j of row t after candidate i of row t-1; ``candidates`` [k, K]
    the candidates' token ids."""

    first: Any
    pairs: Any
    candidates: Any


@dataclass
class Draft:
    """Tokens proposed for one cycle.

    ``token_ids`` is a 1-D backend integer array of length k. ``draft_probs`` is None for
    one-hot proposals, a [k, V] array for dense ones, or a [k, C] array over
    ``candidate_ids`` [k, C] for sparse ones. ``confidence`` (host floats, one per row)
    is draft-side information an adaptive policy may read. ``logits`` [k, V]: a block drafter's
    distribution at every position (what a tree verifier builds its tree from), or None.
    ``branch_ids`` (host ints): a prompt-lookup copy offered beside this draft, which a tree
    verifier adds to its tree as one more path (docs/tree-verification.md), or None.
    ``path_scores``: a drafter's scores of each row's candidates given the token chosen at the row
    before (DFlash2's candidate path selector), which a tree verifier may shape its tree by, or None.
    """

    token_ids: Array
    num_tokens: int
    draft_probs: Array | None = None
    candidate_ids: Array | None = None
    confidence: list[float] | None = None
    source: DraftSource = DraftSource.MODEL
    logits: Array | None = None
    branch_ids: tuple[int, ...] | None = None
    path_scores: "PathScores | None" = None

    @property
    def kind(self) -> ProposalKind:
        if self.draft_probs is None:
            return ProposalKind.ONE_HOT
        return ProposalKind.DENSE if self.candidate_ids is None else ProposalKind.SPARSE

    def truncated(self, k: int, ops) -> "Draft":
        """The first ``k`` rows of this draft (used when a policy verifies fewer)."""
        if k >= self.num_tokens:
            return self
        return Draft(
            token_ids=self.token_ids[:k],
            num_tokens=k,
            draft_probs=None if self.draft_probs is None else self.draft_probs[:k],
            candidate_ids=None if self.candidate_ids is None else self.candidate_ids[:k],
            confidence=None if self.confidence is None else self.confidence[:k],
            source=self.source,
            logits=None if self.logits is None else self.logits[:k],
            branch_ids=None if self.branch_ids is None else self.branch_ids[:k],
            path_scores=self.path_scores,  # readers take the rows they verify
        )


@dataclass(frozen=True)
class Verification:
    """Result of verifying a draft: ``accepted`` drafts plus one correction/bonus token."""

    accepted: int
    token_ids: list[int]  # accepted drafts followed by the correction/bonus token
    # tree cycles only: the tree nodes of the anchor and the accepted drafts (core/tree.py)
    path: tuple[int, ...] = ()
    # tree cycles only: the drafts of the tree's chain path the same target picks accept (what a
    # chain would have accepted: the paired measure that chooses between trees and chains); greedy only
    chain_accepted: int | None = None

    @property
    def bonus_token_id(self) -> int:
        return self.token_ids[-1]


@dataclass(frozen=True)
class PendingVerification:
    """A verification waiting for its host values (:meth:`Verifier.pending`): the 1-D arrays it
    reads, moved with other rows' in one transfer (:func:`speculant.core.arrays.fetch_rows`), and
    ``finish(values)``, their float32 values in order, which verifies and may raise as verify does."""

    parts: list[Any]
    finish: Callable[[list[float]], Verification]


@dataclass(frozen=True)
class CycleTiming:
    """Measured wall time of one decode cycle's parts, for cost-aware verifiers.

    ``context_length``: positions in the target cache before the cycle's forward.
    ``submitted``: drafted tokens in the target forward (its width is ``submitted + 1``).
    ``drafted``: tokens the drafter proposed (0 when the cycle did not draft).
    ``target_s`` for the target forward, ``draft_s`` for ``Drafter.propose`` (0 when not
    called), ``commit_s`` for ``Drafter.commit`` (0 without a drafter). They are measured after
    a backend sync only for verifiers with ``needs_timings`` (or ``Engine.time_phases``);
    otherwise they cover only the scheduling of lazy work.
    """

    context_length: int
    submitted: int
    drafted: int
    target_s: float
    draft_s: float = 0.0
    commit_s: float = 0.0
    source: DraftSource = DraftSource.MODEL  # LOOKUP: a prompt-lookup copy, verified whole


@dataclass(frozen=True)
class Capture:
    """Which target hidden states a forward must return besides logits.

    ``layer_ids``: decoder layers whose residual output (layer id L = output of
    ``layers[L]``) is concatenated on the feature axis, in this order.
    ``final_hidden``: also return the last decoder hidden state, after
    (``"post_norm"``) or before (``"pre_norm"``) the final norm.
    """

    layer_ids: tuple[int, ...] = ()
    final_hidden: str | None = None  # None | "post_norm" | "pre_norm"

    def __bool__(self) -> bool:
        return bool(self.layer_ids) or self.final_hidden is not None


@dataclass
class ForwardOutput:
    """What a target forward returns: logits for the requested rows and captured states.

    ``logits`` [n, V]; ``features`` [n, len(layer_ids) * H] or None; ``final_hidden`` [n, H]
    or None. Rows are the forward's input positions in order (for a prefill, logits may be
    only the last row; features always cover every row).
    """

    logits: Array
    features: Array | None = None
    final_hidden: Array | None = None


@dataclass
class DraftRequest:
    """What the engine asks of a drafter for one cycle."""

    anchor_id: int  # last committed token (block row 0), not yet in the target cache
    position: int  # absolute position of the anchor
    num_tokens: int  # k proposals wanted (verify width - 1)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rng: Any = None  # numpy.random.Generator for sampled drafting (independent of verification)


@dataclass(frozen=True)
class TargetInfo:
    """Target facts read from its config.json, before any weights load."""

    path: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    quantization: dict | None = None
    # One entry per decoder layer, in transformers' ``layer_types`` words: ``full_attention``,
    # ``sliding_attention``, ``linear_attention`` (Gated DeltaNet), ... (what the cache must roll back)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class DrafterInfo:
    """What a drafter needs, read from its checkpoint config before any weights load."""

    kind: str
    target_layer_ids: tuple[int, ...] = ()
    final_hidden: str | None = None  # needs the target's final hidden ("pre_norm"/"post_norm")
    uses_target_embedding: bool = True
    uses_target_lm_head: bool = True
    trained_block_size: int | None = None
    max_block_size: int | None = None  # hard upper bound on the runtime block, if any
    default_block_size: int | None = None  # runtime block when the config sets none (else trained)
    backends: tuple[str, ...] = ()
    proposal_kinds: tuple[ProposalKind, ...] = (ProposalKind.ONE_HOT,)
    can_sample: bool = False
    vocab_size: int | None = None
    hidden_size: int | None = None
    mask_token_id: int | None = None
    num_target_layers: int | None = None
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def block_limit(self) -> int | None:
        return self.max_block_size or self.trained_block_size

    @property
    def capture(self) -> Capture:
        return Capture(tuple(self.target_layer_ids), self.final_hidden)


@dataclass
class Chunk:
    """One piece of streamed output. The request's last chunk (possibly empty) carries its
    finish reason (``stop_reason``: the word ``GenerationStats.stop_reason`` uses) and its stats."""

    text: str
    token_ids: list[int]
    stop_reason: str | None = None
    stats: Any = None  # GenerationStats, on the last chunk only
    error: BaseException | None = None  # on a batched request's last chunk, where it alone failed
