"""Held-out evaluation and generation through Lightning's own loops: `validation_step`, `test_step`,
`predict_step`, and `generate` for scripts and notebooks.

Held-out prompts are answered with `val_sampling` (greedy by default), `val_samples_per_prompt` responses
each, and scored by the training reward (`compute_scores`) and by metric functions that never train (same
contract as reward functions, e.g. exact-match accuracy). Each value is accumulated as a sum and a count
(`torchmetrics.MeanMetric`), so the logged mean over several processes is exact even when their shares of
the prompts differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric

from lit_rlhf.config import ConfigError, SamplingConfig
from lit_rlhf.data.chat import encode_chat
from lit_rlhf.data.sources import check_row
from lit_rlhf.models.actor_critic import eval_mode
from lit_rlhf.rewards.functions import RewardFn, call_reward_fn, callable_name
from lit_rlhf.rollout.collect import RolloutSettings, SingleTurnCollector
from lit_rlhf.rollout.generation import Generation
from lit_rlhf.training import metrics as logs
from lit_rlhf.training.rollouts import Rollouts
from lit_rlhf.training.sharding import is_fsdp2, unsharded_for_rollout
from lit_rlhf.types import PromptBatch, Rollout


class HeldOutEvaluation(Rollouts):
    """Validation, test and prediction, with the module's rollouts (`Rollouts.collector`): conversations when
    there is an environment."""

    def setup_evaluation(
        self, metric_fns: Sequence[RewardFn], val_sampling: SamplingConfig, samples_per_prompt: int
    ) -> None:
        """The metric functions by name, the sampling settings, and one exact mean accumulator per value."""
        if samples_per_prompt < 1:
            raise ConfigError(f"model.val_samples_per_prompt: must be >= 1, got {samples_per_prompt}")
        self.metric_fns = {callable_name(fn): fn for fn in metric_fns}
        if len(self.metric_fns) != len(metric_fns):
            raise ConfigError(
                f"model.metric_fns: two metric functions share a name: {list(map(callable_name, metric_fns))}"
            )
        self.val_sampling, self.val_samples_per_prompt = val_sampling, samples_per_prompt
        self.held_out_settings = RolloutSettings(samples_per_prompt, val_sampling)
        keys = ["reward_mean", "response_len_mean", "frac_truncated", *self.metric_fns]
        if samples_per_prompt > 1:
            keys += [f"{name}_pass@{samples_per_prompt}" for name in self.metric_fns]
        self.eval_means = nn.ModuleDict({key: MeanMetric() for key in keys})

    def answer(self, prompts: PromptBatch) -> Rollout:
        """`val_samples_per_prompt` responses to each prompt with `val_sampling`, scored: a `Rollout`."""
        with eval_mode(self.actor_critic), unsharded_for_rollout(self.actor_critic):  # FSDP2: gathered once
            rollout, _ = self.collector(self.held_out_settings).collect(prompts, self.state.policy_version)
        return rollout

    def evaluation_values(self, rollout: Rollout) -> dict[str, Tensor]:
        """Per-response (B,) values, and per-prompt (B0,) best-of-n values of each metric function."""
        values = {
            "reward_mean": rollout.scores.float().cpu(),
            "response_len_mean": rollout.response_mask.sum(1).float().cpu(),
            "frac_truncated": rollout.truncated.float().cpu(),
        }
        n = self.val_samples_per_prompt
        for name, fn in self.metric_fns.items():
            values[name] = call_reward_fn(fn, rollout.prompts, rollout.responses, rollout.meta)
            if n > 1:
                values[f"{name}_pass@{n}"] = values[name].view(-1, n).max(dim=1).values
        return values

    def evaluation_step(self, prompts: PromptBatch, batch_idx: int, stage: str) -> None:
        rollout = self.answer(prompts)
        for key, value in self.evaluation_values(rollout).items():
            mean = self.eval_means[key]
            assert isinstance(mean, MeanMetric)
            mean.update(value)
            self.log(f"{stage}/{key}", mean, on_step=False, on_epoch=True, batch_size=value.numel())
        if batch_idx == 0 and self.global_rank == 0:
            rows = logs.sample_rows(
                rollout.prompts, rollout.responses, rollout.scores.tolist(), self.val_samples_per_prompt
            )
            logs.write_samples(self.loggers, rows, self.global_step, tag=f"{stage}_samples")

    def check_even_held_out_batches(self, counts: list[int | float], stage: str) -> None:
        """Under FSDP2 each held-out batch gathers the policy, a collective: a rank with more batches than another
        would wait forever for it, so uneven counts are refused on every rank (they all see every count)."""
        if not is_fsdp2(self._trainer) or self.trainer.world_size == 1:
            return
        if any(n == float("inf") for n in counts):
            raise ConfigError(
                f"data.{stage}_prompts: under ModelParallelStrategy (FSDP2) the held-out batches must be counted "
                "(every rank must answer as many), but a held-out dataloader has no length; give it a __len__"
            )
        mine = torch.tensor(int(sum(counts)), device=self.device)
        every = [int(n) for n in self.trainer.strategy.all_gather(mine).flatten()]
        if min(every) != max(every):
            raise ConfigError(
                f"data.{stage}_prompts: under ModelParallelStrategy (FSDP2) every rank must answer as many held-out "
                f"batches (each one gathers the sharded policy, a collective), but the ranks have {every}; use a "
                f"number of {stage} prompts that is a multiple of world_size x the batch size"
            )

    def on_validation_epoch_start(self) -> None:
        self.check_even_held_out_batches(self.trainer.num_val_batches, "val")

    def on_test_epoch_start(self) -> None:
        self.check_even_held_out_batches(self.trainer.num_test_batches, "test")

    def on_predict_epoch_start(self) -> None:
        self.check_even_held_out_batches(self.trainer.num_predict_batches, "predict")

    def validation_step(self, prompts: PromptBatch, batch_idx: int) -> None:
        self.evaluation_step(prompts, batch_idx, "val")

    def test_step(self, prompts: PromptBatch, batch_idx: int) -> None:
        self.evaluation_step(prompts, batch_idx, "test")

    def predict_step(self, prompts: PromptBatch, batch_idx: int) -> list[dict[str, Any]]:
        """One row {"prompt", "response", "score"} per response (`trainer.predict` returns them per batch)."""
        rollout = self.answer(prompts)
        scores = rollout.scores.tolist()
        return [
            {"prompt": p, "response": r, "score": s}
            for p, r, s in zip(rollout.prompts, rollout.responses, scores, strict=True)
        ]

    @torch.no_grad()
    def generate(self, prompts: Any, sampling: SamplingConfig | None = None, n: int = 1) -> list[str]:
        """`n` responses to each prompt (greedy `val_sampling` unless `sampling` is given), in order.

        A prompt is a text, used as given, or a chat conversation (a list of {"role", "content"} messages), rendered
        with the policy's chat template and tokenised as training prompts are (`lit_rlhf.data.chat.encode_chat`).
        `prompts`: one prompt or a list of them; no truncation.
        """
        items = [prompts] if isinstance(prompts, str) or is_conversation(prompts) else list(prompts)
        batch = prompt_batch(self.tokenizer, items)
        settings = sampling if sampling is not None else self.val_sampling
        backend, no_score = self.backend(settings), _no_score
        collector = SingleTurnCollector(backend, self.tokenizer, no_score, RolloutSettings(n, settings), self.stop_ids)
        with eval_mode(self.actor_critic), unsharded_for_rollout(self.actor_critic):  # FSDP2: gathered once
            rollout, _ = collector.collect(batch, self.state.policy_version)
        return rollout.responses


def is_conversation(value: Any) -> bool:
    """A chat prompt: a non-empty list of message dicts."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def prompt_batch(tokenizer: Any, items: list[Any]) -> PromptBatch:
    """Texts as the tokenizer encodes them, conversations through the chat template (left padded)."""
    if all(isinstance(item, str) for item in items):
        encoded = tokenizer(items, padding=True, return_tensors="pt")
        return PromptBatch(encoded["input_ids"], encoded["attention_mask"], list(items))
    texts, ids = [], []
    for i, item in enumerate(items):
        where = f"generate: prompt {i}"
        if isinstance(item, str):
            texts.append(item)
            ids.append(list(tokenizer(item)["input_ids"]))
            continue
        row = check_row({"messages": item}, where, "prompt", "messages", "prompt")
        text, row_ids = encode_chat(tokenizer, row["messages"], where)
        texts.append(text)
        ids.append(row_ids)
    width = max(len(row_ids) for row_ids in ids)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in ids], dtype=torch.long)
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids], dtype=torch.long)
    return PromptBatch(input_ids, attention_mask, texts)


def _no_score(prompts: list[str], responses: list[str], meta: dict[str, list[Any]], generation: Generation) -> Tensor:
    return torch.zeros(len(responses))
