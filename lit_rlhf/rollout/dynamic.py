"""DAPO dynamic sampling (Yu et al. 2025, https://arxiv.org/abs/2503.14476, section 3.2): a group whose scores
all tie has zero group-normalised advantage and gives no gradient, so it is dropped and more prompts are sampled
(with the same policy, before the update) until the batch holds `B0` groups again, for at most
`max_sampling_rounds` rounds.

Extra prompts come from a second prompt stream per rank (`RolloutDataModule.refill_batch`, handed to the module
as `PromptSupply.refill_batch`), read at a slot fixed by the rollout's number, so a resumed run reads the same
refill prompts without any saved state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lit_rlhf.rollout.collect import RolloutTimings
from lit_rlhf.types import PromptBatch, Rollout

LEFT_PADDED = ("prompt_ids", "prompt_mask")
"""The (B, P) fields, left padded; every other (B, *) tensor field is on the response grid, right padded."""


def tied_groups(scores: Tensor, group_size: int) -> Tensor:
    """(B,) scores -> (B/G,) bool: every score of the group equal to the group's first (exactly: the condition
    under which every group estimator gives the whole group zero advantage; NaN never ties)."""
    groups = scores.view(-1, group_size)  # (B/G, G)
    return (groups == groups[:, :1]).all(dim=1)


def refill_position(rollout: int, extra_round: int, max_rounds: int, batch_size: int) -> int:
    """The refill stream's first row for extra round `extra_round` (1-based) of rollout `rollout` (1-based): each
    rollout owns `max_rounds - 1` consecutive slots of `batch_size` rows, used or not."""
    return ((rollout - 1) * (max_rounds - 1) + (extra_round - 1)) * batch_size


def _pad_to(tensor: Tensor, width: int, value: int | float | bool, left: bool) -> Tensor:
    """(B, w) -> (B, width), padded with `value` on the left or the right."""
    pad = tensor.new_full((tensor.shape[0], width - tensor.shape[1]), value)
    return torch.cat([pad, tensor] if left else [tensor, pad], dim=1)


def concat_rollouts(rollouts: Sequence[Rollout], pad_token_id: int) -> Rollout:
    """The rows of `rollouts` in order, as one rollout: prompts re-padded on the left to the widest prompt,
    responses on the right to the longest response (ids with `pad_token_id`, masks with 0/False)."""
    first = rollouts[0]
    sizes = [r.batch_size for r in rollouts]
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(first):
        values = [getattr(r, f.name) for r in rollouts]
        if f.name == "context_mask":  # None: no environment tokens, the same as all False
            if all(v is None for v in values):
                continue
            values = [
                v if v is not None else torch.zeros_like(r.response_mask) for v, r in zip(values, rollouts, strict=True)
            ]
        if isinstance(values[0], Tensor):
            if values[0].dim() == 1:
                changes[f.name] = torch.cat(values)
                continue
            width = max(v.shape[1] for v in values)
            value = pad_token_id if f.name.endswith("_ids") else 0
            changes[f.name] = torch.cat([_pad_to(v, width, value, f.name in LEFT_PADDED) for v in values])
        elif isinstance(values[0], list):
            changes[f.name] = [item for v in values for item in v]
        elif isinstance(values[0], dict):
            if any(set(v) != set(values[0]) for v in values):
                raise ValueError(f"concat_rollouts: the rollouts' meta columns differ: {[sorted(v) for v in values]}")
            changes[f.name] = {key: [item for v in values for item in v[key]] for key in values[0]}
        elif any(v != values[0] for v in values):
            raise ValueError(f"concat_rollouts: the rollouts' {f.name} differ: {values}")
    out = dataclasses.replace(first, **changes)
    assert out.batch_size == sum(sizes)
    return out


def _group_rows(groups: list[int], group_size: int, device: torch.device) -> Tensor:
    """Group indices -> (len(groups) * G,) row indices, each group's rows together, in order."""
    index = torch.tensor(groups, dtype=torch.long, device=device)
    return (index[:, None] * group_size + torch.arange(group_size, device=device)).reshape(-1)


def dynamic_rollout(
    collect: Callable[[PromptBatch], tuple[Rollout, Any]],
    prompts: PromptBatch,
    refill: Callable[[int], PromptBatch],
    group_size: int,
    max_rounds: int,
    pad_token_id: int,
) -> tuple[Rollout, RolloutTimings]:
    """Sample `prompts` with `collect`; while fewer than `B0 = len(prompts)` groups are not tied and rounds are
    left, collect `refill(j)` (extra round j, 1-based) too. Returns B0 groups: the first B0 untied groups in
    sampling order, then, when the rounds ran out, tied groups in sampling order (zero advantage: they train
    nothing but keep every rank's batch the same size). No collective runs here: ranks may take different rounds.

    Metrics: `rollout/sampling_rounds` (1: no refill), `rollout/dropped_groups` (tied groups sampled over all
    rounds), `rollout/kept_fraction` (untied groups in the returned batch / B0).
    """
    wanted = len(prompts)
    timings = RolloutTimings()
    kept: list[Rollout] = []
    tied: list[Rollout] = []
    kept_groups = dropped = rounds = 0
    batch = prompts
    for round_number in range(1, max_rounds + 1):
        if round_number > 1:
            batch = refill(round_number - 1)
        rollout, round_timings = collect(batch)
        timings.generate_s += round_timings.generate_s
        timings.score_s += round_timings.score_s
        rounds = round_number
        is_tied = tied_groups(rollout.scores, group_size).tolist()
        tied_here = [g for g, t in enumerate(is_tied) if t]
        untied = [g for g, t in enumerate(is_tied) if not t][: wanted - kept_groups]
        device = rollout.scores.device
        if round_number == 1 and not tied_here:  # nothing tied: the batch as sampled
            kept.append(rollout)
        elif untied:
            kept.append(rollout.select(_group_rows(untied, group_size, device)))
        if tied_here:
            tied.append(rollout.select(_group_rows(tied_here, group_size, device)))
        dropped += len(tied_here)
        kept_groups += len(untied)
        if kept_groups == wanted:
            break
    short = (wanted - kept_groups) * group_size
    parts = kept + ([concat_rollouts(tied, pad_token_id).select(slice(0, short))] if short else [])
    timings.metrics = {
        "rollout/sampling_rounds": float(rounds),
        "rollout/dropped_groups": float(dropped),
        "rollout/kept_fraction": kept_groups / wanted,
    }
    return (parts[0] if len(parts) == 1 else concat_rollouts(parts, pad_token_id)), timings


def refill_source(
    refill_batch: Callable[[int], PromptBatch], batch_size: int, rollout: int, max_rounds: int
) -> Callable[[int], PromptBatch]:
    """Extra round j's prompts for rollout `rollout`: `refill_batch` (this rank's refill stream) at
    `refill_position`."""
    return lambda j: refill_batch(refill_position(rollout, j, max_rounds, batch_size))
