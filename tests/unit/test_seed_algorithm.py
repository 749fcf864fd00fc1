"""The seed algorithm (plain -A * ratio policy loss, value MSE, full-vocabulary KL in the reward) is reachable
by settings, and its loss equals the formula written out by hand."""

import math

import torch

from conftest import forward_logits, make_policy, prompt_batch, response_logits
from lit_rlhf import AlgorithmConfig, RLHFModule, SamplingConfig
from lit_rlhf.algorithms.objective import MinibatchTotals

SEED_SETTINGS = dict(
    name="ppo",
    clip_eps_low=1e9,
    clip_eps_high=1e9,
    value_clip=None,
    kl_estimator="full",
    kl_in_reward=True,
    kl_coef=0.1,
    vf_coef=0.5,
    whiten_advantages=False,
    group_size=2,
    ppo_epochs=2,
)


def test_seed_settings_give_plain_ratio_loss_plus_value_mse(tokenizer):
    module = RLHFModule(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
        algorithm=AlgorithmConfig(**SEED_SETTINGS),
        sampling=SamplingConfig(max_new_tokens=5),
    )
    exp = module.make_experience(module.make_rollout(prompt_batch(tokenizer, ["312>", "9051>"]))[0])[0]
    with torch.no_grad():  # move the policy so the ratio is not 1
        for p in module.actor_critic.parameters():
            p.add_(0.05 * torch.randn_like(p))

    loss, _ = module.micro_batch_loss(exp, MinibatchTotals.of(exp, module.sampling.max_new_tokens))

    # by hand, token by token: new log-probs and values from a plain forward of each sequence
    with torch.no_grad():
        forward, values = module.actor_critic(exp.input_ids(), exp.attention_mask(), exp.response_ids.shape[1])
        logits = response_logits(forward)
    total, count = 0.0, 0
    for b in range(exp.batch_size):
        for t in range(exp.response_ids.shape[1]):
            if not exp.loss_mask[b, t]:
                continue
            row = logits[b, t].double()
            new_logp = row[exp.response_ids[b, t]] - torch.logsumexp(row, 0)
            ratio = math.exp(float(new_logp) - float(exp.old_logprobs[b, t]))
            advantage = float(exp.advantages[b, t])
            value_error = float(values[b, t]) - float(exp.returns[b, t])
            total += -advantage * ratio + 0.5 * 0.5 * value_error**2  # vf_coef x (1/2)(V - R)^2
            count += 1
    assert abs(float(loss.detach()) - total / count) < 1e-5


def test_seed_rewards_use_the_exact_kl_over_the_vocabulary(tokenizer):
    module = RLHFModule(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
        algorithm=AlgorithmConfig(**SEED_SETTINGS),
        sampling=SamplingConfig(max_new_tokens=5),
    )
    with torch.no_grad():  # a reference different from the policy
        for p in module.reference.parameters():
            p.add_(0.1 * torch.randn_like(p))
    exp = module.make_experience(module.make_rollout(prompt_batch(tokenizer, ["312>", "9051>"]))[0])[0]
    with torch.no_grad():
        logits = response_logits(
            module.actor_critic(exp.input_ids(), exp.attention_mask(), exp.response_ids.shape[1])[0]
        )
        ref_logits = forward_logits(module.reference, exp.input_ids(), exp.attention_mask(), exp.response_ids.shape[1])
    b, t = 0, 0
    p = torch.softmax(logits[b, t].double(), 0)
    q = torch.softmax(ref_logits[b, t].double(), 0)
    by_hand = sum(float(p[v] * (torch.log(p[v]) - torch.log(q[v]))) for v in range(p.shape[0]))
    assert by_hand > 0
    assert abs(float(exp.kl[b, t]) - by_hand) < 1e-5
