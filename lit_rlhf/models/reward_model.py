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
from lit_rlhf.models.forward import position_ids_from_mask
from lit_rlhf.models.loading import disable_dropout, freeze, load_sequence_classifier, load_tokenizer
from lit_rlhf.registry import get_task, is_builtin


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

    def score_texts(self, texts: list[str], finished: Tensor, device: torch.device) -> Tensor:
        """Re-tokenise full texts with the reward model's own tokenizer, its EOS after each `finished` (B,)
        text as in reward-model training (`with_eos`), right padded -> (B,) float32 read at the last token."""
        if self.tokenizer is None:
            raise ValueError(
                "SequenceRewardModel.score_texts: the reward model has no tokenizer of its own; "
                "score the policy's token ids with score_ids"
            )
        eos = self.tokenizer.eos_token_id
        rows = [
            with_eos(ids, eos) if done else list(ids)
            for ids, done in zip(self.tokenizer(texts)["input_ids"], finished.tolist(), strict=True)
        ]
        input_ids, attention_mask = right_padded(rows, self.tokenizer.pad_token_id)
        last = last_token_index(attention_mask.bool())
        return self.score_ids(input_ids.to(device), attention_mask.to(device), last.to(device))


def with_eos(ids: list[int], eos_token_id: int) -> list[int]:
    """`ids` ending with the EOS (appended unless already last): a reward model reads a finished text's
    score at its EOS, in training (`PairCollator`) and in PPO alike."""
    ids = list(ids)
    if not ids or ids[-1] != eos_token_id:
        ids.append(eos_token_id)
    return ids


def right_padded(rows: list[list[int]], pad_token_id: int) -> tuple[Tensor, Tensor]:
    """Token id lists -> input_ids, attention_mask (N, S), right padded with `pad_token_id`."""
    width = max(len(ids) for ids in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, ids in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, : len(ids)] = 1
    return input_ids, attention_mask


def check_shared_tokenizer(
    reward_model: SequenceRewardModel, policy_tokenizer: Any, spec: Any = None, policy_rows: int | None = None
) -> None:
    """A reward model without a tokenizer of its own reads the policy's token ids: fail clearly when its
    vocabulary cannot be the policy's (too small), when its own tokenizer (in its folder, in the hub cache, or
    its built-in task's) has another vocabulary or another EOS, where it reads its score, or, with no tokenizer
    to compare (an instance), when its vocabulary size is neither the policy tokenizer's nor the policy's
    embedding rows (`policy_rows`: a padded table)."""
    if reward_model.tokenizer is not None or policy_tokenizer is None or not hasattr(reward_model, "model"):
        return  # (a reward model of its own kind, `follows_reward_protocol`, is not checked here)
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
    own = reward_model_tokenizer(spec)
    if own is None:
        if vocab_size is not None and vocab_size not in (len(policy_tokenizer), policy_rows):
            rows = f" (the policy embeds {policy_rows})" if policy_rows is not None else ""
            raise ConfigError(
                f"model.reward_tokenizer: the reward model knows {vocab_size} token ids but the policy's tokenizer "
                f"has {len(policy_tokenizer)}{rows}: another vocabulary, whose ids cannot be assumed to be the "
                f"policy's. {fix}"
            )
        return
    if own.get_vocab() != policy_tokenizer.get_vocab():
        raise ConfigError(
            f"model.reward_tokenizer: the reward model {spec!r} holds a tokenizer whose vocabulary differs "
            f"from the policy's ({len(own)} vs {len(policy_tokenizer)} tokens); {fix}"
        )
    if own.eos_token_id != policy_tokenizer.eos_token_id:
        raise ConfigError(
            f"model.reward_tokenizer: the reward model {spec!r} reads its score at its EOS {own.eos_token!r} "
            f"(id {own.eos_token_id}), but the policy ends responses with {policy_tokenizer.eos_token!r} "
            f"(id {policy_tokenizer.eos_token_id}); {fix}"
        )


def reward_model_tokenizer(spec: Any) -> Any | None:
    """The tokenizer that comes with a reward model spec: a built-in task's, a folder's, or a hub id's when it
    is in the local cache (never downloaded); None for instances and specs without one."""
    if is_builtin(spec):
        return get_task(spec, "model.reward_model").tokenizer()
    if not isinstance(spec, str):
        return None
    from transformers import AutoTokenizer

    if os.path.isdir(spec):
        if os.path.isfile(os.path.join(spec, "tokenizer_config.json")):
            return AutoTokenizer.from_pretrained(spec)
        return None
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(spec, "tokenizer_config.json"), str):
        return None
    return AutoTokenizer.from_pretrained(spec, local_files_only=True)


def check_reward_tokenizer(model: nn.Module, reward_tokenizer: Any) -> None:
    """`model.reward_tokenizer` must not produce token ids the reward model cannot embed."""
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab_size is not None and len(reward_tokenizer) > vocab_size:
        raise ConfigError(
            f"model.reward_tokenizer: {len(reward_tokenizer)} tokens, but model.reward_model knows only {vocab_size} "
            "token ids; give the reward model's own tokenizer"
        )


REWARD_MODEL_PROTOCOL = (
    "a reward model instance must be a Hugging Face sequence classifier with one output "
    "(AutoModelForSequenceClassification, num_labels=1: a backbone under its base_model_prefix and a 'score' or "
    "'classifier' head), or an nn.Module with a method score_ids(input_ids, attention_mask, last_index) -> (B,) "
    "scores, reading the policy's token ids (B, S) at column last_index (B,) of each row"
)


def follows_reward_protocol(model: Any) -> bool:
    """A custom reward model: an `nn.Module` with `score_ids(input_ids, attention_mask, last_index)`."""
    return isinstance(model, nn.Module) and callable(getattr(model, "score_ids", None))


def check_reward_model_instance(spec: Any) -> None:
    """An `nn.Module` given as `reward_model` must be a one-output HF sequence classifier or follow the protocol
    (`REWARD_MODEL_PROTOCOL`); checked when the module is made, not at the first score."""
    if not isinstance(spec, nn.Module) or follows_reward_protocol(spec):
        return
    prefix = getattr(spec, "base_model_prefix", None)
    backbone = getattr(spec, prefix, None) if isinstance(prefix, str) and prefix else None
    head = next((h for n in ("score", "classifier") if isinstance(h := getattr(spec, n, None), nn.Module)), None)
    if not isinstance(backbone, nn.Module) or head is None:
        raise ConfigError(
            f"model.reward_model: {type(spec).__name__} is neither kind of reward model; {REWARD_MODEL_PROTOCOL}"
        )


def build_reward_model(spec: Any, tokenizer_spec: Any, trust_remote_code: bool) -> SequenceRewardModel:
    """A frozen `SequenceRewardModel` from a name, folder, instance or `SequenceRewardModel`; a module that follows
    the reward-model protocol (`score_ids`) is used as it is, on the policy's token ids."""
    if isinstance(spec, SequenceRewardModel):
        return freeze(spec)
    if follows_reward_protocol(spec):
        if tokenizer_spec is not None:
            raise ConfigError(
                "model.reward_tokenizer: a reward model with its own score_ids reads the policy's token ids; "
                "remove model.reward_tokenizer"
            )
        if not hasattr(spec, "tokenizer"):
            spec.tokenizer = None  # shares the policy's token ids
        return freeze(spec)  # duck-typed: score_ids is all the composer calls
    check_reward_model_instance(spec)
    model = load_sequence_classifier(spec, "model.reward_model", trust_remote_code)
    disable_dropout(model)
    reward_tokenizer = None
    if tokenizer_spec is not None:
        reward_tokenizer = load_tokenizer(tokenizer_spec, "model.reward_tokenizer", trust_remote_code)
        check_reward_tokenizer(model, reward_tokenizer)
    return freeze(SequenceRewardModel(model, reward_tokenizer))
