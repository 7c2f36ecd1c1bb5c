"""Keys and values appended into spare room, for the batch caches of every backend
(``backends/torch/growing.py``, ``backends/mlx/batch.py``): concatenating each forward's states
onto the whole cache copies all of it every cycle (at 16 rows x 4k columns of a 36-layer model,
gigabytes a cycle). The buffers ``[rows, heads, capacity, dim]`` grow by half when full; the
cache reads back a view of the held columns. Any array library with numpy's slicing and slice
assignment."""

from __future__ import annotations

from typing import Any, Callable

SPARE = 0.5  # room added beyond what is needed when the buffers grow, as a share of it
MIN_SPARE = 64  # columns


class HeldColumns:
    """A cache attribute (``keys`` or ``values``) read as the held columns (axis 2) of its buffer;
    assigning an array (a crop, a gather, a merge) takes it whole as the buffer, all held. Keys
    and values keep their own counts, since callers assign them one after the other."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.buffer, self.held = f"_{name}_buffer", f"_{name}_held"

    def __get__(self, cache: Any, owner: type | None = None) -> Any:
        if cache is None:
            return self
        buffer = getattr(cache, self.buffer, None)
        return None if buffer is None or len(buffer.shape) < 3 else buffer[:, :, :getattr(cache, self.held)]

    def __set__(self, cache: Any, array: Any) -> None:
        setattr(cache, self.buffer, array)
        setattr(cache, self.held, 0 if array is None or len(array.shape) < 3 else int(array.shape[2]))


def append(cache: Any, keys: Any, values: Any, zeros: Callable[[Any, tuple[int, ...]], Any]) -> None:
    """Write ``keys`` / ``values`` ``[rows, heads, new, dim]`` after ``cache``'s held columns (its
    ``keys`` and ``values`` being :class:`HeldColumns`), growing both buffers with
    ``zeros(like, shape)`` when they are full or hold other rows."""
    held, new = cache._keys_held, int(keys.shape[2])
    buffer = cache._keys_buffer
    if cache.keys is None or buffer.shape[2] < held + new or buffer.shape[0] != keys.shape[0]:
        capacity = held + new + max(MIN_SPARE, int((held + new) * SPARE))
        grown_keys = zeros(keys, (*keys.shape[:2], capacity, keys.shape[3]))
        grown_values = zeros(values, (*values.shape[:2], capacity, values.shape[3]))
        if held:
            grown_keys[:, :, :held], grown_values[:, :, :held] = cache.keys, cache.values
        cache._keys_buffer, cache._values_buffer = grown_keys, grown_values
    cache._keys_buffer[:, :, held:held + new] = keys
    cache._values_buffer[:, :, held:held + new] = values
    cache._keys_held = cache._values_held = held + new
