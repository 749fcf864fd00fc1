"""The memory section: the memory plan per device (`training.memory_plan`) against the free memory."""

from __future__ import annotations

from typing import Any

from lit_rlhf.config import ConfigError
from lit_rlhf.preflight.report import Section
from lit_rlhf.training.memory_plan import GiB, MemoryPlan, available_bytes, plan_memory, plan_settings


def check_memory(
    section: Section, module: Any, datamodule: Any, trainer: Any, device_memory_gb: float | None
) -> MemoryPlan | None:
    """The plan's table; a plan over the memory blocks the run when `model.memory_check` is 'error' (the fit would
    refuse it), else warns. `device_memory_gb` replaces the free memory measured now."""
    try:
        settings = plan_settings(module, datamodule, trainer)
        available = (
            int(device_memory_gb * GiB)
            if device_memory_gb
            else available_bytes(settings.device, settings.processes_per_host)
        )
        plan = plan_memory(settings, available)
    except (ConfigError, OSError, ValueError) as err:
        section.refused(err, "model.policy")
        return None
    source = "given (--device-memory-gb)" if device_memory_gb else "free now"
    section.line(f"per {settings.device} device, against the memory {source}:")
    section.lines += plan.table().splitlines()
    refusal = plan.refusal()
    if refusal is not None:
        message = refusal.split("\n", 1)[0]
        mode = module.hparams["memory_check"]
        if mode == "error":
            section.block(message, plan.largest.shrink)
        else:
            section.warn(f"{message} (model.memory_check: {mode} lets the fit start)", plan.largest.shrink)
    return plan
