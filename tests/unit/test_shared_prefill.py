"""Shared prefill (`sampling.share_prefill`): one prefill per prompt, its KV cache repeated group_size times,
draws the same tokens as prefilling every copy of the prompt."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import generate
from lit_rlhf.config import SamplingConfig
from lit_rlhf.rollout.sampler import sample
from lit_rlhf.tasks.digits import builtin_policy, builtin_tokenizer
from lit_rlhf.types import PromptBatch

PROMPTS = ["3142>", "907>", "55>", "98765>"]
G = 4


@pytest.fixture(scope="module")
def tokenizer():
    return builtin_tokenizer()


def gpt2_policy():
    torch.manual_seed(0)
    return builtin_policy(n_layer=2, n_embd=32, n_head=2).eval()


def llama_policy():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def prompt_batch(tokenizer) -> PromptBatch:
    enc = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    return PromptBatch(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], texts=list(PROMPTS))


@pytest.mark.parametrize("make_policy", [gpt2_policy, llama_policy], ids=["gpt2", "llama"])
@pytest.mark.parametrize("settings", [dict(), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8)])
def test_shared_prefill_draws_the_same_tokens_as_one_prefill_per_copy(tokenizer, make_policy, settings):
    """The same generator seed gives the same tokens, and the same log-probs up to float rounding, as the
    prompts repeated G times and each copy prefilled."""
    policy = make_policy()
    batch = prompt_batch(tokenizer)
    ids, mask = batch.input_ids, batch.attention_mask
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    for seed in range(3):
        kwargs = dict(max_new_tokens=16, eos_token_id=eos, pad_token_id=pad, return_logprobs=True, **settings)
        shared = sample(policy, ids, mask, group_size=G, generator=torch.Generator().manual_seed(seed), **kwargs)
        repeated = sample(
            policy,
            ids.repeat_interleave(G, 0),
            mask.repeat_interleave(G, 0),
            generator=torch.Generator().manual_seed(seed),
            **kwargs,
        )
        assert shared.response_ids.shape[0] == len(PROMPTS) * G
        assert torch.equal(shared.response_ids, repeated.response_ids), seed
        torch.testing.assert_close(shared.logprobs, repeated.logprobs, atol=1e-5, rtol=1e-5)
        # the G samples of a prompt differ (they are independent draws, not one draw copied)
        assert any(len({tuple(r) for r in shared.response_ids[i * G : i * G + G].tolist()}) > 1 for i in range(4))


def test_share_prefill_setting_prefills_each_prompt_once_with_the_same_tokens(tokenizer):
    """Through `generate`: share_prefill runs the prefill over B0 rows (not B0 * G), with the same result."""
    policy = gpt2_policy()
    batch = prompt_batch(tokenizer)
    prefill_rows: list[int] = []

    def record(module, args, kwargs):
        if kwargs["input_ids"].shape[1] > 1:  # the prefill (a decode step feeds one column)
            prefill_rows.append(kwargs["input_ids"].shape[0])

    handle = policy.register_forward_pre_hook(record, with_kwargs=True)
    try:
        results = []
        for share in (True, False):
            torch.manual_seed(7)
            sampling = SamplingConfig(max_new_tokens=12, share_prefill=share)
            results.append(generate(policy, batch, G, sampling, tokenizer.eos_token_id, tokenizer.pad_token_id))
    finally:
        handle.remove()
    assert prefill_rows == [len(PROMPTS), len(PROMPTS) * G]
    assert torch.equal(results[0].response_ids, results[1].response_ids)
    assert torch.equal(results[0].response_mask, results[1].response_mask)
    assert torch.equal(results[0].prompt_ids, results[1].prompt_ids)


class TupleCacheModel(nn.Module):
    """Returns its cache as a plain tuple, which has no `batch_repeat_interleave`."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=True, past_key_values=None):
        logits = torch.zeros(*input_ids.shape, 5)
        return SimpleNamespace(logits=logits, past_key_values=((torch.zeros(input_ids.shape[0], 1),),))


def test_a_cache_that_cannot_be_repeated_is_a_clear_error():
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="sampling.share_prefill"):
        sample(TupleCacheModel(), ids, torch.ones_like(ids), 4, eos_token_id=1, pad_token_id=0, group_size=2)
    out = sample(TupleCacheModel(), ids, torch.ones_like(ids), 4, eos_token_id=1, pad_token_id=0, group_size=1)
    assert out.response_ids.shape[0] == 2  # without sharing, no repeat is needed
