"""Strict target loading: a checkpoint that does not hold exactly the model's tensors is an error.

transformers initialises a missing weight at random and only logs it, so a damaged target would
decode different text without a word. Here missing, unexpected and mis-shaped tensors stop the
load with a :class:`~speculant.core.errors.CheckpointError` naming them. What a text-only causal
LM skips on purpose is expected: vision / audio towers of composite checkpoints, multi-token-
prediction layers (``mtp.*``, or DeepSeek's ``model.layers.{N+k}``), and tied output heads,
which transformers already leaves out of its report.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Iterator

import torch

from speculant.backends.torch.loading import load_causal_lm
from speculant.core.errors import CheckpointError

_SKIPPED_WORDS = ("vision", "visual", "audio", "multi_modal", "mm_projector")
_MTP = re.compile(r"(^|\.)mtp(\.|_)")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_REPORT_LOGGER = "transformers.modeling_utils"  # the logger that writes the load report
_LIST = 8  # names shown per kind of problem
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def load_strict(path: str, dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    """``load_causal_lm`` that raises CheckpointError for any tensor the model and checkpoint
    disagree on, before the model is used."""
    with _loading_report() as report:
        try:
            model, info = load_causal_lm(path, dtype)
        except RuntimeError as exc:
            if "mismatch" not in str(exc):
                raise
            rows = [_ANSI.sub("", line).split("|") for line in report if "MISMATCH" in line and "|" in line]
            names = [" ".join(cell.strip() for cell in row[::2] if cell.strip()) for row in rows]  # name, details
            detail = "; ".join(names[:_LIST]) or str(exc).splitlines()[0]
            raise CheckpointError(f"target.path: checkpoint {path} has tensor(s) whose shape does not fit the "
                                  f"model its config.json describes: {detail}", "target.path") from None
    problems = loading_problems(model, info)
    if problems:
        shown = "; ".join(problems[:_LIST]) + (f"; and {len(problems) - _LIST} more" if len(problems) > _LIST else "")
        raise CheckpointError(f"target.path: checkpoint {path} does not match its config.json: {shown} "
                              "(a damaged or partial download, or the wrong config?)", "target.path")
    return model, info


def loading_problems(model: torch.nn.Module, info: dict) -> list[str]:
    """transformers' loading info as messages, less what a text-only target skips on purpose."""
    layers = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    problems = [f"missing tensor {name}" for name in sorted(info.get("missing_keys") or [])
                if not _skipped(name, None)]
    problems += [f"unexpected tensor {name}" for name in sorted(info.get("unexpected_keys") or [])
                 if not _skipped(name, layers)]
    for entry in info.get("mismatched_keys") or []:
        problems.append(f"mis-shaped tensor {entry[0] if isinstance(entry, (tuple, list)) else entry}")
    problems += [str(message).splitlines()[0] for message in info.get("error_msgs") or []]
    return problems


def _skipped(name: str, num_layers: int | None) -> bool:
    if any(word in name for word in _SKIPPED_WORDS) or _MTP.search(name):
        return True
    layer = _LAYER.search(name)
    return num_layers is not None and layer is not None and int(layer.group(1)) >= num_layers


@contextlib.contextmanager
def _loading_report() -> Iterator[list[str]]:
    """transformers' load report, as lines, kept off the terminal (it names mis-shaped tensors
    only there: the error it raises says to look at the report). Other records pass as before."""
    lines: list[str] = []
    logger = logging.getLogger(_REPORT_LOGGER)
    before = logger.getEffectiveLevel()

    def keep(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "LOAD REPORT" in message:
            lines.extend(message.splitlines())
            return False
        return record.levelno >= before

    level = logger.level
    logger.addFilter(keep)
    logger.setLevel(min(before, logging.WARNING))
    try:
        yield lines
    finally:
        logger.removeFilter(keep)
        logger.setLevel(level)
