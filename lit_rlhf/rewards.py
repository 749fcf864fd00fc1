"""Rewards: Python reward functions and Hugging Face reward models, combined with weights into (B,) scores.

A reward function is any callable `fn(prompts: list[str], responses: list[str], **meta) -> sequence of B
numbers` (or a (B,) tensor); `meta` holds the extra dataset columns, one list of B values each.
In YAML, name it by dotted path: `lit_rlhf.builtin.sort_digits_reward`.
"""

from __future__ import annotations

import importlib
import math
import os
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from lit_rlhf.config import ConfigError
from lit_rlhf.losses import last_token_index
from lit_rlhf.models import position_ids_from_mask

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
        raise ConfigError(f"{field}: cannot import module {module_name!r} for {path!r} ({err}); "
                          "check the spelling and that it is on PYTHONPATH") from err
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"{field}: module {module_name!r} has no callable named {attr!r}")
    return fn


def resolve_reward_fns(fns: Sequence[str | RewardFn] | None) -> list[RewardFn]:
    return [import_callable(f) if isinstance(f, str) else f for f in (fns or [])]


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


class SequenceRewardModel(nn.Module):
    """A frozen `AutoModelForSequenceClassification` with one output, read at the last response token.

    When its tokenizer differs from the policy's, the texts are re-tokenised with its own tokenizer
    (right padded) and the score is read at the last real token.
    """

    def __init__(self, model: nn.Module, tokenizer: Any | None = None):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer  # None: shares the policy's token ids
        num_labels = getattr(getattr(model, "config", None), "num_labels", 1)
        if num_labels != 1:
            raise ConfigError(f"reward_model: expected a model with one output (num_labels=1), got {num_labels}")

    def _head(self) -> nn.Module:
        for name in ("score", "classifier"):
            head = getattr(self.model, name, None)
            if isinstance(head, nn.Module):
                return head
        raise ConfigError("reward_model: the model has no 'score' or 'classifier' head to read scores from")

    def score_ids(self, input_ids: Tensor, attention_mask: Tensor, last_index: Tensor) -> Tensor:
        """input_ids, attention_mask (B, S); last_index (B,) column to read -> (B,) float32."""
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        ).last_hidden_state  # (B, S, H)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        return self._head()(hidden[rows, last_index]).squeeze(-1).float()

    def score_texts(self, texts: list[str], device: torch.device) -> Tensor:
        """Re-tokenise full texts with the reward model's own tokenizer -> (B,) float32."""
        self.tokenizer.padding_side = "right"
        enc = self.tokenizer(texts, return_tensors="pt", padding=True).to(device)
        last = last_token_index(enc["attention_mask"].bool())
        return self.score_ids(enc["input_ids"], enc["attention_mask"], last)


class RewardComposer:
    """Weighted sum of reward functions and an optional reward model -> (B,) scores."""

    def __init__(
        self,
        reward_fns: Sequence[RewardFn] = (),
        weights: Sequence[float] | None = None,
        reward_model_weight: float = 1.0,
        nan_score: float | None = None,
    ):
        self.reward_fns = list(reward_fns)
        if weights is None:
            weights = [1.0] * len(self.reward_fns)
        if len(weights) != len(self.reward_fns):
            raise ConfigError(
                f"reward_weights: {len(weights)} weights for {len(self.reward_fns)} reward functions; "
                "give one weight per function"
            )
        self.weights = [float(w) for w in weights]
        self.reward_model_weight = reward_model_weight
        self.nan_score = nan_score

    def __call__(
        self,
        prompts: list[str],
        responses: list[str],
        meta: dict[str, list[Any]],
        reward_model: SequenceRewardModel | None = None,
        sequence_ids: Tensor | None = None,
        sequence_mask: Tensor | None = None,
        last_index: Tensor | None = None,
    ) -> Tensor:
        """(B,) float32 scores on CPU. The reward model reads `sequence_ids` at `last_index` when it
        shares the policy tokenizer, else the prompt+response texts."""
        total = torch.zeros(len(prompts), dtype=torch.float32)
        for fn, weight in zip(self.reward_fns, self.weights):
            total += weight * call_reward_fn(fn, prompts, responses, meta, self.nan_score)
        if reward_model is not None:
            if reward_model.tokenizer is None:
                rm_scores = reward_model.score_ids(sequence_ids, sequence_mask, last_index)
            else:
                texts = [p + r for p, r in zip(prompts, responses)]
                rm_scores = reward_model.score_texts(texts, sequence_ids.device)
            total += self.reward_model_weight * rm_scores.cpu()
        if not math.isfinite(float(total.sum())):
            raise RewardError("the combined reward is not finite; check the reward model's outputs")
        return total


def check_shared_tokenizer(reward_model: SequenceRewardModel, policy_tokenizer: Any, spec: Any = None) -> None:
    """A reward model without a tokenizer of its own reads the policy's token ids: fail clearly when its
    vocabulary cannot be the policy's (too small, or its folder holds a tokenizer with another vocabulary)."""
    if reward_model.tokenizer is not None or policy_tokenizer is None:
        return
    fix = ("Set model.reward_tokenizer to the reward model's tokenizer (for example its folder) so the texts are "
           "re-tokenised for it")
    vocab_size = getattr(getattr(reward_model.model, "config", None), "vocab_size", None)
    if vocab_size is not None and len(policy_tokenizer) > vocab_size:
        raise ConfigError(
            f"model.reward_tokenizer: the reward model knows {vocab_size} token ids but the policy's tokenizer has "
            f"{len(policy_tokenizer)}; they do not share token ids. {fix}"
        )
    if isinstance(spec, str) and os.path.isfile(os.path.join(spec, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        own = AutoTokenizer.from_pretrained(spec)
        if own.get_vocab() != policy_tokenizer.get_vocab():
            raise ConfigError(f"model.reward_tokenizer: the reward model's folder {spec!r} holds a tokenizer whose "
                              f"vocabulary differs from the policy's; {fix}")
