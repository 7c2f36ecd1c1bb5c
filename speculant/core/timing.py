"""Whether another layout of a model's weights is faster on this machine, measured at load.

The CPU fast paths that only change how weights are laid out (stored transposed or packed for
oneDNN on PyTorch, stored transposed on MLX) pay on some CPUs and lose on others, and on one CPU
they can win over a weight hot in the cache yet lose over a whole model's weights in turn: on an
Intel Xeon with AVX-512 an 8-row product ran 1.6x faster transposed over one layer per shape,
but 0.95x over the 57 layers of a 25M-parameter target (docs/history/fast-path-history.md). So
``backend.compile`` (``auto``, and ``on`` on PyTorch) times each layout against the weights as
loaded, interleaved, over the model's own layers in order, as a forward reads them
(:func:`working_set`), and keeps a new one only where it is faster by ``MARGIN``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from speculant.core.home import speculant_home

MARGIN = 1.05  # the new layout must be this much faster than the old one to be kept
REPEATS = 7
# Untimed rounds first: a pass over freshly laid-out weights took several calls to settle (the
# shipped target's transposed layers, one thread: 8.3, 2.8, 2.5, 1.8, then 1.1-1.2 ms), and one
# warm-up call left transposed weights measured at 0.86-0.94x of dense where they run 1.3-1.5x.
WARM_UP = 5
MIN_SAMPLE_S = 0.005
# Layers timed, in model order, until their weights reach this: far more than a core's own
# caches hold, so that each product reads its weight from further out, as in a forward; at most
# this much is copied into a new layout to be timed.
WORKING_SET_BYTES = 256 << 20


def speedup(old: Callable[[], None], new: Callable[[], None], repeats: int = REPEATS) -> float:
    """``old``'s median time over ``new``'s, timed interleaved (drift hits them alike). Each
    callable must return only once its work is done."""
    runs = (old, new)
    for _ in range(WARM_UP):
        for run in runs:
            run()
    # a sample of at least MIN_SAMPLE_S: one pass over a small model is a millisecond or two,
    # where a single timing moved the ratio by ±20 %
    loops = max(1, math.ceil(MIN_SAMPLE_S / max(_seconds(old), 1e-6)))
    times: tuple[list, list] = ([], [])
    for _ in range(repeats):
        for run, samples in zip(runs, times):
            samples.append(_seconds(run, loops))
    old_time, new_time = (statistics.median(samples) for samples in times)
    return old_time / new_time if new_time > 0 else float("inf")


def _seconds(fn: Callable[[], None], loops: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(loops):
        fn()
    return time.perf_counter() - start


def working_set(layers: Sequence[Any], nbytes: Callable[[Any], int], budget: int = WORKING_SET_BYTES) -> list:
    """``layers`` from the first, until their ``nbytes`` reach ``budget`` (at least one)."""
    chosen, total = [], 0
    for layer in layers:
        if chosen and total >= budget:
            break
        chosen.append(layer)
        total += nbytes(layer)
    return chosen


# -- remembered measurements ---------------------------------------------------------------------
# Timing the layouts of SmolLM2-135M's 211 layers took 10-24 s of a 15-30 s load on a 2-core CPU
# (2026-12-06), on every load. The result depends on the machine, the library and the layers'
# shapes, so it is kept under that key and read back by later loads: timed once per machine.
TIMINGS_FILE = "timings.json"


def remembered(what: str, key: dict[str, Any], measure: Callable[[], Any]) -> Any:
    """``measure()``'s result (JSON: a float, or a dict with string keys), timed once per machine
    and ``key`` and kept in ``$SPECULANT_HOME/timings.json``; ``SPECULANT_TIMINGS=off`` times
    every call, ``SPECULANT_TIMINGS=<file>`` keeps them there. A file that cannot be read or
    written is timed around, never an error."""
    path = timings_path()
    if path is None:
        return _as_read(measure())
    identity = json.dumps({"what": what, "machine": machine(), **key}, sort_keys=True)
    digest = hashlib.sha256(identity.encode()).hexdigest()
    entries = _read(path)
    if digest in entries and "value" in entries[digest]:
        return entries[digest]["value"]
    value = _as_read(measure())
    entries = _read(path)  # another process may have written since
    entries[digest] = {"what": what, "value": value, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    _write(path, entries)
    return value


def timings_path() -> Path | None:
    setting = os.environ.get("SPECULANT_TIMINGS", "")
    if setting.lower() == "off":
        return None
    return Path(setting).expanduser() if setting else speculant_home() / TIMINGS_FILE


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def machine() -> dict[str, Any]:
    """What a measurement depends on besides the library and the layers: the CPU and its cores."""
    model = platform.processor()
    with contextlib.suppress(OSError):
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else model
    return {"system": platform.system(), "arch": platform.machine(), "cpu": model, "cores": usable_cores()}


def _as_read(value: Any) -> Any:
    """``value`` as a read of the file gives it back (a dict's keys strings), whatever the setting."""
    return json.loads(json.dumps(value))


def _read(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _write(path: Path, entries: dict) -> None:
    """Written whole, then moved into place: a reader never sees half a file."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".timings-", delete=False) as out:
            json.dump(entries, out, indent=1, sort_keys=True)
        try:
            os.replace(out.name, path)
        except OSError:
            os.unlink(out.name)
            raise
