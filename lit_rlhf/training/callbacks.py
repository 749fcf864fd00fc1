"""Lightning callbacks: `SavePolicy` writes the trained policy as a Hugging Face folder when `fit` ends.

    trainer = L.Trainer(callbacks=[SavePolicy("runs/grpo/policy")])

or in YAML:

    trainer:
      callbacks:
        - class_path: lit_rlhf.SavePolicy
          init_args: {folder: runs/grpo/policy}
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L

from lit_rlhf.models.export import ExportError, replace_problem, save_module_policy
from lit_rlhf.models.full_weights import is_sharded

SHARDING_STRATEGIES = ("FSDPStrategy",)
"""Strategies whose shards this callback cannot gather (FSDP2, `ModelParallelStrategy`, it can)."""


class SavePolicy(L.Callback):
    """Save the module's policy, tokenizer and sampling settings (as the generation config) with
    `lit_rlhf.models.export.save_policy` at the end of `fit`, on global rank 0.

    Args:
        folder: the Hugging Face folder to write (`AutoModelForCausalLM.from_pretrained(folder)` loads it).
        merge_lora: for a LoRA policy, a plain model with the adapters merged in (True) or only the adapters.
        every_n_epochs: also write it (to the same folder, replacing the last one) every this many epochs.
        overwrite: replace a folder that exists before training starts, when it holds a previous export or only
            Hugging Face model/tokenizer files (anything else, such as a run folder, stops `fit` at the start with
            an error naming what is inside); without it `fit` stops at the start with an error naming the folder,
            not after training. Folders this callback wrote in the same run are
            always replaced.
    """

    def __init__(
        self, folder: str, merge_lora: bool = True, every_n_epochs: int | None = None, overwrite: bool = False
    ):
        if every_n_epochs is not None and every_n_epochs < 1:
            raise ExportError(f"SavePolicy.every_n_epochs: must be >= 1 (or None), got {every_n_epochs}")
        self.folder = folder
        self.merge_lora = merge_lora
        self.every_n_epochs = every_n_epochs
        self.overwrite = overwrite
        self.saved = 0  # exports written by this callback in this process
        self.saved_at_step = -1  # the global step of the last one

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        sharded = type(strategy).__name__ in SHARDING_STRATEGIES or getattr(strategy, "zero_stage_3", False)
        if sharded:
            raise ExportError(
                f"SavePolicy({self.folder!r}): the {type(strategy).__name__} strategy shards the policy's weights, "
                "so no single process holds them; save a full checkpoint and export it with lit-rlhf-export"
            )
        exists = trainer.strategy.broadcast(trainer.is_global_zero and os.path.lexists(self.folder), src=0)
        if exists and not self.overwrite and not self.saved:  # every rank stops alike
            raise ExportError(
                f"SavePolicy: the folder {self.folder!r} already exists; choose another folder or set "
                "overwrite: true to replace it at the end of training"
            )
        problem = replace_problem(self.folder) if exists and trainer.is_global_zero and not self.saved else None
        problem = trainer.strategy.broadcast(problem, src=0)
        if problem is not None:  # found before training, not after it
            raise ExportError(
                f"SavePolicy: overwrite: true would replace {self.folder!r}, but {problem}; it replaces only a "
                "previous export or a folder of Hugging Face model/tokenizer files. Choose another folder"
            )

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.save(trainer, pl_module)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save(trainer, pl_module)

    def save(self, trainer: L.Trainer, pl_module: Any) -> str | None:
        """Write the folder on global rank 0; returns its path there (None on other ranks). Under FSDP2 every
        rank takes part in gathering the policy."""
        if self.saved_at_step == trainer.global_step:  # this policy is saved already
            return None
        if not trainer.is_global_zero and not is_sharded(pl_module.actor_critic.policy):
            return None
        path = save_module_policy(pl_module, self.folder, self.merge_lora, overwrite=self.overwrite or self.saved > 0)
        self.saved, self.saved_at_step = self.saved + 1, trainer.global_step  # on every rank alike
        return path


__all__ = ["SavePolicy"]
