"""A policy whose embedding has more rows than its tokenizer has tokens: ids the tokenizer cannot decode are never
sampled (every backend), and the log-probs, entropy and exact KL the loss uses give them no probability."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import forward_logits, full_entropy, full_logprobs, generate, make_policy, make_trainer, prompt_batch
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.algorithms.experience import frozen_forward, policy_forward
from lit_rlhf.models.vocabulary import PaddedVocabularyMask
from lit_rlhf.tasks.digits import builtin_tokenizer

REWARD = ["lit_rlhf.tasks.digits.sort_digits_reward"]
EXTRA = 8


def padded_policy():
    """The tiny GPT-2 with EXTRA more embedding rows than the tokenizer, made likely to be sampled."""
    policy = make_policy()
    n = len(builtin_tokenizer())
    policy.resize_token_embeddings(n + EXTRA)
    with torch.no_grad():
        torch.manual_seed(1)
        policy.get_output_embeddings().weight[n:] = 10 * torch.randn(EXTRA, policy.config.n_embd)
    return policy


def module(policy, **algorithm) -> RLHFModule:
    return RLHFModule(
        policy=policy,
        tokenizer="builtin:digits",
        reward_fns=REWARD,
        algorithm=AlgorithmConfig(name="grpo", group_size=4, **algorithm),
        sampling=SamplingConfig(max_new_tokens=8),
    )


@pytest.mark.parametrize("backend", ["lean", "compiled", "generate"])
def test_no_backend_samples_an_id_past_the_tokenizer(backend):
    m = module(padded_policy())
    tok = m.tokenizer
    prompts = prompt_batch(tok, ["31 4 15", "926 5", "3 58", "9 7 93"])
    sampling = SamplingConfig(max_new_tokens=8, backend=backend)
    torch.manual_seed(0)
    out = generate(m.actor_critic.policy, prompts, 8, sampling, tok.eos_token_id, tok.pad_token_id)
    assert int(out.response_ids.max()) < len(tok)


def test_the_loss_log_probs_and_entropy_are_those_of_the_tokenizer_vocabulary():
    m = module(padded_policy(), kl_estimator="full")
    tok, n = m.tokenizer, len(m.tokenizer)
    prompts = prompt_batch(tok, ["31 4 15", "926 5"])
    torch.manual_seed(0)
    rollout = generate(m.actor_critic.policy, prompts, 4, SamplingConfig(max_new_tokens=8), tok.eos_token_id, 0)
    head = m.actor_critic.policy.get_output_embeddings()
    assert any(isinstance(h, PaddedVocabularyMask) for h in head._forward_hooks.values())
    policy, T = m.actor_critic.policy, rollout.response_ids.shape[1]
    with torch.no_grad():
        forward = policy_forward(m.actor_critic, rollout, 0.7, 1024, frozen_forward(policy, rollout))
        hooks = dict(head._forward_hooks)
        head._forward_hooks.clear()
        unmasked = forward_logits(policy, rollout.input_ids(), rollout.attention_mask(), T)  # every id scored
        head._forward_hooks.update(hooks)
    assert unmasked.shape[-1] > n
    valid = rollout.response_mask
    expected = full_logprobs(unmasked[..., :n], rollout.response_ids, 0.7)
    torch.testing.assert_close(forward.logprobs[valid], expected[valid].float())
    torch.testing.assert_close(forward.entropy[valid], full_entropy(unmasked[..., :n], 0.7)[valid].float())
    assert forward.kl is not None and forward.kl[valid].abs().max() < 1e-6  # against itself
    assert isinstance(m.reference, torch.nn.Module)  # the frozen copy is masked alike
    ref_head = m.reference.get_output_embeddings()
    assert any(isinstance(h, PaddedVocabularyMask) for h in ref_head._forward_hooks.values())


def test_a_padded_policy_trains_with_finite_metrics(tmp_path):
    m = module(padded_policy(), kl_estimator="full", entropy_coef=0.01)
    make_trainer(2, default_root_dir=tmp_path).fit(m, RolloutDataModule(prompts="builtin:digits", batch_size=2))
    assert m.state.policy_version == 2
    assert all(math.isfinite(v) for v in m.step_metrics.values())


def test_a_model_whose_vocabulary_is_the_tokenizers_gets_no_mask():
    m = module(make_policy())
    assert not m.actor_critic.policy.get_output_embeddings()._forward_hooks
