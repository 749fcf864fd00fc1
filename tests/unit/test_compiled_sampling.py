"""`sampling.backend: compiled`: decoding over a static KV cache (eager or `torch.compile`d) draws the same tokens
as the default loop for the same generator seed."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_shared_prefill import TupleCacheModel, gpt2_policy, llama_policy, prompt_batch

from conftest import generate
from lit_rlhf.config import ConfigError, SamplingConfig
from lit_rlhf.rollout.sampler import sample
from lit_rlhf.rollout.static_decode import static_cache_length
from lit_rlhf.tasks.digits import builtin_tokenizer
from lit_rlhf.types import PromptBatch


@pytest.fixture(scope="module")
def tokenizer():
    return builtin_tokenizer()


def both_ways(policy, batch, seed, **kwargs):
    """(default loop, static cache) outputs for the same generator seed."""
    return tuple(
        sample(
            policy,
            batch.input_ids,
            batch.attention_mask,
            generator=torch.Generator().manual_seed(seed),
            return_logprobs=True,
            static_cache=static,
            **kwargs,
        )
        for static in (False, True)
    )


def assert_same(default, static):
    assert torch.equal(default.response_ids, static.response_ids)
    torch.testing.assert_close(static.logprobs, default.logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make_policy", [gpt2_policy, llama_policy], ids=["gpt2", "llama"])
@pytest.mark.parametrize(
    "settings",
    [
        dict(group_size=1),
        dict(group_size=4, temperature=0.7, top_k=5),
        dict(group_size=4, temperature=1.3, top_p=0.8),
        dict(group_size=1, do_sample=False),
        dict(group_size=3, do_sample=False),
    ],
    ids=["plain", "top_k_G4", "top_p_G4", "greedy", "greedy_G3"],
)
def test_static_cache_draws_the_same_tokens_as_the_default_loop(tokenizer, make_policy, settings):
    """Same ids and log-probs within 1e-5 for three seeds (the second and third reuse the kept static cache)."""
    policy = make_policy()
    batch = prompt_batch(tokenizer)
    kwargs = dict(max_new_tokens=16, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    for seed in range(3):
        default, static = both_ways(policy, batch, seed, **kwargs, **settings)
        assert default.response_ids.shape == (4 * settings["group_size"], 16)
        assert_same(default, static)


@pytest.mark.parametrize("make_policy", [gpt2_policy, llama_policy], ids=["gpt2", "llama"])
def test_static_cache_stops_early_and_pads_after_eos_like_the_default_loop(tokenizer, make_policy):
    """With a frequent token as EOS every sequence ends well before the limit: the same early stop, the same pads."""
    policy = make_policy()
    batch = prompt_batch(tokenizer)
    pad = tokenizer.pad_token_id
    kwargs = dict(pad_token_id=pad, temperature=0.5)
    generator = torch.Generator().manual_seed(0)
    free = sample(policy, batch.input_ids, batch.attention_mask, 16, -1, generator=generator, **kwargs)
    eos = Counter(free.response_ids.flatten().tolist()).most_common(1)[0][0]  # the most often drawn token
    stopped_early = []
    for seed in range(4):
        default, static = both_ways(policy, batch, seed, max_new_tokens=48, eos_token_id=eos, **kwargs)
        assert_same(default, static)
        if default.response_ids.shape[1] < 48:  # every row has its EOS, pads after it
            assert (default.response_ids == eos).any(dim=1).all()
            stopped_early.append(seed)
    assert stopped_early  # (the random Llama is close to uniform over 16 tokens: a row can miss EOS in 48 draws)


def test_static_cache_runs_a_peft_lora_policy(tokenizer):
    peft = pytest.importorskip("peft")
    LoraConfig, get_peft_model = peft.LoraConfig, peft.get_peft_model

    torch.manual_seed(1)
    lora = LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True)
    policy = get_peft_model(gpt2_policy(), lora).eval()
    batch = prompt_batch(tokenizer)
    kwargs = dict(max_new_tokens=12, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    assert_same(*both_ways(policy, batch, 0, group_size=2, **kwargs))


def test_static_cache_length_is_rounded_up_to_the_bucket():
    assert static_cache_length(5, 12) == 64
    assert static_cache_length(60, 4) == 64
    assert static_cache_length(61, 4) == 128
    assert static_cache_length(3, 2, bucket=4) == 8


def test_compiled_decode_draws_the_same_tokens_and_compiles_once_per_bucket(tokenizer):
    """Through the 'compiled' backend: the same tokens as the default loop, and a second
    batch of a different prompt width in the same length bucket reuses the compiled step (no new graph)."""
    from torch._dynamo.utils import counters

    policy = gpt2_policy()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    short = prompt_batch(tokenizer)
    texts = ["31415926>", "27>", "161803398>", "4>"]  # a wider batch, still well inside one 64-column bucket
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    wide = PromptBatch(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], texts=texts)
    assert wide.input_ids.shape[1] > short.input_ids.shape[1]
    graphs = []
    for batch in (short, wide):
        results = []
        for compile in (False, True):
            sampling = SamplingConfig(max_new_tokens=16, backend="compiled" if compile else "lean")
            before = counters["stats"]["unique_graphs"]
            generator = torch.Generator().manual_seed(3)
            results.append(generate(policy, batch, 2, sampling, eos, pad, generator=generator))
            if compile:
                graphs.append(counters["stats"]["unique_graphs"] - before)
        assert torch.equal(results[0].response_ids, results[1].response_ids)
        assert torch.equal(results[0].response_mask, results[1].response_mask)
    assert graphs[0] >= 1  # the first call compiled the decode step
    assert graphs[1] == 0  # the wider prompts reused it


def test_a_model_without_static_cache_support_is_a_clear_error():
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(
        ConfigError, match=r"sampling\.backend 'compiled': TupleCacheModel .*set sampling\.backend: lean"
    ):
        sample(TupleCacheModel(), ids, torch.ones_like(ids), 4, eos_token_id=1, pad_token_id=0, compile=True)


def test_the_removed_compile_setting_names_the_backend_that_replaced_it():
    assert SamplingConfig(backend="compiled").backend == "compiled"
    for old in (True, "yes"):
        with pytest.raises(ConfigError, match=r"sampling\.compile: .*set sampling\.backend: compiled"):
            SamplingConfig(compile=old)  # type: ignore[arg-type]
    assert SamplingConfig(compile=False).backend == "lean"


def test_the_kept_static_cache_does_not_keep_the_model_alive(tokenizer):
    import gc
    import weakref

    policy = gpt2_policy()
    batch = prompt_batch(tokenizer)
    sample(policy, batch.input_ids, batch.attention_mask, 4, tokenizer.eos_token_id, 0, static_cache=True)
    ref = weakref.ref(policy)
    del policy
    gc.collect()
    assert ref() is None
