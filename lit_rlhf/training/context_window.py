"""Prompts plus responses must fit the models' context window (`models.build.check_context_window`).

A sequence longer than a learned position table fails deep in a forward with `IndexError: index out of range`.
`ContextWindowCheck` checks it at two points, once the models are loaded:

- when `fit` starts: if `data.max_prompt_length` plus `max_new_tokens` overflows the window, a warning says which
  prompt length would fail (the limit is an upper bound: most prompt sets stay far below it, so this alone does
  not refuse a run that works);
- before each batch is sampled (training, validation, test, predict): this batch's prompt width plus
  `max_new_tokens` must fit, else a `ConfigError` names both settings, the sum, the window and the fix.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
from torch import nn

from lit_rlhf.config import ConfigError, SamplingConfig
from lit_rlhf.data.handoff import PromptSupply
from lit_rlhf.models.build import check_context_window
from lit_rlhf.models.reward_model import SequenceRewardModel
from lit_rlhf.rollout.multi_turn import Conversations
from lit_rlhf.types import PromptBatch


class ContextWindowCheck(L.LightningModule):
    """For a module with the models, the sampling settings, the environment and the DataModule's supply."""

    actor_critic: Any
    reference: nn.Module | None
    reward_model: SequenceRewardModel | None
    sampling: SamplingConfig
    val_sampling: SamplingConfig
    conversations: Conversations | None
    prompt_supply: PromptSupply | None

    def context_models(self) -> dict[str, Any]:
        """The models that read prompt + response token ids, by setting name."""
        models = {"model.policy": self.actor_critic.policy}
        if self.reference is not None:
            models["model.reference"] = self.reference
        reward_model = self.reward_model
        if reward_model is not None and reward_model.tokenizer is None:  # a reward model with its own tokens re-reads
            models["model.reward_model"] = getattr(reward_model, "model", reward_model)  # (a protocol model: itself)
        return models

    def response_budgets(self, field: str, sampling: SamplingConfig) -> dict[str, int]:
        """The longest response in tokens, by the setting that limits it: `field` (a sampling setting's
        max_new_tokens), and with an environment the whole conversation's budget."""
        budgets = {field: sampling.max_new_tokens}
        if self.conversations is not None:
            budgets[self.conversations.budget] = self.conversations.max_total_tokens
        return budgets

    def on_fit_start(self) -> None:
        if self.prompt_supply is not None:
            new_tokens = {
                **self.response_budgets("model.sampling.max_new_tokens", self.sampling),
                **self.response_budgets("model.val_sampling.max_new_tokens", self.val_sampling),
            }
            try:
                check_context_window(self.context_models(), self.prompt_supply.max_prompt_length, new_tokens)
            except ConfigError as err:
                warnings.warn(
                    f"{err} (only a prompt that long fails, with an error before it is sampled)", stacklevel=2
                )
        super().on_fit_start()

    def _check_batch(self, batch: Any, sampling_field: str, sampling: SamplingConfig) -> None:
        if isinstance(batch, PromptBatch):
            new_tokens = self.response_budgets(sampling_field, sampling)
            check_context_window(
                self.context_models(), batch.input_ids.shape[-1], new_tokens, "this batch's prompt tokens"
            )

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        self._check_batch(batch, "model.sampling.max_new_tokens", self.sampling)
        return super().on_train_batch_start(batch, batch_idx)

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._check_batch(batch, "model.val_sampling.max_new_tokens", self.val_sampling)
        super().on_validation_batch_start(batch, batch_idx, dataloader_idx)

    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._check_batch(batch, "model.val_sampling.max_new_tokens", self.val_sampling)
        super().on_test_batch_start(batch, batch_idx, dataloader_idx)

    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._check_batch(batch, "model.val_sampling.max_new_tokens", self.val_sampling)
        super().on_predict_batch_start(batch, batch_idx, dataloader_idx)
