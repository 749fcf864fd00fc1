"""Models: loading, the actor-critic (policy head + value head on one backbone), frozen copies.

The one forward used for training and evaluation is `ActorCritic.forward`; it returns logits and values
on the (B, T) response grid only.
"""

from __future__ import annotations

import copy
import inspect
import os
import warnings
from typing import Any

from torch import Tensor, nn

from lit_rlhf.config import ConfigError
from lit_rlhf.losses import response_logits

BUILTIN_PREFIX = "builtin:"


def is_builtin(spec: Any) -> bool:
    return isinstance(spec, str) and spec.startswith(BUILTIN_PREFIX)


def _check_local_path(spec: str, field: str, needs: tuple[str, ...] = ()) -> None:
    """A spec that looks like a filesystem path must exist (hub ids like 'org/name' pass through); an existing
    folder must hold one of the files in `needs`."""
    looks_local = spec.startswith((".", "/", "~")) or os.sep + os.sep in spec or spec.endswith(os.sep)
    if looks_local and not os.path.exists(os.path.expanduser(spec)):
        raise ConfigError(
            f"{field}: the folder {spec!r} does not exist; give a local checkpoint folder or a model name"
        )
    folder = os.path.expanduser(spec)
    if needs and os.path.isdir(folder) and not any(os.path.exists(os.path.join(folder, n)) for n in needs):
        raise ConfigError(
            f"{field}: the folder {spec!r} holds none of {', '.join(needs)}; is it a folder written by "
            "save_pretrained?"
        )


MODEL_FILES = ("config.json", "adapter_config.json")  # a full model, or a PEFT adapter on a named base
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model")


def load_tokenizer(spec: Any, field: str = "tokenizer", trust_remote_code: bool = False):
    """A tokenizer from an instance, a 'builtin:<task>' name, or a folder/model name; left padding, pad set."""
    from transformers import AutoTokenizer

    if is_builtin(spec):
        from lit_rlhf.builtin import builtin_tokenizer

        tokenizer = builtin_tokenizer(spec[len(BUILTIN_PREFIX) :])
    elif isinstance(spec, str):
        _check_local_path(spec, field, TOKENIZER_FILES)
        tokenizer = AutoTokenizer.from_pretrained(spec, trust_remote_code=trust_remote_code)
    else:
        tokenizer = spec
    return prepare_tokenizer(tokenizer, field)


def prepare_tokenizer(tokenizer, field: str = "tokenizer"):
    """Left padding for prompts, and a pad token (EOS with a warning when the tokenizer has none)."""
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            f"{field}: the tokenizer has no EOS token, so responses cannot end; set tokenizer.eos_token first"
        )
    if tokenizer.pad_token_id is None:
        warnings.warn(
            f"{field}: the tokenizer has no pad token; using its EOS token {tokenizer.eos_token!r} as pad. "
            "Set tokenizer.pad_token yourself to silence this.",
            stacklevel=2,
        )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_causal_lm(spec: Any, field: str = "policy", trust_remote_code: bool = False, **kwargs) -> nn.Module:
    """A causal LM from an instance, a 'builtin:<task>' name, or a folder/model name."""
    from transformers import AutoModelForCausalLM

    if is_builtin(spec):
        from lit_rlhf.builtin import builtin_policy

        return builtin_policy(spec[len(BUILTIN_PREFIX) :])
    if isinstance(spec, str):
        _check_local_path(spec, field, MODEL_FILES)
        return AutoModelForCausalLM.from_pretrained(spec, trust_remote_code=trust_remote_code, **kwargs)
    if not isinstance(spec, nn.Module):
        raise ConfigError(f"{field}: expected a model name, a folder or a transformers model, got {type(spec)!r}")
    head = getattr(spec, "get_output_embeddings", None)
    if head is None or head() is None:
        raise ConfigError(
            f"{field}: {type(spec).__name__} has no language-model head (get_output_embeddings() gives None); "
            "give a causal LM, e.g. AutoModelForCausalLM.from_pretrained(...)"
        )
    return spec


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability to 0: sampling and the update must see the same policy."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode and no gradients, for the reference and reward models."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def frozen_copy(model: nn.Module) -> nn.Module:
    return freeze(copy.deepcopy(model))


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that ignore left padding: cumulative sum of the mask minus one, 0 on padding. (B, S)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _accepts(model: nn.Module, argument: str) -> bool:
    """Whether `model.forward` takes `argument`; a peft wrapper passes its **kwargs to the base model."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        model = get_base()
    return argument in inspect.signature(model.forward).parameters


def causal_lm_response_forward(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_len: int,
    want_hidden: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Logits predicting the last `response_len` tokens, and optionally the last hidden state there.

    input_ids, attention_mask (B, P+T) -> logits (B, T, V) in the model's dtype, hidden (B, T, H) or None.
    Only the T+1 last positions go through the LM head when the model supports `logits_to_keep`.
    """
    kwargs: dict[str, Any] = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        output_hidden_states=want_hidden,
    )
    if _accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = response_len + 1
    out = model(**kwargs)
    logits = out.logits
    kept_prompt = logits.shape[1] - response_len  # 1 when logits_to_keep worked, P otherwise
    logits = response_logits(logits, kept_prompt, response_len)
    hidden = None
    if want_hidden:
        last = out.hidden_states[-1]
        hidden = response_logits(last, last.shape[1] - response_len, response_len)
    return logits, hidden


class ActorCritic(nn.Module):
    """A causal LM policy with a scalar value head on the last hidden state.

    The value head shares the policy's backbone, or sits on a separate critic backbone when one is given.
    Without a value head, `forward` returns values None (GRPO).
    """

    def __init__(self, policy: nn.Module, value_head: bool = True, critic_backbone: nn.Module | None = None):
        super().__init__()
        self.policy = policy
        self.critic_backbone = critic_backbone
        self.value_head: nn.Linear | None = None
        if value_head or critic_backbone is not None:
            source = critic_backbone if critic_backbone is not None else policy
            hidden_size = source.get_output_embeddings().weight.shape[1]
            self.value_head = nn.Linear(hidden_size, 1)
            nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1) ** 0.5)
            nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, response_len: int) -> tuple[Tensor, Tensor | None]:
        """(B, P+T) -> logits (B, T, V), values (B, T) float32 or None."""
        shared = self.value_head is not None and self.critic_backbone is None
        logits, hidden = causal_lm_response_forward(
            self.policy, input_ids, attention_mask, response_len, want_hidden=shared
        )
        values = None
        if self.value_head is not None:
            if self.critic_backbone is not None:
                _, hidden = causal_lm_response_forward(
                    self.critic_backbone, input_ids, attention_mask, response_len, want_hidden=True
                )
            values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()
        return logits, values
