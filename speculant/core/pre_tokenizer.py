"""Keep a folder's serialized pre-tokenizer when transformers rebuilds it.

transformers 5 constructs some tokenizer classes (``GPT2Tokenizer`` among them) with a plain
byte-level pre-tokenizer of their own and ignores the ``pre_tokenizer`` stored in the folder's
``tokenizer.json`` (reported as allenai/open-instruct#1896). A SmolLM2 folder from the Hugging
Face Hub names ``GPT2Tokenizer``, so it silently loses SmolLM's per-digit split, and text around
numbers tokenizes differently from how the model was trained. Written once for every backend
(duck-typed; the ``tokenizers`` package is imported only when a repair is needed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def restore_pre_tokenizer(tokenizer: Any, folder: str | Path) -> bool:
    """Put the file's pre-tokenizer back on ``tokenizer`` where transformers replaced a
    ``Sequence[..., ByteLevel]`` by its last step alone; True when it did. Any other difference
    is left alone (some classes change a pre-tokenizer on purpose, e.g. Llama's legacy mode)."""
    path = Path(folder) / "tokenizer.json"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not path.is_file():
        return False
    loaded = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else None
    if not loaded or loaded.get("type") != "ByteLevel":
        return False
    saved = json.loads(path.read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    steps = saved.get("pretokenizers") if saved.get("type") == "Sequence" else None
    if not steps or len(steps) < 2 or steps[-1].get("type") != "ByteLevel":
        return False
    from tokenizers import Tokenizer

    backend.pre_tokenizer = Tokenizer.from_file(str(path)).pre_tokenizer
    return True
