"""`RolloutDataModule`: owns the prompts and hands `training_step` one `PromptBatch` per rollout.

The module generates each rollout inside `training_step`, from the policy as it is after the previous update,
so Lightning may prefetch prompt batches freely. For an exact resume the saved position is that of the last
batch that reached `training_step` (`on_before_batch_transfer`), not of the last one prefetched.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Literal

import lightning as L

from lit_rlhf.config import ConfigError, check_choice
from lit_rlhf.data.prompts import PromptTokenizer
from lit_rlhf.data.sources import PromptStream, read_prompt_file
from lit_rlhf.models.loading import data_tokenizer
from lit_rlhf.registry import get_task, is_builtin
from lit_rlhf.types import PromptBatch

PromptTruncation = Literal["error", "left"]


class PromptBatches:
    """Iterable of `PromptBatch`es of `batch_size` rows from `prompts`, each stamped with the stream position
    after it."""

    def __init__(self, prompts: PromptStream, batch_size: int, to_batch: PromptTokenizer):
        self.prompts = prompts
        self.batch_size = batch_size
        self.to_batch = to_batch

    def __iter__(self) -> Iterator[PromptBatch]:
        rows: list[dict[str, Any]] = []
        for row in self.prompts:
            rows.append(row)
            if len(rows) == self.batch_size:
                batch = self.to_batch(rows)
                batch.position = self.prompts.rows_consumed
                rows = []
                yield batch


class RolloutDataModule(L.LightningDataModule):
    """Owns the prompts: sources, tokenisation, per-rank sharding, a resumable position.

    Args:
        prompts: 'builtin:digits', a .jsonl/.txt file, or (from Python) a list of strings or dicts.
        batch_size: prompts per step and per process; each gets `group_size` responses.
        max_prompt_length: prompt token limit.
        prompt_truncation: 'error' (default) or 'left' (cut the start of long prompts, with a warning).
        prompt_column: field of the prompt text in .jsonl rows; the other fields reach reward functions.
        tokenizer: defaults to the module's tokenizer.
        seed: order of the prompts.
        shuffle: reshuffle a finite prompt set each pass.
    """

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
    ):
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"data.batch_size: must be >= 1, got {batch_size}")
        if max_prompt_length < 1:
            raise ConfigError(f"data.max_prompt_length: must be >= 1, got {max_prompt_length}")
        check_choice(prompt_truncation, PromptTruncation, "data.prompt_truncation")
        self.batch_size = batch_size
        self.max_prompt_length = max_prompt_length
        self.prompt_truncation = prompt_truncation
        self.prompt_column = prompt_column
        self.tokenizer = tokenizer
        self.seed = seed
        self.shuffle = shuffle
        self.source = self._load_source(prompts)
        self.stream: PromptStream | None = None
        self.rows_trained = 0  # rows of this rank that reached training_step
        self._pending_state: dict[str, int] | None = None

    def _load_source(self, prompts: str | Iterable) -> list[dict[str, Any]] | str:
        if isinstance(prompts, str):
            if is_builtin(prompts):
                get_task(prompts, "data.prompts")  # validates the name
                return prompts
            return read_prompt_file(prompts, self.prompt_column)
        rows = [p if isinstance(p, dict) else {self.prompt_column: p} for p in prompts]
        if not rows:
            raise ConfigError("data.prompts: the prompt list is empty")
        for i, row in enumerate(rows):
            if not isinstance(row.get(self.prompt_column), str):
                raise ConfigError(f"data.prompts: row {i} has no string field {self.prompt_column!r}")
        return rows

    def setup(self, stage: str) -> None:
        tokenizer = data_tokenizer(self.tokenizer, self.trainer)
        self.prompt_tokenizer = PromptTokenizer(
            tokenizer, self.max_prompt_length, self.prompt_truncation, self.prompt_column
        )
        if isinstance(self.source, list) and self.prompt_truncation == "error":
            for i, row in enumerate(self.source):  # fail before any model is loaded
                self.prompt_tokenizer.check_length(row[self.prompt_column], f"#{i}")
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        self.stream = PromptStream(self.source, self.seed, self.shuffle, rank, world)
        if self._pending_state is not None:
            self.load_state_dict({"prompt_stream": self._pending_state})
        module = self.trainer.lightning_module if self.trainer is not None else None
        check_rollout_batch = getattr(module, "check_rollout_batch", None)
        if check_rollout_batch is not None:
            check_rollout_batch(self.batch_size)

    def train_dataloader(self) -> PromptBatches:
        if self.stream is None:
            raise RuntimeError("RolloutDataModule.train_dataloader: call setup() first")
        self.stream.load_state_dict({"rows_consumed": self.rows_trained})  # drop what was prefetched and unused
        return PromptBatches(self.stream, self.batch_size, self.prompt_tokenizer)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, PromptBatch) and self.trainer is not None and self.trainer.training:
            self.rows_trained = batch.position
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"prompt_stream": {"rows_consumed": self.rows_trained}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("prompt_stream", {"rows_consumed": 0})
        if self.stream is None:
            self._pending_state = state
            return
        self.rows_trained = int(state["rows_consumed"])
        self.stream.load_state_dict(state)
        self._pending_state = None
