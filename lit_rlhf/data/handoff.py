"""The one hand-off between the rollout DataModule and the module that trains on its prompts.

Lightning runs the DataModule's `setup` first, then the module's; in its `setup` the module calls
`RolloutDataModule.connect(PromptNeeds(...))` and keeps the `PromptSupply` it returns. Neither side reads the
other's attributes: what the DataModule needs from the module, and what the module needs back, are these two
types, and `training_step_running` tells both whether a checkpoint is written from inside a step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lit_rlhf.types import PromptBatch


@dataclass(frozen=True)
class PromptNeeds:
    """What the module asks of the prompts, checked by `connect` before any model loads."""

    tokenizer: Any
    """The policy's tokenizer: it tokenises the prompts unless `data.tokenizer` names another."""
    reward_fns: Sequence[Callable[..., Any]]
    """Their named parameters must be columns of every training and held-out row."""
    metric_fns: Sequence[Callable[..., Any]]
    """Their named parameters must be columns of every held-out row."""
    check_rollout_batch: Callable[[int], None]
    """Raises when `data.batch_size` prompts per step do not split into the module's (micro-)batches."""


@dataclass(frozen=True)
class PromptSupply:
    """What the DataModule gives the module back."""

    batch_size: int
    """Prompts per rank and step (`data.batch_size`)."""
    max_prompt_length: int
    """The longest prompt a batch can hold, in tokens (`data.max_prompt_length`)."""
    refill_batch: Callable[[int], PromptBatch]
    """`batch_size` rows of this rank's second prompt stream from a row (dynamic sampling's extra prompts)."""
    batches_after: Callable[[int, int], list[PromptBatch]]
    """(stream position stamped on a batch, count) -> the `count` training batches after it, as the dataloader
    will hand them over (asynchronous rollouts sample them ahead)."""
    fingerprint: str = ""
    """The prompt set and its order, in a line (its rows' hash or the task's name, seed, shuffling, batch size):
    a resumed fit compares it with the checkpoint's."""


def training_step_running(trainer: Any) -> bool:
    """Whether a fit's `training_step` has begun (its batch handed over) and not returned: a checkpoint written
    now, from an exception inside it, belongs before that batch."""
    loop = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "batch_progress", None)
    if loop is None or not getattr(trainer, "training", False):
        return False
    return loop.current.ready > loop.current.processed
