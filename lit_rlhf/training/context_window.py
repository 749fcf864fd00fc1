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

from lit_rlhf.config import ConfigError, SamplingConfig
from lit_rlhf.models.build import check_context_window


class ContextWindowCheck(L.LightningModule):
    """For a module with `actor_critic`, `reference`, `reward_model`, `sampling` and `val_sampling`."""

    actor_critic: Any
    sampling: SamplingConfig
    val_sampling: SamplingConfig

    def context_models(self) -> dict[str, Any]:
        """The models that read prompt + response token ids, by setting name."""
        models = {"model.policy": self.actor_critic.policy}
        reference = getattr(self, "reference", None)
        if reference is not None:
            models["model.reference"] = reference
        reward_model = getattr(self, "reward_model", None)
        if reward_model is not None and reward_model.tokenizer is None:  # a reward model with its own tokens re-reads
            models["model.reward_model"] = reward_model.model
        return models

    def on_fit_start(self) -> None:
        max_prompt_length = getattr(getattr(self.trainer, "datamodule", None), "max_prompt_length", None)
        if max_prompt_length is not None:
            new_tokens = {
                "model.sampling.max_new_tokens": self.sampling.max_new_tokens,
                "model.val_sampling.max_new_tokens": self.val_sampling.max_new_tokens,
            }
            try:
                check_context_window(self.context_models(), max_prompt_length, new_tokens)
            except ConfigError as err:
                warnings.warn(
                    f"{err} (only a prompt that long fails, with an error before it is sampled)", stacklevel=2
                )
        super().on_fit_start()

    def _check_batch(self, batch: Any, sampling_field: str, sampling: SamplingConfig) -> None:
        ids = getattr(batch, "input_ids", None)
        if ids is not None:
            new_tokens = {sampling_field: sampling.max_new_tokens}
            check_context_window(self.context_models(), ids.shape[-1], new_tokens, "this batch's prompt tokens")

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
