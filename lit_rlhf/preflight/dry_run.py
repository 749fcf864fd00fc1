"""`--dry-run N`: load the models, run N real training steps and one held-out batch, then time the phases,
estimate the whole run's wall-clock and compare the peak memory with the plan.

The estimate is start-up (this process's age when the check began: imports and the config; then the fit's time
to its first step: the models loaded and set up) + the
run's rollouts x the mean step (the first step left out when there are more, as warm-up) + every held-out batch
(the sanity check's and each evaluation's) x the measured held-out batch; `trainer.max_time` caps it.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer

from lit_rlhf.preflight.report import Section
from lit_rlhf.preflight.run_length import RunLength, duration
from lit_rlhf.training.memory_plan import MemoryPlan

PHASES = ("time/generate_s", "time/score_s", "time/evaluate_s", "time/update_s")


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), or None."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class StepClock(Callback):
    """Wall time of each training step and held-out batch, the phase times each step logged, the start-up."""

    steps: list[float] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)
    held_out: list[float] = field(default_factory=list)
    load_s: float | None = None  # from the fit's call to its first step: models loaded, set up
    _start: float = field(default_factory=time.perf_counter)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.load_s is None:
            self.load_s = time.perf_counter() - self._start
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps.append(time.perf_counter() - self._start)
        self.phases.append({k: float(v) for k, v in pl_module.step_metrics.items() if k in PHASES})

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, *args: Any) -> None:
        self.held_out.append(time.perf_counter() - self._start)


def _trainer(trainer: Any, clock: StepClock, **limits: Any) -> Trainer:
    return Trainer(
        accelerator=trainer.strategy.root_device.type,
        devices=1,
        precision=trainer.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[clock],
        **limits,
    )


def dry_run(
    section: Section,
    module: Any,
    datamodule: Any,
    trainer: Any,
    steps: int,
    length: RunLength,
    plan: MemoryPlan | None,
    started_s: float,
) -> None:
    """Run `steps` rollouts (on one device of the Trainer's kind) and report times, the estimate and memory;
    `started_s`: the seconds this process took to reach the check (imports, the config)."""
    cuda = trainer.strategy.root_device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    baseline = current_rss_bytes()
    clock = StepClock()
    per_rollout = module.algorithm.ppo_epochs * module.algorithm.num_minibatches
    _trainer(trainer, clock, max_steps=steps * per_rollout, limit_val_batches=0).fit(module, datamodule)
    if length.val_batches:
        _trainer(trainer, clock, limit_val_batches=1).validate(module, datamodule, verbose=False)
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes() - baseline
    _report_times(section, clock, length, started_s)
    if plan is not None:
        where = "peak allocated on the GPU" if cuda else "peak RSS growth over the process before loading"
        section.line(
            f"memory: {where} {peak / 2**20:.0f} MiB; the plan {plan.total / 2**20:.0f} MiB "
            f"(measured / plan {peak / max(1, plan.total):.2f})"
        )
        if plan.available is not None and peak > plan.available:
            section.warn("the dry run's peak memory exceeded the memory available", plan.largest.shrink)


def _report_times(section: Section, clock: StepClock, length: RunLength, started_s: float) -> None:
    timed = clock.steps[1:] if len(clock.steps) > 1 else clock.steps
    step_s = statistics.fmean(timed)
    phases = {k: statistics.fmean(p.get(k, 0.0) for p in clock.phases[-len(timed) :]) for k in PHASES}
    section.line(
        f"{len(clock.steps)} steps: " + ", ".join(f"{s:.2f}" for s in clock.steps) + f" s; mean {step_s:.2f} s "
        f"{'(the first left out) ' if len(clock.steps) > 1 else ''}= "
        + ", ".join(f"{k[5:-2]} {v:.2f}" for k, v in phases.items())
        + " s"
    )
    held_s = statistics.fmean(clock.held_out) if clock.held_out else 0.0
    if clock.held_out:
        section.line(f"held-out batch: {held_s:.2f} s")
    startup = started_s + (clock.load_s or 0.0)
    if length.rollouts is None:
        section.line(f"estimate: {step_s:.2f} s per rollout; trainer.max_time ends the run")
        return
    held_batches = length.evaluations * length.val_batches + length.sanity_batches
    total = startup + length.rollouts * step_s + held_batches * held_s
    section.line(
        f"estimate: {duration(total)} = start-up {startup:.0f} s (imports and config {started_s:.0f} s, models "
        f"{clock.load_s or 0.0:.0f} s) + {length.rollouts} rollouts x {step_s:.2f} s + "
        f"{held_batches} held-out batches x {held_s:.2f} s"
    )
    if length.max_time_s is not None and total > length.max_time_s:
        reached = int((length.max_time_s - startup) / step_s) if step_s else 0
        section.line(
            f"trainer.max_time {duration(length.max_time_s)} stops it first, after about {max(0, reached)} of the "
            f"{length.rollouts} rollouts"
        )
