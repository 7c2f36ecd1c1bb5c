"""The prefix cache's disk tier (core/prefix_disk.py): entries evicted from memory are spilled to
safetensors files and brought back with a cold request's tokens; a damaged or truncated file fails
its checksum, is dropped and its tokens are prefilled again; a later engine reuses the directory."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("torch")

from speculant.api import load_engine  # noqa: E402
from speculant.testing.planted_drafter import registry_with_planted  # noqa: E402
from speculant.testing.tiny_families import build_tiny_family  # noqa: E402

HAS_MLX = importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None
BACKENDS = ["torch", pytest.param("mlx", marks=[pytest.mark.mlx,
                                                 pytest.mark.skipif(not HAS_MLX, reason="needs mlx and mlx-lm")])]
FIRST, OTHER, PROMPT = list(range(20, 60)), list(range(100, 140)), list(range(20, 68))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, torch_threads):
    return build_tiny_family(tmp_path_factory.mktemp("disk") / "qwen3_5", "qwen3_5")


def engine(target, backend, **prefix_cache):
    config = {"backend": {"kind": backend, "device": "cpu", "dtype": "float32", "compile": "off"},
              "target": {"path": str(target)}, "drafter": {"kind": "planted", "options": {}},
              "prefix_cache": prefix_cache}
    return load_engine(config, registry=registry_with_planted())


def run(e, ids, new=40):
    return e.run(prompt_ids=ids, max_new_tokens=new, ignore_eos=True)


def spilled(target, backend, directory):
    """An engine whose memory holds one snapshot, after FIRST's was spilled to ``directory``."""
    e = engine(target, backend, disk_dir=str(directory))
    run(e, FIRST, new=1)
    e.prefix_store.max_bytes = e.prefix_store.bytes * 3 // 2  # room for one snapshot
    run(e, OTHER, new=1)
    assert e.prefix_store.stats.spilled == 1 and len(list(directory.glob("*.safetensors"))) == 1
    return e


@pytest.fixture(scope="module")
def cold(hybrid):
    return {b: run(engine(hybrid, b, max_bytes=0), PROMPT).token_ids for b in ("torch", "mlx") if b == "torch" or HAS_MLX}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_spilled_snapshot_comes_back_with_cold_tokens(hybrid, cold, backend, tmp_path):
    e = spilled(hybrid, backend, tmp_path)
    result = run(e, PROMPT)
    assert result.stats.cached_tokens == len(FIRST) and e.prefix_store.stats.disk_hits == 1
    assert result.token_ids == cold[backend]


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_damaged_spill_file_is_dropped_and_recomputed(hybrid, cold, backend, damage, tmp_path):
    e = spilled(hybrid, backend, tmp_path)
    (file,) = tmp_path.glob("*.safetensors") if damage == "flipped byte" else tmp_path.glob("*.structure.json")
    data = bytearray(file.read_bytes())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    file.write_bytes(bytes(data))
    result = run(e, PROMPT)
    assert result.stats.cached_tokens == 0 and e.prefix_store.spill.dropped == 1
    assert not file.exists() or file.read_bytes() != bytes(data)  # gone, or a fresh spill of the recomputed prefix
    assert result.token_ids == cold[backend]


def test_a_later_engine_reuses_the_directory_and_the_disk_budget_holds(hybrid, cold, tmp_path):
    spilled(hybrid, "torch", tmp_path)
    later = engine(hybrid, "torch", disk_dir=str(tmp_path))
    assert len(later.prefix_store.spill.records) == 1
    result = run(later, PROMPT)
    assert result.stats.cached_tokens == len(FIRST) and result.token_ids == cold["torch"]
    tiny = engine(hybrid, "torch", disk_dir=str(tmp_path / "tiny"), disk_max_bytes=1000)
    run(tiny, FIRST, new=1)
    tiny.prefix_store.max_bytes = tiny.prefix_store.bytes * 3 // 2
    run(tiny, OTHER, new=1)
    assert tiny.prefix_store.stats.spilled == 0 and not list((tmp_path / "tiny").iterdir())


def test_a_structure_naming_another_class_is_refused_even_with_a_good_checksum(hybrid, cold, tmp_path):
    """No pickle: a spill file that names a class outside the cache modules (here `os.system`,
    with the record's checksum rewritten to match) is dropped, never called; the tokens are prefilled."""
    import hashlib
    import json

    e = spilled(hybrid, "torch", tmp_path)
    (structure,) = tmp_path.glob("*.structure.json")
    structure.write_text(json.dumps({"object": "os:system", "attributes": {"dict": []}}))
    (arrays,) = tmp_path.glob("*.safetensors")
    record = structure.with_name(structure.name.replace(".structure.json", ".json"))
    data = json.loads(record.read_text())
    data["checksum"] = hashlib.sha256(arrays.read_bytes() + structure.read_bytes()).hexdigest()
    record.write_text(json.dumps(data))
    e.prefix_store.spill.records[record.stem].checksum = data["checksum"]
    result = run(e, PROMPT)
    assert result.stats.cached_tokens == 0 and e.prefix_store.spill.dropped == 1
    assert result.token_ids == cold["torch"]
    from speculant.core.prefix_disk import _allowed_class

    with pytest.raises(ValueError, match="not a cache class"):
        _allowed_class("subprocess:Popen")  # a class, but outside the allow-list: never built
    assert _allowed_class("speculant.core.prefix_cache:CacheSnapshot").__name__ == "CacheSnapshot"
