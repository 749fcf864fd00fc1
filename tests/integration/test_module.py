"""RLHFModule + RolloutDataModule under a CPU Trainer: first-minibatch ratio, micro-batch gradient equality,
what trains and what stays frozen, rollout freshness, and the drop-in use with the user's own objects."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import checksum, make_policy, make_trainer, prompt_batch
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.algorithms.objective import MinibatchTotals
from lit_rlhf.types import split_rows

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"


def length_reward(prompts, responses, **meta):
    """Varies within almost every group, so group advantages are never all zero."""
    return [float(len(r)) for r in responses]


def dropout_policy(seed: int = 0, p: float = 0.1):
    """The tiny policy with dropout switched on, as a user's model would have it: the module must undo it."""
    model = make_policy(seed)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = p
    return model


def algorithm(name: str, **kwargs) -> AlgorithmConfig:
    if name == "grpo":
        kwargs.setdefault("group_size", 2)
    return AlgorithmConfig(name=name, **kwargs)


# ----------------------------------------------------------------------------- ratio 1 on the first minibatch


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_first_minibatch_has_ratio_one_and_zero_approx_kl(tokenizer, name):
    module = RLHFModule(
        policy=dropout_policy(),
        tokenizer=tokenizer,
        reward_fns=[length_reward],
        algorithm=algorithm(name, ppo_epochs=2, num_minibatches=2),
        sampling=SamplingConfig(max_new_tokens=6),
        lr=1e-2,
    )
    dm = RolloutDataModule(prompts="builtin:digits", batch_size=4, max_prompt_length=16)
    trainer = make_trainer(max_steps=4)  # one rollout: 2 epochs x 2 minibatches
    trainer.fit(module, dm)
    stats = module.last_update_stats
    assert len(stats) == 4 and trainer.global_step == 4
    assert stats[0]["policy/approx_kl"] == pytest.approx(0.0, abs=1e-10)
    assert stats[0]["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert stats[0]["policy/clipfrac"] == 0.0
    # the measure is live: after three optimizer steps at lr 1e-2 the policy has moved
    assert stats[-1]["policy/approx_kl"] > 1e-8
    # every dropout of the user's model was switched off
    assert all(m.p == 0.0 for m in module.actor_critic.modules() if isinstance(m, nn.Dropout))


# ----------------------------------------------------------------------------- micro-batching


def grads_of(module: RLHFModule) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.detach().clone()
        for n, p in module.actor_critic.named_parameters()
        if p.requires_grad and p.grad is not None
    }


def minibatch_grads(module, exp, micro_rows: list[slice], own_totals: bool = False) -> dict[str, torch.Tensor]:
    module.actor_critic.zero_grad(set_to_none=True)
    totals = MinibatchTotals.of(exp, module.sampling.max_new_tokens)
    for rows in micro_rows:
        micro = exp.select(rows)
        if own_totals:  # the wrong way: normalise each micro-batch by its own counts
            totals = MinibatchTotals.of(micro, module.sampling.max_new_tokens)
        loss, _ = module.micro_batch_loss(micro, totals)
        loss.backward()
    return grads_of(module)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize(
    "name, extra",
    [
        (
            "ppo",
            dict(mask_truncated=True, micro_batch_size=2),
        ),  # critic, KL in the reward (micro-batches: evaluated in the rollout)
        ("grpo", dict(group_size=4, kl_coef=0.04, kl_estimator="k3", ppo_epochs=2)),  # KL in the loss
        ("grpo", dict(group_size=4, kl_coef=0.04, kl_estimator="k3")),  # one pass: old log-probs from the update
        ("grpo", dict(group_size=4, kl_coef=0.04, kl_estimator="full")),
    ],
)
def test_micro_batches_give_the_gradient_of_the_whole_minibatch(tokenizer, name, extra, aggregation):
    module = RLHFModule(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=[REWARD],
        algorithm=AlgorithmConfig(name=name, loss_aggregation=aggregation, entropy_coef=0.01, **extra),
        sampling=SamplingConfig(max_new_tokens=6),
    )
    texts = ["3142>", "907>", "55>", "1234>", "8>", "602>", "71>", "4>"]
    torch.manual_seed(5)
    exp = module.make_experience(
        module.make_rollout(prompt_batch(tokenizer, texts[: 8 // module.algorithm.group_size]))[0]
    )[0]
    assert exp.batch_size == 8
    lengths = exp.response_mask.sum(1)
    assert len(set(lengths.tolist())) > 1 and exp.loss_mask.any()  # uneven lengths make the modes differ
    # move the policy away from the sampling policy so the ratio, clipping and the KL gradient are all live
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in module.actor_critic.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    module.train()

    whole = minibatch_grads(module, exp, [slice(0, 8)])
    assert whole and all(torch.isfinite(v).all() for v in whole.values())
    assert sum(float(v.abs().sum()) for v in whole.values()) > 0
    expected_params = {n for n, p in module.actor_critic.named_parameters() if p.requires_grad}
    assert set(whole) == expected_params

    for rows in ([slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)], [slice(0, 3), slice(3, 8)], split_rows(8, 1)):
        micro = minibatch_grads(module, exp, rows)
        assert set(micro) == set(whole)
        for key in whole:
            torch.testing.assert_close(micro[key], whole[key], atol=1e-6, rtol=1e-4, msg=key)

    # control: normalising each micro-batch by its own counts does change the gradient
    wrong = minibatch_grads(module, exp, [slice(0, 4), slice(4, 8)], own_totals=True)
    assert any(not torch.allclose(wrong[k], whole[k], atol=1e-6, rtol=1e-4) for k in whole)


# ----------------------------------------------------------------------------- a short fit


class GradientRecorder(RLHFModule):
    """Records, before each optimizer step, which trainable parameters hold a non-zero gradient and the
    state of the reference model."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.grad_records: list[dict[str, bool]] = []
        self.reference_records: list[tuple[bool, bool, bool]] = []

    def clip_and_step(self, *args, **kwargs):
        self.grad_records.append(
            {
                n: p.grad is not None and bool(p.grad.abs().sum() > 0)
                for n, p in self.actor_critic.named_parameters()
                if p.requires_grad
            }
        )
        ref = self.reference
        self.reference_records.append(
            (
                ref.training,
                any(p.requires_grad for p in ref.parameters()),
                any(p.grad is not None for p in ref.parameters()),
            )
        )
        return super().clip_and_step(*args, **kwargs)


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_short_fit_trains_every_trainable_parameter_and_keeps_reference_frozen(tokenizer, name):
    module = GradientRecorder(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=[REWARD],
        algorithm=algorithm(name, group_size=4) if name == "grpo" else algorithm(name),
        sampling=SamplingConfig(max_new_tokens=6),
        lr=1e-3,
    )
    trainable = {n: p.detach().clone() for n, p in module.actor_critic.named_parameters() if p.requires_grad}
    reference = {n: p.detach().clone() for n, p in module.reference.named_parameters()}
    assert ("value_head.weight" in trainable) is (name == "ppo")
    # the reference starts as an exact copy of the policy
    for n, p in module.actor_critic.policy.named_parameters():
        assert torch.equal(p, reference[n])

    trainer = make_trainer(max_steps=3)
    trainer.fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=4, max_prompt_length=16))
    assert trainer.global_step == 3 and len(module.grad_records) == 3

    # every trainable parameter had a gradient at every step, non-zero at least once, and changed
    for record in module.grad_records:
        assert set(record) == set(trainable)
    never = [n for n in trainable if not any(r[n] for r in module.grad_records)]
    assert never == []
    unchanged = [
        n for n, p in module.actor_critic.named_parameters() if p.requires_grad and torch.equal(p, trainable[n])
    ]
    assert unchanged == []

    # the reference: bit-identical, in eval mode during every update, no gradients, not in the optimizer
    for n, p in module.reference.named_parameters():
        assert torch.equal(p, reference[n]), n
    assert module.reference_records == [(False, False, False)] * 3
    assert not module.reference.training
    module.train()  # switching the module to train mode by hand leaves the frozen reference in eval mode
    assert not module.reference.training and module.actor_critic.training
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in module.actor_critic.parameters() if p.requires_grad}
    assert not optimized & {id(p) for p in module.reference.parameters()}
    # reference weights are not shared with the policy
    assert not {p.data_ptr() for p in module.reference.parameters()} & {
        p.data_ptr() for p in module.actor_critic.parameters()
    }


# ----------------------------------------------------------------------------- freshness


class FreshnessRecorder(RLHFModule):
    """Fingerprints the policy when a rollout is sampled and again when its update starts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records: list[dict] = []

    def make_rollout(self, prompts):
        at_sampling = checksum(self.actor_critic)
        version = self.state.policy_version
        rollout, timings = super().make_rollout(prompts)
        self.sampled_with = (at_sampling, version)  # the rollout that the next on_experience sees
        return rollout, timings

    def on_experience(self, experience):
        self.records.append(
            dict(
                sampled=self.sampled_with[0],
                sampled_version=self.sampled_with[1],
                at_update=checksum(self.actor_critic),
                exp_version=experience.policy_version,
                version=self.state.policy_version,
                global_step=self.global_step,
            )
        )


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_every_rollout_comes_from_the_weights_its_update_starts_from(tokenizer, name):
    updates_per_rollout = 2
    module = FreshnessRecorder(
        policy="builtin:digits",
        reward_fns=[REWARD],
        algorithm=algorithm(name, num_minibatches=updates_per_rollout),
        sampling=SamplingConfig(max_new_tokens=5),
        lr=1e-3,
    )
    trainer = make_trainer(max_steps=5 * updates_per_rollout)
    trainer.fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=4, max_prompt_length=16))
    records = module.records
    assert len(records) == 5
    stale = [i for i, r in enumerate(records) if r["sampled"] != r["at_update"]]
    assert stale == []
    for i, r in enumerate(records):
        assert r["exp_version"] == r["sampled_version"] == r["version"] == i * updates_per_rollout
        assert r["global_step"] == i * updates_per_rollout
    # the weights really moved between rollouts, so a stale rollout could not pass unnoticed
    assert len({r["sampled"] for r in records}) == 5
    assert module.state.policy_version == trainer.global_step == 10


# ----------------------------------------------------------------------------- drop-in use


class LengthReward:
    """A stateful callable object (no __qualname__ on the instance), as users write them."""

    def __init__(self):
        self.calls = 0

    def __call__(self, prompts, responses, **meta):
        self.calls += 1
        return [-abs(len(r) - 3) for r in responses]


def test_drop_in_with_users_model_tokenizer_and_python_reward(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=32,
            n_embd=16,
            n_layer=1,
            n_head=2,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    seen: list[str] = []

    def my_reward(prompts, responses, **meta):
        seen.extend(prompts)
        return [float(r.count("1")) for r in responses]

    length_reward = LengthReward()
    prompts = ["12>", "31>", "987>", "5>"]
    module = RLHFModule(
        policy=model,
        tokenizer=tokenizer,
        reward_fns=[my_reward, length_reward],
        reward_weights=[1.0, 0.5],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
        lr=1e-3,
    )
    assert module.actor_critic.policy is model  # the user's instance is trained in place
    dm = RolloutDataModule(prompts=prompts, batch_size=2, max_prompt_length=8)
    trainer = make_trainer(max_steps=2)
    trainer.fit(module, dm)
    assert trainer.global_step == 2
    assert length_reward.calls == 2
    assert len(seen) == 2 * 2 * 2 and set(seen) <= set(prompts)  # 2 rollouts x 2 prompts x G=2
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, nn.Dropout))


def test_reward_callables_are_recorded_by_name_in_hparams():
    import functools

    from lit_rlhf.tasks.digits import sort_digits_reward

    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=[REWARD, sort_digits_reward, LengthReward(), functools.partial(sort_digits_reward)],
    )
    assert module.actor_critic is None  # names are loaded lazily, by the Trainer
    assert module.hparams["reward_fns"] == [
        "lit_rlhf.tasks.digits.sort_digits_reward",
        "lit_rlhf.tasks.digits.sort_digits_reward",
        f"{__name__}.LengthReward",
        "functools.partial",
    ]
