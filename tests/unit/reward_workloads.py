"""Module-level reward functions for the worker-process tests (picklable by dotted path)."""

from __future__ import annotations

import os
import time

from lit_rlhf.rewards.functions import isolated, rowwise

GIL_EXPONENT = 10**8


def gil_holding_reward(prompts, responses, **meta):
    """One C call that holds the GIL for minutes: 10 ** (10 ** 8), a 100-million-digit integer."""
    base = 10
    _ = base**GIL_EXPONENT
    return [0.0] * len(prompts)


@rowwise
def gil_holding_rowwise(prompts, responses, **meta):
    return gil_holding_reward(prompts, responses, **meta)


@isolated
def isolated_gil_holding_reward(prompts, responses, **meta):
    return gil_holding_reward(prompts, responses, **meta)


@isolated(timeout_s=1)
def isolated_metric_with_own_limit(prompts, responses, **meta):
    return gil_holding_reward(prompts, responses, **meta)


def tight_loop_reward(prompts, responses, **meta):
    """Pure Python, never yielding on purpose; stops after 8 s so that its abandoned thread does not spin on."""
    end = time.monotonic() + 8
    while time.monotonic() < end:
        pass
    return [0.0] * len(prompts)


def length_reward(prompts, responses, **meta):
    return [float(len(r)) for r in responses]


@isolated
def pid_reward(prompts, responses, **meta):
    return [float(os.getpid())] * len(prompts)


def raising_reward(prompts, responses, **meta):
    raise ValueError("no score for you")


def dying_reward(prompts, responses, **meta):
    os._exit(3)
