"""Each distinct prompt run once (`algorithm.share_prompt_forward`): the same logits and gradients as the plain
forward, which itself equals running every row alone without padding; the prompt forward sees each prompt once."""

from __future__ import annotations

import pytest
import torch
from test_shared_prefill import llama_policy
from torch import nn

from conftest import forward_logits, make_policy, prompt_batch, response_logits
from lit_rlhf import AlgorithmConfig, RLHFModule, SamplingConfig
from lit_rlhf.algorithms.objective import MinibatchTotals
from lit_rlhf.config import ConfigError
from lit_rlhf.models.actor_critic import ActorCritic
from lit_rlhf.models.forward import causal_lm_response_forward, distinct_prompts
from lit_rlhf.models.output_head import reads_head

B0, G, P, T, V = 3, 4, 9, 6, 16  # V: the vocabulary of test_shared_prefill's Llama


def gpt2(dtype=torch.float64):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return GPT2LMHeadModel(config).to(dtype).eval()


def grouped_batch(seed: int = 1):
    """B0 prompts (two left-padded), each G times, random responses (one ending early), rows shuffled."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, V, (B0, P), generator=g)
    prompt_mask = torch.ones(B0, P, dtype=torch.long)
    prompt_mask[0, :3] = prompt_mask[1, :1] = 0
    prompts[prompt_mask == 0] = 0
    ids = torch.cat([prompts.repeat_interleave(G, 0), torch.randint(3, V, (B0 * G, T), generator=g)], 1)
    mask = torch.cat([prompt_mask.repeat_interleave(G, 0), torch.ones(B0 * G, T, dtype=torch.long)], 1)
    mask[2, -3:] = 0  # a response that ended early: its tail is padding
    order = torch.randperm(B0 * G, generator=g)
    return ids[order], mask[order]


def row_by_row_loss(model, ids, mask, weights):
    """The slow obvious reference: every row alone, its padding removed, its response tokens' logits weighted by
    `weights` (B, T, V) (T: the response grid's width)."""
    total = 0.0
    for i in range(ids.shape[0]):
        tokens = ids[i][mask[i].bool()][None]
        valid = int(mask[i, -weights.shape[1] :].sum())
        logits = model(input_ids=tokens).logits[0]  # (n, V)
        n = tokens.shape[1]
        total = total + (logits[n - valid - 1 : n - 1] * weights[i, :valid]).sum()
    return total


def gradients(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_distinct_prompts_are_found_by_ids_and_mask():
    ids = torch.tensor([[0, 5, 6], [1, 2, 3], [0, 5, 6], [0, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])  # row 3: same ids, 0 is a real token there
    distinct_ids, distinct_mask, inverse = distinct_prompts(ids, mask)
    assert distinct_ids.shape[0] == 3
    assert torch.equal(distinct_ids[inverse], ids) and torch.equal(distinct_mask[inverse], mask)
    assert inverse[0] == inverse[2] != inverse[3]


def test_shared_forward_gives_the_plain_logits_and_gradients_exactly_in_float64():
    model = gpt2()
    ids, mask = grouped_batch()
    weights = torch.randn(ids.shape[0], T, V, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    response_mask = mask[:, -T:, None]

    def loss(share):
        return lambda: (forward_logits(model, ids, mask, T, share_prompts=share) * weights * response_mask).sum()

    plain, shared = gradients(model, loss(False)), gradients(model, loss(True))
    alone = gradients(model, lambda: row_by_row_loss(model, ids, mask, weights))
    for name, grad in alone.items():
        torch.testing.assert_close(plain[name], grad, rtol=1e-10, atol=1e-11)
        torch.testing.assert_close(shared[name], grad, rtol=1e-10, atol=1e-11)
    with torch.no_grad():
        a = forward_logits(model, ids, mask, T, share_prompts=False)
        b = forward_logits(model, ids, mask, T, share_prompts=True)
    valid = mask[:, -T:].bool()
    torch.testing.assert_close(b[valid], a[valid], rtol=1e-12, atol=1e-12)


def test_each_distinct_prompt_goes_through_the_model_once():
    model = gpt2()
    ids, mask = grouped_batch()
    reads_head(model, ids, mask)  # the head's one-row check on a model's first forward, done before counting
    rows_seen = []
    hook = model.transformer.wte.register_forward_hook(lambda m, args, out: rows_seen.append(tuple(args[0].shape)))
    with torch.no_grad():
        causal_lm_response_forward(model, ids, mask, T, share_prompts=True)
        causal_lm_response_forward(model, ids[::G], mask[::G], T, share_prompts=True)  # no repeats: plain
    hook.remove()
    assert rows_seen == [(B0, P), (B0 * G, T - 1), (ids[::G].shape[0], P + T)]


def test_llama_in_float32_agrees_up_to_rounding_and_values_come_along():
    """Grouped-query attention and rotary positions; the value head reads the shared forward's hidden states."""
    torch.manual_seed(3)
    critic = ActorCritic(llama_policy().train(), value_head=True)
    shared = ActorCritic(critic.policy, value_head=True, share_prompts=True)
    shared.value_head = critic.value_head
    ids, mask = grouped_batch()
    assert_same_outputs(critic_outputs(shared, ids, mask, T), critic_outputs(critic, ids, mask, T), mask[:, -T:])


def critic_outputs(model, ids, mask, response_len):
    """An actor-critic's logits (B, T, V), values (B, T) and the parameter gradients of the sum over the response
    tokens of logsumexp(logits) + value."""
    model.zero_grad(set_to_none=True)
    forward, values = model(ids, mask, response_len)
    logits = response_logits(forward)
    ((logits.float().logsumexp(-1) + values) * mask[:, -response_len:]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), values.detach(), grads


def assert_same_outputs(got, expected, response_mask):
    """`critic_outputs` equal up to float32 rounding on the response tokens (response_mask (B, T))."""
    valid = response_mask.bool()
    torch.testing.assert_close(got[0][valid], expected[0][valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1][valid], expected[1][valid], rtol=1e-5, atol=1e-5)
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-4, atol=1e-5)


def test_a_one_token_response_uses_the_prompt_forward_alone():
    model = gpt2()
    ids, mask = grouped_batch()
    ids, mask = ids[:, : P + 1], mask[:, : P + 1]
    with torch.no_grad():
        a = forward_logits(model, ids, mask, 1)
        b = forward_logits(model, ids, mask, 1, share_prompts=True)
    torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_gradient_checkpointing_keeps_the_plain_forward():
    model = gpt2(torch.float32)
    model.gradient_checkpointing_enable()
    model.train()
    ids, mask = grouped_batch()
    reads_head(model, ids, mask)  # the head's one-row check on a model's first forward, done before counting
    rows_seen = []
    hook = model.transformer.wte.register_forward_hook(lambda m, args, out: rows_seen.append(args[0].shape[0]))
    forward_logits(model, ids, mask, T, share_prompts=True).sum().backward()
    hook.remove()
    assert rows_seen[0] == B0 * G  # transformers turns the cache off under checkpointing: no sharing


class NoCacheLM(nn.Module):
    """A causal LM that returns logits and no KV cache."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, 8)
        self.head = nn.Linear(8, V)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, output_hidden_states=False):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.head(self.embed(input_ids)))


def test_a_model_without_a_kv_cache_is_a_clear_error():
    ids, mask = grouped_batch()
    with pytest.raises(
        ConfigError, match="algorithm.share_prompt_forward: NoCacheLM returned no transformers KV cache"
    ):
        causal_lm_response_forward(NoCacheLM(), ids, mask, T, share_prompts=True)
    with pytest.raises(ConfigError, match="algorithm.share_prompt_forward"):
        AlgorithmConfig(share_prompt_forward="yes")


@pytest.mark.parametrize(
    "algorithm",
    [
        dict(name="grpo", group_size=4, kl_coef=0.05),  # single pass; the reference's forward is shared too
        dict(name="ppo", group_size=2, ppo_epochs=2, num_minibatches=2),  # the critic reads the shared hidden states
    ],
    ids=["grpo", "ppo"],
)
def test_the_experience_and_the_loss_gradient_match_the_plain_forward(tokenizer, algorithm):
    texts = ["31425>", "9>", "55>", "1234>"]
    results = []
    for share in (False, True):
        module = RLHFModule(
            policy=make_policy(n_layer=2),
            tokenizer=tokenizer,
            reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
            algorithm=AlgorithmConfig(**algorithm, share_prompt_forward=share),
            sampling=SamplingConfig(max_new_tokens=8),
        )
        torch.manual_seed(7)
        rollout = module.make_rollout(prompt_batch(tokenizer, texts[: 8 // module.algorithm.filled.group_size]))[0]
        experience, first = module.make_experience(rollout)
        loss, _ = module.micro_batch_loss(experience, MinibatchTotals.of(experience, 8), first)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in module.actor_critic.named_parameters() if p.grad is not None}
        results.append((experience, grads))
    (plain, plain_grads), (shared, shared_grads) = results
    assert torch.equal(plain.response_ids, shared.response_ids)  # the same rollout
    mask = plain.response_mask
    for field in ("old_logprobs", "ref_logprobs", "values", "advantages"):
        a, b = getattr(plain, field), getattr(shared, field)
        if a is not None:
            torch.testing.assert_close(b[mask], a[mask], rtol=1e-5, atol=1e-6, msg=field)
    assert plain_grads.keys() == shared_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_lora_reference_shares_prompts_through_the_base_models_cache_keyword():
    """The adapter-disabled reference passes the KV cache under the keyword the base model takes (a deprecated or
    unknown keyword could be dropped silently, and the responses would run without their prompt)."""
    pytest.importorskip("peft")
    import inspect
    import warnings

    from lit_rlhf.models.forward import cache_keyword
    from lit_rlhf.models.lora import AdapterDisabledReference, apply_lora

    policy = apply_lora(llama_policy(), {"r": 4})
    reference = AdapterDisabledReference(policy)
    base_forward = policy.get_base_model().forward
    expected = "cache" if "cache" in inspect.signature(base_forward).parameters else "past_key_values"
    assert cache_keyword(reference) == expected
    ids, mask = grouped_batch()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecated keyword on the way
        plain = forward_logits(reference, ids, mask, T)
        shared = forward_logits(reference, ids, mask, T, share_prompts=True)
    valid = mask[:, -T:].bool()
    torch.testing.assert_close(shared[valid], plain[valid], rtol=1e-5, atol=1e-5)
