"""Multi-turn rollouts: the policy and an `Environment` take turns, and the conversation becomes one `Rollout`.

The rollout's response grid holds the whole continuation after the prompt, the policy's and the environment's
tokens interleaved; `response_mask` marks only the policy's tokens (the loss, KL, entropy and advantages see
only those) and `context_mask` the environment's (attended, never trained on). Each policy turn re-prefills
prompt + conversation so far (left padded) and samples with the configured backend, so both backends work and
no KV cache is carried across turns.

Score: the sum of the environment's per-turn rewards plus the module's `compute_scores` (reward functions and
reward model, 0 when there are none) on the decoded conversation. GRPO-family advantages broadcast it over the
policy's tokens; a per-token estimator that walks the grid (GAE, discounted REINFORCE++) is refused, since its
recursion would pass through the environment's tokens.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch import Tensor, nn

from lit_rlhf.config import AlgorithmConfig, ConfigError, SamplingConfig
from lit_rlhf.models.build import check_context_window
from lit_rlhf.rollout.collect import RolloutTimings, ScoreFn
from lit_rlhf.rollout.environment import (
    Environment,
    EnvironmentConfig,
    build_environment,
    check_reset,
    check_stop_strings,
    checked_step,
)
from lit_rlhf.rollout.generation import Generation, decode_responses, generate
from lit_rlhf.types import PromptBatch, Rollout


def check_multi_turn_settings(algo: AlgorithmConfig) -> None:
    """Refuse the settings whose meaning breaks when environment tokens sit between the policy's."""
    name, walk = algo.filled.advantage_estimator, algo.estimator.walks_token_grid
    if walk == "always":
        raise ConfigError(
            f"model.algorithm.advantage_estimator: {name!r} is not supported with model.environment: its "
            "recursion would run through the environment's tokens; use a group estimator (algorithm.name: grpo)"
        )
    if walk == "when_discounted" and algo.gamma != 1.0:
        raise ConfigError(
            f"model.algorithm.gamma: {algo.gamma} with {name!r} and model.environment would discount over "
            "the environment's tokens; set gamma: 1.0 or use a group estimator"
        )
    if algo.overlong_buffer is not None:
        raise ConfigError(
            "model.algorithm.overlong_buffer: over-long shaping counts one response of max_new_tokens, not a "
            "multi-turn conversation; set it to null with model.environment"
        )


def multi_turn_collector(
    config: EnvironmentConfig | dict[str, Any] | None, algo: AlgorithmConfig
) -> MultiTurnCollector | None:
    """The collector for `model.environment` (None: single-turn rollouts); every check runs here, before any
    model loads."""
    if config is None:
        return None
    config = EnvironmentConfig(**config) if isinstance(config, dict) else config
    if not isinstance(config, EnvironmentConfig):
        raise ConfigError(f"model.environment: {config!r}; give {{name: builtin:peek, max_turns: 4, ...}} or null")
    check_multi_turn_settings(algo)
    return MultiTurnCollector(build_environment(config), config.max_turns, config.max_total_tokens)


def stop_cut(tokenizer: Any, tokens: list[int], stops: tuple[str, ...] | list[str]) -> int | None:
    """The fewest leading `tokens` whose text contains a stop string, or None when no prefix does. Special
    tokens are left out of that text (a '<pad>' the policy wrote does not end a turn at '>')."""
    if not stops or not any(s in tokenizer.decode(tokens, skip_special_tokens=True) for s in stops):
        return None
    for k in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:k], skip_special_tokens=True)
        if any(s in text for s in stops):
            return k
    return None


def left_pad(rows: list[list[int]], pad_token_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Token lists -> left-padded ids (n, L) and attention mask (n, L)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


@dataclasses.dataclass
class Conversation:
    """One episode: its tokens after the prompt, who wrote each, and how it ended."""

    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    policy: list[bool] = dataclasses.field(default_factory=list)  # True: the policy's token
    reward: float = 0.0
    running: bool = True
    truncated: bool = False

    def add(self, tokens: list[int], by_policy: bool) -> None:
        self.tokens += tokens
        self.policy += [by_policy] * len(tokens)

    def end(self, truncated: bool) -> None:
        self.running, self.truncated = False, truncated


class MultiTurnCollector:
    """Collects multi-turn rollouts against `env`: at most `max_turns` policy turns and `max_total_tokens`
    conversation tokens per episode (the grid width T is the longest conversation)."""

    budget = "model.environment.max_total_tokens"

    def __init__(self, env: Environment, max_turns: int, max_total_tokens: int):
        check_stop_strings(env)
        self.env, self.max_turns, self.max_total_tokens = env, max_turns, max_total_tokens

    @torch.no_grad()
    def collect(
        self,
        prompts: PromptBatch,
        policy: nn.Module,
        tokenizer: Any,
        score: ScoreFn,
        group_size: int,
        sampling: SamplingConfig,
        truncated_score: float | None = None,
        policy_version: int = 0,
        overlong: tuple[int, float] | None = None,
    ) -> tuple[Rollout, RolloutTimings]:
        """`collect_rollout`'s contract for conversations: `group_size` episodes per prompt, scored."""
        if overlong is not None:
            raise ConfigError("model.algorithm.overlong_buffer: not supported with model.environment; set it to null")
        check_context_window({"model.policy": policy}, prompts.input_ids.shape[1], {self.budget: self.max_total_tokens})
        timings = RolloutTimings()
        device = next(policy.parameters()).device
        prompts = prompts.to(device)
        G = group_size
        prompt_ids = prompts.input_ids.repeat_interleave(G, dim=0)  # (B, P)
        prompt_mask = prompts.attention_mask.repeat_interleave(G, dim=0)  # (B, P)
        prompt_texts = [text for text in prompts.texts for _ in range(G)]
        meta = {key: [v for v in values for _ in range(G)] for key, values in prompts.meta.items()}
        B = len(prompt_texts)
        rows = [{"prompt": prompt_texts[b], **{key: column[b] for key, column in meta.items()}} for b in range(B)]
        states = check_reset(self.env, self.env.reset(rows), B)
        episodes = [
            Conversation(ids[m.bool()].tolist()) for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu(), strict=True)
        ]
        start = time.perf_counter()
        for turn in range(self.max_turns):
            live = [b for b in range(B) if episodes[b].running]
            if not live:
                break
            actions = self.policy_turn(policy, tokenizer, sampling, [episodes[b] for b in live], device)
            result = checked_step(self.env, [states[b] for b in live], [text for text, _ in actions])
            for i, b in enumerate(live):
                episode, (_, hit_limit) = episodes[b], actions[i]
                states[b] = result.states[i]
                episode.reward += float(result.rewards[i])
                if hit_limit or episode.tokens[-1] == tokenizer.eos_token_id or result.done[i]:
                    episode.end(truncated=hit_limit)  # as single-turn: truncated when a turn hit its token limit
                    continue
                observation = tokenizer.encode(result.observations[i], add_special_tokens=False)
                room = self.max_total_tokens - len(episode.tokens) - len(observation)
                if turn + 1 == self.max_turns or room < 1:  # no turn left, or no room for another policy token
                    episode.end(truncated=True)
                else:
                    episode.add(observation, by_policy=False)
        timings.generate_s = time.perf_counter() - start

        start = time.perf_counter()
        T = max(len(e.tokens) for e in episodes)
        response_ids = torch.full((B, T), tokenizer.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros(B, T, dtype=torch.bool)
        context_mask = torch.zeros(B, T, dtype=torch.bool)
        for b, episode in enumerate(episodes):
            n = len(episode.tokens)
            response_ids[b, :n] = torch.tensor(episode.tokens, dtype=torch.long)
            by_policy = torch.tensor(episode.policy, dtype=torch.bool)
            response_mask[b, :n], context_mask[b, :n] = by_policy, ~by_policy
        response_ids, response_mask, context_mask = (x.to(device) for x in (response_ids, response_mask, context_mask))
        truncated = torch.tensor([e.truncated for e in episodes], dtype=torch.bool, device=device)
        attended = response_mask | context_mask
        responses = decode_responses(tokenizer, response_ids, attended)
        conversation = Generation(prompt_ids, prompt_mask, response_ids, attended, truncated)
        scores = score(prompt_texts, responses, meta, conversation).to(device).float()
        scores = scores + torch.tensor([e.reward for e in episodes], dtype=torch.float32, device=device)
        if truncated_score is not None:
            scores = torch.where(truncated, torch.full_like(scores, truncated_score), scores)
        timings.score_s = time.perf_counter() - start
        rollout = Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            context_mask=context_mask,
            truncated=truncated,
            scores=scores,
            prompts=prompt_texts,
            responses=responses,
            meta=meta,
            policy_version=policy_version,
        )
        return rollout, timings

    def policy_turn(
        self, policy: nn.Module, tokenizer: Any, sampling: SamplingConfig, episodes: list[Conversation], device: Any
    ) -> list[tuple[str, bool]]:
        """One policy turn for each running episode: its tokens are appended; returns (turn text without EOS,
        whether it ended at the token limit rather than at EOS or a stop string) per episode."""
        room = [self.max_total_tokens - len(e.tokens) for e in episodes]
        limit = min(sampling.max_new_tokens, max(room))
        ids, mask = left_pad([e.prompt + e.tokens for e in episodes], tokenizer.pad_token_id, device)
        batch = PromptBatch(input_ids=ids, attention_mask=mask, texts=[""] * len(episodes))
        settings = dataclasses.replace(sampling, max_new_tokens=limit)
        gen = generate(policy, batch, 1, settings, tokenizer.eos_token_id, tokenizer.pad_token_id)
        out = []
        for i, episode in enumerate(episodes):
            cap = min(limit, room[i])
            tokens = gen.response_ids[i][gen.response_mask[i]].tolist()[:cap]  # up to and including EOS
            eos = bool(tokens) and tokens[-1] == tokenizer.eos_token_id
            body = tokens[:-1] if eos else tokens
            cut = stop_cut(tokenizer, body, self.env.stop_strings)
            if cut is not None:
                tokens, body, eos = body[:cut], body[:cut], False
            episode.add(tokens, by_policy=True)
            out.append((tokenizer.decode(body, skip_special_tokens=False), not eos and cut is None))
        return out
