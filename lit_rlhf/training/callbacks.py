"""Lightning callbacks: `SavePolicy` writes the trained policy as a Hugging Face folder when `fit` ends;
`WritePredictions` writes what `trainer.predict` answers to a JSON-lines file.

    trainer = L.Trainer(callbacks=[SavePolicy("runs/grpo/policy")])

or in YAML:

    trainer:
      callbacks:
        - class_path: lit_rlhf.SavePolicy
          init_args: {folder: runs/grpo/policy}

or on the command line:

    python train.py predict --config run.yaml --ckpt_path last.ckpt \
        --trainer.callbacks+=lit_rlhf.WritePredictions --trainer.callbacks.path replies.jsonl
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning as L

from lit_rlhf.config import ConfigError
from lit_rlhf.models.export import ExportError, replace_problem, save_module_policy
from lit_rlhf.models.full_weights import is_sharded

SHARDING_STRATEGIES = ("FSDPStrategy",)
"""Strategies whose shards this callback cannot gather (FSDP2, `ModelParallelStrategy`, it can)."""


class SavePolicy(L.Callback):
    """A callback that exports the policy as a Hugging Face folder at the end of `fit`.

    It saves the module's policy, tokenizer and sampling settings (as the generation config) with
    `lit_rlhf.models.export.save_policy`, on global rank 0.

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


class WritePredictions(L.Callback):
    """A callback that writes the answers of `trainer.predict` to a JSON-lines file.

    Each row is {"prompt", "response", "score"} (see `RLHFModule.predict_step`), one JSON object per line, in the
    order of the predict prompts.

    Rows are appended to `<path>.partial` as each batch ends and the file becomes `path` when the loop ends, so
    `path` only ever holds a complete set: a crash or a signal leaves the rows so far in the `.partial` file and
    any earlier `path` as it was. With several processes each writes its own share, `replies.rank<N>.jsonl`. With
    no predict prompts Lightning skips the loop (and warns) and no file is written.

    Args:
        path: the JSON-lines file to write.
        overwrite: replace a `path` that exists (only once the new one is complete); without it `predict` stops
            at the start with an error naming the file, before anything is generated.
    """

    def __init__(self, path: str, overwrite: bool = False):
        self.path = path
        self.overwrite = overwrite
        self.target = path  # this process's file (set in setup)
        self.handle: Any = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "predict":
            return
        root, extension = os.path.splitext(self.path)
        self.target = f"{root}.rank{trainer.global_rank}{extension}" if trainer.world_size > 1 else self.path
        if os.path.lexists(self.target) and not self.overwrite:
            raise ConfigError(
                f"WritePredictions.path: {self.target!r} already exists; choose another path or set overwrite: "
                "true to replace it once the new predictions are complete"
            )

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.target)), exist_ok=True)
        self.handle = open(self.target + ".partial", "w")  # noqa: SIM115  closed when the loop ends or fails

    def on_predict_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        for row in outputs:
            self.handle.write(json.dumps(row) + "\n")
        self.handle.flush()

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.handle.close()
        self.handle = None
        os.replace(self.target + ".partial", self.target)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self.handle is not None:  # keep the rows so far in the .partial file
            self.handle.close()
            self.handle = None


__all__ = ["SavePolicy", "WritePredictions"]
