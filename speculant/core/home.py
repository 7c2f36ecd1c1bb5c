"""Where speculant keeps what it makes on this machine: pulled models, remembered timings."""

from __future__ import annotations

import os
from pathlib import Path


def speculant_home() -> Path:
    """``$SPECULANT_HOME``, default ``~/.cache/speculant``."""
    return Path(os.environ.get("SPECULANT_HOME") or Path.home() / ".cache" / "speculant").expanduser()
