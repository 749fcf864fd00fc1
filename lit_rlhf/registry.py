"""`builtin:<name>` tasks, found by name through the `lit_rlhf.tasks` entry-point group.

The library never imports task code: a `Task` is looked up in the installed packages' metadata when a
setting names `builtin:<name>`. lit_rlhf registers its own tasks in `pyproject.toml`; a user's package adds
its tasks the same way:

    [project.entry-points."lit_rlhf.tasks"]
    my_task = "my_package.tasks:TASK"

An entry point may also be a `TaskFamily`: `builtin:<family>/<member>` then asks it for the task named by the rest
(`builtin:reasoning_gym/chain_sum?max_terms=3` is reasoning-gym's `chain_sum` with a knob set).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, TypeGuard

from torch import nn

from lit_rlhf.config import ConfigError

BUILTIN_PREFIX = "builtin:"
ENTRY_POINT_GROUP = "lit_rlhf.tasks"


@dataclass(frozen=True)
class Task:
    """What a `builtin:<name>` setting resolves to. Every model is built locally, never downloaded."""

    name: str
    tokenizer: Callable[[], Any]
    """() -> a fast tokenizer with pad and EOS tokens."""
    policy: Callable[..., nn.Module]
    """(**size) -> a causal LM over that tokenizer's vocabulary."""
    prompts: Callable[[int], Iterator[dict[str, Any]]]
    """seed -> an endless stream of prompt rows {"prompt": str, ...extra columns}."""
    reward_model: Callable[..., nn.Module] | None = None
    """(**size) -> a one-output sequence classifier to train as a reward model."""
    preference_pairs: Callable[[int, int], list[dict[str, str]]] | None = None
    """(count, seed) -> rows {"prompt", "chosen", "rejected"} to train a reward model on."""
    held_out_prompts: Callable[[int], Iterator[dict[str, Any]]] | None = None
    """seed -> an endless stream of held-out rows that no `prompts` stream contains; None: held-out sets are drawn
    from `prompts` with a seed of their own."""


@dataclass(frozen=True)
class TaskFamily:
    """What a `builtin:<family>/<member>` setting resolves through: many tasks behind one entry point."""

    name: str
    member: Callable[[str, str], Task]
    """(member, field) -> the task; a `ConfigError` naming `field` for a member it cannot make."""
    usage: str
    """How a member is named, shown when a setting names the family without one."""


def is_builtin(spec: Any) -> TypeGuard[str]:
    return isinstance(spec, str) and spec.startswith(BUILTIN_PREFIX)


@functools.cache
def _registered() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_tasks() -> list[str]:
    """Names usable as `builtin:<name>`, sorted."""
    return sorted(_registered())


def get_task(spec: str, field: str) -> Task:
    """The task named by `spec` ('builtin:<name>', '<name>' or either with '/<member>' of a `TaskFamily`); a
    `ConfigError` naming `field` otherwise."""
    name, has_member, member = spec.removeprefix(BUILTIN_PREFIX).partition("/")
    entry = _registered().get(name)
    if entry is None:
        choices = ", ".join(BUILTIN_PREFIX + n for n in available_tasks()) or "none (is lit_rlhf installed with pip?)"
        raise ConfigError(f"{field}: unknown built-in task {spec!r}; available: {choices}")
    task = entry.load()
    if isinstance(task, TaskFamily):
        if not has_member:
            raise ConfigError(f"{field}: {spec!r} names a family of tasks; name one of them: {task.usage}")
        return task.member(member, field)
    if not isinstance(task, Task):
        raise ConfigError(
            f"{field}: the entry point {entry.value!r} for {spec!r} is not a lit_rlhf.registry.Task or TaskFamily"
        )
    if has_member:
        raise ConfigError(f"{field}: {spec!r}: {BUILTIN_PREFIX}{name} is a task, not a family; drop '/{member}'")
    return task
