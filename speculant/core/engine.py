"""The engine: one backend + target + drafter + verifier, a request's settings, and its stream
(the draft / verify cycles themselves are in :mod:`speculant.core.loop`)."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from speculant.core.batch_plan import BatchPlan
from speculant.core.config import DrafterConfig, EngineConfig, GenerationConfig, SamplingConfig
from speculant.core.errors import EngineBusyError, SettingError
from speculant.core.interfaces import Backend, Drafter, TargetModel, Verifier
from speculant.core.generation import Generation, _Cancelled, _Record
from speculant.core.loop import Loop
from speculant.core.metrics import GenerationStats
from speculant.core.prefix_disk import prefix_store
from speculant.core.problems import Report
from speculant.core.request import Request, checked_ids, numbered
from speculant.core.scheduler import Scheduler
from speculant.core.schema import error_lines
from speculant.core.types import Capture, Chunk
from speculant.core.validator import sampling_problems

if TYPE_CHECKING:
    from speculant.core.session import Session


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats


class Engine:
    """Generates with one model pairing; reuse it across prompts (weights load once).

    One engine serves one call at a time: :meth:`generate` (one request) or :meth:`generate_many`
    (many, verified together in one target forward a cycle). A second call while one is in flight (from
    another thread, or a second generator while the first is still open) raises
    :class:`~speculant.core.errors.EngineBusyError` at once instead of waiting, since a wait
    inside one thread would never end; closing, exhausting or dropping a generator frees the
    engine. Give each thread its own engine, or serialize the calls.
    """

    def __init__(
        self,
        config: EngineConfig,
        backend: Backend,
        target: TargetModel,
        verifier: Verifier,
        drafter: Drafter | None = None,
        report: Report | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.target = target
        self.drafter = drafter
        self.verifier = verifier
        self.report = report
        self.last_stats: GenerationStats | None = None
        self.last_token_ids: list[int] = []
        # Time target and draft calls exactly (stats.target_s / draft_s): a backend sync after
        # each, so the drafter's work and the target's graph building no longer overlap. Off by
        # default; verifiers whose policy needs the seconds (``needs_timings``) force it on.
        self.time_phases = False
        # Held while a request runs; engines sharing one target (without_drafter) share it too.
        self._busy = threading.Lock()
        # Snapshots of earlier requests' caches (prefix_cache.py); may be shared between engines.
        self.prefix_store = prefix_store(config.prefix_cache, backend)
        # The batched forward's measured cost and the pooled acceptance, kept across batches
        self.batch_plan = BatchPlan()
        self.batch_layout = "padded"  # or "flat" (PyTorch, attention-only targets): docs/batching.md

    # -- construction ----------------------------------------------------------------------
    def without_drafter(self) -> "Engine":
        """Plain decoding over the same loaded target and settings (side-by-side comparisons)."""
        config = EngineConfig.load({**self.config.model_dump(), "drafter": {"kind": "none"}})
        engine = type(self)(config, self.backend, self.target, type(self.verifier)(config.verifier.options), None,
                            self.report)
        engine._busy = self._busy
        engine.prefix_store = self.prefix_store  # the same target: its snapshots serve both
        return engine

    def session(self, system: str | None = None) -> "Session":
        """A multi-turn conversation over this engine: each turn sends the conversation so far, and
        the prefix cache restores what earlier turns left instead of prefilling it again."""
        from speculant.core.session import Session

        return Session(self, system)

    def chat_ids(self, messages: "str | Sequence[Mapping[str, str]]") -> list[int]:
        """Prompt ids of a chat for ``prompt_ids=``: ``messages`` (role / content dicts, or one user
        message's text) rendered by the target's chat template (SettingError where it has none)."""
        from speculant.core.session import chat_ids

        return chat_ids(self.tokenizer, messages)

    @property
    def speculative(self) -> bool:
        """True when cycles may verify proposals (a drafter, prompt lookup, or both)."""
        return self.drafter is not None

    @property
    def block_size(self) -> int:
        if self.drafter is None:
            return 1
        info = self.drafter.info
        return self.config.drafter.block_size or info.default_block_size or info.trained_block_size or 2

    def warm_up(self) -> None:
        """Compile the target's forwards for this engine's widths now (a no-op for eager targets);
        :func:`speculant.load_engine` calls it, so no request pays for compiling."""
        capture = self.drafter.info.capture if self.drafter is not None else Capture()
        if self.verifier.builds_trees and self.drafter is not None:  # (only then: older plugin targets take two)
            # a tree of budget b has b + 1 nodes, and up to a block more with a prompt-lookup copy branch
            copy = [self.block_size] if self.config.drafter.lookup.enabled else []
            sizes = {b + 1 + extra for b in self.verifier.tree_budgets for extra in [0, *copy]}
            self.target.warm_up(self.block_size, capture, tree_sizes=sorted(sizes))
        else:
            self.target.warm_up(self.block_size, capture)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    # -- public API ------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        max_new_tokens: int | None = None,
        **overrides: Any,
    ) -> "Generation":
        """Stream chunks of new text and token ids; the last carries the finish reason and stats
        (also on the returned :class:`Generation` once it ends, and in ``last_stats``).

        ``overrides`` may set any ``sampling`` or ``generation`` field for this call
        (``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop_token_ids``, ``stop_strings``,
        ``ignore_eos``) and ``block_size``. A text prompt is tokenized with the tokenizer's
        special tokens (BOS where the model uses one), as ``tokenizer(prompt)`` does; pass
        ``add_special_tokens=False`` for text that already has them (a rendered chat template).
        Settings are taken as written (``temperature=True`` or ``seed="7"`` is an error, not 1.0
        or 7); ``stop_token_ids`` must lie inside the target's vocabulary.

        Every setting goes through the config's checks: a bad one raises
        :class:`~speculant.core.errors.SettingError` naming the field, before anything runs. The
        engine serves one request at a time (see the class docstring): a call while another is in
        flight raises :class:`~speculant.core.errors.EngineBusyError`.
        """
        add_special = overrides.pop("add_special_tokens", True)
        self._check_idle()
        ids = self._prompt_ids(prompt, prompt_ids, add_special)
        sampling, generation, block = self._settings(max_new_tokens, overrides)
        return self._stream(ids, sampling, generation, block)

    def generate_many(
        self,
        prompts: Sequence[str] | None = None,
        *,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        max_new_tokens: int | None = None,
        max_batch: int | None = None,
        **overrides: Any,
    ) -> Iterator[tuple[int, Chunk]]:
        """Generate for several prompts at once: up to ``max_batch`` (default: all) are verified
        in one target forward a cycle, the rest join as others end. Yields ``(index, chunk)`` as
        each request produces text; a request's last chunk carries its ``stop_reason`` and stats
        (``"error"`` and the exception in ``chunk.error`` where that request alone failed).

        Greedy, each request's output is the one :meth:`generate` gives it alone (the same
        settings: ``overrides`` as for :meth:`generate`); sampled, it follows the same distribution,
        and a seed repeats the solo run's draws only for the first request (each other one draws from
        its own child of the seed, so copies of one prompt give other samples) and only where the
        batch verifies the same widths. Every
        prompt and setting is checked before anything runs; the engine is held until the iterator
        is exhausted or closed."""
        add_special = overrides.pop("add_special_tokens", True)
        self._check_idle()
        if (prompts is None) == (prompt_ids is None):
            raise SettingError("prompts / prompt_ids: pass exactly one of prompts or prompt_ids", "prompts")
        if isinstance(prompts, str):
            raise SettingError("prompts: must be a list of prompts, not one string; use generate() for one", "prompts")
        items = (numbered(lambda _, p: self._prompt_ids(p, None, add_special), prompts) if prompts is not None
                 else numbered(lambda _, ids: self._prompt_ids(None, ids), prompt_ids))
        if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
            raise SettingError(f"max_batch: must be a whole number of at least 1, got {max_batch!r}", "max_batch")
        sampling, generation, block = self._settings(max_new_tokens, overrides)
        # a too-long prompt fails here, before anything runs
        requests = numbered(lambda i, ids: self._request(ids, sampling, generation, block, key=i), items)
        return self._many(requests, max_batch or max(1, len(requests)))

    def run_many(self, prompts: Sequence[str] | None = None, **kwargs: Any) -> list[GenerationResult]:
        """:meth:`generate_many` to completion: one result per prompt, in order."""
        texts: dict[int, list[str]] = {}
        ids: dict[int, list[int]] = {}
        ends: dict[int, Chunk] = {}
        many = self.generate_many(prompts, **kwargs)
        while True:
            try:
                index, chunk = next(many)
            except KeyboardInterrupt:  # here, between chunks: generate_many ends the requests as in a cycle
                index, chunk = many.throw(KeyboardInterrupt())
            except StopIteration:
                break
            texts.setdefault(index, []).append(chunk.text)
            ids.setdefault(index, []).extend(chunk.token_ids)
            if chunk.stop_reason is not None:
                ends[index] = chunk
        return [GenerationResult("".join(texts[i]), ids[i], ends[i].stats) for i in sorted(ends)]

    def run(self, prompt: str | None = None, **kwargs: Any) -> GenerationResult:
        """Generate to completion and return text, token ids and stats."""
        # closed even when Ctrl-C lands between chunks: a traceback kept by a REPL would hold it open
        with self.generate(prompt, **kwargs) as generation:
            text = "".join(c.text for c in generation)
        return GenerationResult(text, generation.token_ids, generation.stats)

    def request(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None, *,
                cancel: threading.Event | None = None, **overrides: Any) -> Request:
        """One request for a :class:`~speculant.core.scheduler.Scheduler` of this engine (a
        server adds them as clients arrive): the prompt and settings checked as :meth:`generate`
        checks them (a bad one raises SettingError naming it); setting ``cancel`` ends it."""
        ids = self._prompt_ids(None, prompt_ids)
        sampling, generation, block = self._settings(max_new_tokens, dict(overrides))
        return self._request(ids, sampling, generation, block, cancel)

    # -- internals -------------------------------------------------------------------------
    def _check_idle(self) -> None:
        if self._busy.locked():
            raise EngineBusyError(_BUSY)

    def _prompt_ids(self, prompt: str | None, prompt_ids: Sequence[int] | None, add_special: bool = True) -> list[int]:
        if (prompt is None) == (prompt_ids is None):
            raise SettingError("prompt / prompt_ids: pass exactly one of prompt or prompt_ids", "prompt")
        if prompt_ids is None:
            if not isinstance(prompt, str):
                raise SettingError(f"prompt: must be a string, got {type(prompt).__name__}; pass token ids as prompt_ids=",
                                   "prompt")
            if self.tokenizer is None:
                raise SettingError("prompt: the target folder has no tokenizer: pass prompt_ids instead of a text prompt", "prompt")
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special) if prompt else []
        ids = checked_ids(prompt_ids)
        if not ids:
            field = "prompt_ids" if prompt is None else "prompt"
            raise SettingError(f"{field}: the prompt is empty: give at least one token", field)
        vocab = self.target.info.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise SettingError(f"prompt_ids: contains ids outside the vocabulary 0..{vocab - 1}: {bad[:5]}", "prompt_ids")
        return ids

    def _settings(self, max_new_tokens, overrides):
        """This call's settings: the config's with ``overrides`` applied, through the same checks."""
        sampling_data = self.config.sampling.model_dump()
        generation_data = self.config.generation.model_dump()
        block = overrides.pop("block_size", None)
        for key, value in overrides.items():
            if key in sampling_data:
                sampling_data[key] = value
            elif key in generation_data:
                generation_data[key] = value
            else:
                known = ", ".join(sorted({*sampling_data, *generation_data, "block_size", "add_special_tokens"}))
                raise SettingError(f"generate() got an unexpected setting {key!r} (known: {known})", key)
        if max_new_tokens is not None:
            generation_data["max_new_tokens"] = max_new_tokens
        sampling = _section(SamplingConfig, "sampling", sampling_data)
        generation = _section(GenerationConfig, "generation", generation_data)
        problems = sampling_problems(sampling)
        if problems:
            raise SettingError(f"{_argument(problems[0].field)}: {problems[0]}", problems[0].field)
        vocab = self.target.info.vocab_size
        outside = [t for t in generation.stop_token_ids if t >= vocab]
        if outside:
            raise SettingError(f"{_argument('generation.stop_token_ids')}: token id {outside[0]} is outside the "
                               f"target's vocabulary (vocab size {vocab}); use ids 0..{vocab - 1}",
                               "generation.stop_token_ids")
        return sampling, generation, self._block(block)

    def _block(self, value: Any) -> int:
        if value is None:
            return self.block_size
        block = _section(DrafterConfig, "drafter", {"block_size": value}).block_size
        if not self.speculative:  # plain decoding: as validate warns of a config's unused block_size
            warnings.warn(f"generate(..., block_size={value}): this engine has no drafter and no prompt lookup, "
                          "so the block size is not used", UserWarning, stacklevel=4)
            return 1
        limit = None if self.drafter is None else self.drafter.info.block_limit
        if block is None or not 2 <= block <= (limit or block):
            raise SettingError(f"block_size: {value} is outside 2..{limit or 'any'} (one anchor plus at least one "
                               "proposal, at most the draft's trained block)", "drafter.block_size")
        return block

    def _stop_ids(self, generation: GenerationConfig) -> set[int]:
        ids = set(generation.stop_token_ids)
        if not generation.ignore_eos:
            ids.update(self.target.info.eos_token_ids)
            eos = getattr(self.tokenizer, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
        return ids

    def _stream(self, prompt_ids, sampling_cfg, generation, block) -> "Generation":
        record = _Record()
        return Generation(self._locked_stream(prompt_ids, sampling_cfg, generation, block, record), record)

    def _request(self, ids, sampling, generation, block, cancel=None, key=None) -> Request:
        return Request(Loop(self, ids, sampling, generation, block, cancel, stream=key), generation.stop_strings, key)

    def _many(self, requests: list[Request], max_batch: int) -> Iterator[tuple[int, Chunk]]:
        if not self._busy.acquire(blocking=False):
            raise EngineBusyError(_BUSY)
        events = None
        try:
            scheduler = Scheduler(self, max_batch, whole=True)
            for request in requests:
                scheduler.add(request)
            events = scheduler.run()
            ended = set()
            try:
                for request, chunk in events:
                    if chunk.stop_reason is not None:
                        ended.add(request.key)
                    yield request.key, chunk
            except KeyboardInterrupt:  # Ctrl-C: every request ends with what it produced, as one alone does
                for request in requests:
                    if request.key not in ended:
                        request.loop.stop("interrupted")
                        yield request.key, request.final()
        finally:
            if events is not None:
                events.close()
            self._busy.release()

    def _locked_stream(self, prompt_ids, sampling_cfg, generation, block, record: _Record) -> Iterator[Chunk]:
        if not self._busy.acquire(blocking=False):
            raise EngineBusyError(_BUSY)
        request = events = None
        try:
            request = self._request(prompt_ids, sampling_cfg, generation, block, record.cancel)
            scheduler = Scheduler(self)  # a batch of one
            scheduler.add(request)
            events = scheduler.run()
            try:
                for _, chunk in events:
                    if chunk.stop_reason is not None:
                        break
                    yield chunk
            except KeyboardInterrupt:  # while decoding text: the same end as inside a cycle
                request.loop.stop("interrupted")
            except _Cancelled:  # Generation.cancel() while the stream waited at a chunk
                request.loop.cancel.set()
                request.loop.cancelled()  # keeps a reason already reached (a stop string's last chunk)
        finally:
            try:
                if events is not None:
                    events.close()  # the loop's own cleanup (the pipelined greedy path's crop) runs while held
                if request is not None:
                    final = request.final()
                    record.stats = self.last_stats = final.stats
                    record.token_ids = self.last_token_ids = request.loop.produced
            finally:
                self._busy.release()
        if final.error is not None:
            raise final.error
        yield final


_BUSY = ("this engine is already generating (another thread, or a generator from an earlier generate() call "
         "that is still open); exhaust, close() or cancel() that generator first (`with engine.generate(...) as g:` "
         "closes it for you), or give each thread its own engine")


def _section(model, name: str, data: dict):
    """``model.model_validate(data)``, its errors as a SettingError naming the field."""
    from pydantic import ValidationError

    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join([name, *map(str, err["loc"])])
        raise SettingError(f"{_argument(field)}: {error_lines(exc, model, name)[0]}", field) from None


def _argument(field: str) -> str:
    """The keyword argument that sets a config field this call: ``sampling.top_p`` -> ``top_p``."""
    key = field.split(".")[1] if "." in field else field
    return f"generate(..., {key}=...)"
