"""No work done twice: which forwards a training step runs for each setting, and that folding the rollout's
evaluation into the update's forward (a single PPO pass) changes nothing but the work."""

from __future__ import annotations

import pytest
import torch

from conftest import make_policy, make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"


class ForwardCounter(RLHFModule):
    """Counts, per training step, actor-critic forwards without and with grad, and reference forwards."""

    def configure_model(self):
        super().configure_model()
        if hasattr(self, "counts"):  # Lightning calls it again in fit; the models were built at __init__
            return
        self.counts = {"actor_critic_no_grad": 0, "actor_critic_grad": 0, "reference": 0}

        def on_actor_critic(module, args, output):
            key = "actor_critic_grad" if torch.is_grad_enabled() else "actor_critic_no_grad"
            self.counts[key] += 1

        def on_reference(module, args, kwargs, output):
            if kwargs["input_ids"].shape[0] > 1:  # not the one-row check of its head (`output_head.check_head`)
                self.counts["reference"] += 1

        self.actor_critic.register_forward_hook(on_actor_critic)
        if self.reference is not None:
            self.reference.register_forward_hook(on_reference, with_kwargs=True)


def count_forwards(algorithm: AlgorithmConfig, steps: int = 2) -> dict[str, float]:
    module = ForwardCounter(
        policy=make_policy(),
        tokenizer="builtin:digits",
        reward_fns=[REWARD],
        algorithm=algorithm,
        sampling=SamplingConfig(max_new_tokens=4),
        lr=1e-3,
        log_samples_every_n_steps=0,
    )
    updates = algorithm.ppo_epochs * algorithm.num_minibatches
    make_trainer(max_steps=steps * updates).fit(module, RolloutDataModule(batch_size=4, max_prompt_length=16))
    return {key: value / steps for key, value in module.counts.items()}


@pytest.mark.parametrize(
    "settings, no_grad, grad, reference",
    [
        # GRPO, one pass, no KL: the update's forward is the only policy forward; no reference
        ({"name": "grpo", "group_size": 2, "kl_coef": 0.0}, 0, 1, 0),
        # GRPO, KL k3 in the loss: the reference runs once, in the rollout
        ({"name": "grpo", "group_size": 2, "kl_coef": 0.04}, 0, 1, 1),
        # PPO, one pass: values, KL and advantages come from the update's own forward
        ({"name": "ppo"}, 0, 1, 1),
        ({"name": "ppo", "kl_coef": 0.0}, 0, 1, 0),
        # two epochs: the old log-probs and values need their own no-grad forward, then one per epoch
        ({"name": "ppo", "ppo_epochs": 2}, 1, 2, 1),
        # micro-batches: whitening spans the rollout, so the rollout evaluates; one forward per micro-batch
        ({"name": "ppo", "micro_batch_size": 2}, 1, 2, 1),
        # the exact KL in the reward needs both full distributions at once: evaluated in the rollout
        ({"name": "ppo", "kl_estimator": "full"}, 1, 1, 1),
        # two minibatches, GRPO: old log-probs from the rollout, one forward per minibatch
        ({"name": "grpo", "group_size": 2, "kl_coef": 0.0, "num_minibatches": 2}, 1, 2, 0),
    ],
)
def test_forwards_per_training_step(settings, no_grad, grad, reference):
    # one model call per forward: the shared-prompt forward (two calls, prompts then responses) is off here
    algorithm = AlgorithmConfig(**settings, share_prompt_forward=False)
    counts = count_forwards(algorithm)
    assert counts == {"actor_critic_no_grad": no_grad, "actor_critic_grad": grad, "reference": reference}
    assert algorithm.policy_forward_in_rollout(8) == bool(no_grad)


def test_policy_forward_in_rollout_when_micro_batches_cover_the_rollout():
    algorithm = AlgorithmConfig(name="ppo", micro_batch_size=8)
    assert not algorithm.policy_forward_in_rollout(8)  # one micro-batch holds the whole rollout
    assert algorithm.policy_forward_in_rollout(16)


class StepRecorder(RLHFModule):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.__dict__.setdefault("recorded", []).append(dict(self.step_metrics))


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_evaluation_inside_the_update_gives_the_same_training_as_a_separate_evaluation(name):
    """A single pass with its advantages computed from the update's forward against the same run whose rollout
    evaluates first (micro-batches of 2 force it; they give the whole minibatch's gradient): same weights,
    same metrics."""
    runs = {}
    for label, micro in (("in update", None), ("in rollout", 2)):
        settings = {"name": name, "micro_batch_size": micro, "kl_coef": 0.1}
        if name == "grpo":
            settings.update(group_size=2, kl_in_reward=True, kl_estimator="k1")  # advantages need the policy
        algorithm = AlgorithmConfig(**settings)
        assert algorithm.policy_forward_in_rollout(8) is (micro is not None)
        torch.manual_seed(0)
        module = StepRecorder(
            policy=make_policy(),
            tokenizer="builtin:digits",
            reward_fns=[REWARD],
            algorithm=algorithm,
            sampling=SamplingConfig(max_new_tokens=5),
            lr=3e-3,
            log_samples_every_n_steps=0,
        )
        torch.manual_seed(1)
        make_trainer(max_steps=4).fit(module, RolloutDataModule(batch_size=4, max_prompt_length=16, seed=3))
        runs[label] = module
    fused, separate = runs["in update"], runs["in rollout"]
    for (key, a), b in zip(fused.actor_critic.state_dict().items(), separate.actor_critic.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=key)
    assert len(fused.recorded) == len(separate.recorded) == 4
    keys = ["rollout/reward_mean", "objective/kl", "policy/loss", "policy/approx_kl"]
    if name == "ppo":
        keys += ["value/loss", "value/explained_variance", "value/mean"]
    for step, (a, b) in enumerate(zip(fused.recorded, separate.recorded)):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (step, key)
    # the policy moved, so later rollouts really were sampled from updated weights in both runs
    assert fused.recorded[0]["objective/kl"] == pytest.approx(0.0, abs=1e-6)
    assert any(abs(r["objective/kl"]) > 1e-6 for r in fused.recorded[1:])
