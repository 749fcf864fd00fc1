"""Faults during training, through a real CPU Trainer: non-finite losses and gradients skip the update (weights
unchanged, counted) and stop training after K in a row with an error naming what; reward functions that raise or
return NaN; degenerate rollouts (empty responses, all truncated, all rewards equal) train on with metrics that say
so and no NaN anywhere."""

from __future__ import annotations

import math

import pytest
from lightning.pytorch.callbacks import Callback

from conftest import EOS_ID, checksum, make_policy, make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.rewards.functions import RewardError
from lit_rlhf.tasks.digits import sort_digits_reward

PROMPTS = ["3142>", "907>", "55>", "1234>"]


class StepWatcher(RLHFModule):
    """Records the weights around every optimizer step and whether the step was skipped."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps: list[dict] = []

    def clip_and_step(self, stats):
        before, skipped_before = checksum(self.actor_critic), self.state.skipped_updates
        try:
            return super().clip_and_step(stats)
        finally:
            self.steps.append(
                {
                    "skipped": self.state.skipped_updates > skipped_before,
                    "unchanged": checksum(self.actor_critic) == before,
                    "bad": sorted(k for k, v in stats.items() if not math.isfinite(v)),
                }
            )


class Logged(Callback):
    """Every metric the module logged, per training batch."""

    def __init__(self):
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def fit(module, max_steps, callbacks=(), prompts=PROMPTS, batch_size=2):
    trainer = make_trainer(max_steps=max_steps, callbacks=list(callbacks))
    trainer.fit(module, RolloutDataModule(prompts=prompts, batch_size=batch_size, max_prompt_length=8, shuffle=False))
    return trainer


# ----------------------------------------------------------------------------- non-finite loss / gradient


class HugeFirstRollout:
    """Scores of 1e30 on its first call (finite, but the squared value error overflows float32), then normal."""

    def __init__(self):
        self.calls = 0

    def __call__(self, prompts, responses, **meta):
        self.calls += 1
        scores = sort_digits_reward(prompts, responses)
        return [1e30] * len(scores) if self.calls == 1 else scores


def test_non_finite_loss_skips_the_update_and_training_goes_on(tokenizer):
    module = StepWatcher(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=[HugeFirstRollout()],
        algorithm=AlgorithmConfig(name="ppo", group_size=2, num_minibatches=2),
        sampling=SamplingConfig(max_new_tokens=4),
        lr=1e-2,
        max_consecutive_skips=3,
    )
    logged = Logged()
    trainer = fit(module, max_steps=4, callbacks=[logged])
    # rollout 1: both minibatch steps skipped, weights untouched; then every step applied
    assert [s["skipped"] for s in module.steps] == [True, True, False, False, False, False]
    assert [s["unchanged"] for s in module.steps] == [True, True, False, False, False, False]
    assert "value/loss" in module.steps[0]["bad"]
    # global_step counts applied optimizer steps only: three rollouts to reach max_steps=4
    assert trainer.global_step == module.state.policy_version == 4
    assert module.state.skipped_updates == 2 and module.state.consecutive_skips == 0
    assert [row["optim/skipped_updates"] for row in logged.rows] == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("fault, named", [("loss", "policy/loss"), ("gradient", "optim/grad_norm")])
def test_consecutive_non_finite_steps_stop_with_an_error_naming_what(tokenizer, monkeypatch, fault, named):
    module = StepWatcher(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=[sort_digits_reward],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
        lr=1e-2,
        max_consecutive_skips=2,
    )
    start = checksum(module.actor_critic)
    if fault == "loss":
        from lit_rlhf.algorithms import losses

        clipped = losses.clipped_policy_loss
        monkeypatch.setattr(
            losses,
            "clipped_policy_loss",
            lambda *a, **k: (lambda out: (out[0] * float("nan"), out[1]))(clipped(*a, **k)),
        )
    else:  # a finite loss whose gradient overflows
        weight = module.actor_critic.policy.transformer.wte.weight
        weight.register_hook(lambda grad: grad * float("inf"))
    with pytest.raises(FloatingPointError) as info:
        fit(module, max_steps=5)
    message = str(info.value)
    assert "2 optimizer steps in a row" in message and named in message and "global step 0" in message
    assert [s["skipped"] for s in module.steps] == [True, True]
    assert checksum(module.actor_critic) == start  # no update was applied


# ----------------------------------------------------------------------------- reward functions


def exploding_reward(prompts, responses, **meta):
    raise KeyError("target")


def nan_reward(prompts, responses, **meta):
    return [float("nan")] * len(prompts)


def test_reward_function_that_raises_stops_fit_naming_function_and_prompt(tokenizer):
    module = RLHFModule(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=[exploding_reward],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=3),
    )
    with pytest.raises(RewardError) as info:
        fit(module, max_steps=1)
    assert "exploding_reward raised KeyError" in str(info.value) and "'3142>'" in str(info.value)
    assert isinstance(info.value.__cause__, KeyError)


def test_nan_reward_is_an_error_in_fit_unless_nan_score_replaces_it(tokenizer):
    settings = dict(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=[nan_reward],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=3),
    )
    with pytest.raises(RewardError, match="nan_reward returned nan for prompt '3142>'.*nan_score"):
        fit(RLHFModule(**settings), max_steps=1)
    logged = Logged()
    fit(RLHFModule(**{**settings, "policy": make_policy()}, nan_score=-1.0), max_steps=2, callbacks=[logged])
    assert [row["rollout/score_mean"] for row in logged.rows] == [-1.0, -1.0]
    assert all(math.isfinite(v) for row in logged.rows for v in row.values())


# ----------------------------------------------------------------------------- degenerate rollouts


def eos_biased_policy(bias: float):
    """The tiny policy with `bias` added to the EOS logit: +large -> every response is just EOS (empty);
    -large -> no response ever ends (all truncated)."""
    policy = make_policy()

    def add_bias(module, inputs, logits):
        logits = logits.clone()
        logits[..., EOS_ID] += bias
        return logits

    policy.get_output_embeddings().register_forward_hook(add_bias)
    return policy


def constant_reward(prompts, responses, **meta):
    return [0.5] * len(prompts)


SCENARIOS = {
    # name: (EOS bias, reward, extra algorithm settings)
    "empty_responses": (1e4, sort_digits_reward, {}),
    "all_truncated": (-1e4, sort_digits_reward, {}),
    "all_truncated_and_masked": (-1e4, sort_digits_reward, {"mask_truncated": True}),
    "all_rewards_equal": (0.0, constant_reward, {}),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_degenerate_rollouts_train_on_and_the_metrics_say_so(tokenizer, name, scenario):
    bias, reward, extra = SCENARIOS[scenario]
    max_new_tokens = 4
    module = RLHFModule(
        policy=eos_biased_policy(bias),
        tokenizer=tokenizer,
        reward_fns=[reward],
        algorithm=AlgorithmConfig(name=name, group_size=2, kl_coef=0.05, **extra),
        sampling=SamplingConfig(max_new_tokens=max_new_tokens),
        lr=1e-2,
    )
    logged = Logged()
    trainer = fit(module, max_steps=2, callbacks=[logged])
    assert trainer.global_step == 2 and module.state.skipped_updates == 0  # training went on, nothing skipped
    for row in logged.rows:
        assert [k for k, v in row.items() if not math.isfinite(v)] == []  # no NaN / inf in any logged metric
        if scenario == "empty_responses":  # the response is the EOS alone
            assert row["rollout/response_len_mean"] == 1.0 and row["rollout/frac_truncated"] == 0.0
            assert row["rollout/frac_reward_zero_std"] == 1.0  # every empty answer scores the same
        elif scenario.startswith("all_truncated"):
            assert row["rollout/frac_truncated"] == 1.0
            assert row["rollout/response_len_mean"] == float(max_new_tokens)
        else:
            assert row["rollout/frac_reward_zero_std"] == 1.0 and row["rollout/score_std"] == 0.0
            if name == "grpo":  # every group's advantages are exactly zero: nothing to learn, no NaN
                assert row["policy/loss"] == 0.0
    if scenario == "all_truncated_and_masked":  # nothing left in the loss: it is exactly zero, not NaN
        assert all(row["policy/loss"] == 0.0 for row in logged.rows)
