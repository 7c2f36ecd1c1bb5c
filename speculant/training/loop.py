"""One training loop for every model: AdamW, warmup + cosine, grad clipping, bf16 autocast,
rich progress (loss, tokens/s, ETA), periodic resumable checkpoints, Hugging Face
``accelerate`` for data parallelism (``accelerate launch --num_processes N``)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from speculant.training.checkpoint import load_state, save_state


@dataclass
class TrainSettings:
    steps: int = 1000
    lr: float = 6e-4
    weight_decay: float = 0.01
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    bf16: bool = True
    checkpoint_every: int = 200
    seed: int = 0
    stop_at: int | None = None  # end this run early (checkpointed), keeping the schedule of `steps`
    # seconds: before step 0, time a few forward+backward passes and lower `steps` to what fits
    # (the schedule then follows the chosen `steps`, which the checkpoint keeps for a resume)
    time_budget: float | None = None


def lr_at(step: int, s: TrainSettings) -> float:
    warmup = max(1, int(s.steps * s.warmup_ratio))
    if step < warmup:
        return s.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, s.steps - warmup)
    return s.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def train(
    model: torch.nn.Module,
    make_batch: Callable[[int, int], object],
    loss_fn: Callable[[torch.nn.Module, object], tuple[torch.Tensor, int, dict]],
    settings: TrainSettings,
    checkpoint_dir: str | Path,
    description: str = "training",
) -> list[float]:
    """Run ``settings.steps`` optimiser steps; returns the loss history (main process).

    ``make_batch(step, rank)`` builds a batch deterministically from the step and the process
    rank, so a resumed run sees the same data; ``loss_fn(model, batch)`` (the prepared, possibly
    data-parallel model) returns (loss, tokens, metrics).
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # accelerate keeps one process-wide state and refuses a second precision; each train() call
    # owns its Accelerator, so a different precision starts from a fresh one (the process
    # group, PartialState, is kept)
    precision = "bf16" if settings.bf16 else "no"
    if AcceleratorState._shared_state.get("_mixed_precision", precision) != precision:
        AcceleratorState._reset_state()
    accelerator = Accelerator(mixed_precision=precision, cpu=not torch.cuda.is_available())
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, weight_decay=settings.weight_decay, betas=(0.9, 0.95))
    checkpoint_dir = Path(checkpoint_dir)
    start = 0
    if (checkpoint_dir / "state.json").exists():
        state = load_state(checkpoint_dir, model, optimizer)
        start = int(state["step"])
        settings.steps = int(state.get("steps", settings.steps))
    model, optimizer = accelerator.prepare(model, optimizer)
    if settings.time_budget and start == 0:
        per_step = _seconds_per_step(model, make_batch, loss_fn, accelerator, optimizer)
        settings.steps = steps_within(settings, per_step)
        if accelerator.is_main_process:
            print(f"{description}: {per_step:.3f} s per step -> {settings.steps} steps in {settings.time_budget:g} s",
                  flush=True)
    history: list[float] = []
    progress = _Progress(description, settings.steps, start, accelerator.is_main_process)
    end = min(settings.steps, settings.stop_at or settings.steps)
    for step in range(start, end):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        batch = make_batch(step, accelerator.process_index)
        with accelerator.autocast():
            loss, tokens, metrics = loss_fn(model, batch)
        accelerator.backward(loss)
        if settings.grad_clip:
            accelerator.clip_grad_norm_(trainable, settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(accelerator.reduce(loss.detach(), "mean"))
        history.append(value)
        progress.update(step + 1, value, tokens * accelerator.num_processes, metrics)
        if (step + 1) % settings.checkpoint_every == 0 or step + 1 == end:
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                save_state(checkpoint_dir, accelerator.unwrap_model(model), optimizer,
                           {"step": step + 1, "steps": settings.steps})
    progress.close()
    return history


def steps_within(settings: TrainSettings, seconds_per_step: float) -> int:
    """The steps that fit ``settings.time_budget`` (10 % kept for checkpoints and the optimiser), at most ``steps``."""
    fit = int(0.9 * settings.time_budget / max(seconds_per_step, 1e-6))
    return max(1, min(settings.steps, fit))


def _seconds_per_step(model, make_batch, loss_fn, accelerator, optimizer, passes: int = 4) -> float:
    """Median time of a forward+backward pass over the first batches; gradients are dropped, so
    the model is unchanged (the first pass, which warms caches and kernels, is not counted)."""
    times = []
    for i in range(passes + 1):
        t0 = time.perf_counter()
        with accelerator.autocast():
            loss, _, _ = loss_fn(model, make_batch(i, accelerator.process_index))
        accelerator.backward(loss)
        float(loss.detach())  # waits for the device
        times.append(time.perf_counter() - t0)
        optimizer.zero_grad(set_to_none=True)
    return sorted(times[1:])[len(times[1:]) // 2]


class _Progress:
    def __init__(self, description: str, total: int, start: int, enabled: bool) -> None:
        import sys

        self.enabled = enabled
        self.description = description
        self.total = total
        self.log_every = 0 if sys.stderr.isatty() else max(1, total // 20)  # a log file gets 20 plain lines
        self.tokens = 0
        self.t0 = time.perf_counter()
        self.start = start
        if enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn())
            self.task = self.bar.add_task(description, total=total, completed=start, info="")
            self.bar.start()

    def update(self, step: int, loss: float, tokens: int, metrics: dict) -> None:
        self.tokens += tokens
        if not self.enabled:
            return
        rate = self.tokens / max(1e-9, time.perf_counter() - self.t0)
        extra = " ".join(f"{k} {v:.3f}" for k, v in metrics.items())
        info = f"loss {loss:.4f} {rate:,.0f} tok/s {extra}"
        self.bar.update(self.task, completed=step, info=info)
        if self.log_every and (step % self.log_every == 0 or step == self.total):
            elapsed = time.perf_counter() - self.t0
            print(f"{self.description} {step}/{self.total} {elapsed:.0f}s {info}", flush=True)

    def close(self) -> None:
        if self.enabled:
            self.bar.stop()


class Objective(torch.nn.Module):
    """A trainable model plus its batch loss as one module whose ``forward(batch)`` returns
    (loss, tokens, metrics): data parallelism synchronises gradients only through
    ``forward``, so drafters whose training calls several of their methods go through this."""

    def __init__(self, model: torch.nn.Module, loss: Callable[[torch.nn.Module, object], tuple[torch.Tensor, int, dict]]) -> None:
        super().__init__()
        self.model = model
        self._loss = loss

    def forward(self, batch):
        return self._loss(self.model, batch)


def call_objective(model, batch):
    """``loss_fn`` for :func:`train` over an :class:`Objective` (possibly wrapped for data parallelism)."""
    return model(batch)


def is_main_process() -> bool:
    from accelerate import PartialState

    return PartialState().is_main_process
