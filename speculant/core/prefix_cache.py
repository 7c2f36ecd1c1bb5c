"""The prefix store: snapshots of a request's state at the end of a token prefix, so a later
request whose prompt starts with those tokens resumes there instead of prefilling them again.

Backend-neutral: a snapshot is an opaque :class:`CacheSnapshot` a target produced (its caches as
they stood) plus the captured rows a drafter is fed (``features``, ``final_hidden``), with a byte
size. The store keys entries by a *state key* (what makes two states differ although their tokens
agree: the backend, target, dtype, drafter and the layers it taps) and the token ids, finds the
longest usable prefix of a request, and keeps the bytes held under a budget, evicting the least
recently used entry first. A snapshot larger than the budget is never stored.

Usable prefixes. A target whose caches can be cut back at any token (``CacheSnapshot.cuttable``:
every layer full attention) serves any prefix the request shares with an entry. A target with
sliding windows or Gated DeltaNet states cannot be cut back, so its snapshot serves only requests
that extend the entry's whole token list. Either way at least one prompt token is left to
prefill: its logits give the first new token.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable, Sequence

from speculant.core.types import Array

if TYPE_CHECKING:
    from speculant.core.prefix_disk import DiskTier


@dataclass
class CacheSnapshot:
    """A target's caches as they stood after ``length`` positions (``state`` is the backend's)."""

    state: Any
    length: int
    nbytes: int
    cuttable: bool  # can be restored at any shorter length (every layer full attention)


@dataclass
class PrefixEntry:
    """What a request needs to resume after ``tokens``: the target's caches and the drafter's rows."""

    tokens: tuple[int, ...]
    snapshot: CacheSnapshot
    features: Array | None = None  # captured target features of every token ([n, F]) for the drafter
    final_hidden: Array | None = None  # [n, H]

    @property
    def nbytes(self) -> int:
        return self.snapshot.nbytes + array_bytes(self.features) + array_bytes(self.final_hidden)

    def usable(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of ``prompt`` this entry can restore (0: none), leaving one."""
        limit = min(len(prompt) - 1, len(self.tokens))
        shared = _common_prefix(self.tokens, prompt, limit)
        if self.snapshot.cuttable:
            return shared
        return len(self.tokens) if shared == len(self.tokens) else 0


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0  # prompt tokens restored instead of prefilled, over all hits
    stored: int = 0
    evicted: int = 0
    skipped: int = 0  # snapshots larger than the whole budget
    spilled: int = 0  # evicted entries written to the disk tier
    disk_hits: int = 0  # entries brought back from it

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


RECENT_PROMPTS = 16  # prompts per state key compared with a new one for a shared prefix


class PrefixStore:
    """Snapshots by state key and tokens, within ``max_bytes`` (0 = off), least recently used first out."""

    def __init__(self, max_bytes: int, spill: "DiskTier | None" = None) -> None:
        self.max_bytes = max_bytes
        self.spill = spill  # where evicted entries go, if anywhere
        self.stats = PrefixStats()
        self._entries: OrderedDict[tuple[Hashable, tuple[int, ...]], PrefixEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.RLock()
        self._recent: dict[Hashable, deque] = {}  # recent prompts per state key, for checkpoints

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, state_key: Hashable, prompt: Sequence[int]) -> tuple[PrefixEntry, int] | None:
        """The entry restoring the most leading tokens of ``prompt`` and how many, or None."""
        with self._lock:
            best, best_length = None, 0
            for (key, _), entry in self._entries.items():
                if key == state_key and (n := entry.usable(prompt)) > best_length:
                    best, best_length = (key, entry.tokens), n
            spilled = self.spill.find(state_key, prompt) if self.spill is not None else None
            if spilled is not None and spilled[1] > best_length:
                entry = self.spill.load(spilled[0])  # None when its files fail the checksum
                if entry is not None and self.store(state_key, entry):
                    best, best_length = (state_key, entry.tokens), spilled[1]
                    self.stats.disk_hits += 1
            if best is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(best)
            self.stats.hits += 1
            self.stats.cached_tokens += best_length
            return self._entries[best], best_length

    def store(self, state_key: Hashable, entry: PrefixEntry) -> bool:
        """Keep ``entry`` (replacing one with the same tokens), evicting old entries to fit (to the
        disk tier if there is one); False when it alone is over the budget or the store is off."""
        size = entry.nbytes
        if not self.enabled or size > self.max_bytes:
            self.stats.skipped += self.enabled
            return False
        with self._lock:
            self._drop((state_key, entry.tokens))
            if entry.snapshot.cuttable:  # a cuttable entry serves every prefix of its tokens
                for key in [k for k, e in self._entries.items()
                            if k[0] == state_key and e.snapshot.cuttable and entry.tokens[:len(e.tokens)] == e.tokens]:
                    self._drop(key)
            while self._entries and self._bytes + size > self.max_bytes:
                key = next(iter(self._entries))
                evicted = self._drop(key)
                self.stats.evicted += 1
                if self.spill is not None and self.spill.put(key[0], evicted):
                    self.stats.spilled += 1
            self._entries[(state_key, entry.tokens)] = entry
            self._bytes += size
            self.stats.stored += 1
            return True

    def remember(self, state_key: Hashable, prompt: Sequence[int]) -> None:
        """Note a request's prompt, so later ones can find the prefix they share with it."""
        with self._lock:
            self._recent.setdefault(state_key, deque(maxlen=RECENT_PROMPTS)).append(tuple(prompt))

    def shared_prefix(self, state_key: Hashable, prompt: Sequence[int]) -> int:
        """The most leading tokens ``prompt`` shares with a recent prompt, leaving one."""
        with self._lock:
            recent = list(self._recent.get(state_key, ()))
        return max((_common_prefix(p, prompt, min(len(p), len(prompt) - 1)) for p in recent), default=0)

    def cuttable(self, state_key: Hashable) -> bool:
        """Whether this key's snapshots are cut at any token (then no checkpoint is needed)."""
        with self._lock:
            return any(e.snapshot.cuttable for (key, _), e in self._entries.items() if key == state_key)

    def clear(self) -> None:
        """Drop every entry, the disk tier's too."""
        with self._lock:
            self._entries.clear()
            self._recent.clear()
            self._bytes = 0
            if self.spill is not None:
                self.spill.clear()

    def _drop(self, key) -> PrefixEntry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
        return entry


def array_bytes(array: Array | None) -> int:
    """An array's size in bytes (torch, MLX and numpy arrays all say ``nbytes``)."""
    return 0 if array is None else int(array.nbytes)


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n

