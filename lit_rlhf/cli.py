"""Command lines from YAML configs, through LightningCLI (`fit`, `validate`, ... and `--print_config`).

lit-rlhf fit --config configs/grpo.yaml                  # PPO / GRPO (also: python train.py ...)
lit-rlhf-reward fit --config configs/reward_model.yaml   # a reward model on preference pairs
lit-rlhf-export --ckpt runs/grpo/checkpoints/last.ckpt --out runs/grpo/policy   # a Hugging Face folder
lit-rlhf-plan --config configs/grpo.yaml                 # the memory plan per device, before anything loads
lit-rlhf check --config configs/grpo.yaml               # a preflight of the whole run (lit_rlhf.preflight)
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import signal
import sys
import tempfile
import traceback
import typing
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from jsonargparse import set_parsing_settings
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_rlhf.config import AlgorithmConfig, ConfigError, SamplingConfig, check_foreign_names, yaml_boolean_hint
from lit_rlhf.data.datamodule import RolloutDataModule
from lit_rlhf.models.export import check_target, save_module_policy
from lit_rlhf.preflight.run import check, refused_settings
from lit_rlhf.training.checkpoint_io import (
    CheckpointError,
    check_checkpoint_file,
    consolidate_distributed_checkpoint,
    is_distributed_checkpoint,
    load_checkpoint_file,
)
from lit_rlhf.training.checkpoint_trust import without_vllm_server
from lit_rlhf.training.memory_plan import GiB, available_bytes, plan_memory, plan_settings
from lit_rlhf.training.module import RLHFModule
from lit_rlhf.training.reward_model_training import PreferenceDataModule, RewardModelModule
from lit_rlhf.training.state import CHECKPOINT_KEY, checkpoint_hparams

# A Lightning notice that does not apply to these runs, silenced only while a command of this file runs:
# ModelCheckpoint under manual optimisation suggests saving the weights from before the optimizer step, but the
# state after a complete RL step is the one to resume from.
QUIET = (r"Using ModelCheckpoint with manual optimization",)


SIGTERM_STATUS = 128 + signal.SIGTERM  # the shell's status for a process ended by SIGTERM (143)


class CheckedCLI(LightningCLI):
    """LightningCLI that names an unreadable `--ckpt_path` file, and whose subcommand never ends with status 0
    unless it finished.

    Lightning reads `--ckpt_path` before anything else (for its hyperparameters), and its loader reports an empty
    file as a bare `EOFError`; the file is checked first, and an empty, truncated or foreign one is named.

    Lightning stops `fit` on SIGTERM by raising `SIGTERMException`, a `SystemExit` without a code (status 0);
    here it becomes status 143 (128 + SIGTERM), after Lightning's teardown and the `last.ckpt` that
    `RunFolderGuard` writes. A `SystemExit(0)` raised inside a subcommand (code that calls `sys.exit()`) becomes
    status 1 with a message naming where it was raised. Other exceptions keep Python's status 1 and traceback.
    """

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """The parser, reading the settings dataclasses' attribute docstrings (`AlgorithmConfig`'s fields are
        documented that way) so every setting in `--help` carries its one-line description."""
        set_parsing_settings(docstring_parse_attribute_docstrings=True)
        return super().init_parser(**kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """TRL's option names in a config file or on the command line get a `ConfigError` naming ours, before
        LightningCLI's own "unexpected key" error (which does not know them)."""
        raw = args if args is not None else sys.argv[1:]
        sections = {"model": self.model_class, "data": self.datamodule_class, "trainer": Trainer}
        for config in raw_configs(raw):
            check_raw_config(config, sections)
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else None
        if config is not None and config.get("ckpt_path"):
            path = resolve_checkpoint(config.ckpt_path, config.trainer.get("callbacks") or [])
            if path:
                check_checkpoint_file(path)
        super()._parse_ckpt_path()

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except SIGTERMException:
            print(f"{self.parser.prog}: {subcommand} stopped by SIGTERM; exit status {SIGTERM_STATUS}", file=sys.stderr)
            raise SystemExit(SIGTERM_STATUS) from None
        except SystemExit as err:
            if err.code not in (None, 0):
                raise
            where = traceback.extract_tb(err.__traceback__)[-1]
            print(
                f"{self.parser.prog}: {subcommand} stopped by SystemExit({err.code}) raised at {where.filename}:"
                f"{where.lineno} ({where.name}) before it finished; exit status 1",
                file=sys.stderr,
            )
            raise SystemExit(1) from err


class ResumingCLI(CheckedCLI):
    """LightningCLI whose `fit --ckpt_path` run logs into the TensorBoard/CSV logger version of the run it resumes
    (read from the checkpoint), so one run's curves stay in one folder."""

    def before_instantiate_classes(self) -> None:
        if self.subcommand != "fit":
            return
        config = self.config[self.subcommand]
        logger: Any = config.trainer.get("logger")
        logger_class = str(getattr(logger, "class_path", "")).rsplit(".", 1)[-1]
        if not config.get("ckpt_path") or logger_class not in ("TensorBoardLogger", "CSVLogger"):
            return
        path = resolve_checkpoint(config.ckpt_path, config.trainer.get("callbacks") or [])
        version = saved_logger_version(path) if path else None
        if version is not None and logger.init_args.get("version") is None:
            logger.init_args.version = version


def is_plain_version(version: Any) -> bool:
    """A logger version that names one folder inside the logger's own (`version_3`, 3, `my-run`): never a path
    (a separator, '..', an absolute path) that would let a checkpoint choose where the logs are written."""
    if isinstance(version, int) and not isinstance(version, bool):
        return version >= 0
    return (
        isinstance(version, str)
        and version not in ("", ".", "..")
        and all(c.isalnum() or c in "._-=" for c in version)
        and len(version) <= 255
    )


# Settings that are dataclasses inside the model's section: their keys are checked against the dataclass.
NESTED_SETTINGS = {"algorithm": AlgorithmConfig, "sampling": SamplingConfig, "val_sampling": SamplingConfig}
SUBCOMMANDS = ("fit", "validate", "test", "predict")


class UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping (plain YAML keeps the last silently, and a
    second `model:` block would replace the first whole)."""

    source = "config"

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(
                    f"{self.source}: the key {key!r} is given twice in one mapping, on lines {seen[key]} and {line}; "
                    "YAML would keep the last silently. Merge them into one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep)


def load_config_text(text: str, source: str) -> Any:
    """A YAML config, with keys given twice refused (`UniqueKeyLoader`); `source` names it in the error."""
    loader = UniqueKeyLoader(text)
    loader.source = source
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def raw_configs(args: Any) -> list[Any]:
    """The configs a command line names before LightningCLI parses it: each `--config` file (or YAML string) and
    one nested dict of the dotted `--section.key value` arguments; a dict of arguments as it is. A key given twice
    in one mapping of a config is a `ConfigError` naming it and both lines."""
    if isinstance(args, dict):
        return [args]
    configs: list[Any] = []
    dotted: dict[str, Any] = {}
    items = [str(a) for a in args]
    for i, item in enumerate(items):
        key, eq, value = item.partition("=")
        value = value if eq else (items[i + 1] if i + 1 < len(items) else "")
        if key in ("--config", "-c"):
            with contextlib.suppress(OSError, yaml.YAMLError):
                text = Path(value).read_text() if os.path.isfile(value) else value
                configs.append(load_config_text(text, value if os.path.isfile(value) else "--config"))
        elif key.startswith("--") and "." in key:
            node = dotted
            *parents, last = key[2:].split(".")
            for part in parents:
                node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
            node[last] = value
    return [*configs, dotted]


def _init_args(section: Any) -> Any:
    return section.get("init_args", {}) if isinstance(section, dict) and "class_path" in section else section


def check_raw_config(config: Any, sections: dict[str, Any]) -> None:
    """Raise a `ConfigError` naming our setting for a TRL option name in a `model`, `data` or `trainer` section
    of `config` (or in `model.algorithm`, `model.sampling`, `model.val_sampling`)."""
    if not isinstance(config, dict):
        return
    for subcommand in SUBCOMMANDS:
        check_raw_config(config.get(subcommand), sections)
    for name, cls in sections.items():
        section = _init_args(config.get(name))
        if not isinstance(section, dict) or cls is None:
            continue
        check_foreign_names(name, section, inspect.signature(cls.__init__).parameters)
        check_yaml_booleans(name, section, cls.__init__)
        if name != "model":
            continue
        for key, settings in NESTED_SETTINGS.items():
            nested = _init_args(section.get(key))
            if key in inspect.signature(cls.__init__).parameters and isinstance(nested, dict):
                check_foreign_names(f"model.{key}", nested, inspect.signature(settings).parameters)
                check_yaml_booleans(f"model.{key}", nested, settings)


def check_yaml_booleans(name: str, section: dict[str, Any], function: Any) -> None:
    """A `ConfigError` with the hint to quote it for a boolean given to a setting whose values are words YAML
    reads as booleans unquoted (`memory_check: off` is False), before the parser's own type error."""
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # an annotation that does not resolve here: the parser reports what it must
        return
    for key, value in section.items():
        choices = typing.get_args(hints.get(key)) if typing.get_origin(hints.get(key)) is typing.Literal else ()
        hint = yaml_boolean_hint(value, choices)
        if hint:
            raise ConfigError(
                f"{name}.{key}: got the boolean {value!r}, one of {', '.join(map(repr, choices))} is expected{hint}"
            )


def resolve_checkpoint(ckpt_path: str, callbacks: list[Any]) -> str | None:
    """The file `--ckpt_path` names: a path, or for 'last' the newest last.ckpt of the configured ModelCheckpoints."""
    if ckpt_path != "last":
        return ckpt_path if os.path.isfile(ckpt_path) else None
    folders = [getattr(c, "init_args", {}).get("dirpath") for c in callbacks if "ModelCheckpoint" in str(c.class_path)]
    found = [f for d in folders if d and os.path.isfile(f := os.path.join(d, "last.ckpt"))]
    return max(found, key=os.path.getmtime) if found else None


def saved_logger_version(path: str) -> int | str | None:
    """The logger version a checkpoint of this package was written under (None if it does not say)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # the fit itself reports an unreadable checkpoint, naming it
        return None
    version = checkpoint.get(CHECKPOINT_KEY, {}).get("logger_version") if isinstance(checkpoint, dict) else None
    if version is None or is_plain_version(version):
        return version
    warnings.warn(
        f"checkpoint {path}: its logger version {version!r} is not a plain folder name; the resumed run logs into a "
        "new version instead (set trainer.logger.init_args.version to choose one)",
        stacklevel=2,
    )
    return None


def main(args: list[str] | None = None) -> LightningCLI:
    """PPO/GRPO training; `args` replaces sys.argv[1:] (for tests and notebooks)."""
    with quiet_known_notices():
        return ResumingCLI(
            RLHFModule, RolloutDataModule, save_config_kwargs={"overwrite": True}, seed_everything_default=0, args=args
        )


def reward_main(args: list[str] | None = None) -> LightningCLI:
    """Reward-model training; `args` replaces sys.argv[1:]."""
    with quiet_known_notices():
        return CheckedCLI(
            RewardModelModule,
            PreferenceDataModule,
            save_config_kwargs={"overwrite": True},
            seed_everything_default=0,
            args=args,
        )


@contextlib.contextmanager
def quiet_known_notices() -> Iterator[None]:
    with warnings.catch_warnings():
        for pattern in QUIET:
            warnings.filterwarnings("ignore", message=pattern)
        yield


def checkpoint_names_policy(path: str) -> bool:
    """Check that `path` is an `RLHFModule` checkpoint (errors name the file); whether it names its policy.

    The file is memory-mapped, so looking costs little even for a large model.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not a zip checkpoint, truncated, or holding code: the plain load says which
        checkpoint = load_checkpoint_file(path, "cpu")
    state_dict = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    ours = isinstance(state_dict, dict) and any(str(k).startswith("actor_critic.policy.") for k in state_dict)
    if not ours or CHECKPOINT_KEY not in checkpoint:
        raise CheckpointError(
            f"checkpoint {path}: not written by lit_rlhf's RLHFModule (it has no actor_critic.policy weights or no "
            f"{CHECKPOINT_KEY!r} training state)"
        )
    hparams = checkpoint.get("hyper_parameters")
    return isinstance(hparams, dict) and hparams.get("policy") is not None


def export_checkpoint(
    ckpt_path: str,
    out: str,
    merge_lora: bool = True,
    overwrite: bool = False,
    policy: str | None = None,
    tokenizer: str | None = None,
    trust_remote_code: bool = False,
) -> str:
    """The policy of an `RLHFModule` checkpoint as a Hugging Face folder (see `lit_rlhf.models.export`).

    `policy` / `tokenizer`: where to rebuild them from when the checkpoint does not name them (a module built
    from model instances) or names a folder that moved; the checkpoint's weights are then loaded into them.
    Nothing the checkpoint names is imported or run (its environment is not rebuilt, its reward functions are
    not needed); `trust_remote_code`: let the model folders it names run their own code.
    Returns the folder's absolute path. `out` is checked first (an existing folder needs `overwrite`, and is then
    replaced only when it holds a previous export or Hugging Face files), before the checkpoint is read.
    """
    check_target(out, overwrite)
    if is_distributed_checkpoint(ckpt_path):  # FSDP2's folder of shards: one full file first, beside nothing
        with tempfile.TemporaryDirectory(prefix="lit-rlhf-export-") as folder:
            consolidated = os.path.join(folder, "consolidated.ckpt")
            consolidate_distributed_checkpoint(ckpt_path, consolidated)
            return export_checkpoint(consolidated, out, merge_lora, overwrite, policy, tokenizer, trust_remote_code)
    named = checkpoint_names_policy(ckpt_path)
    overrides: dict[str, Any] = {k: v for k, v in (("policy", policy), ("tokenizer", tokenizer)) if v is not None}
    # exporting scores nothing: the training's reward and metric functions (perhaps defined in a script that is
    # not importable here) are not needed
    overrides.update(reward_fns=[_no_scoring_in_export], reward_weights=None, metric_fns=None, environment=None)
    overrides.update(without_vllm_server(checkpoint_hparams(ckpt_path)))  # an export sends nothing to a server
    if trust_remote_code:
        overrides["trust_remote_code"] = True
    try:
        module = RLHFModule.load_from_checkpoint(ckpt_path, map_location="cpu", **overrides)
    except CheckpointError as err:
        if "trust_remote_code" in str(err):
            raise CheckpointError(f"{err}; on the command line: lit-rlhf-export --trust-remote-code") from err
        raise
    except Exception as err:
        if not named and policy is None:
            raise CheckpointError(
                f"checkpoint {ckpt_path}: the checkpoint does not name its policy (the module was built from a "
                "model instance); pass --policy NAME_OR_FOLDER (and --tokenizer if it differs): a model of the "
                f"same architecture, whose weights the checkpoint then replaces ({type(err).__name__}: {err})"
            ) from err
        raise CheckpointError(
            f"checkpoint {ckpt_path}: could not rebuild the module ({type(err).__name__}: {err}); --policy "
            "NAME_OR_FOLDER rebuilds the policy from elsewhere"
        ) from err
    module.configure_model()
    path = save_module_policy(module, out, merge_lora, overwrite)
    assert path is not None  # one process, nothing sharded: this process writes
    return path


def _no_scoring_in_export(prompts: list[str], responses: list[str], **meta: Any) -> list[float]:
    raise RuntimeError("lit-rlhf-export rebuilt this module to export its policy only; it scores nothing")


def export_main(argv: list[str] | None = None) -> None:
    """`lit-rlhf-export`: a checkpoint's policy as a Hugging Face folder (its path printed); `argv` replaces
    sys.argv[1:]. Errors exit with status 1 and a message naming the file or folder."""
    parser = argparse.ArgumentParser(
        prog="lit-rlhf-export",
        description="Write the policy of a lit_rlhf checkpoint as a Hugging Face folder (model, tokenizer, "
        "generation config) that AutoModelForCausalLM.from_pretrained loads.",
    )
    parser.add_argument(
        "--ckpt", required=True, help="a .ckpt written by training an RLHFModule (a file, or an FSDP2 folder)"
    )
    parser.add_argument("--out", required=True, help="the folder to write (must not exist, unless --overwrite)")
    parser.add_argument(
        "--no-merge-lora",
        dest="merge_lora",
        action="store_false",
        help="for a LoRA policy, save only the adapters (load them with peft on the same base model)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--policy", help="rebuild the policy from this name or folder (same architecture)")
    parser.add_argument("--tokenizer", help="rebuild the tokenizer from this name or folder")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="let the model folders the checkpoint names run their code"
    )
    args = parser.parse_args(argv)
    try:
        path = export_checkpoint(
            args.ckpt, args.out, args.merge_lora, args.overwrite, args.policy, args.tokenizer, args.trust_remote_code
        )
    except (ConfigError, FileNotFoundError) as err:
        raise SystemExit(f"lit-rlhf-export: error: {err}") from err
    print(path, file=sys.stdout)


def plan_main(argv: list[str] | None = None) -> None:
    """`lit-rlhf-plan --config X [--device-memory-gb N] [--model.x ...]`: the memory plan of a training config
    per device, from the config and the models' configs alone (no weights loaded); exit status 1 with the
    refusal `fit` would give when it does not fit. Other arguments go to the config parser as for `fit`."""
    parser = argparse.ArgumentParser(
        prog="lit-rlhf-plan",
        description="Print the memory plan per device of a lit_rlhf training config (nothing is loaded).",
    )
    parser.add_argument("--config", action="append", required=True, help="a config as for lit-rlhf fit")
    parser.add_argument("--device-memory-gb", type=float, help="plan against this many GiB (default: free now)")
    args, rest = parser.parse_known_args(argv)
    gb = args.device_memory_gb
    if gb is not None and not (math.isfinite(gb) and gb > 0):
        parser.error(f"--device-memory-gb: must be a positive, finite number of GiB, got {gb!r} (e.g. 80 for an H100)")
    cli_args = [arg for path in args.config for arg in ("--config", path)] + rest
    with quiet_known_notices():
        cli = CheckedCLI(RLHFModule, RolloutDataModule, run=False, args=cli_args, save_config_callback=None)
    settings = plan_settings(cli.model, cli.datamodule, cli.trainer)
    plan = plan_memory(settings, int(gb * GiB) if gb else available_bytes(settings.device, settings.processes_per_host))
    print(plan.table())
    refusal = plan.refusal()
    if refusal is not None:
        raise SystemExit("lit-rlhf-plan: error: " + refusal.split("\n", 1)[0])


def check_main(argv: list[str] | None = None) -> int:
    """`lit-rlhf check --config X [--dry-run N] [--device-memory-gb G] [--strict] [--model.x ...]`: the preflight
    (`lit_rlhf.preflight`) printed as one report; returns the exit status (0: nothing blocks the run). Other
    arguments go to the config parser as for `fit`."""
    parser = argparse.ArgumentParser(
        prog="lit-rlhf check",
        description="Check a lit_rlhf training config before running it: settings, data, model and tokenizer, "
        "rewards, memory, backends (nothing heavier than the tokenizer and the models' configs is loaded).",
    )
    parser.add_argument("--config", action="append", required=True, help="a config as for lit-rlhf fit")
    parser.add_argument("--dry-run", type=int, default=0, metavar="N", help="load the models and run N real steps")
    parser.add_argument("--device-memory-gb", type=float, help="plan against this many GiB (default: free now)")
    parser.add_argument("--strict", action="store_true", help="exit status 1 on warnings too")
    args, rest = parser.parse_known_args(argv)
    if args.dry_run < 0:
        parser.error(f"--dry-run: the number of steps must be >= 0 (0: none), got {args.dry_run}")
    title = "lit-rlhf check " + " ".join(sys.argv[1:] if argv is None else argv)
    cli_args = [arg for path in args.config for arg in ("--config", path)] + rest
    try:
        with quiet_known_notices():
            cli = CheckedCLI(RLHFModule, RolloutDataModule, run=False, args=cli_args, save_config_callback=None)
    except ValueError as err:  # a ConfigError, or jsonargparse's ValueError around one
        report = refused_settings(title, err)
    else:
        gb, steps = args.device_memory_gb, args.dry_run
        report = check(cli.model, cli.datamodule, cli.trainer, device_memory_gb=gb, dry_run=steps, title=title)
    print(report.render())
    return report.exit_status(args.strict)


def main_script() -> None:
    """Console script `lit-rlhf` and `train.py`: `main()` returns the LightningCLI object, which `sys.exit` would
    print and turn into exit status 1; this returns None (status 0) after leaving the process group.
    `lit-rlhf check ...` runs the preflight instead (`check_main`), before LightningCLI sees the arguments."""
    if sys.argv[1:2] == ["check"]:
        argv, sys.argv[1:] = sys.argv[2:], []  # LightningCLI warns when it is given both
        raise SystemExit(check_main(argv))
    main()
    leave_process_group()


def reward_script() -> None:
    """Console script `lit-rlhf-reward` (see `main_script`)."""
    reward_main()
    leave_process_group()


def leave_process_group() -> None:
    """Leave the torch.distributed group of a finished multi-process run, all ranks together, before the
    interpreter exits.

    Lightning destroys the group at exit for NCCL only. A gloo group left to the interpreter's teardown once
    aborted a finished run ("terminate called without an active exception", status -6 instead of 0), and so did
    a rank that destroyed its group while a peer was still in a collective: the ranks first meet at a barrier
    (on gloo a monitored one, which names the ranks missing after the group's timeout and fails at once when a
    peer has exited). A rank whose peer failed raises, so the run exits non-zero, and leaves the group as it is
    (destroying it could wait on the missing peer).
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    try:
        if torch.distributed.get_backend() == "gloo":
            torch.distributed.monitored_barrier(wait_all_ranks=True)
        else:
            torch.distributed.barrier()
    except RuntimeError as error:
        raise RuntimeError(
            f"this rank finished, but another process of the run did not reach the end ({error}): see its log"
        ) from error
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
