"""Reward-model training on preference pairs with the pairwise (Bradley-Terry) loss.

`RewardModelModule` trains an `AutoModelForSequenceClassification` with one output; the score of a text is
read at its last non-pad token (the same `SequenceRewardModel.score_ids` that PPO uses), so what is trained is
what PPO reads. `PreferenceDataModule` reads JSONL rows `{"prompt", "chosen", "rejected"}` (or makes a
built-in task's set in memory, e.g. `builtin:digits`). At the end of `fit` the model and tokenizer are written with
`save_pretrained` to `save_dir`, the folder a PPO config then names: `model.reward_model: <save_dir>`.

    lit-rlhf-reward fit --config configs/reward_model.yaml
    python train.py fit --config configs/ppo_reward_model.yaml

End of sequence: by default an EOS token is appended to every `prompt + response`, because PPO reads the
score at the last response token, which is the EOS for a response that ended (docs/design.md).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAccuracy

from lit_rlhf.algorithms.losses import last_token_index
from lit_rlhf.config import ConfigError
from lit_rlhf.data.sources import jsonl_objects
from lit_rlhf.models.loading import data_tokenizer, load_sequence_classifier, load_tokenizer
from lit_rlhf.models.reward_model import SequenceRewardModel, right_padded, with_eos
from lit_rlhf.registry import get_task, is_builtin
from lit_rlhf.training.optim import warmup_then_decay

PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")
# A built-in validation set draws from a different stream, so held-out pairs are not the training pairs.
HELD_OUT_SEED_OFFSET = 1_000_003


def bradley_terry_loss(chosen: Tensor, rejected: Tensor) -> Tensor:
    """Mean of -log sigmoid(r_chosen - r_rejected): (N,), (N,) -> scalar."""
    return -F.logsigmoid(chosen.float() - rejected.float()).mean()


# ----------------------------------------------------------------------------- data


def read_preference_file(path: str, field: str = "data.train") -> list[dict[str, str]]:
    """Rows of a JSONL file, each an object with string fields prompt, chosen and rejected."""
    if not os.path.isfile(path):
        raise ConfigError(f"{field}: the preference file {path!r} does not exist")
    rows: list[dict[str, str]] = []
    for line_number, row in jsonl_objects(path, field):
        if not isinstance(row, dict):
            raise ConfigError(f"{field}: {path}:{line_number} is not a JSON object with {PREFERENCE_FIELDS}")
        for name in PREFERENCE_FIELDS:
            if name not in row:
                raise ConfigError(
                    f"{field}: {path}:{line_number} has no field {name!r}; every line needs "
                    f"{', '.join(PREFERENCE_FIELDS)}"
                )
            if not isinstance(row[name], str):
                raise ConfigError(
                    f"{field}: {path}:{line_number} field {name!r} must be a string, got {type(row[name]).__name__}"
                )
        rows.append({name: row[name] for name in PREFERENCE_FIELDS})
    if not rows:
        raise ConfigError(f"{field}: the preference file {path!r} holds no pairs")
    return rows


def load_preferences(source: str | list, field: str, count: int, seed: int) -> list[dict[str, str]]:
    """Rows from 'builtin:<task>' (`count` generated pairs from `seed`), a .jsonl file, or a list of dicts."""
    if is_builtin(source):
        make_pairs = get_task(source, field).preference_pairs
        if make_pairs is None:
            raise ConfigError(f"{field}: the built-in task {source!r} has no preference pairs")
        return make_pairs(count, seed)
    if isinstance(source, str):
        return read_preference_file(source, field)
    rows = list(source)
    for i, row in enumerate(rows):
        missing = [name for name in PREFERENCE_FIELDS if not isinstance(row.get(name), str)]
        if missing:
            raise ConfigError(f"{field}: row {i} has no string field(s) {missing}")
    if not rows:
        raise ConfigError(f"{field}: the preference list is empty")
    return rows


class PairCollator:
    """Rows -> one right-padded batch holding the N chosen texts, then the N rejected ones.

    Returns input_ids, attention_mask (2N, S) and last_index (2N,): the column of each text's last token.
    """

    def __init__(self, tokenizer: Any, max_length: int, append_eos: bool = True):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.append_eos = append_eos
        self._warned = False

    def encode(self, ids: list[int]) -> list[int]:
        ids = with_eos(ids, self.tokenizer.eos_token_id) if self.append_eos else list(ids)
        if len(ids) > self.max_length:
            if not self._warned:
                warnings.warn(
                    f"data.max_length: preference texts longer than {self.max_length} tokens are cut from the left "
                    "(the end, where the score is read, is kept)",
                    stacklevel=2,
                )
                self._warned = True
            ids = ids[-self.max_length :]
        return ids

    def __call__(self, rows: list[dict[str, str]]) -> dict[str, Tensor]:
        texts = [r["prompt"] + r["chosen"] for r in rows] + [r["prompt"] + r["rejected"] for r in rows]
        encoded = [self.encode(ids) for ids in self.tokenizer(texts)["input_ids"]]
        input_ids, attention_mask = right_padded(encoded, self.tokenizer.pad_token_id)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "last_index": last_token_index(attention_mask.bool()),
        }


class PreferenceDataModule(L.LightningDataModule):
    """Preference pairs for `RewardModelModule`.

    Args:
        train: 'builtin:digits' (pairs generated and labelled by a rule, see `lit_rlhf.tasks.digits`),
            or a .jsonl file of {"prompt", "chosen", "rejected"} rows.
        val: held-out pairs, same forms; None: no validation.
        batch_size: pairs per step (each step scores 2 x batch_size texts).
        max_length: token limit of prompt + response (+ EOS); longer texts lose their start, with a warning.
        append_eos: end every text with the tokenizer's EOS (PPO reads the score at the response's EOS).
        tokenizer: defaults to the module's tokenizer.
        num_builtin_train: pairs in the built-in training set.
        num_builtin_val: pairs in the built-in held-out set.
        seed: the built-in sets' seed (the held-out set uses a different stream) and the shuffling order.
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        train: str | list = "builtin:digits",
        val: str | list | None = None,
        batch_size: int = 32,
        max_length: int = 512,
        append_eos: bool = True,
        tokenizer: Any = None,
        num_builtin_train: int = 4000,
        num_builtin_val: int = 500,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"data.batch_size: must be >= 1, got {batch_size}")
        if max_length < 2:
            raise ConfigError(f"data.max_length: must be >= 2, got {max_length}")
        self.batch_size, self.max_length, self.append_eos = batch_size, max_length, append_eos
        self.tokenizer, self.seed, self.num_workers = tokenizer, seed, num_workers
        # read (and check) the files now, before any model is loaded
        self.train_rows = load_preferences(train, "data.train", num_builtin_train, seed)
        self.val_rows = (
            None if val is None else load_preferences(val, "data.val", num_builtin_val, seed + HELD_OUT_SEED_OFFSET)
        )

    def setup(self, stage: str) -> None:
        tokenizer = data_tokenizer(self.tokenizer, self.trainer)
        self.collate = PairCollator(tokenizer, self.max_length, self.append_eos)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        # a list is a map-style dataset; torch annotates the argument as Dataset
        return DataLoader(
            self.train_rows,  # type: ignore[arg-type]
            batch_size=self.batch_size,
            shuffle=True,
            collate_fn=self.collate,
            generator=generator,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_rows is None:
            return []
        return DataLoader(
            self.val_rows,  # type: ignore[arg-type]
            batch_size=self.batch_size,
            shuffle=False,
            collate_fn=self.collate,
            num_workers=self.num_workers,
        )


# ----------------------------------------------------------------------------- model


class RewardModelModule(L.LightningModule):
    """Trains a sequence-classification reward model on preference pairs (Bradley-Terry loss).

    Args:
        model: 'builtin:digits' (a from-scratch tiny GPT-2 classifier), a folder or model name loaded with
            `AutoModelForSequenceClassification.from_pretrained(num_labels=1)` (a causal LM checkpoint gets a
            new, randomly initialised score head), or an instance with one output.
        tokenizer: name, folder or instance; defaults to `model`'s.
        lr: AdamW's learning rate over the trainable parameters.
        weight_decay: AdamW's weight decay.
        betas: AdamW's betas.
        warmup_steps: linear warm-up of the learning rate.
        save_dir: folder for `save_pretrained` of the model and tokenizer at the end of fit (None: no save).
            Name it in a PPO config as `model.reward_model`.
        gradient_checkpointing: recompute activations in backward to save memory.
        trust_remote_code: allow model code from the model folder.

    Logged: train/loss, train/accuracy (chosen scored above rejected), train/margin (mean r_chosen - r_rejected),
    and val/loss, val/accuracy, val/margin per validation run.
    """

    def __init__(
        self,
        model: Any = "builtin:digits",
        tokenizer: Any = None,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        save_dir: str | None = "models/reward_model",
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
    ):
        super().__init__()
        if lr <= 0:
            raise ConfigError(f"model.lr: must be > 0, got {lr}")
        if warmup_steps < 0:
            raise ConfigError(f"model.warmup_steps: must be >= 0, got {warmup_steps}")
        self.save_hyperparameters(ignore=["model", "tokenizer"])
        self.hparams.update(
            {k: v for k, v in dict(model=model, tokenizer=tokenizer).items() if v is None or isinstance(v, str)}
        )
        self._model_spec = model
        if len(betas) != 2:
            raise ConfigError(f"model.betas: expected two numbers (beta1, beta2), got {betas!r}")
        self.lr, self.weight_decay, self.warmup_steps = lr, weight_decay, warmup_steps
        self.betas = (betas[0], betas[1])
        self.save_dir = save_dir
        self.gradient_checkpointing = gradient_checkpointing
        self.trust_remote_code = trust_remote_code
        if tokenizer is None and not isinstance(model, str):
            raise ConfigError("model.tokenizer: the model was given as an instance; pass its tokenizer too")
        self.tokenizer = load_tokenizer(
            tokenizer if tokenizer is not None else model, "model.tokenizer", trust_remote_code
        )
        self.scorer: SequenceRewardModel | None = None
        self.train_accuracy, self.val_accuracy = BinaryAccuracy(), BinaryAccuracy()
        self.train_margin, self.val_margin = MeanMetric(), MeanMetric()
        if not isinstance(model, str):
            self.configure_model()

    def configure_model(self) -> None:
        if self.scorer is not None:
            return
        model = load_sequence_classifier(self._model_spec, "model.model", self.trust_remote_code)
        # `config` and `gradient_checkpointing_enable` are transformers', typed Tensor | Module by nn.Module
        if getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = self.tokenizer.pad_token_id  # type: ignore[union-attr]
        if self.gradient_checkpointing:
            model.gradient_checkpointing_enable()  # type: ignore[operator]
        self.scorer = SequenceRewardModel(model)  # raises unless num_labels == 1

    def _built_scorer(self) -> SequenceRewardModel:
        if self.scorer is None:
            raise RuntimeError(
                "RewardModelModule: the model is not built yet; configure_model() builds it (Trainer.fit calls it)"
            )
        return self.scorer

    @property
    def model(self) -> nn.Module:
        return self._built_scorer().model

    def forward(self, input_ids: Tensor, attention_mask: Tensor, last_index: Tensor) -> Tensor:
        """(B, S) ids and mask, (B,) last-token columns -> (B,) float32 scores."""
        return self._built_scorer().score_ids(input_ids, attention_mask, last_index)

    def _step(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        scores = self(batch["input_ids"], batch["attention_mask"], batch["last_index"])  # (2N,)
        chosen, rejected = scores.chunk(2)
        return bradley_terry_loss(chosen, rejected), (chosen - rejected).detach()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, margin = self._step(batch)
        self.train_accuracy(margin > 0, torch.ones_like(margin, dtype=torch.long))
        self.train_margin(margin)
        n = margin.shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=n)
        self.log("train/accuracy", self.train_accuracy, prog_bar=True, batch_size=n)
        self.log("train/margin", self.train_margin, batch_size=n)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, margin = self._step(batch)
        self.val_accuracy(margin > 0, torch.ones_like(margin, dtype=torch.long))
        self.val_margin(margin)
        n = margin.shape[0]
        self.log("val/loss", loss, prog_bar=True, batch_size=n, sync_dist=True)
        self.log("val/accuracy", self.val_accuracy, prog_bar=True, batch_size=n)
        self.log("val/margin", self.val_margin, batch_size=n)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)
        if not self.warmup_steps:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay("constant", self.warmup_steps, None))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def save(self, folder: str) -> None:
        """`save_pretrained` of the model and tokenizer: a folder `RLHFModule(reward_model=folder)` loads."""
        os.makedirs(folder, exist_ok=True)
        self.model.save_pretrained(folder)  # type: ignore[operator]  # transformers method
        self.tokenizer.save_pretrained(folder)

    def on_fit_end(self) -> None:
        if self.save_dir and self.trainer.is_global_zero:
            self.save(self.save_dir)
