"""The four roles the engine composes: Backend, TargetModel, Drafter, Verifier.

Plugins implement these. Nothing here imports an array library: arrays are opaque values
handled through the backend's :class:`~speculant.core.arrays.ArrayOps`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Mapping, Protocol, Sequence

from speculant.core.arrays import ArrayOps
from speculant.core.types import (Array, Capture, CycleTiming, Draft, DrafterInfo, DraftRequest, ForwardOutput,
                                  PendingVerification, ProposalKind, SamplingParams, TargetInfo, Verification)

if TYPE_CHECKING:
    from pydantic import BaseModel

    from speculant.core.batch import BatchedTarget
    from speculant.core.tree import DraftTree
    from speculant.core.config import BackendConfig, DrafterConfig, EngineConfig, VerifierConfig
    from speculant.core.prefix_cache import CacheSnapshot
    from speculant.core.problems import Problem


class Catalogue(Protocol):
    """What the installed plugins registered, as the validator and composition root read it (a Registry)."""

    backends: Mapping[str, type["Backend"]]
    drafters: Mapping[str, "DrafterFactory"]
    verifiers: Mapping[str, type["Verifier"]]

    def missing_hint(self, kind: str, name: str) -> str:
        """Why no ``kind`` (backends, drafters, verifiers) named ``name`` is registered."""

    def origin(self, kind: str, name: str) -> str:
        """Where a registered name came from (for error messages)."""

    def failed_plugins(self) -> list:
        """Plugins that failed to load (records with ``distribution``, ``source``, ``error``)."""

    def check_pairing(self, config: "EngineConfig", target: TargetInfo, drafter: DrafterInfo | None) -> list["Problem"]:
        """Every plugin's extra problems with this pairing."""


class TargetModel(ABC):
    """A loaded target LM with a KV cache for one sequence (batch size 1)."""

    info: TargetInfo
    tokenizer: Any  # a Hugging Face tokenizer (or compatible: encode/decode/apply_chat_template)
    fast_path: str = "eager"  # what runs compiled, or why the forwards stay eager (copied into each request's stats)

    @property
    @abstractmethod
    def cache_length(self) -> int:
        """Number of positions currently held in the KV cache."""

    @abstractmethod
    def reset(self) -> None:
        """Drop the KV cache so a new sequence can start."""

    @abstractmethod
    def prefill(self, token_ids: Sequence[int], capture: Capture = Capture()) -> ForwardOutput:
        """Run the prompt; logits of the last row only, captured states for every row."""

    @abstractmethod
    def forward(self, token_ids: Array, capture: Capture = Capture()) -> ForwardOutput:
        """Run ``token_ids`` (1-D backend ints) after the cache; logits for every row."""

    @abstractmethod
    def crop(self, length: int) -> None:
        """Roll the KV cache back to its first ``length`` positions."""

    def snapshot(self) -> "CacheSnapshot | None":
        """A copy of the caches as they stand (``cache_length`` positions), for the prefix store;
        None (the default) when this target cannot take one."""
        return None

    def restore(self, snapshot: "CacheSnapshot", length: int) -> bool:
        """Replace the caches with a copy of ``snapshot``'s, cut to ``length`` positions (only a
        ``cuttable`` snapshot is cut); False (the default) when this target cannot."""
        return False

    def warm_up(self, block_size: int, capture: Capture = Capture(), tree_sizes: Sequence[int] = ()) -> None:
        """Compile every verify width up to ``block_size``, and trees of ``tree_sizes`` nodes, before any request."""

    def greedy_steps(self, anchor_id: int) -> "Iterator[int] | None":
        """Optional fast path for plain greedy decoding: from ``anchor_id`` (not yet cached), yield the
        target's argmax tokens one at a time, each fed back on the device so the next step is queued
        before the host reads this one; raises NonFiniteLogitsError on a non-finite largest logit, as
        the verifiers do. The engine closes it when the request ends, then crops. None: no such path."""
        return None

    @abstractmethod
    def embed(self, token_ids: Array, *, raw: bool = False) -> Array:
        """The target's input embedding rows for ``token_ids`` ([n] -> [n, H]), as its first layer
        reads them (Gemma's sqrt(hidden) scale, Muse Glimmer's weightless norm: what MTP heads take);
        ``raw=True`` gives the table's rows alone, what DFlash drafts take (times their
        ``input_embedding_scale``), as the reference ``dflash`` package feeds them."""

    @abstractmethod
    def lm_head(self, hidden: Array, *, raw: bool = False) -> Array:
        """The target's output head ([n, H] -> [n, V] logits), with the family's logit transform
        (Gemma's soft-capping); ``raw=True`` gives the head alone, what DFlash drafts were trained on."""

    def prepare_draft(self, module: Any) -> str | None:
        """Lay a drafter's modules out for this target's fast path (the CPU's packed weights on
        PyTorch); returns what was done, or None when nothing was."""
        return None

    def tree_problem(self) -> str | None:
        """Why this target cannot verify a draft tree in one forward (the engine then verifies
        chains), or None when :meth:`forward_tree` and :meth:`commit_tree` work."""
        return f"{type(self).__name__} has no tree verify forward"

    def forward_tree(self, tree: "DraftTree", capture: Capture = Capture()) -> ForwardOutput:
        """Run every node of ``tree`` after the cache in one forward: node i at position
        ``cache_length + depth[i]``, seeing the cache and its own ancestors only; logits and
        captured states for every node, in node order."""
        raise NotImplementedError(self.tree_problem())

    def commit_tree(self, length: int, path: Sequence[int]) -> None:
        """After :meth:`forward_tree` over a cache of ``length`` positions: keep the rows of the
        tree nodes ``path`` (root first) at positions ``length ..`` and drop every other node."""
        raise NotImplementedError(self.tree_problem())

    def new_batch(self, layout: str = "padded") -> "BatchedTarget":
        """An empty batch of sequences over this target's weights, with caches of its own, padded or
        ``"flat"`` (docs/batching.md); raises ValueError saying why this target cannot batch so."""
        raise ValueError(f"{type(self).__name__} has no batched verify (one sequence at a time)")


class Backend(ABC):
    """An array runtime: loads targets, provides ArrayOps, reports memory."""

    name: ClassVar[str]
    ops: ArrayOps
    dtype_name: str = ""  # the dtype the models run in, e.g. ``float32`` (the statistics report it)
    dtype_reason: str = ""  # why that dtype: ``auto: CPU``, ``set by backend.dtype``, ...

    def __init__(self, config: "BackendConfig") -> None:
        self.config = config

    @classmethod
    def availability_problem(cls) -> str | None:
        """Why this backend cannot run here (missing package, device), or None."""
        return None

    @classmethod
    def supported_dtypes(cls) -> tuple[str, ...]:
        return ("auto", "float32", "bfloat16", "float16")

    @classmethod
    def family_problem(cls, target: TargetInfo) -> str | None:
        """Why this backend cannot load ``target``'s family (config.json's ``model_type``: unknown, or
        no text model), naming it and what is supported, or None; asked before any weights load."""
        return None

    @classmethod
    def rollback_problem(cls, target: TargetInfo) -> str | None:
        """Why this backend cannot roll back ``target``'s caches after a rejected block (naming
        the layer type and the family), or None when every layer kind is rolled back exactly."""
        return None

    @classmethod
    def tree_problem(cls, target: TargetInfo) -> str | None:
        """Why this backend cannot verify a draft tree of ``target`` in one forward (naming the layer
        kind), or None; the ``tree`` verifier then verifies chains, the reason in its statistics."""
        return f"the {cls.name} backend has no tree verify forward"

    @property
    @abstractmethod
    def device(self) -> str:
        """The resolved device, e.g. ``cuda:0``, ``mps``, ``cpu``, ``gpu``."""

    @abstractmethod
    def load_target(self, path: str, info: TargetInfo) -> TargetModel:
        """Load a target model folder (config.json + safetensors) from a local path."""

    def int_array(self, values: Sequence[int]) -> Array:
        return self.ops.asarray(list(values), dtype="int64")

    def synchronize(self) -> None:
        """Wait for queued device work (timing only)."""

    writes_arrays: ClassVar[bool] = False
    """Whether ``is_array`` / ``save_arrays`` / ``load_arrays`` work (the prefix cache's disk tier)."""

    def is_array(self, value: Any) -> bool:
        """Whether ``value`` is one of this backend's arrays."""
        return False

    def save_arrays(self, path: str, arrays: dict[str, Array]) -> None:
        """Write ``arrays`` to a safetensors file at ``path``."""
        raise NotImplementedError

    def load_arrays(self, path: str) -> dict[str, Array]:
        """Read a safetensors file written by ``save_arrays``, onto this backend's device."""
        raise NotImplementedError

    def value_name(self, value: Any) -> str | None:
        """A name for one of this backend's small values that caches hold (a dtype, a device), or None."""
        return None

    def named_value(self, name: str) -> Any:
        """The value :meth:`value_name` named (an unknown name is a ValueError)."""
        raise ValueError(f"{name!r}: not a value the {self.name} backend names")

    @property
    def asynchronous(self) -> bool:
        """Whether queued work runs on a device while the host goes on (a GPU), so that the host's
        work between two cycles can overlap the device's (``backend.draft_ahead: auto``)."""
        return False

    def peak_memory_bytes(self) -> int | None:
        """Peak device (or process) memory since the last reset, if measurable."""
        return None

    def reset_peak_memory(self) -> None:
        pass


class Drafter(ABC):
    """Proposes tokens for the target to verify. One instance serves one sequence at a time;
    :meth:`fork` gives another sequence one of its own over the same weights.

    ``commit`` follows every verification, but ``propose`` may be skipped for a cycle (a plain
    target step, or a free proposal such as a prompt-lookup copy): a drafter must take in several
    commits before its next proposal."""

    info: DrafterInfo

    @abstractmethod
    def prefill(self, prompt_ids: Sequence[int], output: ForwardOutput, first_token_id: int) -> None:
        """Start a sequence from the target's prefill output and the first generated token."""

    @abstractmethod
    def propose(self, request: DraftRequest) -> Draft | None:
        """Propose up to ``request.num_tokens`` tokens following ``request.anchor_id`` (None: nothing
        to propose, the cycle is a plain target step)."""

    @property
    def fast_path(self) -> str:
        """What the draft's forwards run as (compiled, packed or transposed weights), or why eager."""
        return "eager"

    only_free = False  # True: propose_free is all it proposes (prompt lookup alone); without one, a plain step

    def propose_free(self, request: DraftRequest) -> Draft | None:
        """A proposal that costs no forward (a copy out of the context), tried every cycle before the
        verifier is asked whether drafting pays; None (the default) when there is none."""
        return None

    def rejoin(self, history: Sequence[int]) -> bool:
        """Draft again from ``history`` (prompt, emitted tokens) after cycles it was not given (False: can't)."""
        return False

    def propose_beside(self, request: DraftRequest, copy: Draft) -> Draft | None:
        """The drafter's own proposal for ``request`` carrying the free ``copy`` as ``branch_ids``,
        for a verifier about to build a tree (the copy becomes one of its paths); None (the
        default) when this drafter has no model proposal to put beside it."""
        return None

    def propose_ahead(self, output: ForwardOutput, anchor: Array, request: DraftRequest) -> Draft | None:
        """Before this cycle's verification is read: commit every row of ``output`` and propose
        after ``anchor`` (a one-token device array, the target's greedy token at the last row),
        as the next cycle would if the whole block is accepted. The engine then either keeps it
        (no ``commit`` follows for these rows) or calls ``withdraw_ahead``. None (the default):
        not supported."""
        return None

    def withdraw_ahead(self) -> None:
        """Undo the last ``propose_ahead`` (the block was not accepted whole)."""
        raise NotImplementedError

    @abstractmethod
    def commit(self, output: ForwardOutput, num_rows: int, token_ids: Sequence[int]) -> None:
        """Take in a verification: the first ``num_rows`` rows of ``output`` (anchor +
        accepted drafts) are now committed, and ``token_ids`` are the tokens that were
        emitted this cycle (accepted drafts + bonus)."""

    def propose_rows(self, drafters: Sequence["Drafter"], requests: Sequence[DraftRequest]) -> list[Draft | None]:
        """Proposals for several sequences at once: ``drafters[i]`` (this drafter or one of its
        forks) proposes for ``requests[i]``. The default asks each in turn; a drafter that can
        run every row in one forward overrides it."""
        return [d.propose(r) for d, r in zip(drafters, requests)]

    def fork(self) -> "Drafter":
        """A drafter for another sequence: it shares this one's weights (and compiled code where
        that is safe) but has per-sequence state of its own, empty until its ``prefill``; the two
        may be used interleaved, and nothing done to one changes the other's proposals. The
        default raises NotImplementedError: a drafter that cannot fork is not batched."""
        raise NotImplementedError(f"{type(self).__name__} cannot fork per-sequence copies (Drafter.fork), "
                                  "so it drafts one sequence at a time")


class DrafterFactory(ABC):
    """What a drafter plugin registers: reads a checkpoint's needs, then builds the drafter."""

    name: ClassVar[str]
    backends: ClassVar[tuple[str, ...]]
    options_model: ClassVar[type["BaseModel"] | None] = None

    @abstractmethod
    def describe(
        self, config: "DrafterConfig", target: TargetInfo, backend: str
    ) -> tuple[DrafterInfo | None, list["Problem"]]:
        """Read the drafter checkpoint's config and tensor headers (no weights) for ``backend``;
        return its needs and every problem found."""

    @abstractmethod
    def load(self, config: "DrafterConfig", info: DrafterInfo, backend: Backend, target: TargetModel) -> Drafter:
        """Load the weights on ``backend`` and bind to ``target``."""


class Verifier(ABC):
    """Decides how many drafted tokens to keep and emits the correction/bonus token."""

    name: ClassVar[str]
    accepts: ClassVar[tuple[ProposalKind, ...]] = (ProposalKind.ONE_HOT,)
    supports_sampling: ClassVar[bool] = False
    options_model: ClassVar[type["BaseModel"] | None] = None
    # Context length from which a request decodes plainly: the engine stops drafting,
    # capturing hidden states and committing to the drafter (None = no limit).
    max_context: int | None = None
    # Whether observe() needs each cycle's parts timed exactly: the engine then waits for the
    # backend after every draft and target call, which stops it overlapping them (MLX, CUDA).
    needs_timings: ClassVar[bool] = False
    # Whether the next cycle may be drafted before this cycle's verification is read: true for
    # a verifier whose wants_draft/plan read nothing from past verifications.
    allows_draft_ahead: ClassVar[bool] = True
    # Whether tree() may return draft trees (the engine then asks the target whether it takes them),
    # and their node budgets (the root not counted), for a target to compile ahead.
    builds_trees: ClassVar[bool] = False
    tree_budgets: tuple[int, ...] = ()

    def __init__(self, options: dict | None = None) -> None:
        self.options = options or {}

    def fork(self) -> "Verifier":
        """The same options, a per-request state of its own (one per batched request)."""
        return type(self)(self.options)

    def begin(self, context_length: int) -> None:
        """A new sequence starts (policies reset per-request state here)."""

    def batched(self, on: bool) -> None:
        """This request verifies in a batch (``on``) or alone again: in a batch the scheduler's
        plan prices the widths, so a policy should not price them from the batch's timings."""

    def wants_draft(self, max_tokens: int, context_length: int) -> bool:
        """Whether to call the drafter this cycle (False: a plain target step, no draft cost);
        called before drafting, so it may read only past statistics."""
        return True

    def draft_length(self, max_tokens: int, context_length: int) -> int:
        """How many of ``max_tokens`` to draft, once :meth:`wants_draft` said yes (past statistics only)."""
        return max_tokens

    def plan(self, draft: Draft | None, max_tokens: int, context_length: int) -> int:
        """How many drafted tokens to submit this cycle (0 = plain target step); called after
        drafting, **before** the target forward, so it may read only the draft and past statistics."""
        return 0 if draft is None else min(draft.num_tokens, max_tokens)

    @abstractmethod
    def verify(self, ops: ArrayOps, draft: Draft | None, target_logits: Array, sampling: SamplingParams,
               rng: Any) -> Verification:
        """Verify ``draft`` (k tokens, or None) against ``target_logits`` [k+1, V]."""

    def pending(self, ops: ArrayOps, draft: Draft | None, target_logits: Array, sampling: SamplingParams,
                rng: Any) -> PendingVerification | None:
        """:meth:`verify` in two halves, so that a batch moves every row's host values in one
        transfer; None (the default): this cycle is verified whole by :meth:`verify`."""
        return None

    def tree(self, ops: ArrayOps, draft: Draft, anchor_id: int, budget: int | None = None) -> "DraftTree | None":
        """A draft tree to verify this cycle instead of ``draft``'s chain (from the drafter's
        per-position distributions; at most ``budget`` drafted nodes where given), or None."""
        return None

    def tree_next(self) -> bool:
        """Whether this cycle, if drafted with per-position distributions, is verified as a tree
        (decided from finished cycles, kept for :meth:`tree`): its lookup copy becomes a path."""
        return False

    def verify_tree(self, ops: ArrayOps, tree: "DraftTree", target_logits: Array, sampling: SamplingParams,
                    rng: Any) -> Verification:
        """Verify ``tree`` against the target's logits at every node [T, V]; ``Verification.path``
        names the accepted nodes."""
        raise NotImplementedError(f"the {self.name} verifier verifies no trees")

    def tree_refused(self, reason: str) -> None:
        """The target cannot verify trees (``reason``): this verifier's requests verify chains."""

    def observe(self, verification: Verification, submitted: int, timing: CycleTiming | None = None) -> None:
        """Learn from a finished cycle (for adaptive policies); ``timing`` is what it cost."""

    def decisions(self) -> dict:
        """Per-generation record of what this verifier decided (for stats)."""
        return {}
