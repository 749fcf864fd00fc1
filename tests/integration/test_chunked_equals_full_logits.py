"""Every path of the update computed from the LM head's input in chunks equals the same path computed from the
model's own full logits, in float64: the experience (old and reference log-probs, KL, advantages, values, loss
mask) and the gradient of every trainable parameter over a whole update (minibatches, micro-batches, the single
pass's reused forward).

The full-logits path is the one a model whose head cannot be read takes (`output_head.reads_head` False): the
model's forward builds its (B, T, V) logits and every statistic comes from them, itself checked against a float64
log-softmax in tests/unit/test_chunked_logprobs.py. Here it is forced by patching `reads_head`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from conftest import make_policy, prompt_batch
from lit_rlhf import AlgorithmConfig, RLHFModule, SamplingConfig
from lit_rlhf.algorithms.objective import MinibatchTotals
from lit_rlhf.models import forward as forward_module
from lit_rlhf.models.output_head import check_head
from lit_rlhf.training.batching import micro_batches
from lit_rlhf.types import Experience, Rollout, iterate_minibatches

REWARD = ["lit_rlhf.tasks.digits.sort_digits_reward"]
TEXTS = ["31425>", "9>", "550>", "1234>"]
RTOL = 1e-6  # the bound; float64 rounding gives ~1e-12

CASES: dict[str, dict[str, Any]] = {
    "grpo_k3_in_loss": dict(algorithm=dict(name="grpo", group_size=4, kl_coef=0.04)),
    "grpo_k2_in_loss_micro": dict(
        algorithm=dict(name="grpo", group_size=4, kl_coef=0.04, kl_estimator="k2", micro_batch_size=3)
    ),
    "grpo_full_kl_in_loss_token_budget": dict(
        algorithm=dict(name="grpo", group_size=4, kl_coef=0.04, kl_estimator="full", micro_batch_tokens=40)
    ),
    "grpo_full_kl_in_reward": dict(
        algorithm=dict(name="grpo", group_size=4, kl_coef=0.04, kl_estimator="full", kl_in_reward=True)
    ),
    "dr_grpo": dict(
        algorithm=dict(
            name="grpo", group_size=4, advantage_estimator="dr_grpo", loss_aggregation="seq_mean_token_sum_norm"
        )
    ),
    "rloo_epochs_minibatches": dict(
        algorithm=dict(name="grpo", group_size=4, advantage_estimator="rloo", ppo_epochs=2, num_minibatches=2)
    ),
    "dapo": dict(
        algorithm=dict(name="grpo", group_size=4, kl_coef=0.0, clip_eps_high=0.28, overlong_buffer=2),
    ),
    "gspo": dict(algorithm=dict(name="grpo", group_size=4, ratio_level="sequence", num_minibatches=2)),
    "gspo_token": dict(algorithm=dict(name="grpo", group_size=4, ratio_level="sequence_token", ppo_epochs=2)),
    "reinforce_pp_k1_in_reward": dict(
        algorithm=dict(
            name="grpo", group_size=2, advantage_estimator="reinforce_pp", kl_in_reward=True, kl_estimator="k1"
        )
    ),
    "dual_clip_entropy": dict(
        algorithm=dict(name="grpo", group_size=4, dual_clip=3.0, entropy_coef=0.05, ppo_epochs=2),
        sampling=dict(temperature=0.7),
    ),
    "entropy_selection": dict(algorithm=dict(name="grpo", group_size=4, entropy_top_fraction=0.5)),
    "tis": dict(algorithm=dict(name="grpo", group_size=4, tis_cap=1.5, num_minibatches=2)),
    "ppo_shared_critic": dict(algorithm=dict(name="ppo", ppo_epochs=2, num_minibatches=2)),
    "ppo_separate_critic_full_kl": dict(
        algorithm=dict(name="ppo", kl_estimator="full", micro_batch_size=2), separate_critic=True
    ),
    "plain_forward": dict(
        algorithm=dict(name="grpo", group_size=4, kl_coef=0.04, share_prompt_forward=False, length_groups=1)
    ),
    "lora": dict(algorithm=dict(name="grpo", group_size=4, kl_coef=0.04), lora=dict(r=4, alpha=8)),
    "lora_on_the_head": dict(
        algorithm=dict(name="grpo", group_size=4, kl_coef=0.04, kl_estimator="full"),
        lora=dict(r=4, alpha=8, target_modules=["c_attn", "lm_head"]),
    ),
    "lora_head_saved": dict(
        algorithm=dict(name="ppo", micro_batch_size=3),
        lora=dict(r=4, alpha=8, target_modules=["c_attn"], modules_to_save=["lm_head"]),
    ),
}


def build(case: dict[str, Any], tokenizer) -> RLHFModule:
    settings = dict(case)
    algorithm = AlgorithmConfig(**settings.pop("algorithm"))
    sampling = SamplingConfig(**{"max_new_tokens": 8, **settings.pop("sampling", {})})
    module = RLHFModule(
        policy=make_policy(n_layer=2).double(),
        tokenizer=tokenizer,
        reward_fns=REWARD,
        algorithm=algorithm,
        sampling=sampling,
        **settings,
    )
    module.double()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # adapters away from zero: the policy differs from the reference, and A gets gradients
        for param_name, param in module.named_parameters():
            if "lora_B" in param_name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return module


def with_environment_tokens(rollout: Rollout) -> Rollout:
    """Column 1 of every response long enough made an environment's token (attended, not the policy's)."""
    context = torch.zeros_like(rollout.response_mask)
    context[:, 1] = rollout.response_mask[:, 1] & rollout.response_mask[:, 2]
    return dataclasses.replace(rollout, response_mask=rollout.response_mask & ~context, context_mask=context)


def update_gradients(module: RLHFModule, rollout: Rollout) -> tuple[Experience, dict[str, torch.Tensor]]:
    """The experience and the gradients a whole update accumulates (`RLHFModule.update` without the steps)."""
    module.zero_grad(set_to_none=True)
    experience, first = module.make_experience(rollout)
    algo = module.algorithm
    size = experience.batch_size // algo.num_minibatches
    for _ in range(algo.ppo_epochs):
        for minibatch in iterate_minibatches(experience, size, shuffle=False):
            totals = MinibatchTotals.of(minibatch, module.sampling.max_new_tokens)
            for piece in micro_batches(minibatch, algo.micro_batch_size or size, algo.micro_batch_tokens):
                loss, _ = module.micro_batch_loss(piece, totals, first)
                first = None
                loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return experience, grads


@pytest.mark.parametrize("name", list(CASES))
def test_the_chunked_path_equals_the_full_logits_path(name, tokenizer, monkeypatch):
    if "lora" in CASES[name]:
        pytest.importorskip("peft")
    module = build(CASES[name], tokenizer)
    torch.manual_seed(0)
    rollout = module.make_rollout(prompt_batch(tokenizer, TEXTS[: 16 // module.algorithm.filled.group_size]))[0]
    rollout = with_environment_tokens(rollout)
    ids, mask = rollout.input_ids(), rollout.attention_mask()
    for model in (module.actor_critic.policy, module.reference):  # both really take the chunked path
        assert model is None or check_head(model, ids[:1], mask[:1]) is None
    if module.algorithm.tis_cap is not None:  # a sampler of its own: its log-probs a little off the trainer's
        noise = 0.1 * torch.randn(rollout.response_mask.shape, generator=torch.Generator().manual_seed(1))
        rollout.sampler_logprobs = torch.where(rollout.response_mask, -1.0 + noise, 0.0).double()
    chunked, chunked_grads = update_gradients(module, rollout)
    monkeypatch.setattr(forward_module, "reads_head", lambda *args: False)
    full, full_grads = update_gradients(module, rollout)

    assert chunked_grads.keys() == full_grads.keys() and chunked_grads
    for field in ("old_logprobs", "ref_logprobs", "kl", "advantages", "values", "returns"):
        ours, theirs = getattr(chunked, field), getattr(full, field)
        assert (ours is None) == (theirs is None), field
        if ours is not None:
            valid = chunked.response_mask
            torch.testing.assert_close(ours[valid], theirs[valid].to(ours.dtype), rtol=RTOL, atol=1e-12, msg=field)
    assert torch.equal(chunked.loss_mask, full.loss_mask)
    for param, grad in full_grads.items():
        assert grad.abs().max() > 0, param  # a path that trains nothing proves nothing
        torch.testing.assert_close(chunked_grads[param], grad, rtol=RTOL, atol=1e-12 * grad.abs().max(), msg=param)
