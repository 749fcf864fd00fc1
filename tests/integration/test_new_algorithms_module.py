"""GSPO, REINFORCE++, over-long shaping and entropy token selection through `RLHFModule`: splitting a minibatch
into micro-batches gives the gradient of the whole, and a Trainer step logs the new metrics."""

from __future__ import annotations

import pytest
import torch

from conftest import make_policy, make_trainer, prompt_batch
from lit_rlhf import RLHFModule, RolloutDataModule
from lit_rlhf.algorithms.objective import MinibatchTotals
from lit_rlhf.config import AlgorithmConfig, ConfigError, SamplingConfig

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"
TEXTS = ["3142>", "907>", "55>", "1234>", "8>", "602>", "71>", "4>"]


def grads(module: RLHFModule) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.actor_critic.named_parameters() if p.grad is not None}


def minibatch_grads(module: RLHFModule, exp, pieces: list[slice]) -> dict[str, torch.Tensor]:
    module.actor_critic.zero_grad(set_to_none=True)
    totals = MinibatchTotals.of(exp, module.sampling.max_new_tokens)
    for rows in pieces:
        loss, _ = module.micro_batch_loss(exp.select(rows), totals)
        loss.backward()
    return grads(module)


@pytest.mark.parametrize(
    "settings",
    [
        dict(ratio_level="sequence", loss_aggregation="seq_mean_token_mean", clip_eps_low=0.01, clip_eps_high=0.02),
        dict(ratio_level="sequence_token", loss_aggregation="token_mean", clip_eps_low=0.01, clip_eps_high=0.02),
        dict(entropy_top_fraction=0.3, loss_aggregation="seq_mean_token_sum_norm"),
        dict(advantage_estimator="reinforce_pp", kl_coef=0.05, kl_estimator="k1", kl_in_reward=True),
        dict(advantage_estimator="reinforce_pp_baseline", overlong_buffer=3, entropy_top_fraction=0.5),
    ],
)
def test_micro_batches_give_the_gradient_of_the_whole_minibatch(tokenizer, settings):
    module = RLHFModule(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=[REWARD],
        algorithm=AlgorithmConfig(name="grpo", group_size=4, micro_batch_size=2, **settings),
        sampling=SamplingConfig(max_new_tokens=6),
    )
    torch.manual_seed(5)
    exp = module.make_experience(module.make_rollout(prompt_batch(tokenizer, TEXTS[:2]))[0])[0]
    assert exp.batch_size == 8 and len(set(exp.response_mask.sum(1).tolist())) > 1
    if settings.get("entropy_top_fraction"):
        assert 0 < exp.loss_mask.sum() < exp.response_mask.sum()
    with torch.no_grad():  # move away from the sampling policy: ratios and clipping are live
        g = torch.Generator().manual_seed(0)
        for p in module.actor_critic.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    module.train()
    whole = minibatch_grads(module, exp, [slice(0, 8)])
    assert sum(float(v.abs().sum()) for v in whole.values()) > 0
    for pieces in ([slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)], [slice(0, 3), slice(3, 8)]):
        micro = minibatch_grads(module, exp, pieces)
        for key in whole:
            torch.testing.assert_close(micro[key], whole[key], atol=1e-6, rtol=1e-4, msg=key)


def test_a_trainer_step_logs_the_shaping_metrics(tokenizer):
    algo = AlgorithmConfig(
        name="grpo", group_size=2, overlong_buffer=2, entropy_top_fraction=0.2, ratio_level="sequence"
    )
    module = RLHFModule(
        policy=make_policy(), tokenizer=tokenizer, reward_fns=[REWARD], algorithm=algo, sampling=SamplingConfig(6)
    )
    trainer = make_trainer(max_steps=2)
    trainer.fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=4, max_prompt_length=16))
    metrics = module.step_metrics
    assert -1.0 <= metrics["rollout/overlong_penalty_mean"] <= 0.0
    assert 0.2 <= metrics["policy/entropy_selected_frac"] < 0.5
    assert "rollout/overlong_penalty_mean" in trainer.logged_metrics


def test_overlong_buffer_longer_than_the_responses_fails_before_models_load(tokenizer):
    with pytest.raises(ConfigError, match=r"algorithm\.overlong_buffer"):
        RLHFModule(
            policy="builtin:digits",
            reward_fns=[REWARD],
            algorithm=AlgorithmConfig(overlong_buffer=7),
            sampling=SamplingConfig(max_new_tokens=6),
        )


def test_plain_reinforce_pp_trains_with_one_response_per_prompt(tokenizer):
    seen = []

    class Recording(RLHFModule):
        def on_experience(self, experience):
            seen.append(experience)

    algo = AlgorithmConfig(
        name="grpo", group_size=1, advantage_estimator="reinforce_pp", kl_coef=0.05, kl_in_reward=True
    )
    module = Recording(
        policy=make_policy(), tokenizer=tokenizer, reward_fns=[REWARD], algorithm=algo, sampling=SamplingConfig(6)
    )
    make_trainer(max_steps=2).fit(
        module, RolloutDataModule(prompts="builtin:digits", batch_size=4, max_prompt_length=16)
    )
    assert len(seen) == 2 and module.actor_critic.value_head is None
    for exp in seen:  # whitened over the rollout's valid tokens: mean 0, variance 1
        valid = exp.advantages[exp.response_mask]
        assert (
            exp.batch_size == 4 and abs(float(valid.mean())) < 1e-5 and float(valid.var()) == pytest.approx(1, rel=1e-4)
        )
