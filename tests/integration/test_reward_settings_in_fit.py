"""`model.reward_workers` and `model.reward_timeout_s` through a real CPU Trainer: the scores trained on are those
of the plain serial loop, a stuck reward function stops `fit` naming it, and bad values fail before any model loads."""

from __future__ import annotations

import threading

import pytest

from conftest import make_policy, make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.config import ConfigError
from lit_rlhf.rewards.functions import RewardError, rowwise
from lit_rlhf.tasks.digits import sort_digits_score

PROMPTS = ["3142>", "907>", "55>", "1234>"]


@rowwise
def rule_reward(prompts, responses, **meta):
    return [sort_digits_score(p, r) for p, r in zip(prompts, responses, strict=True)]


def rank_reward(prompts, responses, **meta):
    """Depends on the whole batch (a response's length rank), so it must never be split."""
    order = sorted(range(len(responses)), key=lambda i: (len(responses[i]), i))
    return [float(order.index(i)) / len(responses) for i in range(len(responses))]


class Recorder(RLHFModule):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[list[str], list[str], list[float]]] = []

    def on_experience(self, experience):
        self.seen.append((list(experience.prompts), list(experience.responses), experience.scores.tolist()))


def fit(module, max_steps):
    trainer = make_trainer(max_steps=max_steps)
    trainer.fit(module, RolloutDataModule(prompts=PROMPTS, batch_size=4, max_prompt_length=8, shuffle=False))


def settings(tokenizer, **extra):
    return dict(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=[rule_reward, rank_reward],
        reward_weights=[1.0, 0.5],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
        log_samples_every_n_steps=0,
        **extra,
    )


def test_workers_train_on_the_scores_of_the_plain_loop(tokenizer):
    module = Recorder(**settings(tokenizer, reward_workers=3, reward_timeout_s=60))
    fit(module, max_steps=2)
    assert len(module.seen) == 2
    for prompts, responses, scores in module.seen:
        rank = sorted(range(len(responses)), key=lambda i: (len(responses[i]), i))
        expected = [
            sort_digits_score(p, r) + 0.5 * rank.index(i) / len(responses)
            for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
        ]
        assert scores == pytest.approx(expected, abs=1e-6)


def test_a_stuck_reward_function_stops_fit_after_the_timeout(tokenizer):
    release = threading.Event()

    def stuck_reward(prompts, responses, **meta):
        release.wait(60)
        return [0.0] * len(prompts)

    module = RLHFModule(
        **{**settings(tokenizer, reward_timeout_s=0.5), "reward_fns": [stuck_reward], "reward_weights": None}
    )
    with pytest.raises(RewardError, match="stuck_reward did not return within reward_timeout_s=0.5 s"):
        fit(module, max_steps=1)
    release.set()


@pytest.mark.parametrize(
    ("extra", "field"),
    [({"reward_timeout_s": 0.0}, "model.reward_timeout_s"), ({"reward_workers": -2}, "model.reward_workers")],
)
def test_bad_reward_settings_fail_before_any_model_loads(extra, field):
    with pytest.raises(ConfigError, match=field):
        RLHFModule(policy="./no/such/folder", reward_fns=[rule_reward], **extra)
