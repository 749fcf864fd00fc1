"""LoRA on the policy (via `peft`), and the reference policy for free: the same weights with the adapters
switched off, so no second copy of the model is held.

`RLHFModule(lora={"r": 8, "alpha": 16, "target_modules": "all-linear"})` wraps the policy with
`peft.get_peft_model`; a `peft.LoraConfig` (what TRL takes as `peft_config`) is accepted too and kept as these
settings (`lora_settings`: plain data, so `hparams.yaml` and checkpoints stay safe to load); only the adapters
(and the value head, for PPO) are trained. Without an explicit `reference`, the reference is an
`AdapterDisabledReference`: a module with no parameters whose forward runs the policy inside
`policy.disable_adapter()`. LoRA's B matrices start at zero, so at the first step the policy equals the reference
exactly and the KL is 0.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from torch import Tensor, nn

from lit_rlhf.config import ConfigError
from lit_rlhf.models.forward import accepts_argument

LORA_DEFAULTS: dict[str, Any] = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}
_RENAMED = {"alpha": "lora_alpha", "dropout": "lora_dropout"}


def _plain(value: Any) -> Any:
    if isinstance(value, set | frozenset | tuple):
        return sorted(value) if isinstance(value, set | frozenset) else list(value)
    return value.value if isinstance(value, enum.Enum) else value


def lora_settings(lora: Any, field: str = "model.lora") -> Any:
    """`lora` as our settings, checked by `lora_config` before any model loads (None: no LoRA); a peft
    `LoraConfig` (TRL's `peft_config`) becomes a dict (`_from_peft`)."""
    if lora is None:
        return None
    settings = _from_peft(lora, field)
    lora_config(settings, field)
    return settings


def _from_peft(lora: Any, field: str) -> Any:
    """A peft `LoraConfig` as the dict of its r, alpha, dropout, target_modules and every other field it sets
    away from peft's default (named as `lora_config` takes them); anything else as it is."""
    try:
        from peft import LoraConfig, TaskType
    except ImportError:
        return lora
    if not isinstance(lora, LoraConfig):
        return lora
    if lora.task_type not in (None, TaskType.CAUSAL_LM, TaskType.CAUSAL_LM.value):
        raise ConfigError(
            f"{field}: a LoraConfig with task_type={lora.task_type!r}; the policy is a causal LM: use "
            "task_type='CAUSAL_LM' or leave it unset"
        )
    defaults, always = LoraConfig(), {"r", "lora_alpha", "lora_dropout", "target_modules"}
    ours = {value: key for key, value in _RENAMED.items()}
    return {
        ours.get(f.name, f.name): _plain(getattr(lora, f.name))
        for f in dataclasses.fields(lora)
        if f.name not in ("task_type", "peft_type")
        and (f.name in always or getattr(lora, f.name) != getattr(defaults, f.name))
    }


def lora_config(settings: dict[str, Any], field: str = "model.lora"):
    """A `peft.LoraConfig` for a causal LM from {r, alpha, dropout, target_modules, ...any LoraConfig field}."""
    try:
        from peft import LoraConfig, TaskType
    except ImportError as err:
        raise ConfigError(
            f"{field}: LoRA needs the peft package; pip install peft (or pip install -e '.[lora]')"
        ) from err
    if not isinstance(settings, dict):
        raise ConfigError(
            f"{field}: expected a mapping like {{r: 8, alpha: 16, target_modules: all-linear}} or a "
            f"peft.LoraConfig, got {type(settings).__name__}"
        )
    merged = {**LORA_DEFAULTS, **settings}
    if not isinstance(merged["r"], int) or merged["r"] < 1:
        raise ConfigError(f"{field}.r: the LoRA rank must be an integer >= 1, got {merged['r']!r}")
    if merged["alpha"] <= 0:
        raise ConfigError(f"{field}.alpha: must be > 0, got {merged['alpha']!r}")
    if not 0 <= merged["dropout"] < 1:
        raise ConfigError(f"{field}.dropout: must be in [0, 1), got {merged['dropout']!r}")
    kwargs = {_RENAMED.get(k, k): v for k, v in merged.items()}
    try:
        return LoraConfig(task_type=TaskType.CAUSAL_LM, bias=kwargs.pop("bias", "none"), **kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{field}: {err}") from err


def apply_lora(policy: nn.Module, settings: dict[str, Any], field: str = "model.lora") -> nn.Module:
    """Wrap `policy` with LoRA adapters (base weights frozen); returns the `peft` model."""
    from peft import get_peft_model
    from transformers.pytorch_utils import Conv1D

    if "fan_in_fan_out" not in settings and any(isinstance(m, Conv1D) for m in policy.modules()):
        settings = {**settings, "fan_in_fan_out": True}  # GPT-2 stores its linear weights transposed
    config = lora_config(settings, field)
    try:
        return get_peft_model(policy, config)
    except ValueError as err:  # e.g. target modules not found in the model
        raise ConfigError(f"{field}: {err}") from err


def has_adapters(model: nn.Module) -> bool:
    return callable(getattr(model, "disable_adapter", None)) and hasattr(model, "peft_config")


class AdapterDisabledReference(nn.Module):
    """The reference policy as the LoRA policy with its adapters disabled: no weights of its own.

    The policy is held outside the module tree (not a submodule), so this module has no parameters, is not
    saved in checkpoints, and freezing or moving it never touches the policy.
    """

    def __init__(self, policy: nn.Module):
        super().__init__()
        if not has_adapters(policy):
            raise ConfigError("model.lora: the adapter-disabled reference needs a peft model with adapters")
        self._policy = (policy,)  # a tuple: not registered as a submodule

    @property
    def policy(self) -> nn.Module:
        return self._policy[0]

    def get_base_model(self) -> nn.Module:
        """The transformers model under the adapters, whose forward keywords this one passes on."""
        return self.policy.get_base_model()  # type: ignore[operator]  # a peft method

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ):
        """The policy's forward with the adapters off (same arguments and outputs as the policy)."""
        if logits_to_keep and accepts_argument(self.policy, "logits_to_keep"):
            kwargs["logits_to_keep"] = logits_to_keep
        with self.policy.disable_adapter():  # type: ignore[operator]  # peft method
            return self.policy(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=use_cache,
                output_hidden_states=output_hidden_states,
                **kwargs,
            )


def parameter_bytes(*modules: nn.Module) -> int:
    """Bytes of the distinct parameter storages of `modules` (shared weights counted once)."""
    seen: dict[int, int] = {}
    for module in modules:
        for p in module.parameters():
            seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


__all__ = [
    "LORA_DEFAULTS",
    "AdapterDisabledReference",
    "apply_lora",
    "has_adapters",
    "lora_config",
    "parameter_bytes",
]
