"""A Hugging Face sequence-classification reward model, read at the last response token.

`build_reward_model` loads it (the same loader reward-model training uses) and freezes it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

from lit_rlhf.algorithms.losses import last_token_index
from lit_rlhf.config import ConfigError
from lit_rlhf.models.actor_critic import position_ids_from_mask
from lit_rlhf.models.loading import disable_dropout, freeze, load_sequence_classifier, load_tokenizer


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
        backbone = getattr(self.model, self.model.base_model_prefix)  # type: ignore[call-overload]  # transformers
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
        if self.tokenizer is None:
            raise ValueError(
                "SequenceRewardModel.score_texts: the reward model has no tokenizer of its own; "
                "score the policy's token ids with score_ids"
            )
        self.tokenizer.padding_side = "right"
        enc = self.tokenizer(texts, return_tensors="pt", padding=True).to(device)
        last = last_token_index(enc["attention_mask"].bool())
        return self.score_ids(enc["input_ids"], enc["attention_mask"], last)


def check_shared_tokenizer(reward_model: SequenceRewardModel, policy_tokenizer: Any, spec: Any = None) -> None:
    """A reward model without a tokenizer of its own reads the policy's token ids: fail clearly when its
    vocabulary cannot be the policy's (too small, or its folder holds a tokenizer with another vocabulary)."""
    if reward_model.tokenizer is not None or policy_tokenizer is None:
        return
    fix = (
        "Set model.reward_tokenizer to the reward model's tokenizer (for example its folder) so the texts are "
        "re-tokenised for it"
    )
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
            raise ConfigError(
                f"model.reward_tokenizer: the reward model's folder {spec!r} holds a tokenizer whose "
                f"vocabulary differs from the policy's; {fix}"
            )


def build_reward_model(spec: Any, tokenizer_spec: Any, trust_remote_code: bool) -> SequenceRewardModel:
    """A frozen `SequenceRewardModel` from a name, folder, instance or `SequenceRewardModel`."""
    if isinstance(spec, SequenceRewardModel):
        return freeze(spec)
    model = load_sequence_classifier(spec, "model.reward_model", trust_remote_code)
    disable_dropout(model)
    reward_tokenizer = None
    if tokenizer_spec is not None:
        reward_tokenizer = load_tokenizer(tokenizer_spec, "model.reward_tokenizer", trust_remote_code)
    return freeze(SequenceRewardModel(model, reward_tokenizer))
