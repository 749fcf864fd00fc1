"""The lean sampling loop (`lit_rlhf.rollout.sampler`) against Hugging Face `generate`, by hand examples and a stub."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import forward_logits, full_logprobs, generate
from lit_rlhf.config import ConfigError, SamplingConfig
from lit_rlhf.models.forward import position_ids_from_mask
from lit_rlhf.rollout.sampler import mask_logits, sample
from lit_rlhf.tasks.digits import builtin_policy, builtin_tokenizer
from lit_rlhf.types import PromptBatch

PROMPTS = ["3142>", "907>", "55>", "98765>"]


@pytest.fixture(scope="module")
def tokenizer():
    return builtin_tokenizer()


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return builtin_policy(n_layer=1, n_embd=32, n_head=2).eval()


def prompt_batch(tokenizer, texts=PROMPTS) -> PromptBatch:
    enc = tokenizer(list(texts), padding=True, return_tensors="pt")
    return PromptBatch(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], texts=list(texts))


def run_backend(policy, tokenizer, backend: str, seed: int, **settings):
    sampling = SamplingConfig(backend=backend, **settings)
    torch.manual_seed(seed)
    return generate(policy, prompt_batch(tokenizer), 3, sampling, tokenizer.eos_token_id, tokenizer.pad_token_id)


# ----------------------------------------------------------------------------- same distribution as generate


@pytest.mark.parametrize(
    "settings",
    [
        dict(max_new_tokens=12),
        dict(max_new_tokens=12, temperature=0.7, top_k=5),
        dict(max_new_tokens=12, temperature=1.3, top_p=0.8),
        dict(max_new_tokens=12, top_k=6, top_p=0.9),
    ],
)
def test_same_seed_gives_the_same_tokens_as_generate(policy, tokenizer, settings):
    """Both backends draw with torch.multinomial on the same processed distribution, so the same global seed
    gives the same tokens, masks and shapes."""
    for seed in range(3):
        lean = run_backend(policy, tokenizer, "lean", seed, **settings)
        hf = run_backend(policy, tokenizer, "generate", seed, **settings)
        assert torch.equal(lean.response_ids, hf.response_ids), (seed, lean.response_ids, hf.response_ids)
        assert torch.equal(lean.response_mask, hf.response_mask)
        assert torch.equal(lean.truncated, hf.truncated)
        assert torch.equal(lean.prompt_ids, hf.prompt_ids)


def test_top_k_1_is_greedy_and_matches_generate(policy, tokenizer):
    lean = run_backend(policy, tokenizer, "lean", 0, max_new_tokens=10, top_k=1)
    hf = run_backend(policy, tokenizer, "generate", 123, max_new_tokens=10, top_k=1)  # another seed: no randomness
    assert torch.equal(lean.response_ids, hf.response_ids)
    # greedy by hand: argmax of a full forward at each step
    batch = prompt_batch(tokenizer)
    ids, mask = batch.input_ids.repeat_interleave(3, 0), batch.attention_mask.repeat_interleave(3, 0)
    for t in range(lean.response_ids.shape[1]):
        logits = policy(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        nxt = logits[:, -1].argmax(-1)
        alive = lean.response_mask[:, t]
        assert torch.equal(nxt[alive], lean.response_ids[alive, t])
        ids = torch.cat([ids, lean.response_ids[:, t : t + 1]], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)


def test_reported_logprobs_match_a_fresh_forward(policy, tokenizer):
    batch = prompt_batch(tokenizer)
    torch.manual_seed(1)
    out = sample(
        policy,
        batch.input_ids,
        batch.attention_mask,
        12,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        temperature=0.7,
        top_k=8,
        return_logprobs=True,
    )
    is_eos = out.response_ids == tokenizer.eos_token_id  # mask: up to and including the first EOS
    mask = (is_eos.long().cumsum(1) - is_eos.long()) == 0
    ids = torch.cat([batch.input_ids, out.response_ids], 1)
    attention = torch.cat([batch.attention_mask, mask.long()], 1)
    T = out.response_ids.shape[1]
    logits = forward_logits(policy, ids, attention, T)
    fresh = full_logprobs(logits, out.response_ids, 0.7).float()
    assert torch.allclose(out.logprobs[mask], fresh[mask], atol=1e-5), (out.logprobs[mask] - fresh[mask]).abs().max()
    assert (out.logprobs[mask] <= 0).all()


# ----------------------------------------------------------------------------- reproducibility


def test_same_generator_seed_gives_the_same_tokens_and_leaves_the_global_rng_alone(policy, tokenizer):
    batch = prompt_batch(tokenizer)

    def draw(seed):
        gen = torch.Generator().manual_seed(seed)
        return sample(
            policy,
            batch.input_ids,
            batch.attention_mask,
            16,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            generator=gen,
        ).response_ids

    state = torch.get_rng_state()
    a, b, c = draw(7), draw(7), draw(8)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    sampling = SamplingConfig(backend="lean", max_new_tokens=16)
    g1 = generate(
        policy, batch, 2, sampling, tokenizer.eos_token_id, tokenizer.pad_token_id, torch.Generator().manual_seed(3)
    )
    g2 = generate(
        policy, batch, 2, sampling, tokenizer.eos_token_id, tokenizer.pad_token_id, torch.Generator().manual_seed(3)
    )
    assert torch.equal(g1.response_ids, g2.response_ids)


# ----------------------------------------------------------------------------- masking by hand


def test_mask_logits_by_hand():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()

    def kept(**kw):
        return torch.isfinite(mask_logits(logits, **kw))[0].nonzero().flatten().tolist()

    assert kept() == [0, 1, 2, 3, 4]
    assert kept(top_k=2) == [0, 1]
    assert kept(top_k=5) == [0, 1, 2, 3, 4]
    assert kept(top_p=0.6) == [0, 1]  # 0.5 < 0.6, so the token that crosses it (0.2) stays
    assert kept(top_p=0.45) == [0]
    assert kept(top_p=0.99) == [0, 1, 2, 3, 4]
    assert kept(top_p=1e-6) == [0]  # the most likely token always stays
    # top-k first, then top-p on the renormalised rest: 0.5, 0.2, 0.15 -> 0.588, 0.235, 0.176
    assert kept(top_k=3, top_p=0.6) == [0, 1]
    assert kept(top_k=3, top_p=0.85) == [0, 1, 2]  # 0.588 + 0.235 = 0.823 < 0.85
    ties = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert torch.isfinite(mask_logits(ties, top_k=1)).tolist() == [[False, True, True, False]]  # ties are kept


def test_mask_logits_matches_the_transformers_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen) * 3
    for top_k, top_p in [(0, 0.3), (0, 0.9), (7, 1.0), (7, 0.5), (1, 0.9)]:
        expected = logits
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1:
            expected = TopPLogitsWarper(top_p)(None, expected)
        assert torch.equal(torch.isfinite(mask_logits(logits, top_k, top_p)), torch.isfinite(expected))


# ----------------------------------------------------------------------------- padding, EOS, positions


def test_extra_left_padding_gives_the_same_greedy_continuation(policy, tokenizer):
    enc = tokenizer(["3142>"], return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    pad = torch.full((1, 5), tokenizer.pad_token_id)
    padded_ids, padded_mask = torch.cat([pad, ids], 1), torch.cat([torch.zeros_like(pad), mask], 1)
    kw = dict(
        max_new_tokens=12,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        top_k=1,
        return_logprobs=True,
    )
    plain = sample(policy, ids, mask, **kw)
    padded = sample(policy, padded_ids, padded_mask, **kw)
    assert torch.equal(plain.response_ids, padded.response_ids)
    assert torch.allclose(plain.logprobs, padded.logprobs, atol=1e-5)
    # and inside a batch whose other prompt forces padding
    batch = tokenizer(["3142>", "98765432>"], padding=True, return_tensors="pt")
    both = sample(policy, batch["input_ids"], batch["attention_mask"], **kw)
    assert torch.equal(both.response_ids[0, : plain.response_ids.shape[1]], plain.response_ids[0])


class EosStub(nn.Module):
    """A causal-LM stand-in: sequence b emits EOS as its token number `stop[b]` (1-based), token 5 before.

    It records the position ids and attention-mask widths it is called with, and counts forwards.
    """

    def __init__(self, stop: list[int], vocab: int = 8, eos: int = 1):
        super().__init__()
        self.stop, self.vocab, self.eos = torch.tensor(stop), vocab, eos
        self.calls: list[tuple[torch.Tensor, int]] = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, cache=None, logits_to_keep=0):
        self.calls.append((position_ids.clone(), attention_mask.shape[1]))
        produced = len(self.calls)  # the token this call's logits choose is token number `produced`
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -1e4)
        choose = torch.where(self.stop == produced, self.eos, 5)
        logits[torch.arange(input_ids.shape[0]), 0, choose] = 0.0
        return SimpleNamespace(logits=logits, cache=(cache or 0) + 1)


def test_stops_once_every_sequence_has_emitted_eos_and_pads_after_it():
    stub = EosStub(stop=[2, 4, 1])
    ids = torch.tensor([[0, 0, 7, 7], [7, 7, 7, 7], [0, 7, 7, 7]])
    mask = (ids != 0).long()
    out = sample(stub, ids, mask, max_new_tokens=10, eos_token_id=1, pad_token_id=0)
    assert out.response_ids.tolist() == [[5, 1, 0, 0], [5, 5, 5, 1], [1, 0, 0, 0]]
    assert len(stub.calls) == 4  # prefill + 3 decode steps, none after the last EOS
    # prefill positions ignore the left padding; then +1 per step for every sequence
    assert stub.calls[0][0].tolist() == [[0, 0, 0, 1], [0, 1, 2, 3], [0, 0, 1, 2]]
    assert [c[0].flatten().tolist() for c in stub.calls[1:]] == [[2, 4, 3], [3, 5, 4], [4, 6, 5]]
    assert [c[1] for c in stub.calls] == [4, 5, 6, 7]


def test_deferred_stop_check_gives_the_same_output():
    """On an accelerator the loop asks "all ended?" only every few steps; the extra steps are dropped."""
    ids = torch.tensor([[7, 7], [7, 7], [7, 7]])
    for every in (1, 3, 8):
        stub = EosStub(stop=[2, 4, 1])
        out = sample(
            stub,
            ids,
            torch.ones_like(ids),
            max_new_tokens=10,
            eos_token_id=1,
            pad_token_id=0,
            stop_check_every=every,
            return_logprobs=True,
        )
        assert out.response_ids.tolist() == [[5, 1, 0, 0], [5, 5, 5, 1], [1, 0, 0, 0]], every
        assert out.logprobs.shape == (3, 4)
        assert len(stub.calls) == {1: 4, 3: 6, 8: 8}[every]  # forwards run before the check noticed


def test_lean_generation_marks_eos_and_truncation():
    stub = EosStub(stop=[2, 99])
    batch = PromptBatch(
        input_ids=torch.tensor([[7, 7]]), attention_mask=torch.ones(1, 2, dtype=torch.long), texts=["x"]
    )
    sampling = SamplingConfig(backend="lean", max_new_tokens=3, share_prefill=False)  # the stub keeps no cache
    stub.stop = torch.tensor([2, 99])  # group of 2 copies of the one prompt: the first ends, the second runs out
    gen = generate(stub, batch, 2, sampling, eos_token_id=1, pad_token_id=0)
    assert gen.response_ids.tolist() == [[5, 1, 0], [5, 5, 5]]
    assert gen.response_mask.tolist() == [[True, True, False], [True, True, True]]
    assert gen.truncated.tolist() == [False, True]


def test_backend_setting_is_validated():
    assert SamplingConfig(backend="lean").backend == "lean"
    assert SamplingConfig(backend="generate").backend == "generate"
    with pytest.raises(ConfigError, match="sampling.backend: unknown value 'sglang'"):
        SamplingConfig(backend="sglang")


def test_the_cache_keyword_of_a_peft_wrapped_model_is_the_wrapped_models():
    """A peft model's forward takes **kwargs: the lean sampler must ask the model inside which keyword it uses,
    or it passes the deprecated `past_key_values` to a transformers that wants `cache`."""
    import inspect

    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    from lit_rlhf.models.forward import cache_keyword

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config)
    expected = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert cache_keyword(wrapped) == expected
