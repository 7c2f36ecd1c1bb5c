"""The prefix store on its own (core/prefix_cache.py): longest usable prefix, state keys kept
apart, the byte budget and least-recently-used eviction."""

from __future__ import annotations

import numpy as np
import pytest

from speculant.core.config import EngineConfig
from speculant.core.errors import ConfigError
from speculant.core.prefix_cache import CacheSnapshot, PrefixEntry, PrefixStore

KEY = ("torch", "cpu", "/models/a", "float32", (), None)


def entry(tokens, nbytes=100, cuttable=False, features=None) -> PrefixEntry:
    return PrefixEntry(tuple(tokens), CacheSnapshot(object(), len(tokens), nbytes, cuttable), features)


def test_a_whole_snapshot_serves_only_prompts_that_extend_it_leaving_one_token():
    store = PrefixStore(10_000)
    store.store(KEY, entry(range(10)))
    store.store(KEY, entry(range(6)))
    assert store.lookup(KEY, list(range(12)))[1] == 10
    assert store.lookup(KEY, list(range(10)))[1] == 6  # the 10-token one would leave nothing to prefill
    assert store.lookup(KEY, list(range(8)) + [99, 100])[1] == 6  # diverges inside the longer one
    assert store.lookup(KEY, [1, 2, 3]) is None
    assert (store.stats.hits, store.stats.misses, store.stats.cached_tokens) == (3, 1, 22)


def test_a_cuttable_snapshot_serves_any_shared_prefix_and_replaces_its_own_prefixes():
    store = PrefixStore(10_000)
    store.store(KEY, entry(range(5), cuttable=True))
    store.store(KEY, entry(range(10), cuttable=True))
    assert len(store) == 1 and store.bytes == 100  # the 5-token entry is a prefix of the new one
    assert store.lookup(KEY, list(range(7)) + [50])[1] == 7
    assert store.lookup(KEY, list(range(10)))[1] == 9  # one token short: its logits start the output


def test_other_targets_or_dtypes_never_share_entries():
    store = PrefixStore(10_000)
    store.store(KEY, entry(range(10)))
    for other in (KEY[:2] + ("/models/b",) + KEY[3:], KEY[:3] + ("bfloat16",) + KEY[4:], KEY[:4] + ((1, 2), None)):
        assert store.lookup(other, list(range(12))) is None


def test_the_budget_is_never_exceeded_and_the_least_recently_used_goes_first():
    store = PrefixStore(250)
    store.store(KEY, entry([1, 2, 3]))
    store.store(KEY, entry([4, 5, 6]))
    store.lookup(KEY, [1, 2, 3, 9])  # [1, 2, 3] is now the most recently used
    store.store(KEY, entry([7, 8, 9]))
    assert store.bytes <= 250 and store.stats.evicted == 1
    assert store.lookup(KEY, [4, 5, 6, 9]) is None
    assert store.lookup(KEY, [1, 2, 3, 9]) is not None
    assert not store.store(KEY, entry([1, 1, 1], nbytes=251))  # larger than the whole budget
    assert store.stats.skipped == 1 and store.bytes <= 250


def test_features_count_towards_the_bytes_and_zero_turns_the_store_off():
    features = np.zeros((4, 8), dtype=np.float32)
    assert entry(range(4), features=features).nbytes == 100 + 128
    store = PrefixStore(0)
    assert not store.enabled and not store.store(KEY, entry(range(4)))
    assert store.lookup(KEY, list(range(6))) is None


def test_the_budget_is_a_checked_config_field():
    config = EngineConfig.load({"target": {"path": "/m"}})
    assert config.prefix_cache.max_bytes == 1 << 30
    with pytest.raises(ConfigError, match="prefix_cache.max_bytes"):
        EngineConfig.load({"target": {"path": "/m"}, "prefix_cache": {"max_bytes": -1}})
