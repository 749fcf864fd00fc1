"""The optimizer side of the manual update loop: the default AdamW with its learning-rate schedule, the
clipped step that skips non-finite updates, and the schedulers of any `configure_optimizers` override stepped
as Lightning documents them (interval "step" or "epoch", frequency, `ReduceLROnPlateau` on a monitored metric).

Lightning steps nothing itself under manual optimisation, and refuses `Trainer(gradient_clip_val=...)` and
`accumulate_grad_batches`; `ManualOptimization.configure_callbacks` names the settings to use instead."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau

from lit_rlhf.config import AlgorithmConfig, ConfigError, LRSchedule, check_precision
from lit_rlhf.training.exit_guard import ExitStatusGuard
from lit_rlhf.training.hooks import ManagedHooks
from lit_rlhf.training.host_memory import return_freed_memory_on_cpu
from lit_rlhf.training.run_folder import RunFolderGuard
from lit_rlhf.training.state import TrainingState


def warmup_then_decay(schedule: LRSchedule, warmup_steps: int, total_steps: int | None) -> Callable[[int], float]:
    """Multiplier at optimizer step `step`: linear warm-up over `warmup_steps`, then constant, or a linear or
    cosine decay to 0 at `total_steps` (constant when `total_steps` is None)."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant" or not total_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def parameter_groups(
    trainable: Iterable[nn.Parameter], critic: Sequence[nn.Parameter], lr: float, value_lr_scale: float
) -> list[dict[str, Any]]:
    """AdamW's parameter groups: one at `lr`, or, with `value_lr_scale` != 1 and a critic, the critic's parameters
    (`critic`) in a second group at `lr * value_lr_scale` (`algorithm.value_lr_scale`)."""
    params = list(trainable)
    if value_lr_scale == 1.0 or not critic:
        return [{"params": params}]
    critic_ids = {id(p) for p in critic}
    rest = [p for p in params if id(p) not in critic_ids]
    return [{"params": rest}, {"params": [p for p in params if id(p) in critic_ids], "lr": lr * value_lr_scale}]


def gradient_norm(parameters: Iterable[nn.Parameter]) -> float:
    """The global L2 norm of the parameters' gradients (0.0 when none has one), before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


def non_finite(stats: dict[str, float], grad_norm: float) -> dict[str, float]:
    """The losses in `stats` and the gradient norm that are not finite (empty: the step may be taken)."""
    bad = {k: v for k, v in stats.items() if k.endswith("loss") and not math.isfinite(v)}
    if not math.isfinite(grad_norm):
        bad["optim/grad_norm"] = grad_norm
    return bad


def non_finite_parameters(named_parameters: Iterable[tuple[str, nn.Parameter]]) -> list[str]:
    """The names of the parameters holding a NaN or an infinity (one device sync for all of them; under FSDP2 one
    all-reduce, so every rank names the same ones)."""
    named = list(named_parameters)
    if not named:
        return []
    local = [p.to_local() if hasattr(p, "to_local") else p for _, p in named]  # FSDP2: this rank's shard
    finite = torch.stack([torch.isfinite(p.detach()).all() for p in local]).to(torch.int32)
    if any(hasattr(p, "to_local") for _, p in named):
        # FSDP2: a NaN in one rank's shard is every rank's verdict, or that rank alone would stop (the rest hang)
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
    return [name for (name, _), ok in zip(named, finite.cpu().tolist(), strict=True) if not ok]


def single_optimizer(optimizers: Any) -> LightningOptimizer:
    """`LightningModule.optimizers()` narrowed to the one optimizer the manual update loop steps."""
    if not isinstance(optimizers, LightningOptimizer):
        raise ConfigError("configure_optimizers: the update loop steps one optimizer; return exactly one")
    return optimizers


def total_optimizer_steps(trainer: Any, updates_per_rollout: int) -> int | None:
    """Optimizer steps the run will take: `max_steps`, else `max_epochs` x rollouts per epoch x updates per
    rollout; None when neither bounds the run (an endless epoch, or no max_epochs)."""
    if trainer.max_steps > 0:
        return int(trainer.max_steps)
    rollouts = trainer.estimated_stepping_batches  # max_epochs x batches per epoch when max_steps is unset
    return None if math.isinf(rollouts) else int(rollouts) * updates_per_rollout


class ManualOptimization(ManagedHooks):
    """Optimizer and scheduler handling for a module with `algorithm` and `state` (a `TrainingState`), and the
    hyperparameters lr, betas, weight_decay, lr_schedule, warmup_steps and max_consecutive_skips."""

    algorithm: AlgorithmConfig
    state: TrainingState
    step_metrics: dict[str, float]  # the last training step's own metrics
    scheduler_monitors: Sequence[str | None] = ()  # per `trainer.lr_scheduler_configs` entry, set at fit start

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Under DDP, skip the gradient all-reduce for all but a minibatch's last micro-batch."""
        block = getattr(self.trainer.strategy, "block_backward_sync", None)
        return contextlib.nullcontext() if enabled or block is None else block()

    def trainable_parameters(self) -> Iterable[nn.Parameter]:
        """The parameters that train: every one with requires_grad (frozen models have none)."""
        return (p for p in self.parameters() if p.requires_grad)

    def critic_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters of the value head and a separate critic backbone (none without a critic)."""
        actor_critic = getattr(self, "actor_critic", None)
        parts = [getattr(actor_critic, name, None) for name in ("value_head", "critic_backbone")]
        return [p for part in parts if part is not None for p in part.parameters() if p.requires_grad]

    def setup(self, stage: str) -> None:
        check_precision(str(self.trainer.precision))
        if stage == "fit":  # after the ModelCheckpoints resolved their folders, before any model loads
            trainer: Any = self.trainer
            for guard in (c for c in trainer.callbacks if isinstance(c, RunFolderGuard)):
                guard.acquire(trainer)
        super().setup(stage)

    def configure_callbacks(self) -> list[Any]:
        """A `RunFolderGuard` (one run per checkpoint folder, `last.ckpt` saved on SIGTERM) and an `ExitStatusGuard`
        (`os._exit(0)` during fit ends the process with status 1). Refuse the Trainer's
        own clipping and accumulation (Lightning's checks run next, with advice that does not apply here), naming
        this module's settings for the same thing."""
        trainer = self.trainer
        if trainer.gradient_clip_val:
            raise ConfigError(
                f"trainer.gradient_clip_val: {trainer.gradient_clip_val} is not used by the manual update loop, which "
                "clips by norm itself; set model.algorithm.max_grad_norm instead (null: no clipping)"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError(
                f"trainer.accumulate_grad_batches: {trainer.accumulate_grad_batches} is not used by the manual update "
                "loop; for less memory per forward set model.algorithm.micro_batch_size (gradients accumulate over "
                "a minibatch), for more rollout per optimizer step raise data.batch_size or lower num_minibatches"
            )
        inherited = super().configure_callbacks()
        assert isinstance(inherited, Sequence)  # the mixins below return lists
        return [RunFolderGuard(), ExitStatusGuard(), *inherited]  # the guard's SIGTERM checkpoint first

    def configure_optimizers(self) -> Any:
        """AdamW over the trainable parameters, with linear warm-up, then constant, linear or cosine decay to the
        end of training (`max_steps`, or `max_epochs` with finite epochs)."""
        hp = self.hparams
        beta1, beta2 = hp["betas"]
        algo = self.algorithm
        groups = parameter_groups(self.trainable_parameters(), self.critic_parameters(), hp["lr"], algo.value_lr_scale)
        optimizer = torch.optim.AdamW(groups, hp["lr"], (beta1, beta2), weight_decay=hp["weight_decay"])
        total = total_optimizer_steps(self.trainer, algo.ppo_epochs * algo.num_minibatches)
        if total is None and hp["lr_schedule"] != "constant":
            raise ConfigError(
                f"model.lr_schedule: {hp['lr_schedule']!r} decays to the end of training, but the Trainer has no "
                "end: set trainer.max_steps, or trainer.max_epochs with finite epochs (data.rollouts_per_epoch)"
            )
        schedule = warmup_then_decay(hp["lr_schedule"], hp["warmup_steps"], total)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_start(self) -> None:
        if len(self.trainer.optimizers) != 1:
            raise ConfigError(
                f"configure_optimizers: returned {len(self.trainer.optimizers)} optimizers; the update loop steps "
                "exactly one (put every parameter group in one optimizer)"
            )
        configs = self.trainer.lr_scheduler_configs
        if any(isinstance(c.scheduler, ReduceLROnPlateau) for c in configs):
            # Lightning drops 'monitor' from scheduler configs under manual optimisation: read the names from a
            # second call of configure_optimizers (its fresh optimizer and schedulers are discarded)
            self.scheduler_monitors = scheduler_monitors(self.configure_optimizers(), len(configs))
        else:
            self.scheduler_monitors = [None] * len(configs)
        super().on_fit_start()

    def clip_and_step(self, stats: dict[str, float]) -> float:
        """Clip, step the optimizer and the step-interval schedulers, zero the gradients; returns the pre-clip
        gradient norm.

        A non-finite loss or gradient norm skips the step (weights unchanged, counted); after
        `max_consecutive_skips` skips in a row training stops with an error naming what went non-finite. A step
        that leaves a weight non-finite stops training at once (`check_parameters_finite`).
        """
        optimizer = single_optimizer(self.optimizers())
        return_freed_memory_on_cpu(self.device)  # the backward's freed pages, before the step's temporaries
        norm = gradient_norm(self.trainable_parameters())
        bad = non_finite(stats, norm)
        if bad:
            optimizer.zero_grad(set_to_none=True)
            self.state.skip_update(bad, self.hparams["max_consecutive_skips"], self.global_step)
            return norm
        self.state.consecutive_skips = 0
        if self.algorithm.max_grad_norm is not None:
            self.clip_gradients(optimizer.optimizer, self.algorithm.max_grad_norm, "norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.check_parameters_finite(optimizer)
        self.state.policy_version += 1
        self.step_schedulers("step", self.state.policy_version, plateau=False)
        return norm

    def check_parameters_finite(self, optimizer: LightningOptimizer) -> None:
        """Stop if the step just taken made a weight non-finite (finite gradients, but a learning rate or a custom
        optimizer that overflows): every later rollout would be garbage. No checkpoint holds the broken weights."""
        bad = non_finite_parameters((n, p) for n, p in self.named_parameters() if p.requires_grad)
        if bad:
            lr = optimizer.param_groups[0]["lr"]
            raise FloatingPointError(
                f"after optimizer step {self.state.policy_version + 1} (learning rate {lr:g}), {len(bad)} parameter "
                f"tensors hold NaN or inf, first {bad[0]}; the gradients were finite, so the step itself overflowed. "
                "Lower model.lr (or check a custom optimizer) and resume from the last checkpoint"
            )

    def on_train_epoch_end(self) -> None:
        self.step_schedulers("epoch", self.current_epoch + 1, plateau=False)
        self.step_schedulers("epoch", self.current_epoch + 1, plateau=True)

    def step_schedulers(self, interval: str, count: int, plateau: bool) -> None:
        """Step the schedulers of this `interval` whose `frequency` divides `count` (optimizer steps, rollouts or
        epochs): the `ReduceLROnPlateau` ones (`plateau`) with the value of their monitored metric, which a
        step-interval one gets after each rollout's metrics exist (`count`: rollouts), or the others."""
        for config, monitor in zip(self.trainer.lr_scheduler_configs, self.scheduler_monitors, strict=True):
            scheduler = config.scheduler
            if config.interval != interval or isinstance(scheduler, ReduceLROnPlateau) != plateau:
                continue
            if count % config.frequency:
                continue
            if isinstance(scheduler, ReduceLROnPlateau):
                scheduler.step(self.monitored_value(monitor, f"{interval} {count}"))
            else:
                scheduler.step()

    def monitored_value(self, monitor: str | None, when: str) -> float:
        """The monitored metric: this step's own value, else what Lightning last logged (validation metrics)."""
        value = self.step_metrics.get(monitor or "", self.trainer.callback_metrics.get(monitor or ""))
        if value is None:
            logged = sorted({*self.step_metrics, *self.trainer.callback_metrics})
            raise ConfigError(
                f"lr_scheduler monitor: {monitor!r} has no value at {when}; logged so far: {logged}. Name one of "
                "them in the scheduler config's 'monitor' (a validation metric needs interval 'epoch')"
            )
        return float(value)


def scheduler_monitors(optimizer_config: Any, count: int) -> list[str | None]:
    """The 'monitor' of each scheduler in a `configure_optimizers` return value, in Lightning's order."""
    items = optimizer_config if isinstance(optimizer_config, (list, tuple)) else [optimizer_config]
    monitors: list[str | None] = []
    for item in items:
        if isinstance(item, dict) and "lr_scheduler" in item:
            scheduler = item["lr_scheduler"]
            monitors.append(scheduler.get("monitor") if isinstance(scheduler, dict) else item.get("monitor"))
    if len(monitors) != count:
        raise ConfigError(
            "configure_optimizers: with a ReduceLROnPlateau, return {'optimizer': ..., 'lr_scheduler': {'scheduler':"
            " ..., 'monitor': '<metric>', 'interval': 'step' or 'epoch'}}"
        )
    return monitors
