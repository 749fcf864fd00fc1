"""Every setting of AlgorithmConfig, SamplingConfig and RLHFModule is checked for type (a bool is not an int, a
string is not a float), finiteness and range, with a ConfigError naming the field and the value."""

from __future__ import annotations

import dataclasses
import inspect
import math
import re

import pytest

from lit_rlhf.config import AlgorithmConfig, ConfigError, SamplingConfig, check_module_settings
from lit_rlhf.training.module import RLHFModule

INF, NAN = math.inf, math.nan

ALGORITHM_CASES = [
    ("group_size", 0),
    ("group_size", True),
    ("group_size", 2.0),
    ("ppo_epochs", 0),
    ("ppo_epochs", "2"),
    ("num_minibatches", -1),
    ("micro_batch_size", 0),
    ("micro_batch_size", 1.5),
    ("kl_coef", -0.1),
    ("kl_coef", INF),
    ("kl_coef", "0.05"),
    ("kl_in_reward", 1),
    ("kl_in_reward", "yes"),
    ("clip_eps_low", 0.0),
    ("clip_eps_low", NAN),
    ("clip_eps_high", -0.2),
    ("clip_eps_high", INF),
    ("dual_clip", 0.5),
    ("dual_clip", INF),
    ("value_clip", 0.0),
    ("value_clip", NAN),
    ("vf_coef", -0.5),
    ("vf_coef", NAN),
    ("value_lr_scale", 0.0),
    ("value_lr_scale", INF),
    ("gamma", 1.5),
    ("gamma", NAN),
    ("lam", -0.1),
    ("lam", True),
    ("whiten_advantages", 0),
    ("entropy_coef", -0.01),
    ("entropy_coef", INF),
    ("truncated_score", NAN),
    ("truncated_score", "-1"),
    ("mask_truncated", "false"),
    ("max_grad_norm", 0.0),
    ("max_grad_norm", INF),
    ("group_eps", 0.0),
    ("group_eps", -1e-6),
    ("group_eps", NAN),
]

SAMPLING_CASES = [
    ("max_new_tokens", 0),
    ("max_new_tokens", 8.0),
    ("max_new_tokens", True),
    ("temperature", 0.0),
    ("temperature", INF),
    ("temperature", NAN),
    ("temperature", "1.0"),
    ("top_k", -1),
    ("top_k", 1.5),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", NAN),
    ("do_sample", 1),
]

MODULE_CASES = [
    ("lr", 0.0),
    ("lr", INF),
    ("lr", NAN),
    ("lr", "1e-5"),
    ("lr", True),
    ("weight_decay", -0.1),
    ("weight_decay", INF),
    ("betas", (0.9,)),
    ("betas", (0.9, 1.0)),
    ("betas", (NAN, 0.999)),
    ("betas", "0.9,0.999"),
    ("warmup_steps", -1),
    ("warmup_steps", 2.5),
    ("lr_schedule", "step"),
    ("max_consecutive_skips", 0),
    ("max_consecutive_skips", True),
    ("log_samples_every_n_steps", -1),
    ("log_samples_every_n_steps", 0.5),
    ("val_samples_per_prompt", 0),
    ("separate_critic", "no"),
    ("gradient_checkpointing", 1),
    ("trust_remote_code", "false"),
    ("reward_weights", [1.0, NAN]),
    ("reward_weights", [INF]),
    ("reward_weights", ["1"]),
    ("reward_weights", 2.0),
    ("reward_model_weight", INF),
    ("reward_model_weight", None),
    ("nan_score", NAN),
    ("nan_score", "0"),
]


def _names(value):
    """The value as the message shows it (repr), escaped for a regex."""
    return re.escape(repr(value))


@pytest.mark.parametrize("field, value", ALGORITHM_CASES, ids=[f"{f}={v!r}" for f, v in ALGORITHM_CASES])
def test_algorithm_setting_is_refused_naming_field_and_value(field, value):
    with pytest.raises(ConfigError, match=f"^algorithm\\.{field}: must be .*got {_names(value)}"):
        AlgorithmConfig(name="ppo", **{field: value})


@pytest.mark.parametrize("field, value", SAMPLING_CASES, ids=[f"{f}={v!r}" for f, v in SAMPLING_CASES])
def test_sampling_setting_is_refused_naming_field_and_value(field, value):
    with pytest.raises(ConfigError, match=f"^sampling\\.{field}: must be .*got {_names(value)}"):
        SamplingConfig(**{field: value})


def module_defaults() -> dict:
    """RLHFModule's constructor arguments at their defaults, read from its signature, plus one reward function."""
    params = inspect.signature(RLHFModule.__init__).parameters
    args = {k: p.default for k, p in params.items() if k != "self"}
    args["reward_fns"] = ["lit_rlhf.tasks.digits.sort_digits_reward"]
    return args


def test_module_defaults_pass():
    check_module_settings(module_defaults(), SamplingConfig())


@pytest.mark.parametrize("field, value", MODULE_CASES, ids=[f"{f}={v!r}" for f, v in MODULE_CASES])
def test_module_setting_is_refused_naming_field_and_value(field, value):
    args = {**module_defaults(), field: value}
    with pytest.raises(ConfigError, match=f"^model\\.{field}: "):
        check_module_settings(args, SamplingConfig())


def test_every_numeric_or_boolean_setting_refuses_a_string():
    """A guard for fields added later: each int/float/bool field of the two configs names itself for a string."""
    for cls, prefix, base in ((AlgorithmConfig, "algorithm", {"name": "ppo"}), (SamplingConfig, "sampling", {})):
        for field in dataclasses.fields(cls):
            if not re.search(r"\b(int|float|bool)\b", str(field.type)):
                continue
            with pytest.raises(ConfigError, match=f"^{prefix}\\.{field.name}"):
                cls(**base, **{field.name: "nonsense"})


def test_valid_edge_values_pass():
    """The closed ends of the ranges and None where allowed are accepted."""
    algo = AlgorithmConfig(name="ppo", gamma=0.0, lam=1.0, kl_coef=0, vf_coef=0, dual_clip=None, value_clip=None)
    assert (algo.gamma, algo.lam, algo.kl_coef) == (0.0, 1.0, 0)
    assert AlgorithmConfig(name="grpo", clip_eps_low=1e9, clip_eps_high=1e9, max_grad_norm=None).clip_eps_high == 1e9
    assert SamplingConfig(top_p=1.0, top_k=0, temperature=1e-3).top_p == 1.0
    check_module_settings({**module_defaults(), "betas": [0.0, 0.0], "nan_score": -1, "lr": 1}, SamplingConfig())


def test_module_refuses_an_infinite_learning_rate_before_any_model_loads():
    with pytest.raises(ConfigError, match=r"^model\.lr: must be > 0 \(a finite number\), got inf"):
        RLHFModule(policy="builtin:digits", reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"], lr=INF)
