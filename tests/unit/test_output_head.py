"""The LM head read off a model (`lit_rlhf.models.output_head`): what each kind of head computes as a `Head`, the
head skipped in every training forward and run on the last position only while sampling, models whose logits are
transformed after the head (Gemma's soft-cap, Cohere's and Granite's scales) read correctly, and a transformation
the library does not know caught by the check and answered with the model's own logits.

Expected values come from the models' own forwards (their full logits) and a float64 log-softmax."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from conftest import full_entropy, full_logprobs, make_policy, prompt_batch
from lit_rlhf.algorithms.chunked_logprobs import Head, head_stats
from lit_rlhf.models.forward import causal_lm_response_forward
from lit_rlhf.models.output_head import check_head, output_module, read_head
from lit_rlhf.models.vocabulary import mask_padded_vocabulary

V = 48


def tiny(config_class: str, **extra):
    """A 1-layer model of a transformers architecture, float64, with large logits (weights scaled up) so that a
    soft-cap or a scale after the head changes them by far more than rounding."""
    import transformers

    config = getattr(transformers, config_class)(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        **extra,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
    with torch.no_grad():
        output_module(model).weight.mul_(40.0)
    return model


def batch(rows: int = 3, prompt: int = 5, response: int = 6):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (rows, prompt + response), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    mask[1, -2:] = 0  # a response that ended early
    return ids, mask, response


def model_logits(model, ids, mask, response_len):
    """The model's own full logits on the response grid: (B, T, V)."""
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    return logits[:, -response_len - 1 : -1]


def stats_of(model, ids, mask, response_len):
    """The library's log-probs and entropy of the sampled tokens (the valid ones) at temperature 0.8."""
    forward = causal_lm_response_forward(model, ids, mask, response_len)
    valid = mask[:, -response_len:].bool()
    tokens = ids[:, -response_len:]
    stats = head_stats(forward.head_inputs[valid], tokens[valid], forward.head, 0.8)
    return forward, stats, valid, tokens


@pytest.mark.parametrize(
    "architecture, extra, transform",
    [
        ("LlamaConfig", {}, (1.0, None)),
        ("Gemma2Config", {"final_logit_softcapping": 3.0}, (1.0, 3.0)),
        ("CohereConfig", {"logit_scale": 0.25}, (0.25, None)),
        ("GraniteConfig", {"logits_scaling": 4.0}, (0.25, None)),
    ],
    ids=["llama", "gemma2-softcap", "cohere-scale", "granite-scaling"],
)
def test_heads_with_a_transformation_after_them_are_read_and_give_the_models_log_probs(architecture, extra, transform):
    model = tiny(architecture, **extra)
    ids, mask, T = batch()
    assert check_head(model, ids, mask) is None
    forward, stats, valid, tokens = stats_of(model, ids, mask, T)
    assert forward.logits is None and (forward.head.scale, forward.head.softcap) == transform
    with torch.no_grad():
        theirs = model_logits(model, ids, mask, T)
    expected = full_logprobs(theirs, tokens, 0.8)[valid]
    torch.testing.assert_close(stats.logprobs, expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(stats.entropy, full_entropy(theirs, 0.8)[valid], rtol=1e-9, atol=1e-9)
    if transform != (1.0, None):  # the logits are large enough that leaving the transformation out would show
        plain = dataclasses.replace(forward.head, scale=1.0, softcap=None)
        missed = head_stats(forward.head_inputs[valid], tokens[valid], plain, 0.8).logprobs
        assert (missed - expected).abs().max() > 0.1


class ScaledGPT2(nn.Module):
    """A causal LM that multiplies its logits by 3 after the head: a transformation the library does not know."""

    def __init__(self):
        super().__init__()
        self.inner = make_policy().double()

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits * 3.0
        return out


def test_an_unknown_transformation_is_caught_and_the_models_own_logits_are_used(tokenizer):
    model = ScaledGPT2().eval()
    ids = prompt_batch(tokenizer, ["31425>1234", "9>5", "550>05"]).input_ids
    mask = (ids != tokenizer.pad_token_id).long()
    assert "a transformation after the head" in check_head(model, ids, mask)
    with pytest.warns(UserWarning, match="ScaledGPT2: its logits are not the LM head's"):
        forward, stats, valid, tokens = stats_of(model, ids, mask, 3)
    assert forward.logits is not None and forward.head.weight is None  # the model's own logits, kept
    with torch.no_grad():
        theirs = model_logits(model, ids, mask, 3)
    torch.testing.assert_close(stats.logprobs, full_logprobs(theirs, tokens, 0.8)[valid], rtol=1e-9, atol=1e-9)


def test_every_training_forward_skips_the_head_and_sampling_runs_it_on_one_position(tokenizer):
    from lit_rlhf import RLHFModule, SamplingConfig

    module = RLHFModule(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
        algorithm={"name": "grpo", "group_size": 4, "kl_coef": 0.04},
        sampling=SamplingConfig(max_new_tokens=6),
    )
    seen = recording_head(module.actor_critic.policy)
    torch.manual_seed(0)
    rollout = module.make_rollout(prompt_batch(tokenizer, ["31425>", "9>"]))[0]
    sampled, seen[:] = list(seen), []
    module.make_experience(rollout)
    checked, seen[:] = list(seen), []  # the first forward checks the head once (`check_head`)
    module.make_experience(rollout)
    assert sampled and all(shape[1] == 1 for shape in sampled)  # prefill and decode: the last position only
    assert checked[0] == (1, 12, 32) and all(shape[1] == 0 for shape in checked[1:])
    assert seen and all(shape[1] == 0 for shape in seen)  # the policy's forwards: no logits


def recording_head(model) -> list[tuple[int, ...]]:
    """The shapes of every input `model`'s LM head gets from now on (wrapped on the instance: a forward hook would
    make the head unreadable)."""
    head, seen = output_module(model), []
    linear = head.forward
    head.forward = lambda hidden: (seen.append(tuple(hidden.shape)), linear(hidden))[1]
    return seen


@pytest.mark.parametrize("backend", ["lean", "compiled", "generate", "multi-turn"])
def test_every_sampler_scores_the_last_position_only(backend, tokenizer):
    from test_multi_turn import Episodes, PeekEnvironment, no_score

    from conftest import generate
    from lit_rlhf import SamplingConfig

    policy = make_policy().eval()
    prompts = prompt_batch(tokenizer, ["31425>", "9>", "550>"])
    sampling = SamplingConfig(max_new_tokens=6, backend="lean" if backend == "multi-turn" else backend)
    seen = recording_head(policy)
    torch.manual_seed(0)
    if backend == "multi-turn":
        Episodes(PeekEnvironment(), 3, 12).collect(prompts, policy, tokenizer, no_score, 2, sampling)
    else:
        generate(policy, prompts, 2, sampling, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert len(seen) >= 6 and all(shape[1] == 1 for shape in seen), seen


def test_held_out_evaluation_scores_the_last_position_only(tokenizer):
    from conftest import make_trainer
    from lit_rlhf import RLHFModule, RolloutDataModule, SamplingConfig

    module = RLHFModule(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
        metric_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
        sampling=SamplingConfig(max_new_tokens=5),
    )
    seen = recording_head(module.actor_critic.policy)
    data = RolloutDataModule(prompts="builtin:digits", batch_size=2, val_prompts="builtin:digits", val_size=4)
    make_trainer(1).validate(module, datamodule=data, verbose=False)
    assert len(seen) >= 5 and all(shape[1] == 1 for shape in seen), seen


def test_a_padded_vocabulary_is_read_as_the_tokenizers():
    model = make_policy()
    rows = model.get_output_embeddings().weight.shape[0]
    mask_padded_vocabulary(model, rows - 5)
    head = read_head(output_module(model))
    assert isinstance(head, Head) and head.vocab == rows - 5


def test_heads_that_are_not_a_plain_linear_layer_are_named():
    model = make_policy()
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: out * 2)
    assert "a forward hook on the LM head" in read_head(output_module(model))
    assert "not a linear layer" in read_head(nn.Sequential(nn.Linear(4, 4)))


def lora_model(**settings):
    pytest.importorskip("peft")
    from lit_rlhf.models.lora import apply_lora

    model = apply_lora(make_policy().double(), {"r": 4, "alpha": 8, "target_modules": ["lm_head"], **settings})
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return model


def test_a_lora_head_is_its_base_weight_plus_the_scaled_product_and_the_base_with_adapters_off():
    model = lora_model().eval()
    layer = output_module(model)
    head = read_head(layer)
    hidden = torch.randn(5, layer.in_features, dtype=torch.float64)
    torch.testing.assert_close(hidden @ head.weight.T, layer(hidden))
    with model.disable_adapter():
        torch.testing.assert_close(read_head(layer).weight, layer.base_layer.weight)
    model.train()
    assert "dropout" in read_head(output_module(lora_model(dropout=0.1).train()))


def test_a_saved_head_copy_is_read_while_it_is_active():
    pytest.importorskip("peft")
    from lit_rlhf.models.lora import apply_lora

    model = apply_lora(make_policy().double(), {"r": 4, "target_modules": ["c_attn"], "modules_to_save": ["lm_head"]})
    wrapper = output_module(model)
    with torch.no_grad():
        wrapper.modules_to_save["default"].weight.add_(1.0)
    assert read_head(wrapper).weight is wrapper.modules_to_save["default"].weight
    with model.disable_adapter():
        assert read_head(wrapper).weight is wrapper.original_module.weight
