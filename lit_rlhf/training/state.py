"""What an exact resume needs besides the weights and the optimizer: the training counters, the update's
shuffling generator, and every rank's RNG streams; and which frozen weights a checkpoint may leave out.

Stored under `checkpoint["lit_rlhf"]`; everything is a tensor, number or list, so the file loads with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import dataclasses
import warnings
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Timer
from torch import nn

from lit_rlhf.config import AlgorithmConfig, ConfigError, SamplingConfig
from lit_rlhf.data.handoff import PromptSupply
from lit_rlhf.models.build import ModelSpecs
from lit_rlhf.models.reward_model import SequenceRewardModel
from lit_rlhf.rewards.functions import callable_path
from lit_rlhf.training.checkpoint_integrity import DIGEST_KEY, check_weights_fit, payload_digest, verify_payload
from lit_rlhf.training.checkpoint_trust import load_arguments
from lit_rlhf.training.sharding import is_fsdp2

CHECKPOINT_KEY = "lit_rlhf"
LOADING: ContextVar[tuple[Any, bool]] = ContextVar("lit_rlhf_loading", default=(None, True))
"""The file `load_from_checkpoint` is reading and whether it loads strictly (for the checks of the hook)."""


@dataclass
class TrainingState:
    """Counters that advance with training, restored exactly on resume."""

    policy_version: int = 0  # optimizer updates applied so far
    rollouts_done: int = 0  # training steps (rollouts) consumed so far
    skipped_updates: int = 0  # optimizer steps skipped for non-finite values
    consecutive_skips: int = 0
    update_generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))
    rng_restored_per_rank: bool = False  # a checkpoint gave this rank its own RNG state

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (`Trainer(strategy="ddp_spawn")` sends the module to each process): the generator as its
        state tensor."""
        return {**self.__dict__, "update_generator": bytes(self.update_generator.get_state().numpy())}

    def __setstate__(self, state: dict[str, Any]) -> None:
        generator = torch.Generator()
        generator.set_state(torch.frombuffer(bytearray(state["update_generator"]), dtype=torch.uint8))
        self.__dict__.update({**state, "update_generator": generator})

    def skip_update(self, bad: dict[str, float], max_consecutive: int, global_step: int) -> None:
        """Count an optimizer step skipped for the non-finite values `bad`; raise after `max_consecutive` in a
        row, naming them."""
        self.skipped_updates += 1
        self.consecutive_skips += 1
        if self.consecutive_skips >= max_consecutive:
            raise FloatingPointError(
                f"{self.consecutive_skips} optimizer steps in a row were skipped because values went non-finite; "
                f"last: {bad} at global step {global_step} (policy version {self.policy_version}). Lower the "
                "learning rate, check the reward scale, or use bf16/fp32."
            )

    def to_checkpoint(self, strategy: Any | None, world_size: int) -> dict[str, Any]:
        """The state and this process's RNG; with several ranks every rank's RNG, gathered (a collective:
        every rank must call it)."""
        saved: dict[str, Any] = {
            "policy_version": self.policy_version,
            "rollouts_done": self.rollouts_done,
            "skipped_updates": self.skipped_updates,
            "consecutive_skips": self.consecutive_skips,
            "update_generator": self.update_generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }
        if strategy is not None and world_size > 1:
            # ranks sample different amounts, so their RNG streams differ: keep every rank's
            device = strategy.root_device
            states = strategy.all_gather(torch.get_rng_state().to(device))
            saved["torch_rng_per_rank"] = [s.cpu().clone() for s in states]  # own storage each
            if device.type == "cuda":
                states = strategy.all_gather(torch.cuda.get_rng_state(device).to(device))
                saved["cuda_rng_per_rank"] = [s.cpu().clone() for s in states]
        return saved

    def restore(self, saved: dict[str, Any], rank: int, world_size: int, device: torch.device) -> None:
        """Counters, generator and this rank's RNG streams from `to_checkpoint`'s dictionary."""
        self.policy_version = saved["policy_version"]
        self.rollouts_done = saved.get("rollouts_done", 0)
        self.skipped_updates = saved["skipped_updates"]
        self.consecutive_skips = saved["consecutive_skips"]
        self.update_generator.set_state(saved["update_generator"])
        per_rank = saved.get("torch_rng_per_rank")
        self.rng_restored_per_rank = per_rank is not None and len(per_rank) == world_size
        state = per_rank[rank] if per_rank is not None and self.rng_restored_per_rank else saved["torch_rng"]
        torch.set_rng_state(state.clone())  # a view with a storage offset crashes set_rng_state
        if saved.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda_rng"])
        cuda_per_rank = saved.get("cuda_rng_per_rank")
        if cuda_per_rank is not None and len(cuda_per_rank) == world_size and device.type == "cuda":
            torch.cuda.set_rng_state(cuda_per_rank[rank].clone(), device)


def save_training_state(
    checkpoint: dict[str, Any],
    state: TrainingState,
    rebuilt_prefixes: tuple[str, ...],
    strategy: Any | None,
    world_size: int,
    portable_specs: dict[str, Any] | None = None,
) -> None:
    """Into a Lightning checkpoint: the training state, without the weights under `rebuilt_prefixes` (frozen
    models reloaded from their source), dataclass settings as plain dicts (weights-only loadable), and the
    `portable_specs` of models given as instances in place of their hyperparameter (None)."""
    state_dict = checkpoint["state_dict"]
    for key in [k for k in state_dict if k.startswith(rebuilt_prefixes)]:
        del state_dict[key]
    checkpoint[CHECKPOINT_KEY] = {
        **state.to_checkpoint(strategy, world_size),
        "rebuilt_prefixes": list(rebuilt_prefixes),
    }
    hparams = checkpoint.get("hyper_parameters")
    if isinstance(hparams, dict):
        checkpoint["hyper_parameters"] = {
            k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v
            for k, v in hparams.items()
        }
        for key, value in checkpoint["hyper_parameters"].items():  # rebuilt from a portable spec, or given again
            if isinstance(value, str) and value.startswith(INSTANCE):
                checkpoint["hyper_parameters"][key] = None
        checkpoint["hyper_parameters"].update(portable_specs or {})


def load_training_state(
    checkpoint: dict[str, Any],
    state: TrainingState,
    own_weights: dict[str, Any],
    rank: int,
    world_size: int,
    device: torch.device,
) -> None:
    """From a Lightning checkpoint: the training state, and the module's `own_weights` where the file left
    them out."""
    saved = checkpoint.get(CHECKPOINT_KEY)
    if saved is None:
        return
    prefixes = tuple(saved.get("rebuilt_prefixes", []))
    if prefixes:
        checkpoint["state_dict"].update({k: v for k, v in own_weights.items() if k.startswith(prefixes)})
    state.restore(saved, rank, world_size, device)


INSTANCE = "instance:"  # how hparams.yaml names a model given as an instance (a checkpoint carries its spec)


def instance_name(obj: Any) -> str:
    """'instance:GPT2LMHeadModel from gpt2': the class and, when it has one, the folder or hub id it came from."""
    model = getattr(obj, "model", obj)
    source = getattr(obj, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return f"{INSTANCE}{type(obj).__name__}" + (f" from {source}" if isinstance(source, str) and source else "")


def plain(value: Any) -> Any:
    """A setting as plain YAML data (safe-loadable): dataclasses as dicts, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def named_settings(specs: ModelSpecs, settings: dict[str, Any], **callables: Any) -> dict[str, Any]:
    """Hyperparameters as plain data (`hparams.yaml` loads with `yaml.safe_load`): `settings` with dataclasses
    as dicts and tuples as lists, each model by its name or, for an instance, `instance_name` (a checkpoint
    carries its portable spec instead), and each list of functions by their dotted paths."""
    names: dict[str, Any] = {k: plain(v) for k, v in settings.items()}
    for key, name in specs.names().items():
        value = getattr(specs, key)
        names[key] = name if name is not None or value is None else instance_name(value)
    for key, fns in callables.items():
        if fns:
            names[key] = [f if isinstance(f, str) else callable_path(f) for f in fns]
    return names


def checkpoint_hparams(path: Any) -> dict[str, Any]:
    """A checkpoint's hyperparameters, read memory-mapped ({} when it cannot be read: the load reports that)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return {}
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None
    return hparams if isinstance(hparams, dict) else {}


def attached_trainer(module: Any) -> Any | None:
    """The module's Trainer, or None when it has none (Lightning's `module.trainer` raises then)."""
    try:
        return module.trainer
    except RuntimeError:
        return None


def changed_settings(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    """'setting: old -> new' for each entry of two rollout fingerprints that differs (absent on either side: none)."""
    return [f"{key}: {saved[key]} -> {now[key]}" for key in sorted(saved.keys() & now.keys()) if saved[key] != now[key]]


class ExactResume(L.LightningModule):
    """A LightningModule whose checkpoints resume exactly and rebuild without arguments: its `state` (a
    `TrainingState`) and every rank's RNG are saved and restored; frozen models named by a folder or hub id are
    left out (reloaded from source), models given as instances are described by portable specs; a resumed run
    gets the whole `max_time` again."""

    state: TrainingState
    specs: ModelSpecs
    reference: nn.Module | None
    reward_model: SequenceRewardModel | None
    algorithm: AlgorithmConfig
    sampling: SamplingConfig
    prompt_supply: PromptSupply | None

    @classmethod
    def load_from_checkpoint(
        cls, checkpoint_path: Any, *args: Any, trust_checkpoint_code: bool = False, **kwargs: Any
    ) -> Any:
        """Lightning's `load_from_checkpoint`, treating the checkpoint as data (`checkpoint_trust`): its reward and
        metric functions are imported only when they are lit_rlhf's own or a registered task's (otherwise, and
        when one does not import here, an `UnavailableFunction`: loading to export or generate works; pass
        `reward_fns=` / `metric_fns=` to score), and an environment or `trust_remote_code` it names is refused
        unless passed here. `trust_checkpoint_code=True`: import and run what a file you made names."""
        hparams = checkpoint_hparams(checkpoint_path)
        kwargs = load_arguments(checkpoint_path, hparams, kwargs, trust_checkpoint_code)
        token = LOADING.set((checkpoint_path, kwargs.get("strict", True) is not False))
        try:
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)
        finally:
            LOADING.reset(token)

    def record_named_settings(self, **callables: Any) -> None:
        """The hyperparameters (and what loggers write to hparams.yaml) as plain, safe-loadable data with every
        model and function named (`named_settings`); called once the module's settings are saved."""
        names = named_settings(self.specs, dict(self.hparams), **callables)
        self.hparams.update(names)
        self.__dict__["_hparams_initial"].update(names)

    def rebuilt_prefixes(self) -> tuple[str, ...]:
        """Frozen models reloaded from their source, left out of checkpoints; none under FSDP2, whose distributed
        checkpoint Lightning loads into every key of the module (a missing one fails the resume)."""
        if is_fsdp2(attached_trainer(self)):
            return ()
        return self.specs.rebuildable_prefixes(self.reference is not None, self.reward_model is not None)

    def on_fit_start(self) -> None:
        """Every rank was seeded alike (same initial weights); give each rank its own sampling stream, so the
        ranks do not draw the same noise for their different prompts. A resume restores each rank's own stream."""
        if self.trainer.world_size > 1 and not self.state.rng_restored_per_rank:
            torch.manual_seed((torch.initial_seed() + self.trainer.global_rank) % 2**63)
        super().on_fit_start()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Drop rebuildable frozen weights; keep counters and RNG states for an exact resume."""
        world = self.trainer.world_size
        strategy = self.trainer.strategy if world > 1 else None
        save_training_state(checkpoint, self.state, self.rebuilt_prefixes(), strategy, world, self.specs.portable())
        # the version a resumed command-line run logs into again (lit_rlhf.cli.ResumingCLI)
        checkpoint[CHECKPOINT_KEY]["logger_version"] = getattr(self.logger, "version", None)
        checkpoint[CHECKPOINT_KEY]["rollout_fingerprint"] = self.rollout_fingerprint()
        if not is_fsdp2(self.trainer):  # a sharded state dict is hashed by no one process
            checkpoint[CHECKPOINT_KEY][DIGEST_KEY] = payload_digest(checkpoint)
        super().on_save_checkpoint(checkpoint)

    def rollout_fingerprint(self) -> dict[str, str]:
        """What defines this run's rollouts, setting by setting: group size, sampling, rewards and, with a
        `RolloutDataModule`, the prompt set; a resume compares it with the checkpoint's."""
        hp = self.hparams
        fingerprint = {
            "model.algorithm.group_size": str(self.algorithm.filled.group_size),
            "model.algorithm.max_staleness": str(self.algorithm.max_staleness),  # which rollouts in flight are kept
            "model.sampling": repr(plain(self.sampling)),
            **{f"model.{key}": repr(hp.get(key)) for key in ("reward_fns", "reward_weights", "reward_model")},
        }
        if self.prompt_supply is not None:
            fingerprint["data.prompts"] = self.prompt_supply.fingerprint
        return fingerprint

    def check_resumed_rollouts(self, saved: dict[str, str] | None) -> None:
        """Warn (or raise, `resume_changes: error`) naming each setting that changes the rollouts on resume."""
        changes = changed_settings(saved or {}, self.rollout_fingerprint())
        if not changes:
            return
        message = (
            "resuming a checkpoint whose rollouts were made differently: " + "; ".join(changes) + ". The run goes "
            "on with the new settings; set model.resume_changes: error to refuse such a resume"
        )
        if self.hparams.get("resume_changes", "warn") == "error":
            raise ConfigError(message.replace("The run goes on with the new settings; set", "Restore them, or set"))
        warnings.warn(message, stacklevel=2)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Put back the frozen weights rebuilt from source, and the counters and RNG states."""
        trainer = attached_trainer(self)  # None in load_from_checkpoint
        if trainer is not None and trainer.state.fn == "fit":  # a resumed fit, not a load for export
            self.check_resumed_rollouts(checkpoint.get(CHECKPOINT_KEY, {}).get("rollout_fingerprint"))
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        device = trainer.strategy.root_device if trainer is not None else self.device  # the module is not moved yet
        path, strict = (trainer.ckpt_path, self.strict_loading) if trainer is not None else LOADING.get()
        checked = not is_fsdp2(trainer)  # a sharded state dict: no one process holds the whole payload
        if checked:  # before any weight is used
            verify_payload(checkpoint, checkpoint.get(CHECKPOINT_KEY, {}), path)
        own = self.state_dict()
        load_training_state(checkpoint, self.state, own, rank, world, device)
        if checked and strict:
            saved_hparams = checkpoint.get("hyper_parameters") or {}
            check_weights_fit(path, checkpoint["state_dict"], own, saved_hparams, dict(self.hparams))
        # `Trainer(max_time=...)` limits each process: forget the elapsed time the Timer callback saved (this hook
        # runs before callbacks restore their state from the same dictionary)
        for key, callback_state in checkpoint.get("callbacks", {}).items():
            if key.startswith(Timer.__qualname__) and "time_elapsed" in callback_state:
                callback_state["time_elapsed"] = dict.fromkeys(callback_state["time_elapsed"], 0.0)
        super().on_load_checkpoint(checkpoint)
