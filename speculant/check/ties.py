"""Near-tie or bug: why speculative and plain greedy output first differ.

In bfloat16 or float16 a verify block (anchor + drafts) and a one-token step are matrix products
of different shapes, which round differently; where the target's two best tokens are within that
rounding of each other, the two paths may pick different ones. That is the target's own output
in that dtype, not a bug, and float32 (or a fixed verify width: see docs/verifiers.md) removes it.

The check replays the target calls of both paths exactly (the speculative run's recorded
prefill/forward/crop calls, and plain decoding's prefill and one-token steps), reads the logits
each path decided the differing token with, and compares the two tokens' logit gap with the
dtype's rounding at that logit magnitude (``rounding_bound``). Within it: a near-tie. Beyond it
(the verifier accepted a token its own forward does not prefer, a cache rolled back wrong, a
draft leaking into the target): a failure, with both margins as the evidence.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

# Bits of significand (the implicit one included): ulp(x) = 2 ** (floor(log2 |x|) - (bits - 1)).
SIGNIFICAND_BITS = {"bfloat16": 8, "float16": 11}
# How many ulps at the logit magnitude two product shapes may move the gap between two logits.
# Each path rounds each logit once at the output head (half an ulp each, so one ulp for a gap),
# and the hidden state entering the head carries every layer's rounding, which a different shape
# rounds differently. Measured on the shipped pair (PyTorch on a CPU, 768 positions of 12 prompts,
# the top-2 gap of a one-token step against the verify block that decided the same position):
# at most 2 ulps in bfloat16 and in float16, median 0 (MLX: 0). 8 is four times that, for deeper
# targets, and stays below the gaps of wrong tokens (a verifier accepting every draft: 27 ulps and up).
ROUNDING_ULPS = 8


def ulp(dtype: str, magnitude: float) -> float:
    """One unit in the last place of ``dtype`` at ``magnitude``."""
    exponent = math.floor(math.log2(max(abs(magnitude), 2.0 ** -14)))
    return 2.0 ** (exponent - (SIGNIFICAND_BITS[dtype] - 1))


def rounding_bound(dtype: str, magnitude: float) -> float:
    """How far rounding may move the gap between two logits of about ``magnitude``: 0 in float32,
    where speculative output must equal plain decoding's exactly."""
    return ROUNDING_ULPS * ulp(dtype, magnitude) if dtype in SIGNIFICAND_BITS else 0.0


@dataclass
class Divergence:
    """The first position where speculative and plain output differ, with the target's logits
    under both paths: ``*_margin`` is each path's top-2 margin, ``*_gap`` how much it preferred its
    own token over the other path's."""

    position: int  # index into the new tokens
    plain_token: int
    speculative_token: int
    plain_margin: float
    block_margin: float
    plain_gap: float
    block_gap: float
    bound: float
    dtype: str

    @property
    def near_tie(self) -> bool:
        return max(abs(self.plain_gap), abs(self.block_gap)) <= self.bound

    def describe(self) -> str:
        margins = f"top-2 margin {self.plain_margin:.4g} one-token, {self.block_margin:.4g} block"
        if self.near_tie:
            return f"near-tie ({margins}, within {self.dtype} rounding {self.bound:.3g})"
        picked = ("; the engine emitted a token its own verify block does not pick" if self.block_gap < -self.bound
                  else "")
        return (f"the target prefers plain's token by {self.plain_gap:.4g} in a one-token step and by "
                f"{-self.block_gap:.4g} in the verify block, beyond {self.dtype} rounding ({self.bound:.3g}; "
                f"{margins}){picked}")


class TargetCalls:
    """The target's prefill / forward / crop / reset calls during one run, replayable exactly."""

    def __init__(self, engine: Any) -> None:
        self.target, self.ops = engine.target, engine.backend.ops
        self.backend = engine.backend
        self.calls: list[tuple[str, Any, Any, int]] = []  # (method, argument, capture, cache length before)

    @contextlib.contextmanager
    def recording(self) -> Iterator["TargetCalls"]:
        target = self.target
        originals = {name: getattr(target, name) for name in ("prefill", "forward", "crop", "reset")}

        def record(name: str):
            def call(arg=None, *rest, **kwargs):
                value = self.ops.to_list(arg) if name == "forward" else (list(arg) if name == "prefill" else arg)
                capture = rest[0] if rest else kwargs.get("capture")
                self.calls.append((name, value, capture, target.cache_length))
                return originals[name](*(() if arg is None else (arg,)), *rest, **kwargs)
            return call

        for name in originals:
            setattr(target, name, record(name))
        try:
            yield self
        finally:
            for name in originals:
                delattr(target, name)  # the class's methods again

    def logits_at(self, index: int) -> np.ndarray:
        """Replay the calls up to the one whose logits decided the token at absolute ``index`` (the
        prompt's tokens included) and return that row's logits."""
        decider, row = None, 0
        for i, (name, value, _, before) in enumerate(self.calls):
            if name == "prefill" and len(value) == index:
                decider, row = i, -1
            elif name == "forward" and before <= index - 1 < before + len(value):
                decider, row = i, index - 1 - before
        if decider is None:
            raise LookupError(f"no recorded target call decided position {index}")
        out = None
        for name, value, capture, _ in self.calls[: decider + 1]:
            out = self._call(name, value, capture)
        self.target.reset()
        return self.ops.to_numpy(self.ops.float32(out.logits))[row].astype(np.float64)

    def _call(self, name: str, value: Any, capture: Any) -> Any:
        extra = () if capture is None else (capture,)
        if name == "prefill":
            return self.target.prefill(value, *extra)
        if name == "forward":
            return self.target.forward(self.backend.int_array(value), *extra)
        return self.target.crop(value) if name == "crop" else self.target.reset()


def one_token_logits(engine: Any, prompt_ids: list[int], tokens: list[int]) -> np.ndarray:
    """Plain decoding's logits for the token after ``prompt_ids + tokens``: a prefill of the prompt,
    then one-token steps, as plain greedy decoding computes them."""
    target, ops = engine.target, engine.backend.ops
    target.reset()
    out = target.prefill(prompt_ids)
    for token in tokens:
        out = target.forward(engine.backend.int_array([token]))
    logits = ops.to_numpy(ops.float32(out.logits))[-1].astype(np.float64)
    target.reset()
    return logits


def classify(engine: Any, prompt_ids: list[int], plain: list[int], calls: TargetCalls, position: int,
             speculative_token: int) -> Divergence:
    """Both paths' logits at new-token ``position``, where plain decoding gave ``plain[position]`` and
    the speculative run (``calls``) ``speculative_token``."""
    p, s = plain[position], speculative_token
    one = one_token_logits(engine, prompt_ids, plain[:position])
    block = calls.logits_at(len(prompt_ids) + position)
    magnitude = max(abs(one[p]), abs(one[s]), abs(block[p]), abs(block[s]))
    dtype = engine.backend.dtype_name
    return Divergence(position, p, s, _margin(one), _margin(block), float(one[p] - one[s]), float(block[s] - block[p]),
                      rounding_bound(dtype, magnitude), dtype)


def _margin(logits: np.ndarray) -> float:
    top = np.partition(logits, -2)[-2:]
    return float(top[1] - top[0])
