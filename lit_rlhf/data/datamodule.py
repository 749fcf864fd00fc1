"""`RolloutDataModule`: owns the prompts and hands `training_step` one `PromptBatch` per rollout, and the
validation, test and predict loops their held-out prompts.

The module generates each rollout inside `training_step`, from the policy as it is after the previous update,
so Lightning may prefetch prompt batches freely. For an exact resume the saved position is that of the last
batch that reached `training_step` (`on_before_batch_transfer`), not of the last one prefetched; a checkpoint
written while that step still runs (an exception inside it) saves the position before its batch, so a resume
trains it again (`training_step_running`; `lit_rlhf.training.step_boundary` does the same for the counters).

`Trainer(overfit_batches=n)` pins the training batches: every epoch yields the first epoch's first batches again.

Epochs: one `iter()` over the training iterable is one epoch. Over a finite prompt set an epoch is one pass
(this rank's share, reshuffled each pass; a tail smaller than `batch_size` is dropped); over a `builtin:<task>`
stream it is `rollouts_per_epoch` batches (100 by default). Given `rollouts_per_epoch`, an epoch is that many
batches of either kind of source, passes end to end.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import random
from collections.abc import Callable, Iterator
from typing import Any, Literal

import lightning as L

from lit_rlhf.config import ConfigError, check_choice, refuses_trl_names
from lit_rlhf.data.handoff import PromptNeeds, PromptSupply, training_step_running
from lit_rlhf.data.prompts import PromptTokenizer
from lit_rlhf.data.sources import PromptStream, builtin_rows, load_prompt_rows, prompt_key
from lit_rlhf.models.loading import load_tokenizer
from lit_rlhf.registry import get_task, is_builtin
from lit_rlhf.rewards.columns import check_columns
from lit_rlhf.types import PromptBatch

PromptTruncation = Literal["error", "left"]
SpecialTokensInPrompts = Literal["error", "text", "parse"]

BUILTIN_ROLLOUTS_PER_EPOCH = 100
"""Batches per epoch over an endless `builtin:<task>` stream when `rollouts_per_epoch` is not given."""

HELD_OUT_SEEDS = {"data.val_prompts": 1_000_001, "data.test_prompts": 1_000_002, "data.predict_prompts": 1_000_003}
"""Seeds of the `builtin:<task>` streams that held-out prompt sets are drawn from: fixed, not `data.seed`, so runs
with different seeds are compared on the same prompts, and different from any training seed in the configs."""

SPLIT_FIELDS = {
    "data.prompts": "prompt_split",
    "data.val_prompts": "val_split",
    "data.test_prompts": "test_split",
    "data.predict_prompts": "predict_split",
}
"""The setting that picks the split of a `datasets.DatasetDict` given as each prompt setting."""

REFILL_SEED_OFFSET = 7_000_003
"""Dynamic sampling's refill stream is the training prompts in a second order, drawn with `seed` + this (a
different order for a shuffled set or a built-in task; the file order again for an unshuffled file)."""

VAL_SPLIT_SALT = "lit_rlhf.val_split"
"""The split by a fraction `val_prompts` shuffles with random.Random(f"{VAL_SPLIT_SALT}:{seed}")."""


class PromptBatches:
    """The training batches: each `iter()` yields the rest of one epoch of `PromptBatch`es of `batch_size` rows,
    each stamped with the stream position after it, then stops; `len()` is the batches of a whole epoch.

    Batches never straddle two passes over a finite source: a pass's tail of fewer than `batch_size` rows is
    dropped (as `drop_last`), and the stamped position after a pass's last batch is the next pass's start. An
    `iter()` starts at the stream's position (where the previous one stopped, or where `train_dataloader`
    rewound it to) and runs to the end of the epoch that position lies in, so after a resume mid-epoch it yields
    exactly that epoch's remaining batches. `epoch_floor` (the Trainer's current epoch) moves the start to that
    epoch's first batch when the stream is behind it, e.g. after `limit_train_batches` cut an epoch short.
    `pinned`: every `iter()` starts at the first batch instead (the Trainer cuts the epoch to its overfit batches).
    """

    def __init__(
        self,
        prompts: PromptStream,
        batch_size: int,
        to_batch: Callable[[list[dict[str, Any]]], PromptBatch],
        rollouts_per_epoch: int | None = None,
        epoch_floor: Callable[[], int | None] | None = None,
        pinned: bool = False,
    ):
        self.prompts = prompts
        self.pinned = pinned  # every epoch starts at batch 0 (`Trainer(overfit_batches=...)`)
        self.batch_size = batch_size
        self.to_batch = to_batch
        self.epoch_floor = epoch_floor
        self.rows_per_pass = prompts.rows_per_pass
        self.batches_per_pass = None if self.rows_per_pass is None else self.rows_per_pass // batch_size
        if self.batches_per_pass == 0:
            raise ConfigError(
                f"data.batch_size: {batch_size} prompts per process and step, but each of the "
                f"{prompts.world_size} processes gets {self.rows_per_pass} prompts per pass; "
                "lower data.batch_size or give more prompts"
            )
        if rollouts_per_epoch is not None and rollouts_per_epoch < 1:
            raise ConfigError(f"data.rollouts_per_epoch: must be >= 1, got {rollouts_per_epoch}")
        self.batches_per_epoch: int = rollouts_per_epoch or self.batches_per_pass or BUILTIN_ROLLOUTS_PER_EPOCH

    def __len__(self) -> int:
        return self.batches_per_epoch

    def state_dict(self) -> dict[str, Any]:
        """Nothing: the position lives in `RolloutDataModule.state_dict` (the last batch that reached
        `training_step`, which `train_dataloader` rewinds the stream to). These two methods tell Lightning that
        the iterable resumes mid-epoch, so it does not warn that it cannot."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        del state_dict

    def position(self, index: int) -> int:
        """This rank's stream position (rows) where batch `index` (counted over all epochs) starts."""
        if self.rows_per_pass is None or self.batches_per_pass is None:
            return index * self.batch_size
        number, i = divmod(index, self.batches_per_pass)
        return number * self.rows_per_pass + i * self.batch_size

    def batch_index(self, position: int) -> int:
        """The first batch that starts at or after the stream position `position`."""
        if self.rows_per_pass is None or self.batches_per_pass is None:
            return -(-position // self.batch_size)
        number, offset = divmod(position, self.rows_per_pass)
        return number * self.batches_per_pass + min(-(-offset // self.batch_size), self.batches_per_pass)

    def __iter__(self) -> Iterator[PromptBatch]:
        index = 0 if self.pinned else self.batch_index(self.prompts.rows_consumed)
        floor = self.epoch_floor() if self.epoch_floor is not None and not self.pinned else None
        if floor is not None:
            index = max(index, floor * self.batches_per_epoch)
        end = (index // self.batches_per_epoch + 1) * self.batches_per_epoch
        for i in range(index, end):
            batch = self.at(i)
            self.prompts.rows_consumed = batch.position
            yield batch

    def at(self, index: int) -> PromptBatch:
        """Batch `index` (counted over all epochs), stamped with the stream position after it; moves nothing."""
        batch = self.to_batch(self.prompts.rows(self.position(index), self.batch_size))
        batch.position = self.position(index + 1)
        return batch


class HeldOutBatches:
    """Held-out rows as `PromptBatch`es of up to `batch_size` rows, in order; the last batch may be smaller."""

    def __init__(
        self, rows: list[dict[str, Any]], batch_size: int, to_batch: Callable[[list[dict[str, Any]]], PromptBatch]
    ):
        self.rows = rows
        self.batch_size = batch_size
        self.to_batch = to_batch

    def __len__(self) -> int:
        return -(-len(self.rows) // self.batch_size)

    def __iter__(self) -> Iterator[PromptBatch]:
        for start in range(0, len(self.rows), self.batch_size):
            yield self.to_batch(self.rows[start : start + self.batch_size])


NO_PROMPT_LIMIT = (
    "; TRL's None (no limit) is not taken: give a limit above the longest prompt's tokens (lit-rlhf check reports "
    "them), or data.prompt_truncation: left"
)


def check_data_settings(settings: dict[str, Any]) -> None:
    """`RolloutDataModule`'s numeric and choice settings (its constructor's arguments by name)."""
    s = settings
    for name in ("batch_size", "max_prompt_length", "val_size", "rollouts_per_epoch", "val_batch_size"):
        value, optional = s[name], name in ("rollouts_per_epoch", "val_batch_size")
        if not (value is None and optional) and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
            hint = NO_PROMPT_LIMIT if name == "max_prompt_length" and value is None else ""
            raise ConfigError(f"data.{name}: must be an integer{' or None' if optional else ''}, got {value!r}{hint}")
    if s["batch_size"] < 1:
        raise ConfigError(f"data.batch_size: must be >= 1, got {s['batch_size']}")
    if s["max_prompt_length"] < 1:
        raise ConfigError(f"data.max_prompt_length: must be >= 1, got {s['max_prompt_length']}")
    check_choice(s["prompt_truncation"], PromptTruncation, "data.prompt_truncation")
    check_choice(s["special_tokens_in_prompts"], SpecialTokensInPrompts, "data.special_tokens_in_prompts")
    if s["rollouts_per_epoch"] is not None and s["rollouts_per_epoch"] < 1:
        raise ConfigError(
            f"data.rollouts_per_epoch: must be >= 1, got {s['rollouts_per_epoch']}; or null for one pass over a "
            f"finite prompt set ({BUILTIN_ROLLOUTS_PER_EPOCH} batches for a builtin:<task> stream)"
        )
    if s["val_batch_size"] is not None and s["val_batch_size"] < 1:
        raise ConfigError(f"data.val_batch_size: must be >= 1, got {s['val_batch_size']}; or null for data.batch_size")
    if s["val_size"] < 1:
        raise ConfigError(f"data.val_size: must be >= 1, got {s['val_size']}")


@refuses_trl_names("data")
class RolloutDataModule(L.LightningDataModule):
    """Owns the prompts: sources, tokenisation, per-rank sharding, epochs, held-out sets, a resumable position.

    Args:
        prompts: 'builtin:digits', a .jsonl/.json/.txt file (format by suffix, any case), or (from Python) a list
            of strings or dicts, or a `datasets` Dataset/DatasetDict. A row's prompt is a string or a list of
            {'role', 'content'} messages (rendered by the tokenizer's chat template); see docs/data.md.
        batch_size: prompts per step and per process; each gets `group_size` responses.
        max_prompt_length: prompt token limit.
        prompt_truncation: 'error' (default) or 'left' (cut the start of long prompts, with a warning).
        prompt_column: field of the prompt (a string or a message list) in rows; the other fields reach reward
            and metric functions as keyword arguments.
        messages_column: field of a chat prompt's message list in rows that have no `prompt_column`.
        special_tokens_in_prompts: what a special token's spelling (e.g. '<|im_start|>') in a plain string prompt
            means: 'error' (default: refuse, naming the row), 'text' (literal text), or 'parse' (the special token:
            for prompts already rendered with a chat template). Message lists never need it.
        tokenizer: defaults to the module's tokenizer.
        seed: order of the prompts (and which rows a fractional `val_prompts` holds out).
        shuffle: reshuffle a finite prompt set each pass.
        rollouts_per_epoch: batches per epoch. None: one pass over a finite prompt set (this rank's share; a
            tail smaller than `batch_size` is dropped), 100 for a `builtin:<task>` stream.
        val_prompts: held-out prompts for the validation loop: a file, a list or 'builtin:<task>' (`val_size`
            rows drawn with a seed of their own), or a fraction 0 < f < 1 of a finite `prompts` set (ceil(f x n)
            rows chosen by `seed`, in file order) that training then leaves out. None: no validation.
        test_prompts: for the test loop, the same forms but a fraction; None: the validation prompts.
        predict_prompts: for the predict loop, as `test_prompts`; None: the validation prompts.
        val_batch_size: prompts per held-out batch and process; None: `batch_size`.
        val_size: rows drawn from a `builtin:<task>` held-out set.
        prompt_split: the split read when `prompts` is a `datasets.DatasetDict` (None: refuse a DatasetDict).
        val_split: the same for `val_prompts`.
        test_split: the same for `test_prompts`.
        predict_split: the same for `predict_prompts`.
    """

    # held-out prompts are sharded row by row, so a rank can have none when there are fewer rows than ranks
    allow_zero_length_dataloader_with_multiple_devices = True

    def __init__(
        self,
        prompts: str | list = "builtin:digits",
        batch_size: int = 16,
        max_prompt_length: int = 256,
        prompt_truncation: PromptTruncation = "error",
        prompt_column: str = "prompt",
        tokenizer: Any = None,
        seed: int = 0,
        shuffle: bool = True,
        rollouts_per_epoch: int | None = None,
        val_prompts: float | str | list | None = None,
        test_prompts: str | list | None = None,
        predict_prompts: str | list | None = None,
        val_batch_size: int | None = None,
        val_size: int = 64,
        messages_column: str = "messages",
        prompt_split: str | None = "train",
        val_split: str | None = "validation",
        test_split: str | None = "test",
        predict_split: str | None = "test",
        special_tokens_in_prompts: SpecialTokensInPrompts = "error",
    ):
        super().__init__()
        check_data_settings(locals())
        self.batch_size = batch_size
        self.max_prompt_length = max_prompt_length
        self.prompt_truncation = prompt_truncation
        self.prompt_column = prompt_column
        self.messages_column = messages_column
        self.special_tokens_in_prompts = special_tokens_in_prompts
        self.splits = {"data.prompts": prompt_split, "data.val_prompts": val_split}
        self.splits.update({"data.test_prompts": test_split, "data.predict_prompts": predict_split})
        self.tokenizer = tokenizer
        self.seed = seed
        self.shuffle = shuffle
        self.rollouts_per_epoch = rollouts_per_epoch
        self.val_batch_size = val_batch_size
        self.val_size = val_size
        self.source = self._load_source(prompts)
        self.held_out_from_prompts = 0  # rows of `prompts` that a fractional val_prompts moved to validation
        self.val_rows = self._load_val(val_prompts)
        self.test_rows = self._load_held_out(test_prompts, "data.test_prompts", self.val_rows)
        self.predict_rows = self._load_held_out(predict_prompts, "data.predict_prompts", self.val_rows)
        self.stream: PromptStream | None = None
        self.refill_stream: PromptStream | None = None  # dynamic sampling's extra prompts (`refill_batch`)
        self.prompt_tokenizer: PromptTokenizer | None = None
        self.rank, self.world_size = 0, 1
        self.rows_trained = 0  # rows of this rank that reached training_step
        self.rows_before_batch = 0  # rows_trained before the last batch that reached training_step
        self._pending_state: dict[str, int] | None = None

    # ------------------------------------------------------------------------------------------- sources

    def _rows(self, spec: Any, field: str) -> list[dict[str, Any]]:
        """Checked rows of a file, a list or a `datasets` Dataset/DatasetDict given as setting `field`."""
        split_field = f"data.{SPLIT_FIELDS[field]}"
        return load_prompt_rows(spec, self.prompt_column, self.messages_column, field, self.splits[field], split_field)

    def _load_source(self, prompts: Any) -> list[dict[str, Any]] | str:
        if isinstance(prompts, str) and is_builtin(prompts):
            get_task(prompts, "data.prompts")  # validates the name
            return prompts
        return self._rows(prompts, "data.prompts")

    def _load_held_out(
        self, spec: Any, field: str, default: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]] | None:
        """A held-out prompt set: rows from a file, a list or 'builtin:<task>' (`val_size` rows; for the test set,
        rows that are not validation rows, so a checkpoint chosen on validation is reported on problems it was not
        chosen on)."""
        if spec is None:
            return default
        if isinstance(spec, str) and is_builtin(spec):
            exclude: frozenset[str] = frozenset()
            if field == "data.test_prompts" and self.val_rows:
                exclude = frozenset(prompt_key(row) for row in self.val_rows)
            return builtin_rows(spec, HELD_OUT_SEEDS[field], self.val_size, field, exclude, "data.val_prompts")
        return self._rows(spec, field)

    def _load_val(self, spec: Any) -> list[dict[str, Any]] | None:
        if not isinstance(spec, (int, float)) or isinstance(spec, bool):
            return self._load_held_out(spec, "data.val_prompts")
        if isinstance(self.source, str):
            raise ConfigError(
                f"data.val_prompts: a fraction ({spec}) splits a finite data.prompts set, but data.prompts is "
                f"{self.source!r}, an endless stream; set data.val_prompts: {self.source} (data.val_size prompts "
                "drawn with a seed of their own), a file or a list"
            )
        if not 0 < spec < 1:
            raise ConfigError(
                f"data.val_prompts: a fraction of data.prompts must be between 0 and 1 (exclusive), got {spec}"
            )
        n = len(self.source)
        count = math.ceil(spec * n - 1e-9)
        if count >= n:
            raise ConfigError(
                f"data.val_prompts: holding out {spec} of the {n} prompts leaves none to train on; "
                "lower data.val_prompts or give more prompts"
            )
        order = list(range(n))
        random.Random(f"{VAL_SPLIT_SALT}:{self.seed}").shuffle(order)
        held = set(order[:count])
        val_rows = [row for i, row in enumerate(self.source) if i in held]
        self.source = [row for i, row in enumerate(self.source) if i not in held]
        self.held_out_from_prompts = count
        return val_rows

    # ------------------------------------------------------------------------------------------- Lightning

    def setup(self, stage: str) -> None:
        """The per-rank prompt streams; with `data.tokenizer` also the prompt checks (else in `connect`)."""
        if self.tokenizer is not None:
            self._tokenize_with(load_tokenizer(self.tokenizer, "data.tokenizer"))
        if self.trainer is not None:
            self.rank, self.world_size = self.trainer.global_rank, self.trainer.world_size
        self.stream = PromptStream(self.source, self.seed, self.shuffle, self.rank, self.world_size)
        seed = self.seed + REFILL_SEED_OFFSET
        self.refill_stream = PromptStream(self.source, seed, self.shuffle, self.rank, self.world_size)
        if stage == "fit":
            self._check_training_set(self.stream)
        if self._pending_state is not None:
            self.load_state_dict({"prompt_stream": self._pending_state})

    def connect(self, needs: PromptNeeds) -> PromptSupply:
        """The module's hand-off (`lit_rlhf.data.handoff`), from its `setup`: the prompts are checked against
        what it needs (its tokenizer, when `data.tokenizer` is None; the columns its reward and metric functions
        name; a batch that splits into its micro-batches), and it gets what it needs of the prompts back."""
        if self.prompt_tokenizer is None:
            self._tokenize_with(needs.tokenizer)
        self._check_columns(list(needs.reward_fns), list(needs.metric_fns))
        needs.check_rollout_batch(self.batch_size)
        return PromptSupply(
            self.batch_size, self.max_prompt_length, self.refill_batch, self.batches_after, self.fingerprint()
        )

    def fingerprint(self) -> str:
        """The training prompts and their order in a line: the task's name or the rows' hash, the seed, shuffling
        and the batch size."""
        if isinstance(self.source, str):
            source = self.source
        else:
            rows = json.dumps(self.source, sort_keys=True, default=repr).encode()
            source = f"{len(self.source)} rows sha256:{hashlib.sha256(rows).hexdigest()[:16]}"
        return f"{source}, seed {self.seed}, {'shuffled' if self.shuffle else 'in order'}, batch {self.batch_size}"

    def _tokenize_with(self, tokenizer: Any) -> None:
        """Tokenise with `tokenizer` from now on; every finite prompt set is checked with it at once (chat
        templates apply, prompts fit when truncation is 'error')."""
        self.prompt_tokenizer = PromptTokenizer(
            tokenizer,
            self.max_prompt_length,
            self.prompt_truncation,
            self.prompt_column,
            self.messages_column,
            self.special_tokens_in_prompts,
        )
        checked: set[int] = set()  # test/predict rows default to the validation rows: tokenise them once
        for field, rows in self._prompt_sets():
            if rows and id(rows) not in checked:
                self.prompt_tokenizer.check_rows(rows, field)
                checked.add(id(rows))

    def _prompt_sets(self) -> list[tuple[str, list[dict[str, Any]] | None]]:
        """Every finite prompt set by setting name (an endless `builtin:<task>` stream is None)."""
        return [
            ("data.prompts", self.source if isinstance(self.source, list) else None),
            ("data.val_prompts", self.val_rows),
            ("data.test_prompts", self.test_rows),
            ("data.predict_prompts", self.predict_rows),
        ]

    def _check_columns(self, reward_fns: list[Any], metric_fns: list[Any]) -> None:
        """Reward functions (and, for held-out sets, metric functions) find the columns they need in every row."""
        for field, rows in self._prompt_sets():
            if rows:
                fns = reward_fns if field == "data.prompts" else reward_fns + metric_fns
                check_columns(fns, rows, field, self.prompt_column)

    def _check_training_set(self, stream: PromptStream) -> None:
        per_rank = stream.rows_per_pass  # raises when there are fewer prompts than processes
        if per_rank is not None and per_rank < self.batch_size:
            held_out = f" ({self.held_out_from_prompts} went to data.val_prompts)" if self.held_out_from_prompts else ""
            raise ConfigError(
                f"data.batch_size: {self.batch_size} prompts per process and step, but the {len(stream.source)} "
                f"training prompts{held_out} give each of the {self.world_size} processes only {per_rank} per pass; "
                "lower data.batch_size or give more prompts"
            )

    def _current_epoch(self) -> int | None:
        epoch = getattr(self.trainer, "current_epoch", None) if self.trainer is not None else None
        return epoch if isinstance(epoch, int) else None

    def _tokenizer_missing(self, hook: str) -> RuntimeError:
        if self.stream is None:
            return RuntimeError(f"RolloutDataModule.{hook}: call setup() first")
        return RuntimeError(
            f"RolloutDataModule.{hook}: data.tokenizer is None and no module handed its tokenizer over "
            "(RLHFModule does, through connect, in its setup); give data.tokenizer"
        )

    def train_dataloader(self) -> PromptBatches:
        if self.stream is None or self.prompt_tokenizer is None:
            raise self._tokenizer_missing("train_dataloader")
        self.stream.load_state_dict({"rows_consumed": self.rows_trained})  # drop what was prefetched and unused
        pinned = getattr(self.trainer, "overfit_batches", 0) > 0  # Trainer(overfit_batches=n): the same n batches
        return PromptBatches(
            self.stream, self.batch_size, self.prompt_tokenizer, self.rollouts_per_epoch, self._current_epoch, pinned
        )

    def batches_after(self, position: int, count: int) -> list[PromptBatch]:
        """The `count` training batches that follow the one stamped with stream position `position`, as
        `train_dataloader` will yield them (asynchronous rollouts sample them ahead); reading them moves nothing."""
        if self.stream is None or self.prompt_tokenizer is None:
            raise self._tokenizer_missing("batches_after")
        batches = PromptBatches(self.stream, self.batch_size, self.prompt_tokenizer, self.rollouts_per_epoch)
        first = batches.batch_index(position)
        return [batches.at(index) for index in range(first, first + count)]

    def refill_batch(self, start: int) -> PromptBatch:
        """`batch_size` rows of this rank's refill stream from row `start` (dynamic sampling's extra prompts,
        read at a position fixed by the rollout's number: `lit_rlhf.rollout.dynamic.refill_position`)."""
        if self.refill_stream is None or self.prompt_tokenizer is None:
            raise self._tokenizer_missing("refill_batch")
        return self.prompt_tokenizer(self.refill_stream.rows(start, self.batch_size))

    def _held_out_batches(self, rows: list[dict[str, Any]] | None, hook: str) -> HeldOutBatches | list:
        """This rank's rows i with i % world_size == rank, in order; [] when no prompts are configured."""
        if rows is None:
            return []
        if self.prompt_tokenizer is None:
            raise self._tokenizer_missing(hook)
        shard = rows[self.rank :: self.world_size]
        return HeldOutBatches(shard, self.val_batch_size or self.batch_size, self.prompt_tokenizer)

    def val_dataloader(self) -> HeldOutBatches | list:
        return self._held_out_batches(self.val_rows, "val_dataloader")

    def test_dataloader(self) -> HeldOutBatches | list:
        return self._held_out_batches(self.test_rows, "test_dataloader")

    def predict_dataloader(self) -> HeldOutBatches | list:
        return self._held_out_batches(self.predict_rows, "predict_dataloader")

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, PromptBatch) and self.trainer is not None and self.trainer.training:
            self.rows_before_batch, self.rows_trained = self.rows_trained, batch.position
        return batch

    def state_dict(self) -> dict[str, Any]:
        running = training_step_running(self.trainer)  # its batch is trained again after a resume
        return {"prompt_stream": {"rows_consumed": self.rows_before_batch if running else self.rows_trained}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("prompt_stream", {"rows_consumed": 0})
        if self.stream is None:
            self._pending_state = state
            return
        self.rows_trained = self.rows_before_batch = int(state["rows_consumed"])
        self.stream.load_state_dict(state)
        self._pending_state = None
