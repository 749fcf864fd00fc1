"""A lean sampling loop with a KV cache: the 'lean' generation backend.

It does what Hugging Face `generate(do_sample=True)` does for one causal LM and nothing else: one prefill
forward over the left-padded prompts, then one forward per new token through the model's KV cache, with
explicit position ids (prefill: cumulative sum of the attention mask minus one, clamped at 0; then +1 per
step for every sequence), temperature, top-k and top-p applied to float32 logits in that order (as
`generate` orders them), `torch.multinomial` on the softmax, pad after a sequence's EOS, and a stop as soon
as every sequence has emitted EOS. With the same global seed and the same settings it draws the same tokens
as `generate`; pass a `torch.Generator` to make it reproducible without touching the global RNG.

With `group_size` G > 1 it prefills each distinct prompt once and repeats the KV cache G times along the batch
(`repeat_interleave`, the order of `prompt.repeat_interleave(G)`), instead of prefilling G copies of every
prompt: the prefill, most of a step's compute for long prompts and short responses, costs 1/G.

Decode steps run only over the rows that have not emitted EOS, once enough have: when, at a stop check (every step
on the CPU), the running rows are at most `COMPACT_BELOW` of the rows the KV cache holds, the cache, attention-mask
and position rows of the finished ones are dropped (`Cache.reorder_cache`). The dropped rows get zero logits, whose
draws the loop replaces by pad; `torch.multinomial` draws each row from random numbers that do not depend on the
other rows' probabilities, so the running rows draw the same tokens as over all rows. A cache without
`reorder_cache` (not a transformers `Cache`) keeps every row.

The loop skips `generate`'s per-step machinery (logits-processor and stopping-criteria lists,
`prepare_inputs_for_generation`, growing `input_ids` with `torch.cat`), which is most of the cost of a
small model's decode step.

With `static_cache` / `compile` (`sampling.backend: compiled`) the decode steps run over a static KV cache of
fixed shapes, compiled with `torch.compile` (`lit_rlhf.rollout.static_decode`); everything else is this loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lit_rlhf.models.forward import accepts_argument, cache_keyword, returned_cache
from lit_rlhf.rollout.generation import EosIds, eos_id_list
from lit_rlhf.rollout.static_decode import StaticDecoder


def mask_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Set to -inf the logits outside the top-k tokens, then outside the top-p nucleus: (B, V) -> (B, V).

    top_k: keep the k largest logits (ties with the k-th are kept). 0 turns it off.
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p (the token that
        crosses top_p is kept; the most likely token always is). 1.0 turns it off.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_index = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # ascending: mass of this token and all below
        remove_sorted = cumulative <= (1.0 - top_p)
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_index, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


@dataclass
class SampleOutput:
    """Raw output of `sample`; T <= max_new_tokens is the number of decode steps that ran."""

    response_ids: Tensor  # (B, T) long, pad after the first EOS
    # (B, T) float32: log softmax(logits / temperature)[token], no top-k/top-p, 0 after the row's EOS; None unless asked
    logprobs: Tensor | None


def _repeat_cache(cache: Any, repeats: int) -> Any:
    """The prefill's KV cache with every row repeated `repeats` times in place (transformers' `Cache` API)."""
    repeat = getattr(cache, "batch_repeat_interleave", None)
    if repeat is None:
        raise TypeError(
            f"sampling.share_prefill: the model returned a {type(cache).__name__} cache without "
            "`batch_repeat_interleave`, so its prefill cannot be shared; set sampling.share_prefill: false"
        )
    repeat(repeats)
    return cache


@dataclass
class DecodeGrid:
    """Where each decode step writes: B = B0 x G rows, P prompt columns, then `max_new_tokens` new ones."""

    full_mask: Tensor  # (B, P + max_new_tokens): the prompts' mask, then 1 for every generated column (as generate)
    prefill_positions: Tensor  # (B0, P): cumulative sum of the mask minus one, clamped at 0
    next_position: Tensor  # (B, 1): the first generated token's position id
    step_positions: Tensor  # (B, max_new_tokens): the position id of each step's token

    @classmethod
    def of(cls, attention_mask: Tensor, group_size: int, max_new_tokens: int) -> DecodeGrid:
        B0, P = attention_mask.shape
        device = attention_mask.device
        full_mask = torch.ones(B0 * group_size, P + max_new_tokens, dtype=attention_mask.dtype, device=device)
        full_mask[:, :P] = attention_mask.repeat_interleave(group_size, dim=0)
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B0, P)
        next_position = positions[:, -1:].repeat_interleave(group_size, dim=0) + 1  # (B, 1)
        step_positions = next_position + torch.arange(max_new_tokens, device=device)  # (B, max_new_tokens)
        return cls(full_mask, positions, next_position, step_positions)


COMPACT_BELOW = 0.75
"""Drop finished rows from the KV cache once the running ones are at most this share of the rows it holds: a copy
costs about what one step's attention reads, so the copies together write at most 3 caches' worth, while a step after
a stop check runs at most 4/3 of the rows it needs."""


class DynamicCacheSteps:
    """Decode steps through the model's growing KV cache (the prefill's, rows repeated G times), over the rows still
    running once enough have finished (`COMPACT_BELOW`)."""

    def __init__(self, model: nn.Module, cache: Any, grid: DecodeGrid, prompt_width: int) -> None:
        self.model, self.cache, self.P = model, cache, prompt_width
        self.cache_key = cache_keyword(model)
        self.batch = grid.full_mask.shape[0]
        self.rows = torch.arange(self.batch, device=grid.full_mask.device)  # (R,): the batch rows the cache holds
        self.mask, self.positions = grid.full_mask, grid.step_positions  # the grid's R rows
        self.compactable = callable(getattr(cache, "reorder_cache", None))

    def step(self, next_tokens: Tensor, t: int) -> Tensor:
        """The tokens drawn at step t, (B,) -> the logits for step t + 1, (B, V), zeros in the rows dropped."""
        out = self.model(
            input_ids=next_tokens[self.rows, None],
            attention_mask=self.mask[:, : self.P + t + 1],
            position_ids=self.positions[:, t : t + 1],
            use_cache=True,
            **{self.cache_key: self.cache},
        )
        self.cache = returned_cache(out)
        logits = out.logits[:, -1]  # (R, V)
        if logits.shape[0] == self.batch:
            return logits
        return logits.new_zeros(self.batch, logits.shape[-1]).index_copy_(0, self.rows, logits)

    def drop_finished(self, running: Tensor) -> None:
        """running: (B,) bool, the rows that have not ended. Keep only those in the cache when they are at most
        `COMPACT_BELOW` of its rows (a host synchronisation on an accelerator); a cache without `reorder_cache`
        keeps every row."""
        keep = running[self.rows]  # (R,)
        if not self.compactable or int(keep.sum()) > COMPACT_BELOW * keep.shape[0]:
            return
        index = keep.nonzero().squeeze(1)
        self.cache.reorder_cache(index)
        self.rows, self.mask, self.positions = self.rows[index], self.mask[index], self.positions[index]


def prefill(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    grid: DecodeGrid,
    group_size: int,
    static_cache: bool,
    compile: bool,
) -> tuple[Tensor, DynamicCacheSteps | StaticDecoder]:
    """One forward over the B0 prompts -> the first step's logits (B, V), each row repeated G times, and the
    decode steps that continue from the prompts' KV cache (static and maybe compiled, or the dynamic cache)."""
    keep_last = {"logits_to_keep": 1} if accepts_argument(model, "logits_to_keep") else {}
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=grid.prefill_positions,
        use_cache=True,
        **keep_last,
    )
    cache = returned_cache(out)
    last_logits = out.logits[:, -1]  # (B0, V)
    P = input_ids.shape[1]
    max_new_tokens = grid.step_positions.shape[1]
    steps: DynamicCacheSteps | StaticDecoder
    if static_cache or compile:  # copies the prefill cache, each row G times
        cache_key = cache_keyword(model)
        mask = grid.full_mask[:, :P]
        steps = StaticDecoder(model, cache, mask, grid.next_position, max_new_tokens, cache_key, keep_last, compile)
    else:
        steps = DynamicCacheSteps(model, _repeat_cache(cache, group_size) if group_size > 1 else cache, grid, P)
    if group_size > 1:
        last_logits = last_logits.repeat_interleave(group_size, dim=0)  # (B, V)
    return last_logits, steps


def draw(logits: Tensor, do_sample: bool, top_k: int, top_p: float, generator: torch.Generator | None) -> Tensor:
    """One token per row from float32 logits already divided by the temperature, (B, V) -> (B,): a sample
    after top-k/top-p masking, or the argmax (greedy)."""
    if do_sample:
        probs = torch.softmax(mask_logits(logits, top_k, top_p), dim=-1)
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
    return logits.argmax(dim=-1)


@torch.no_grad()
def sample(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    max_new_tokens: int,
    eos_token_id: EosIds,
    pad_token_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    return_logprobs: bool = False,
    stop_check_every: int | None = None,
    do_sample: bool = True,
    group_size: int = 1,
    static_cache: bool = False,
    compile: bool = False,
    skip_finished: bool = True,
) -> SampleOutput:
    """Sample up to `max_new_tokens` tokens after each left-padded prompt (`do_sample` False: greedy, the
    most likely token at every step, as `generate(do_sample=False)`; top-k/top-p do not change the argmax).

    input_ids, attention_mask (B0, P) -> `SampleOutput` with response_ids (B, T), B = B0 * group_size: the
    `group_size` samples of prompt i are rows i*G .. i*G+G-1 (one prefill per prompt, its KV cache repeated).
    A sequence ends at the first of the ids `eos_token_id` (one or several, as in `generate`), then gets
    `pad_token_id`; sampling stops once every sequence has ended, checked every `stop_check_every` steps (a host
    synchronisation on an accelerator; None: 1 on CPU, 8 elsewhere; the output does not depend on it).
    `static_cache`: decode over a transformers `StaticCache` of fixed shapes (`lit_rlhf.rollout.static_decode`);
    `compile`: that, with the decode step `torch.compile`d (`sampling.backend: compiled`). The same draws.
    `skip_finished`: decode only the rows not yet ended (dynamic cache; `COMPACT_BELOW`). The same draws."""
    if group_size < 1:
        raise ValueError(f"sample: group_size must be >= 1, got {group_size}")
    B, device = input_ids.shape[0] * group_size, input_ids.device
    grid = DecodeGrid.of(attention_mask, group_size, max_new_tokens)
    tokens = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device) if return_logprobs else None
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    stop_ids = torch.tensor(eos_id_list(eos_token_id), dtype=torch.long, device=device)
    alive_before = torch.zeros(max_new_tokens, dtype=torch.bool, device=device)  # some sequence unfinished at step t
    # On an accelerator, asking "all finished?" synchronises with the host; do it every few steps there.
    check_every = stop_check_every or (1 if device.type == "cpu" else 8)
    last_logits, steps = prefill(model, input_ids, attention_mask, grid, group_size, static_cache, compile)
    ran = 0
    for t in range(max_new_tokens):
        logits = last_logits.float() if temperature == 1.0 else last_logits.float() / temperature  # (B, V)
        next_tokens = torch.where(unfinished, draw(logits, do_sample, top_k, top_p, generator), pad_token_id)  # (B,)
        tokens[:, t] = next_tokens
        if logprobs is not None:
            logprobs[:, t] = _token_logprobs(logits, next_tokens, unfinished)
        alive_before[t] = unfinished.any()
        unfinished = unfinished & ~torch.isin(next_tokens, stop_ids)
        ran = t + 1
        if t + 1 == max_new_tokens or ((t + 1) % check_every == 0 and not bool(unfinished.any())):
            break
        if skip_finished and (t + 1) % check_every == 0 and isinstance(steps, DynamicCacheSteps):
            steps.drop_finished(unfinished)
        last_logits = steps.step(next_tokens, t)
    del last_logits, steps
    ran = _steps_with_a_live_sequence(alive_before[:ran]) if check_every > 1 else ran
    return SampleOutput(tokens[:, :ran], logprobs[:, :ran] if logprobs is not None else None)


def _token_logprobs(logits: Tensor, tokens: Tensor, running: Tensor) -> Tensor:
    """log softmax(logits)[tokens] in the running rows, 0 in the others: (B, V), (B,), (B,) bool -> (B,)."""
    picked = logits.gather(-1, tokens[:, None]).squeeze(-1)
    return torch.where(running, picked - torch.logsumexp(logits, dim=-1), 0.0)


def _steps_with_a_live_sequence(alive_before: Tensor) -> int:
    """(steps run,) bool, some sequence unfinished at that step -> the steps to keep (at least 1): with a deferred
    stop check, trailing steps may have run after every sequence had ended."""
    return max(int(alive_before.nonzero().max()) + 1 if bool(alive_before.any()) else 0, 1)
