"""The reward-function contract: import by dotted path, call, and check the answer.

A reward function is any callable `fn(prompts: list[str], responses: list[str], **meta) -> B scores`; `meta`
holds the extra dataset columns, one list of B values each. Its parameters may also be bound by name, ours or
TRL's (`completions`, ...): `lit_rlhf.rewards.binding` says which forms are accepted. The answer must be a list,
tuple, 1-D tensor or 1-D numpy array of exactly B finite real numbers (not bools); anything else is a
`RewardError` naming the function. In YAML, name it by dotted path: `lit_rlhf.tasks.digits.sort_digits_reward`.
"""

from __future__ import annotations

import copy
import functools
import importlib
import numbers
import os
import pickle
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lit_rlhf.config import ConfigError
from lit_rlhf.rewards.binding import SignatureError, TrainerState, call, form
from lit_rlhf.rewards.isolation import IsolationError, ProcessWorkers, shared_workers

RewardFn = Callable[..., Any]

CONTRACT = (
    "a reward function must return a list, tuple, 1-D tensor or 1-D numpy array of one finite real number per "
    "response (not bools: convert with float())"
)


HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
"""A Hugging Face hub id, 'owner/name': never a dotted path."""


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable; the message names it."""


def looks_like_model(path: str) -> bool:
    """Whether `path` names a folder or a hub id ('owner/name') rather than a Python function."""
    return os.path.isdir(path) or "/" in path or "\\" in path or HUB_ID.fullmatch(path) is not None


def import_callable(path: str, field: str = "reward_fns") -> RewardFn:
    """The callable at dotted `path` ('package.module.function' or 'package.module:function')."""
    if looks_like_model(path):
        raise ConfigError(
            f"{field}: {path!r} looks like a model folder or hub id, not a function; a reward model goes in "
            "model.reward_model (and its tokenizer, when it is not the policy's, in model.reward_tokenizer)"
        )
    module_name, sep, attr = path.replace(":", ".").rpartition(".")
    if not sep or not module_name:
        raise ConfigError(f"{field}: {path!r} is not a dotted path like 'my_package.rewards.my_reward'")
    try:
        module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # SystemExit too: a module's own code may call sys.exit on import
        missing = err.name if isinstance(err, ModuleNotFoundError) else None  # the module (or a parent) is absent
        if missing is not None and (module_name == missing or module_name.startswith(f"{missing}.")):
            raise ConfigError(
                f"{field}: cannot import module {module_name!r} for {path!r} ({err}); "
                "check the spelling and that it is on PYTHONPATH"
            ) from err
        raise ConfigError(
            f"{field}: importing module {module_name!r} for {path!r} raised {type(err).__name__}: {err}; fix that "
            f"module (`python -c 'import {module_name}'` shows the traceback)"
        ) from err
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"{field}: module {module_name!r} has no callable named {attr!r}")
    return fn


RewardFns = str | RewardFn | Sequence[str | RewardFn]
"""What `reward_fns` and `metric_fns` take: one function (a callable or a dotted path, as TRL's `reward_funcs`
takes one) or a list of them."""


def function_list(fns: RewardFns | None) -> list[str | RewardFn] | None:
    """`fns` as a list: one callable or dotted path becomes a list of one; None stays None."""
    if fns is None:
        return None
    if isinstance(fns, str) or callable(fns):
        return [fns]
    return list(fns)


def resolve_reward_fns(fns: RewardFns | None, field: str = "reward_fns") -> list[RewardFn]:
    """Callables as given, dotted paths imported, their signatures checked (a `ConfigError` naming `field` when
    one fails); one function is a list of one."""
    resolved = [import_callable(f, field) if isinstance(f, str) else f for f in (function_list(fns) or [])]
    for fn in resolved:
        check_signature(fn, field)
    return resolved


def check_signature(fn: RewardFn, field: str = "reward_fns") -> None:
    """A `ConfigError` naming `fn` when its parameters cannot be bound (see `lit_rlhf.rewards.binding`)."""
    try:
        form(fn)
    except SignatureError as err:
        raise ConfigError(f"{field}: {callable_path(fn)} {err}") from err


def callable_path(fn: RewardFn) -> str:
    """'module.qualname' of a function, or of a callable object's class (a partial has neither name)."""
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}.{getattr(fn, '__qualname__', None) or type(fn).__qualname__}"


def callable_name(fn: RewardFn) -> str:
    """The short name of a function, of the function a `functools.partial` wraps, or of a callable object's class:
    a metric's name in logs."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def _name(fn: RewardFn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def rowwise(fn: RewardFn) -> RewardFn:
    """Mark `fn` as scoring each response on its own, so `reward_workers` may split its batch into chunks.

    Use it as a decorator; leave it off a function whose scores depend on the rest of the batch.

    Args:
        fn: a reward or metric function `fn(prompts, responses, **columns)`.

    Returns:
        `fn` itself, marked.
    """
    fn.lit_rlhf_rowwise = True  # type: ignore[attr-defined]  # a marker attribute on the user's callable
    return fn


def is_rowwise(fn: RewardFn) -> bool:
    """Whether `rowwise` marked `fn`."""
    return getattr(fn, "lit_rlhf_rowwise", False) is True


def isolated(fn: RewardFn | None = None, *, timeout_s: float | None = None) -> Any:
    """Mark `fn` to run in a worker process, which is killed (and replaced) when a call overruns its time limit:
    the hard limit for work that may hold the GIL (big-integer powers, sympy, regexes), whatever the composer's
    `isolation`. `timeout_s`: this function's own limit, used where no `reward_timeout_s` is set (and always for
    a metric function). Use as `@isolated` or `@isolated(timeout_s=10)`; the function must be defined at module
    level (picklable)."""

    def mark(f: RewardFn) -> RewardFn:
        f.lit_rlhf_isolated = True  # type: ignore[attr-defined]  # a marker attribute on the user's callable
        f.lit_rlhf_timeout_s = timeout_s  # type: ignore[attr-defined]
        return f

    return mark if fn is None else mark(fn)


def is_isolated(fn: RewardFn) -> bool:
    """Whether `isolated` marked `fn`."""
    return getattr(fn, "lit_rlhf_isolated", False) is True


def own_timeout(fn: RewardFn) -> float | None:
    """The time limit `isolated(timeout_s=...)` gave `fn`, or None."""
    value = getattr(fn, "lit_rlhf_timeout_s", None)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def invoke(
    fn: RewardFn,
    prompts: list[str],
    responses: list[str],
    meta: dict[str, list[Any]],
    state: TrainerState | None = None,
) -> Any:
    """`fn`'s raw answer (awaited, for an async function) on its own copy of the columns (`private_columns`);
    any exception from it (SystemExit too, not KeyboardInterrupt) as a `RewardError`."""
    try:
        return call(fn, prompts, responses, private_columns(meta), state)
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # user code: sys.exit() in it must not end the run quietly
        raise raised_error(fn, prompts, err) from err


IMMUTABLE = (str, int, float, bool, bytes, type(None))


def private_columns(meta: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """The columns as a reward function may keep or change them: new lists, and a deep copy of each column that
    holds anything mutable (a dict, a list), so that no call changes what later reward functions, held-out
    metrics or epochs see."""
    return {
        key: list(values) if all(isinstance(v, IMMUTABLE) for v in values) else copy.deepcopy(values)
        for key, values in meta.items()
    }


def raised_error(fn: RewardFn, prompts: list[str], err: BaseException) -> RewardError:
    """The `RewardError` for `fn` raising `err` on a batch."""
    return RewardError(
        f"reward function {_name(fn)} raised {type(err).__name__}: {err} "
        f"(batch of {len(prompts)}, first prompt {prompts[0]!r})"
    )


def _describe(raw: Any) -> str:
    size = f" of length {len(raw)}" if isinstance(raw, dict | str) else ""
    return f"{type(raw).__name__}{size}"


def _real(x: Any) -> bool:
    """A real number that is not a bool: int, float, numpy scalar, or a 0-d real tensor/array."""
    if isinstance(x, Tensor | np.ndarray):
        return x.ndim == 0 and _real_dtype(x.dtype)
    return isinstance(x, numbers.Real) and not isinstance(x, bool | np.bool_)


def _real_dtype(dtype: Any) -> bool:
    if isinstance(dtype, torch.dtype):
        return dtype != torch.bool and not dtype.is_complex
    return np.dtype(dtype).kind in "iuf"


def check_scores(
    fn: RewardFn,
    raw: Any,
    prompts: list[str],
    responses: list[str],
    nan_score: float | None = None,
    offset: int = 0,
) -> Tensor:
    """Check `raw` against the contract for a batch of len(prompts) -> (B,) float32 on CPU.

    A NaN is an error unless `nan_score` is given, which then replaces it; `offset` is the batch's first
    row in the caller's batch (for the messages, when a batch was split into chunks).
    """
    n, name = len(prompts), _name(fn)
    expected = f"expected one score per response ({n},): {CONTRACT}"
    if isinstance(raw, Tensor | np.ndarray):
        if raw.ndim != 1 or raw.shape[0] != n or not _real_dtype(raw.dtype):
            shape = tuple(raw.shape)
            raise RewardError(f"reward function {name} returned shape {shape}; {expected} (got dtype {raw.dtype})")
        values = torch.as_tensor(raw).detach().to("cpu", torch.float64)
    elif isinstance(raw, list | tuple):
        if len(raw) != n:
            raise RewardError(f"reward function {name} returned a {type(raw).__name__} of {len(raw)}; {expected}")
        for i, x in enumerate(raw):
            if not _real(x):
                skip = " (TRL's None, 'this function does not apply', is not taken: return a neutral score)"
                raise RewardError(
                    f"reward function {name} returned a {type(raw).__name__} whose element {offset + i} is {x!r} "
                    f"({type(x).__name__}) for prompt {prompts[i]!r}, response {responses[i]!r}; {CONTRACT}"
                    + (skip if x is None else "")
                )
        values = torch.tensor([float(x) for x in raw], dtype=torch.float64)
    else:
        raise RewardError(f"reward function {name} must return numbers, got {_describe(raw)}; {expected}")
    bad = ~torch.isfinite(values)
    if bad.any():
        i = int(bad.nonzero()[0])
        if nan_score is None or torch.isinf(values).any():
            raise RewardError(
                f"reward function {name} returned {values[i].item()} for prompt {prompts[i]!r} (element "
                f"{offset + i}), response {responses[i]!r}; return finite numbers (or set model.nan_score to "
                "replace NaN)"
            )
        values = torch.nan_to_num(values, nan=nan_score)
    scores = values.float()
    if not torch.isfinite(scores).all():  # finite in float64, too large for float32
        i = int((~torch.isfinite(scores)).nonzero()[0])
        raise RewardError(
            f"reward function {name} returned {values[i].item()} (element {offset + i}), beyond float32; "
            "return finite numbers of a sensible size"
        )
    return scores


def call_reward_fn(
    fn: RewardFn,
    prompts: list[str],
    responses: list[str],
    meta: dict[str, list[Any]],
    nan_score: float | None = None,
    state: TrainerState | None = None,
) -> Tensor:
    """Call `fn` and check its answer against the contract: -> (B,) float32 tensor on CPU. A function marked
    `isolated` runs in a worker process, within its own `timeout_s` when it has one."""
    if is_isolated(fn):
        calls = [(fn, prompts, responses, meta, 0)]
        return run_in_workers(shared_workers(), calls, nan_score, own_timeout(fn), state)[0]
    return check_scores(fn, invoke(fn, prompts, responses, meta, state), prompts, responses, nan_score)


FATES = {
    "killed": "its worker process was killed",
    "thread": "its thread is left running as a daemon (Python cannot stop a thread)",
    "cancelled": "its coroutine was cancelled",
}
"""What happens to a call past its time limit, by where it ran."""


def timeout_error(fn: RewardFn, prompts: list[str], timeout_s: float, fate: str) -> RewardError:
    """The `RewardError` for a call of `fn` past `timeout_s`; `fate` is a key of `FATES`."""
    return RewardError(
        f"reward function {_name(fn)} did not return within reward_timeout_s={timeout_s:g} s (batch of "
        f"{len(prompts)}, first prompt {prompts[0]!r}); the run stops here and {FATES[fate]}. Make the function "
        "faster or raise model.reward_timeout_s"
    )


def run_in_workers(
    workers: ProcessWorkers,
    calls: Sequence[tuple[RewardFn, list[str], list[str], dict[str, list[Any]], int]],
    nan_score: float | None,
    timeout_s: float | None,
    state: TrainerState | None = None,
) -> list[Tensor]:
    """Each call (fn, prompts, responses, meta, offset of its first row) run in a worker process, its answer
    checked against the contract -> (b,) scores, in order; a failure, an overrun (the worker is killed) or a dead
    worker is a `RewardError` naming the function."""
    try:
        raws = workers.run([(fn, p, r, m, state) for fn, p, r, m, _ in calls], timeout_s)
    except IsolationError as err:
        fn, prompts = calls[err.index][0], calls[err.index][1]
        batch = f"batch of {len(prompts)}, first prompt {prompts[0]!r}"
        if err.kind == "timeout":
            raise timeout_error(fn, prompts, timeout_s or 0.0, "killed") from err
        if err.kind == "error":
            raise RewardError(f"reward function {callable_path(fn)} raised {err.detail} ({batch})") from err
        if err.kind == "died":
            raise RewardError(
                f"reward function {callable_path(fn)}: its worker process died ({err.detail}) during a {batch}"
            ) from err
        if err.kind == "pickle":
            raise RewardError(
                f"reward function {callable_path(fn)} runs in a worker process, but its call cannot be pickled "
                f"({err.detail}); define the function at module level (a dotted path) and keep the prompt rows' "
                "columns to plain values"
            ) from err
        raise RewardError(f"reward function {callable_path(fn)}: {err.detail}") from err
    return [
        check_scores(fn, raw, p, r, nan_score, offset) for (fn, p, r, _, offset), raw in zip(calls, raws, strict=True)
    ]


def check_picklable(fn: RewardFn, field: str = "reward_fns") -> None:
    """A `ConfigError` naming `fn` when it cannot be sent to a worker process."""
    try:
        pickle.dumps(fn)
    except Exception as err:
        raise ConfigError(
            f"{field}: {callable_path(fn)} is to run in a worker process (for a hard time limit), but it cannot be "
            f"pickled ({type(err).__name__}: {err}); define it at module level and name it by dotted path, or run "
            "it on threads (isolation='thread', and no @isolated)"
        ) from err
