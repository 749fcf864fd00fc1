"""Every model an `RLHFModule` holds, built from its settings: the actor-critic (with LoRA, gradient
checkpointing, an optional separate critic), the frozen reference, and the frozen reward model."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from lit_rlhf.config import AlgorithmConfig, ConfigError
from lit_rlhf.models.actor_critic import ActorCritic
from lit_rlhf.models.loading import disable_dropout, freeze, frozen_copy, load_causal_lm
from lit_rlhf.models.lora import AdapterDisabledReference, apply_lora, has_adapters
from lit_rlhf.models.portable import is_portable, portable_spec
from lit_rlhf.models.reward_model import (
    SequenceRewardModel,
    build_reward_model,
    check_reward_model_instance,
    check_shared_tokenizer,
)
from lit_rlhf.models.vocabulary import mask_padded_vocabulary
from lit_rlhf.registry import is_builtin

MODEL_ARGUMENTS = ("policy", "tokenizer", "reference", "reward_model", "reward_tokenizer")
# the keyword settings of `build_models`, as RLHFModule arguments of the same names
BUILD_OPTIONS = ("lora", "separate_critic", "gradient_checkpointing", "trust_remote_code")


@dataclass
class ModelSpecs:
    """What the user gave for each model: a name, a folder, 'builtin:<task>', an instance, or None."""

    policy: Any
    tokenizer: Any = None
    reference: Any = None
    reward_model: Any = None
    reward_tokenizer: Any = None

    def __post_init__(self) -> None:
        if self.policy is None:
            raise ConfigError(
                "model.policy: none given. A checkpoint of a module built from a model instance without a "
                "transformers config cannot rebuild it: pass policy=<the model or its folder> to load_from_checkpoint"
            )
        check_reward_model_instance(self.reward_model)  # a custom module: the right kind, before anything loads
        for key in ("policy", "reference"):
            check_not_compiled(getattr(self, key), f"model.{key}")

    def names(self) -> dict[str, str | None]:
        """Hyperparameters: each spec that is a name, else None (instances and portable specs are not
        hyperparameters; checkpoints carry `portable()` instead)."""
        return {k: v if isinstance(v := getattr(self, k), str) else None for k in MODEL_ARGUMENTS}

    def portable(self) -> dict[str, Any]:
        """For each spec given as an instance, what a checkpoint needs to rebuild it (`models.portable`)."""
        out = {}
        for key in MODEL_ARGUMENTS:
            value = getattr(self, key)
            spec = value if is_portable(value) or value is None or isinstance(value, str) else portable_spec(value)
            if isinstance(spec, dict):
                out[key] = spec
        return out

    def rebuildable_prefixes(self, has_reference: bool, has_reward_model: bool) -> tuple[str, ...]:
        """State-dict prefixes of the frozen models that are reloaded from their source, so checkpoints need
        not carry them: a reference or reward model named by a folder or hub id."""
        named = isinstance(self.policy, str) and not is_builtin(self.policy)
        prefixes = []
        if has_reference and (
            (self.reference is None and named) or (isinstance(self.reference, str) and not is_builtin(self.reference))
        ):
            prefixes.append("reference.")
        if has_reward_model and isinstance(self.reward_model, str):
            prefixes.append("reward_model.")
        return tuple(prefixes)


def check_not_compiled(model: Any, field: str) -> None:
    """A `torch.compile`d model is refused: it recompiles for every new shape (each decode step's cache length,
    the update's and the reference's widths), so a CPU step takes minutes; `sampling.backend: compiled` compiles
    the decode loop over static, bucketed shapes instead."""
    if isinstance(model, nn.Module) and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        raise ConfigError(
            f"{field}: a torch.compile'd model (OptimizedModule) is recompiled for every new shape it meets (each "
            "decode step's cache length, the update's and the reference's widths): two GRPO steps of a tiny model "
            f"took minutes instead of half a second. Pass the model itself ({field.split('.')[-1]}._orig_mod) and set "
            "sampling.backend: compiled, which compiles the decode loop over static, bucketed shapes"
        )


@dataclass
class Models:
    actor_critic: ActorCritic
    reference: nn.Module | None
    reward_model: SequenceRewardModel | None


def build_models(
    specs: ModelSpecs,
    tokenizer: Any,
    algo: AlgorithmConfig,
    lora: dict[str, Any] | None = None,
    separate_critic: bool = False,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    load_model: Callable[[Any, str, bool], nn.Module] = load_causal_lm,
) -> Models:
    """`load_model(spec, field, trust_remote_code)` loads the policy and a named reference (under FSDP2: rank 0
    alone, `training.rank0_weights`)."""
    policy = load_model(specs.policy, "model.policy", trust_remote_code)
    rows = getattr(getattr(policy, "get_input_embeddings", lambda: None)(), "num_embeddings", None)
    if rows is not None and len(tokenizer) > rows:  # token ids past the table fail deep in a forward
        raise ConfigError(
            f"model.tokenizer: {len(tokenizer)} tokens, but model.policy embeds only {rows}; "
            "use the policy's own tokenizer (or resize the policy's token embeddings)"
        )
    disable_dropout(policy)
    mask_padded_vocabulary(policy, len(tokenizer))  # ids the tokenizer cannot decode are never sampled
    adapters = check_peft_policy(policy, lora)
    if gradient_checkpointing:
        policy.gradient_checkpointing_enable()  # type: ignore[operator]  # transformers method
    if lora is not None:
        policy = apply_lora(policy, lora)
    critic_backbone = copy.deepcopy(policy) if algo.uses_critic and separate_critic else None
    actor_critic = ActorCritic(policy, algo.uses_critic, critic_backbone, algo.share_prompt_forward, algo.length_groups)
    reference: nn.Module | None = None
    if algo.uses_reference:
        if specs.reference is None and adapters:
            reference = AdapterDisabledReference(policy)
        elif specs.reference is None:
            reference = frozen_copy(policy)
        else:
            reference = freeze(load_model(specs.reference, "model.reference", trust_remote_code))
            disable_dropout(reference)
            mask_padded_vocabulary(reference, len(tokenizer))
    reward_model = None
    if specs.reward_model is not None:
        reward_model = build_reward_model(specs.reward_model, specs.reward_tokenizer, trust_remote_code)
        check_shared_tokenizer(reward_model, tokenizer, specs.reward_model, rows)
    return Models(actor_critic, reference, reward_model)


def check_peft_policy(policy: nn.Module, lora: dict[str, Any] | None) -> bool:
    """Whether the policy trains adapters: `lora` settings, or a peft model given as the policy (whose adapters,
    and only they, train; its reference is then the same weights with the adapters disabled)."""
    if not has_adapters(policy):
        return lora is not None
    if lora is not None:
        raise ConfigError(
            "model.lora: the policy is already a peft model with adapters; remove model.lora (its adapters train) "
            "or give the base model with model.lora"
        )
    if not any(p.requires_grad for p in policy.parameters()):
        raise ConfigError(
            "model.policy: the peft model's adapters are frozen (PeftModel.from_pretrained loads them for "
            "inference); load it with is_trainable=True, or give the base model with model.lora"
        )
    return True


# the config fields that give a model's longest sequence (learned position tables index past their end)
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def context_window(model: Any) -> tuple[str, int] | None:
    """The longest sequence `model` takes and the config field that says so (None: its config does not say)."""
    config = getattr(model, "config", None)
    for field in CONTEXT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return field, value
    return None


def check_context_window(
    models: dict[str, Any],
    prompt_length: int,
    max_new_tokens: dict[str, int],
    prompt_label: str = "data.max_prompt_length",
) -> None:
    """Raise if `prompt_length` prompt tokens plus the longest response overflow a model's context window.

    `models`: field name -> model (e.g. {"model.policy": policy}); `max_new_tokens`: sampling field -> its value;
    `prompt_label`: what `prompt_length` is, for the message. A sequence past the window fails deep in a forward
    (`IndexError: index out of range` in the position table).
    """
    for model_field, model in models.items():
        window = context_window(model)
        if window is None:
            continue
        config_field, limit = window
        for sampling_field, new_tokens in max_new_tokens.items():
            total = prompt_length + new_tokens
            if total > limit:
                raise ConfigError(
                    f"{prompt_label} + {sampling_field}: {prompt_length} + {new_tokens} = {total} tokens, "
                    f"but {model_field} takes at most {limit} ({config_field} in its config); lower "
                    f"data.max_prompt_length or {sampling_field} so that they sum to {limit} or less"
                )
