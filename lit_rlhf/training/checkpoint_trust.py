"""A checkpoint is data: which of the code its hyper-parameters name `load_from_checkpoint` may import or run.

A checkpoint's hyper-parameters rebuild the module: models by name, settings, and a few names of code (the reward
and metric functions, the multi-turn environment) plus `trust_remote_code`, which lets a model folder run its own
code. Someone else's checkpoint must not choose code for this process, so without `trust_checkpoint_code=True`:

- reward and metric functions are imported only from lit_rlhf's own reward and task modules or from a module
  that an installed package registered as a `lit_rlhf.tasks` entry point; any other becomes an
  `UnavailableFunction` that is never imported (loading, exporting and generating work; scoring with it raises,
  naming `reward_fns=` / `metric_fns=`);
- an environment other than `builtin:<name>`, `trust_remote_code: true`, and a vLLM server (its address and the
  folder the weights are written to) are a `CheckpointError` naming the setting and how to pass it to
  `load_from_checkpoint` explicitly.

Arguments the caller passes to `load_from_checkpoint` are the caller's choice and are used as given.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from lit_rlhf.config import ConfigError
from lit_rlhf.registry import BUILTIN_PREFIX, ENTRY_POINT_GROUP
from lit_rlhf.rewards.functions import RewardError, import_callable
from lit_rlhf.training.checkpoint_io import CheckpointError

LIBRARY_FUNCTION_MODULES = ("lit_rlhf.rewards.verifiable", "lit_rlhf.tasks")
"""lit_rlhf's own modules (and their submodules) whose functions a checkpoint may name."""
FUNCTION_KEYS = ("reward_fns", "metric_fns")
SAMPLING_KEYS = ("sampling", "val_sampling")


def without_vllm_server(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's sampling settings that name a vLLM server, with the in-process 'lean' backend instead (for
    an export, which samples nothing but writes the other settings into the generation config)."""
    local = {}
    for key in SAMPLING_KEYS:
        settings = hparams.get(key)
        vllm = settings.get("vllm") if isinstance(settings, Mapping) else None
        if isinstance(settings, Mapping) and isinstance(vllm, Mapping) and vllm.get("mode") == "server":
            local[key] = {**settings, "backend": "lean", "vllm": None}
    return local


OPT_IN = "trust_checkpoint_code=True"


@functools.cache
def registered_task_modules() -> frozenset[str]:
    """The modules the installed `lit_rlhf.tasks` entry points live in (the user's environment registered them)."""
    return frozenset(ep.module for ep in entry_points(group=ENTRY_POINT_GROUP))


def is_trusted_function(path: Any) -> bool:
    """Whether a checkpoint may make this process import the function at dotted `path`."""
    if not isinstance(path, str):
        return False
    module = path.replace(":", ".").rpartition(".")[0]
    library = any(module == m or module.startswith(m + ".") for m in LIBRARY_FUNCTION_MODULES)
    return library or module in registered_task_modules()


class UnavailableFunction:
    """Stands in for a reward or metric function that a checkpoint names but that is not imported here (not
    importable, or not code a checkpoint may choose): loading, exporting and generating work; scoring raises."""

    def __init__(self, path: str, field: str, reason: str):
        self.path, self.field, self.reason = path, field, reason
        self.__module__, _, self.__qualname__ = path.rpartition(".")  # callable_path gives `path` back

    def __call__(self, prompts: list[str], responses: list[str], **meta: Any) -> Any:
        raise RewardError(
            f"{self.field}: {self.path!r} {self.reason}; pass {self.field.split('.')[-1]}=[...] to "
            "load_from_checkpoint to score with it"
        )


def checkpoint_functions(paths: Any, field: str, trust: bool) -> list[Any]:
    """The checkpoint's dotted paths for `field`: each trusted one that imports kept as it is (the module imports
    it), every other one an `UnavailableFunction` (untrusted ones are never imported)."""
    if not isinstance(paths, list | tuple):
        raise CheckpointError(f"{field}: the checkpoint holds {type(paths).__name__}, not a list of dotted paths")
    out: list[Any] = []
    for path in paths:
        if not isinstance(path, str):
            raise CheckpointError(f"{field}: the checkpoint holds {path!r}, not a dotted path")
        if not trust and not is_trusted_function(path):
            out.append(UnavailableFunction(path, field, "was not imported: a checkpoint is data (" + _NOT_OURS + ")"))
            continue
        try:
            import_callable(path, field)
            out.append(path)
        except ConfigError:
            out.append(UnavailableFunction(path, field, "could not be imported when this module was loaded"))
    return out


_NOT_OURS = f"it names neither lit_rlhf's own nor a registered task's function; {OPT_IN} imports it for a file you made"


def load_arguments(path: Any, hparams: Mapping[str, Any], given: dict[str, Any], trust: bool) -> dict[str, Any]:
    """The keyword arguments `load_from_checkpoint` builds the module with: `given` (the caller's, as they are)
    plus stand-ins for the checkpoint's functions; a `CheckpointError` for code the checkpoint may not choose."""
    arguments = dict(given)
    for key in FUNCTION_KEYS:
        if key not in given and hparams.get(key):
            arguments[key] = checkpoint_functions(hparams[key], f"model.{key}", trust)
    skipped = [f"model.{k}: {f.path!r}" for k in FUNCTION_KEYS for f in arguments.get(k) or [] if _untrusted(f)]
    if skipped:
        warnings.warn(
            f"load_from_checkpoint({str(path)!r}): not imported, scoring with them raises: {'; '.join(skipped)}. "
            f"Pass reward_fns= / metric_fns= to score ({OPT_IN} imports them for a file you made)",
            stacklevel=3,
        )
    if trust:
        return arguments
    environment = hparams.get("environment")
    name = environment.get("name") if isinstance(environment, Mapping) else None
    if "environment" not in given and name is not None and not str(name).startswith(BUILTIN_PREFIX):
        raise CheckpointError(
            f"checkpoint {path}: model.environment.name is {name!r}, code the checkpoint names (not a "
            f"{BUILTIN_PREFIX}<name> environment); a checkpoint may not choose code to run. Pass environment=... (or "
            f"environment=None to load without it) to load_from_checkpoint, or {OPT_IN} for a file you made"
        )
    for key in SAMPLING_KEYS:
        vllm = hparams.get(key, {}).get("vllm") if isinstance(hparams.get(key), Mapping) else None
        if key not in given and isinstance(vllm, Mapping) and vllm.get("mode") == "server":
            raise CheckpointError(
                f"checkpoint {path}: model.{key}.vllm names a vLLM server ({vllm.get('server_url')!r}) and a folder "
                f"to write the weights to ({vllm.get('weights_dir')!r}); a checkpoint may not choose where prompts "
                f"are sent or files are written. Pass {key}=... to load_from_checkpoint (or {OPT_IN})"
            )
    if "trust_remote_code" not in given and hparams.get("trust_remote_code") not in (None, False):
        raise CheckpointError(
            f"checkpoint {path}: model.trust_remote_code is {hparams['trust_remote_code']!r}, which lets the model "
            "folders it names run their own code; a checkpoint may not switch that on. Pass trust_remote_code=True "
            f"to load_from_checkpoint if you trust those folders (or {OPT_IN})"
        )
    return arguments


def _untrusted(fn: Any) -> bool:
    return isinstance(fn, UnavailableFunction) and fn.reason.startswith("was not imported")
