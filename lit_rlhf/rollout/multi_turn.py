"""Multi-turn rollouts: the policy and an `Environment` take turns, and the conversation becomes one `Rollout`.

The rollout's response grid holds the whole continuation after the prompt, the policy's and the environment's
tokens interleaved; `response_mask` marks only the policy's tokens (the loss, KL, entropy and advantages see
only those) and `context_mask` the environment's (attended, never trained on). Each policy turn re-prefills
prompt + conversation so far (left padded) and samples with the rollout backend, so every backend works and no
KV cache is carried across turns.

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
from torch import Tensor

from lit_rlhf.config import AlgorithmConfig, ConfigError
from lit_rlhf.models.stop_ids import stop_token_ids
from lit_rlhf.rewards.composer import one_part, reward_parts
from lit_rlhf.rollout.backends.base import RolloutBackend
from lit_rlhf.rollout.collect import RolloutSettings, RolloutTimings, ScoreFn, repeat_rows
from lit_rlhf.rollout.environment import (
    Environment,
    EnvironmentConfig,
    build_environment,
    check_reset,
    check_stop_strings,
    checked_step,
)
from lit_rlhf.rollout.generation import EosIds, Generation, decode_responses, eos_id_list
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


@dataclasses.dataclass(frozen=True)
class Conversations:
    """The environment the policy talks to, and each episode's limits: at most `max_turns` policy turns and
    `max_total_tokens` tokens after the prompt (policy and environment tokens together)."""

    env: Environment
    max_turns: int
    max_total_tokens: int

    budget = "model.environment.max_total_tokens"


def conversations_from(
    config: EnvironmentConfig | dict[str, Any] | None, algo: AlgorithmConfig
) -> Conversations | None:
    """The environment of `model.environment` (None: single-turn rollouts); every check runs here, before any
    model loads."""
    if config is None:
        return None
    config = EnvironmentConfig(**config) if isinstance(config, dict) else config
    if not isinstance(config, EnvironmentConfig):
        raise ConfigError(f"model.environment: {config!r}; give {{name: builtin:peek, max_turns: 4, ...}} or null")
    check_multi_turn_settings(algo)
    env = build_environment(config)
    check_stop_strings(env)
    return Conversations(env, config.max_turns, config.max_total_tokens)


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


@dataclasses.dataclass
class MultiTurnCollector:
    """Collects multi-turn rollouts (`Collector`): `group_size` episodes per prompt against the environment, each
    policy turn sampled by `backend`; the grid width T is the longest conversation."""

    conversations: Conversations
    backend: RolloutBackend
    tokenizer: Any
    score: ScoreFn
    settings: RolloutSettings
    eos_token_id: EosIds | None = None  # the stop ids that end a policy turn; None: `stop_token_ids(tokenizer)`

    def __post_init__(self) -> None:
        eos = stop_token_ids(self.tokenizer) if self.eos_token_id is None else self.eos_token_id
        self.stop_ids = frozenset(eos_id_list(eos))

    @torch.no_grad()
    def collect(self, prompts: PromptBatch, policy_version: int = 0) -> tuple[Rollout, RolloutTimings]:
        """The episodes played to their end, then scored: the environment's rewards plus `score`'s."""
        if self.settings.overlong is not None:
            raise ConfigError("model.algorithm.overlong_buffer: not supported with model.environment; set it to null")
        timings = RolloutTimings()
        prompts = prompts.to(self.backend.device)
        G = self.settings.group_size
        texts, meta = repeat_rows(prompts, G)
        prompt_ids = prompts.input_ids.repeat_interleave(G, dim=0)  # (B, P)
        prompt_mask = prompts.attention_mask.repeat_interleave(G, dim=0)  # (B, P)
        start = time.perf_counter()
        episodes = self.play(prompt_ids, prompt_mask, texts, meta)
        timings.generate_s = time.perf_counter() - start
        start = time.perf_counter()
        rollout = self.scored_rollout(episodes, prompt_ids, prompt_mask, texts, meta, policy_version)
        timings.score_s = time.perf_counter() - start
        return rollout, timings

    def play(
        self, prompt_ids: Tensor, prompt_mask: Tensor, texts: list[str], meta: dict[str, list[Any]]
    ) -> list[Conversation]:
        """Every episode (B = B0 x G rows of prompt_ids, prompt_mask (B, P)) from reset to its end: policy turns
        and the environment's answers."""
        env = self.conversations.env
        B = len(texts)
        rows = [{"prompt": texts[b], **{key: column[b] for key, column in meta.items()}} for b in range(B)]
        states = check_reset(env, env.reset(rows), B)
        episodes = [
            Conversation(ids[m.bool()].tolist()) for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu(), strict=True)
        ]
        for turn in range(self.conversations.max_turns):
            live = [b for b in range(B) if episodes[b].running]
            if not live:
                break
            actions = self.policy_turn([episodes[b] for b in live])
            result = checked_step(env, [states[b] for b in live], [text for text, _ in actions])
            for i, b in enumerate(live):
                states[b] = result.states[i]
                self.answer(
                    episodes[b], turn, actions[i][1], float(result.rewards[i]), result.done[i], result.observations[i]
                )
        return episodes

    def answer(
        self, episode: Conversation, turn: int, hit_limit: bool, reward: float, done: bool, observation: str
    ) -> None:
        """After a policy turn: the episode's reward, then its end or the environment's observation."""
        episode.reward += reward
        if hit_limit or episode.tokens[-1] in self.stop_ids or done:
            episode.end(truncated=hit_limit)  # as single-turn: truncated when a turn hit its token limit
            return
        observed = self.tokenizer.encode(observation, add_special_tokens=False)
        room = self.conversations.max_total_tokens - len(episode.tokens) - len(observed)
        if turn + 1 == self.conversations.max_turns or room < 1:  # no turn left, or no room for another policy token
            episode.end(truncated=True)
        else:
            episode.add(observed, by_policy=False)

    def scored_rollout(
        self,
        episodes: list[Conversation],
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        texts: list[str],
        meta: dict[str, list[Any]],
        policy_version: int,
    ) -> Rollout:
        """The conversations on one response grid (policy tokens in `response_mask`, the environment's in
        `context_mask`), decoded and scored."""
        device, pad = prompt_ids.device, self.tokenizer.pad_token_id
        B, T = len(episodes), max(len(e.tokens) for e in episodes)
        response_ids = torch.full((B, T), pad, dtype=torch.long)
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
        responses = decode_responses(self.tokenizer, response_ids, attended, sorted(self.stop_ids))
        conversation = Generation(prompt_ids, prompt_mask, response_ids, attended, truncated)
        with reward_parts() as parts:
            scores = self.score(texts, responses, meta, conversation).to(device).float()
        scores = scores + torch.tensor([e.reward for e in episodes], dtype=torch.float32, device=device)
        if self.settings.truncated_score is not None:
            scores = torch.where(truncated, torch.full_like(scores, self.settings.truncated_score), scores)
        return Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            context_mask=context_mask,
            truncated=truncated,
            scores=scores,
            prompts=texts,
            responses=responses,
            meta=meta,
            reward_parts=one_part(parts),
            policy_version=policy_version,
        )

    def policy_turn(self, episodes: list[Conversation]) -> list[tuple[str, bool]]:
        """One policy turn for each running episode: its tokens are appended; returns (turn text without EOS,
        whether it ended at the token limit rather than at EOS or a stop string) per episode."""
        tokenizer, sampling = self.tokenizer, self.settings.sampling
        room = [self.conversations.max_total_tokens - len(e.tokens) for e in episodes]
        limit = min(sampling.max_new_tokens, max(room))
        ids, mask = left_pad([e.prompt + e.tokens for e in episodes], tokenizer.pad_token_id, self.backend.device)
        batch = PromptBatch(input_ids=ids, attention_mask=mask, texts=[""] * len(episodes))
        gen = self.backend.generate(batch, 1, dataclasses.replace(sampling, max_new_tokens=limit))
        out = []
        for i, episode in enumerate(episodes):
            cap = min(limit, room[i])
            tokens = gen.response_ids[i][gen.response_mask[i]].tolist()[:cap]  # up to and including EOS
            eos = bool(tokens) and tokens[-1] in self.stop_ids
            body = tokens[:-1] if eos else tokens
            cut = stop_cut(tokenizer, body, self.conversations.env.stop_strings)
            if cut is not None:
                tokens, body, eos = body[:cut], body[:cut], False
            episode.add(tokens, by_policy=True)
            out.append((tokenizer.decode(body, skip_special_tokens=False), not eos and cut is None))
        return out
