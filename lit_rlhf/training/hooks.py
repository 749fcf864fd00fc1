"""Lightning hooks the manual update loop makes unreachable: an override of one is refused at construction.

Under manual optimisation Lightning never calls `optimizer_step`, `optimizer_zero_grad`,
`configure_gradient_clipping` or `lr_scheduler_step`: the update loop (`training/optim.py`) steps, zeroes, clips
and schedules itself, so a subclass's override would be silently skipped. `backward` and
`on_before_optimizer_step` are still called (by `manual_backward` and the optimizer step) and may be overridden.
"""

from __future__ import annotations

from typing import Any

import lightning as L

from lit_rlhf.config import ConfigError

MANAGED = {
    "optimizer_step": "override clip_and_step(stats), or hook in with on_before_optimizer_step / a Callback",
    "optimizer_zero_grad": "override clip_and_step(stats), or hook in with on_before_optimizer_step",
    "configure_gradient_clipping": "set model.algorithm.max_grad_norm, or override clip_and_step(stats)",
    "lr_scheduler_step": "return the scheduler from configure_optimizers (stepped by its interval and frequency), "
    "or override step_schedulers(interval, count, plateau)",
}
"""Hook name -> what to override instead."""


def hook_owner(cls: type, name: str) -> type | None:
    """The class in `cls`'s MRO that defines `name`."""
    return next((klass for klass in cls.__mro__ if name in vars(klass)), None)


def managed_overrides(cls: type) -> list[str]:
    """The managed hooks a class outside Lightning and lit_rlhf overrides."""
    found = []
    for name in MANAGED:
        owner = hook_owner(cls, name)
        if owner is not None and not owner.__module__.startswith(("lightning.", "lit_rlhf.")):
            found.append(name)
    return found


class ManagedHooks(L.LightningModule):
    """Refuses, at construction, a subclass overriding a hook the manual update loop never calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        overridden = managed_overrides(type(self))
        if overridden:
            advice = "; ".join(f"{name}: {MANAGED[name]}" for name in overridden)
            raise ConfigError(
                f"{type(self).__qualname__} overrides {', '.join(overridden)}, which Lightning never calls here: "
                f"the module optimises manually (its own clipped step, zeroing and schedulers). Instead: {advice}"
            )
        super().__init__(*args, **kwargs)
