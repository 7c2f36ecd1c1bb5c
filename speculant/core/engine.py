"""The scheduler: one backend + target + drafter + verifier, and the draft/verify loop."""

from __future__ import annotations

import operator
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from speculant.core.config import DrafterConfig, EngineConfig, GenerationConfig, SamplingConfig
from speculant.core.errors import ContextTooLongError, EngineBusyError, GenerationError, SettingError
from speculant.core.interfaces import Backend, Drafter, TargetModel, Verifier
from speculant.core.metrics import GenerationStats
from speculant.core.text import StreamDecoder
from speculant.core.types import Capture, Chunk, CycleTiming, Draft, DraftRequest, DraftSource, SamplingParams, Verification
from speculant.core.problems import Report
from speculant.core.validator import sampling_problems


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats


class Engine:
    """Generates with one model pairing; reuse it across prompts (weights load once).

    One engine serves one request at a time. A second request while one is in flight (from
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

    # -- construction ----------------------------------------------------------------------
    def without_drafter(self) -> "Engine":
        """Plain decoding over the same loaded target and settings (side-by-side comparisons)."""
        config = EngineConfig.load({**self.config.model_dump(), "drafter": {"kind": "none"}})
        engine = type(self)(config, self.backend, self.target, type(self.verifier)(config.verifier.options), None,
                            self.report)
        engine._busy = self._busy
        return engine

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

    def run(self, prompt: str | None = None, **kwargs: Any) -> GenerationResult:
        """Generate to completion and return text, token ids and stats."""
        generation = self.generate(prompt, **kwargs)
        text = "".join(c.text for c in generation)
        return GenerationResult(text, generation.token_ids, generation.stats)

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
        ids = _token_ids(prompt_ids)
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
                known = ", ".join(sorted([*sampling_data, *generation_data, "block_size", "max_new_tokens",
                                          "add_special_tokens"]))
                raise SettingError(f"generate() got an unexpected setting {key!r} (known: {known})", key)
        if max_new_tokens is not None:
            generation_data["max_new_tokens"] = max_new_tokens
        sampling = _section(SamplingConfig, "sampling", sampling_data)
        generation = _section(GenerationConfig, "generation", generation_data)
        problems = sampling_problems(sampling)
        if problems:
            raise SettingError(f"{_argument(problems[0].field)}: {problems[0]}", problems[0].field)
        return sampling, generation, self._block(block)

    def _block(self, value: Any) -> int:
        if value is None:
            return self.block_size
        block = _section(DrafterConfig, "drafter", {"block_size": value}).block_size
        if not self.speculative:
            return 1  # plain decoding; a config's block_size is likewise unused there
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

    def _locked_stream(self, prompt_ids, sampling_cfg, generation, block, record: "_Record") -> Iterator[Chunk]:
        if not self._busy.acquire(blocking=False):
            raise EngineBusyError(_BUSY)
        loop = None
        try:
            loop = _Loop(self, prompt_ids, sampling_cfg, generation, block)
            decoder = StreamDecoder(self.tokenizer, generation.stop_strings)
            tail = ""
            try:
                for new_ids in loop.cycles():
                    text, hit = decoder.feed(new_ids)
                    if hit is not None:  # a stop string ended inside the text just produced
                        loop.stop("stop_string")
                        kept = decoder.token_count_for_stop()
                        loop.truncate(kept)
                        trimmed = new_ids[: max(0, len(new_ids) - (decoder.total_tokens - kept))]
                        yield Chunk(text, trimmed)
                        break
                    if text or new_ids:
                        yield Chunk(text, list(new_ids))
                tail = decoder.flush()
            except KeyboardInterrupt:  # while decoding text: the same end as inside a cycle
                loop.stop("interrupted")
        finally:
            if loop is not None:
                loop.finish()
                record.stats = self.last_stats = loop.stats
                record.token_ids = self.last_token_ids = loop.produced
            self._busy.release()
        yield Chunk(tail, [], loop.stats.stop_reason, loop.stats)


class _Record:
    """One request's outcome, filled in when it ends (shared by its Generation and its stream)."""

    stats: GenerationStats | None = None
    token_ids: list[int] = []


class Generation(Iterator[Chunk]):
    """The chunks of one request, as :meth:`Engine.generate` returns them.

    Iterate it for text as it is produced; the last chunk carries the finish reason and the stats.
    ``stats`` and ``token_ids`` hold this request's own record once it has ended, closed early
    (``close()``: the engine is freed and what was produced is kept) or failed.
    """

    def __init__(self, chunks: Iterator[Chunk], record: _Record) -> None:
        self._chunks = chunks
        self._record = record

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()

    @property
    def stats(self) -> GenerationStats | None:
        return self._record.stats

    @property
    def token_ids(self) -> list[int]:
        return list(self._record.token_ids)


class _Loop:
    """One generation: prefill, then draft / verify / commit cycles."""

    def __init__(self, engine: Engine, prompt_ids, sampling_cfg: SamplingConfig, generation: GenerationConfig, block: int):
        self.e = engine
        self.prompt_ids = prompt_ids
        self.sampling = SamplingParams(sampling_cfg.temperature, sampling_cfg.top_p, sampling_cfg.top_k)
        seeds = np.random.SeedSequence(sampling_cfg.seed).spawn(2)
        self.verify_rng = np.random.default_rng(seeds[0])
        self.draft_rng = np.random.default_rng(seeds[1])
        self.max_new = generation.max_new_tokens
        self.stop_ids = engine._stop_ids(generation)
        self.block = block
        self.produced: list[int] = []
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self._stop_reason: str | None = None
        self._t0 = time.perf_counter()
        self._t_first: float | None = None
        self._finished = False
        limit = engine.verifier.max_context  # from this context on the request decodes plainly
        self.limit = limit
        self.timed = engine.time_phases or engine.verifier.needs_timings
        self.stats.phases_timed = self.timed
        within = limit is None or len(prompt_ids) < limit
        self.speculating = engine.drafter is not None and within
        window = engine.target.info.max_position_embeddings
        self.window = window
        if window is not None and len(prompt_ids) >= window:
            raise ContextTooLongError(
                f"the prompt has {len(prompt_ids)} tokens but the target's context window is {window}; shorten the prompt"
            )

    def stop(self, reason: str) -> None:
        self._stop_reason = reason

    def truncate(self, n: int) -> None:
        del self.produced[n:]

    def cycles(self) -> Iterator[list[int]]:
        e = self.e
        try:
            e.backend.reset_peak_memory()
            e.target.reset()
            e.verifier.begin(len(self.prompt_ids))
            out, _ = self._timed(lambda: e.target.prefill(self.prompt_ids, self.capture), "target_s")
            first = self._verify(None, out.logits[-1:]).token_ids
            self._t_first = time.perf_counter()
            if self.speculating:
                self._timed(lambda: e.drafter.prefill(self.prompt_ids, out, first[0]), "draft_s")
            new = self._emit(first)
            yield new
            position = len(self.prompt_ids)
            steps = self._greedy_steps(first[-1]) if self._stop_reason is None else None
            if steps is not None:
                yield from self._plain_greedy(steps, position)
                return
            while self._stop_reason is None:
                new = self._cycle(position, new[-1] if new else self.produced[-1])
                position += len(new)
                yield new
        except KeyboardInterrupt:  # Ctrl-C in any phase: the request ends with what was emitted
            self._stop_reason = "interrupted"
        except GenerationError as exc:
            self._stop_reason = "error"
            exc.token_ids = list(self.produced)
            raise

    def _greedy_steps(self, anchor: int):
        """The target's pipelined greedy path, for plain greedy requests that time nothing."""
        if self.e.drafter is not None or not self.sampling.is_greedy or self.timed:
            return None
        return self.e.target.greedy_steps(anchor)

    def _plain_greedy(self, steps, position: int) -> Iterator[list[int]]:
        e = self.e
        try:
            for token in steps:
                e.verifier.observe(Verification(0, [token]), 0, CycleTiming(position, 0, 0, 0.0))
                new = self._emit([token])
                self.stats.record_cycle(0, 0, len(new))
                position += len(new)
                yield new
                if self._stop_reason is not None:
                    break
        finally:
            steps.close()
            e.target.crop(position)

    @property
    def capture(self) -> Capture:
        return self.e.drafter.info.capture if self.speculating else Capture()

    def _cycle(self, position: int, anchor: int) -> list[int]:
        e = self.e
        if self.limit is not None and position >= self.limit:
            self.speculating = False  # plain for the rest of this request; the drafter is reset by the next prefill
        k = self._room(position)
        draft, draft_s = self._draft(anchor, position, k) if self.speculating and k > 0 else (None, 0.0)
        drafted = 0 if draft is None else draft.num_tokens
        source = DraftSource.MODEL if draft is None else draft.source
        n = e.verifier.plan(draft, k, position) if draft is not None else 0
        if draft is not None and n < draft.num_tokens:
            draft = draft.truncated(n, e.backend.ops) if n > 0 else None
        anchor_arr = e.backend.int_array([anchor])
        block = anchor_arr if draft is None else e.backend.ops.concatenate([anchor_arr, draft.token_ids])
        capture = self.capture
        out, target_s = self._timed(lambda: e.target.forward(block, capture), "target_s")
        verification = self._verify(draft, out.logits)
        accepted = verification.accepted
        e.target.crop(position + accepted + 1)
        commit_s = 0.0
        if self.speculating:
            _, commit_s = self._timed(lambda: e.drafter.commit(out, accepted + 1, verification.token_ids), "draft_s")
        e.verifier.observe(verification, n, CycleTiming(position, n, drafted, target_s, draft_s, commit_s, source))
        new = self._emit(verification.token_ids)
        self.stats.record_cycle(n, accepted, len(new), copied=source is DraftSource.LOOKUP)
        return new

    def _room(self, position: int) -> int:
        """Most proposals this cycle may verify: the block, what is left to generate, the window."""
        k = min(self.block - 1, self.max_new - len(self.produced) - 1)
        return k if self.window is None else min(k, self.window - position - 1)

    def _draft(self, anchor: int, position: int, k: int) -> tuple[Draft | None, float]:
        """A free proposal (a prompt-lookup copy) if there is one, else the drafter's when the
        verifier's policy says drafting pays this cycle; and the seconds the drafter took."""
        e = self.e
        request = DraftRequest(anchor, position, k, self.sampling, self.draft_rng)
        free = e.drafter.propose_free(request)
        if free is not None or not e.verifier.wants_draft(k, position):
            return free, 0.0
        return self._timed(lambda: e.drafter.propose(request), "draft_s")

    def _verify(self, draft, logits):
        return self.e.verifier.verify(self.e.backend.ops, draft, logits, self.sampling, self.verify_rng)

    def _emit(self, token_ids: list[int]) -> list[int]:
        """Commit tokens, cutting at a stop token (kept) and at max_new_tokens / the window."""
        new: list[int] = []
        for t in token_ids:
            new.append(t)
            self.produced.append(t)
            if t in self.stop_ids:
                self._stop_reason = "eos"
                break
            if len(self.produced) >= self.max_new:
                self._stop_reason = "max_new_tokens"
                break
            if self.window is not None and len(self.prompt_ids) + len(self.produced) >= self.window:
                self._stop_reason = "context_length"
                break
        return new

    def _timed(self, fn, total: str):
        """``(fn(), seconds)``; decode-time seconds also go to ``stats.<total>`` when timed.
        Untimed, the seconds only cover scheduling: lazy backends keep computing after it."""
        t = time.perf_counter()
        result = fn()
        if self.timed:
            self.e.backend.synchronize()
        elapsed = time.perf_counter() - t
        if self.timed and self._t_first is not None:
            setattr(self.stats, total, getattr(self.stats, total) + elapsed)
        return result, elapsed

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        end = time.perf_counter()
        s = self.stats
        s.total_s = end - self._t0
        if self._t_first is not None:
            s.ttft_s = s.prefill_s = self._t_first - self._t0
            s.decode_s = end - self._t_first
        s.new_tokens = len(self.produced)
        s.stop_reason = self._stop_reason or "interrupted"
        s.peak_memory_bytes = self.e.backend.peak_memory_bytes()
        s.verifier = self.e.verifier.decisions()
        s.fast_path = self.e.target.fast_path


_BUSY = ("this engine is already generating (another thread, or a generator from an earlier generate() call "
         "that is still open); exhaust or close() that generator first, or give each thread its own engine")


def _token_ids(values: Sequence[int]) -> list[int]:
    """Integer token ids; floats and bools are refused rather than converted with ``int()``."""
    if isinstance(values, (str, bytes)):
        raise SettingError("prompt_ids: must be a sequence of integer token ids, not a string", "prompt_ids")
    try:
        items = list(values)
    except TypeError:
        raise SettingError(f"prompt_ids: must be a sequence of integer token ids, got {type(values).__name__}",
                           "prompt_ids") from None
    ids = []
    for t in items:
        if isinstance(t, bool) or "bool" in type(t).__name__ or "bool" in str(getattr(t, "dtype", "")):
            raise SettingError(f"prompt_ids: must hold integer token ids, got a boolean {t!r}", "prompt_ids")
        try:
            ids.append(operator.index(t))
        except TypeError:
            raise SettingError(f"prompt_ids: must hold integer token ids, got {t!r} ({type(t).__name__})",
                               "prompt_ids") from None
    return ids


def _section(model, name: str, data: dict):
    """``model.model_validate(data)``, its errors as a SettingError naming the field."""
    from pydantic import ValidationError

    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join([name, *map(str, err["loc"])])
        raise SettingError(f"{_argument(field)}: {field}: {err['msg']}", field) from None


def _argument(field: str) -> str:
    """The keyword argument that sets a config field this call: ``sampling.top_p`` -> ``top_p``."""
    key = field.split(".")[1] if "." in field else field
    return f"generate(..., {key}=...)"
