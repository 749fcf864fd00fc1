"""Environments for multi-turn rollouts: what answers the policy between its turns (docs/multi-turn.md).

An `Environment` is batched over episodes and keeps its per-episode state in values it hands back, so the
collector can step any subset of the episodes:

    states = env.reset(rows)                       # one state per episode, from its prompt row
    result = env.step(states, actions)             # actions: the policy's text of this turn, one per episode
    result.observations, result.rewards, result.done, result.states   # one each per stepped episode

A policy turn ends at its EOS, at one of `env.stop_strings` (e.g. '</calc>', the end of a tool call; the stop
string is part of the turn) or at the per-turn token limit. The observation is appended to the conversation as
context tokens (attended, never trained on); it is not appended when the episode ends.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lit_rlhf.config import ConfigError, check_int
from lit_rlhf.registry import BUILTIN_PREFIX
from lit_rlhf.rewards.functions import import_callable

BUILTIN_ENVIRONMENTS = {
    "calculator": "lit_rlhf.tasks.calculator.CalculatorEnvironment",
    "peek": "lit_rlhf.tasks.calculator.PeekEnvironment",
}
"""`builtin:<name>` environments: dotted paths, imported only when named."""


@dataclass
class StepResult:
    """An environment's answer to one turn of n episodes.

    Attributes:
        observations: n texts appended after the policy's turn (ignored where done).
        rewards: n finite rewards for this turn; an episode's score is the sum over its turns.
        done: n flags: the episode is over.
        states: n new episode states, passed to the next `step`.
    """

    observations: list[str]
    rewards: list[float]
    done: list[bool]
    states: list[Any]


class Environment(ABC):
    """A batched, stateless-by-convention environment: all per-episode state lives in the returned states."""

    stop_strings: tuple[str, ...] = ()
    """Texts that end a policy turn (included in it), e.g. the end of a tool call."""

    @abstractmethod
    def reset(self, rows: list[dict[str, Any]]) -> list[Any]:
        """One initial state per episode from its prompt row ({'prompt': text, ...the dataset's extra columns})."""

    @abstractmethod
    def step(self, states: list[Any], actions: list[str]) -> StepResult:
        """Answer one policy turn (`actions[i]`, its text without EOS) of each episode `states[i]`."""


@dataclass
class EnvironmentConfig:
    """Multi-turn rollouts: the environment and the limits of an episode."""

    name: str
    """'builtin:<name>' (builtin:peek, builtin:calculator) or the dotted path of an `Environment` class or
    factory, called with `options`."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the environment class or factory `name` names."""
    max_turns: int = 4
    """Policy turns per episode; an episode still running after them is truncated."""
    max_total_tokens: int = 64
    """Tokens of the whole conversation after the prompt (policy and environment); an episode that reaches it
    is truncated. Each policy turn writes at most `sampling.max_new_tokens` of them."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(
                f"model.environment.name: {self.name!r}; give 'builtin:<name>' or a dotted path to an Environment"
            )
        if not isinstance(self.options, dict):
            raise ConfigError(f"model.environment.options: {self.options!r}; give a mapping of keyword arguments")
        check_int(self.max_turns, "model.environment.max_turns", 1, fix="1 is a single-turn episode")
        check_int(self.max_total_tokens, "model.environment.max_total_tokens", 1, fix="64 is the default")


def build_environment(config: EnvironmentConfig) -> Environment:
    """The environment `config.name` names, built with `config.options` (a `ConfigError` naming the field)."""
    name = config.name
    if name.startswith(BUILTIN_PREFIX):
        key = name.removeprefix(BUILTIN_PREFIX)
        if key not in BUILTIN_ENVIRONMENTS:
            choices = ", ".join(BUILTIN_PREFIX + n for n in sorted(BUILTIN_ENVIRONMENTS))
            raise ConfigError(f"model.environment.name: unknown built-in environment {name!r}; available: {choices}")
        name = BUILTIN_ENVIRONMENTS[key]
    factory = import_callable(name, "model.environment.name")
    try:
        env = factory(**config.options)
    except TypeError as err:
        raise ConfigError(f"model.environment.options: {name} rejected {config.options!r}: {err}") from err
    if not isinstance(env, Environment):
        raise ConfigError(
            f"model.environment.name: {name} built a {type(env).__name__}, not a lit_rlhf.rollout.environment."
            "Environment; subclass it (reset and step)"
        )
    check_stop_strings(env)
    return env


def check_stop_strings(env: Environment) -> None:
    """Refuse an environment whose `stop_strings` is not a tuple or list of non-empty strings."""
    stops = env.stop_strings
    if not isinstance(stops, tuple | list) or not all(isinstance(s, str) and s for s in stops):
        raise ConfigError(f"{type(env).__name__}.stop_strings: {stops!r}; give a tuple of non-empty strings")


def checked_step(env: Environment, states: list[Any], actions: list[str]) -> StepResult:
    """`env.step`, with its answer checked: n of everything, strings, finite rewards, bool flags."""
    result = env.step(states, actions)
    where = f"{type(env).__name__}.step"
    if not isinstance(result, StepResult):
        raise TypeError(f"{where} returned a {type(result).__name__}; return a lit_rlhf.rollout.environment.StepResult")
    n = len(actions)
    for name in ("observations", "rewards", "done", "states"):
        value = getattr(result, name)
        if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != n:
            size = f"a {type(value).__name__}" if isinstance(value, str) else f"{len(value)} entries"
            if not isinstance(value, Sequence):
                size = f"a {type(value).__name__}"
            raise ValueError(f"{where}: {name} has {size} for {n} episodes; return a list of one per stepped episode")
    for i, (obs, reward, done) in enumerate(zip(result.observations, result.rewards, result.done, strict=True)):
        if not isinstance(obs, str):
            raise TypeError(f"{where}: observations[{i}] is a {type(obs).__name__}, not a str")
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise ValueError(f"{where}: rewards[{i}] is {reward!r}; give a finite float")
        if not isinstance(done, bool):
            raise TypeError(f"{where}: done[{i}] is {done!r}; give a bool")
    return result


def check_reset(env: Environment, states: Any, n: int) -> list[Any]:
    """`env.reset`'s states, checked to be a list of n."""
    if not isinstance(states, list) or len(states) != n:
        size = len(states) if isinstance(states, list) else type(states).__name__
        raise ValueError(
            f"{type(env).__name__}.reset returned {size} states for {n} episodes; return a list of one each"
        )
    return states
