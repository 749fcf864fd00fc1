"""The reward-function contract: import by dotted path, call, and check the answer.

A reward function is any callable `fn(prompts: list[str], responses: list[str], **meta) -> sequence of B
numbers` (or a (B,) tensor); `meta` holds the extra dataset columns, one list of B values each.
In YAML, name it by dotted path: `lit_rlhf.tasks.digits.sort_digits_reward`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.config import ConfigError

RewardFn = Callable[..., Any]


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable; the message names it."""


def import_callable(path: str, field: str = "reward_fns") -> RewardFn:
    """The callable at dotted `path` ('package.module.function' or 'package.module:function')."""
    module_name, sep, attr = path.replace(":", ".").rpartition(".")
    if not sep or not module_name:
        raise ConfigError(f"{field}: {path!r} is not a dotted path like 'my_package.rewards.my_reward'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            f"{field}: cannot import module {module_name!r} for {path!r} ({err}); "
            "check the spelling and that it is on PYTHONPATH"
        ) from err
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"{field}: module {module_name!r} has no callable named {attr!r}")
    return fn


def resolve_reward_fns(fns: Sequence[str | RewardFn] | None, field: str = "reward_fns") -> list[RewardFn]:
    """Callables as given, dotted paths imported (a `ConfigError` naming `field` when one fails)."""
    return [import_callable(f, field) if isinstance(f, str) else f for f in (fns or [])]


def callable_path(fn: RewardFn) -> str:
    """'module.qualname' of a function, or of a callable object's class (a partial has neither name)."""
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}.{getattr(fn, '__qualname__', None) or type(fn).__qualname__}"


def callable_name(fn: RewardFn) -> str:
    """The short name of a function, or of a callable object's class: a metric's name in logs."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def _name(fn: RewardFn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def call_reward_fn(
    fn: RewardFn, prompts: list[str], responses: list[str], meta: dict[str, list[Any]], nan_score: float | None = None
) -> Tensor:
    """Call `fn` and check its answer: B finite numbers -> (B,) float32 tensor on CPU.

    A NaN is an error unless `nan_score` is given, which then replaces it.
    """
    try:
        raw = fn(prompts, responses, **meta)
    except Exception as err:  # re-raised with the function and the first prompt named
        raise RewardError(
            f"reward function {_name(fn)} raised {type(err).__name__}: {err} "
            f"(batch of {len(prompts)}, first prompt {prompts[0]!r})"
        ) from err
    try:
        scores = torch.as_tensor(raw if isinstance(raw, Tensor) else list(raw), dtype=torch.float32).cpu()
    except (TypeError, ValueError) as err:
        raise RewardError(f"reward function {_name(fn)} must return numbers, got {type(raw).__name__}: {err}") from err
    if scores.dim() != 1 or scores.shape[0] != len(prompts):
        raise RewardError(
            f"reward function {_name(fn)} returned shape {tuple(scores.shape)}; expected one score per response "
            f"({len(prompts)},)"
        )
    bad = ~torch.isfinite(scores)
    if bad.any():
        i = int(bad.nonzero()[0])
        if nan_score is not None and torch.isnan(scores[i]) and not torch.isinf(scores).any():
            scores = torch.nan_to_num(scores, nan=nan_score)
        else:
            raise RewardError(
                f"reward function {_name(fn)} returned {scores[i].item()} for prompt {prompts[i]!r}, response "
                f"{responses[i]!r}; return finite numbers (or set reward nan_score to replace NaN)"
            )
    return scores
