"""What a vLLM weight sync sends, without vLLM: which LoRA adapters vLLM can serve (and why not), the adapter folder
a policy version is written as (peft loads it back to the same model), the base weights under the checkpoint's
names, and the bounded shards of a full-weights push (tied names apart, every tensor back as it was)."""

from __future__ import annotations

import os
import re

import pytest
import torch
from safetensors.torch import load_file

from lit_rlhf.models.lora import apply_lora
from lit_rlhf.rollout.backends.vllm_weights import (
    AdapterVersions,
    adapter_refusal,
    base_weights,
    serves_adapters,
    vllm_max_lora_rank,
    write_weight_shards,
)


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def trained_lora(settings: dict, seed: int = 1):
    policy = apply_lora(tiny_llama(), settings)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:  # B starts at zero: give the adapters an effect
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return policy


def test_adapters_on_linear_layers_are_served_and_the_rank_rounds_up_to_vllms():
    policy = trained_lora({"r": 4, "alpha": 8})
    assert adapter_refusal(policy) is None
    assert serves_adapters(policy, wanted=True) == (True, None)
    assert vllm_max_lora_rank(policy) == 8  # vLLM 0.32 takes 1, 8, 16, ...
    assert vllm_max_lora_rank(trained_lora({"r": 1})) == 1
    assert vllm_max_lora_rank(trained_lora({"r": 20})) == 32


@pytest.mark.parametrize(
    "settings, reason",
    [
        ({"modules_to_save": ["lm_head"]}, "modules_to_save \\['lm_head'\\]"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target module .*lm_head' is the output layer"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens' is a Embedding, not a linear layer"),
        ({"use_dora": True}, "DoRA"),
    ],
    ids=["modules_to_save", "output_layer", "embedding", "dora"],
)
def test_adapters_vllm_cannot_serve_are_named(settings, reason):
    policy = apply_lora(tiny_llama(), settings)
    assert adapter_refusal(policy) is not None
    sends, why = serves_adapters(policy, wanted=True)
    assert not sends and why is not None
    assert re.search(reason, why), why


def test_no_adapters_or_adapters_turned_off_send_full_weights():
    assert serves_adapters(tiny_llama(), wanted=True) == (False, None)
    assert serves_adapters(trained_lora({"r": 4}), wanted=False) == (False, "sampling.vllm.lora_adapters is false")


def test_an_adapter_version_loads_back_into_peft_as_the_same_model(tmp_path):
    from peft import PeftModel

    policy = trained_lora({"r": 4, "alpha": 8})
    versions = AdapterVersions(str(tmp_path))
    name, lora_id, folder, sent = versions.write(policy)
    assert (name, lora_id) == ("policy-v1", 1)
    lora_bytes = sum(p.numel() * p.element_size() for n, p in policy.named_parameters() if "lora_" in n)
    saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
    assert sent == lora_bytes == sum(t.numel() * t.element_size() for t in saved.values())
    loaded = PeftModel.from_pretrained(tiny_llama(), folder).eval()  # the same base (seed 0) with the saved adapters
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, policy(input_ids=ids).logits, rtol=0, atol=1e-6)
        assert not torch.allclose(tiny_llama()(input_ids=ids).logits, policy(input_ids=ids).logits, atol=1e-3)
    versions.write(policy)
    versions.drop_older()
    assert sorted(os.listdir(tmp_path)) == ["v2"]


def test_base_weights_are_the_checkpoints_names_and_tensors_without_a_copy():
    policy = trained_lora({"r": 4})
    plain = tiny_llama()
    base = dict(base_weights(policy))
    assert base.keys() == plain.state_dict().keys()  # lm_head.weight (tied) included
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(base[name], tensor, rtol=0, atol=0)
    parameters = {p.data_ptr() for p in policy.parameters()}
    assert all(tensor.data_ptr() in parameters for tensor in base.values())


def test_full_weights_go_in_bounded_shards_with_tied_names_apart(tmp_path):
    weights = tiny_llama().state_dict()
    largest = max(t.numel() * t.element_size() for t in weights.values())
    sent = write_weight_shards(weights.items(), str(tmp_path), shard_bytes=largest)
    assert sent == sum(t.numel() * t.element_size() for t in weights.values())
    shards = sorted(os.listdir(tmp_path))
    back: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors = load_file(os.path.join(tmp_path, shard))
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= largest or len(tensors) == 1
        back.update(tensors)
    assert back.keys() == weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(back[name], tensor, rtol=0, atol=0)
