"""A `peft.PeftModel` given as the policy, the TRL way: the reference is the same weights with the adapters
disabled, only the adapters train, a checkpoint rebuilds it without arguments, and `save_policy` writes it merged
or as adapters (`peft` required; skipped without it)."""

from __future__ import annotations

import pytest
import torch

from conftest import checksum, make_policy, make_trainer

peft = pytest.importorskip("peft")

from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig  # noqa: E402
from lit_rlhf.config import ConfigError  # noqa: E402
from lit_rlhf.models.lora import AdapterDisabledReference, parameter_bytes  # noqa: E402

REWARD = ["lit_rlhf.tasks.digits.sort_digits_reward"]


def peft_policy():
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM")
    return peft.get_peft_model(make_policy(), config)


def peft_module(policy=None, **kwargs) -> RLHFModule:
    return RLHFModule(
        policy=policy if policy is not None else peft_policy(),
        tokenizer="builtin:digits",
        reward_fns=REWARD,
        algorithm=AlgorithmConfig(name="grpo", group_size=2, kl_coef=0.05),
        sampling=SamplingConfig(max_new_tokens=6),
        lr=1e-2,
        **kwargs,
    )


def fit(module, tmp_path, steps=2):
    trainer = make_trainer(steps, default_root_dir=tmp_path)
    trainer.fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=2))
    return trainer


def base_and_adapters(module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    named = {k: v.detach().clone() for k, v in module.actor_critic.policy.named_parameters()}
    adapters = {k: v for k, v in named.items() if "lora_" in k}
    return {k: v for k, v in named.items() if k not in adapters}, adapters


def test_a_peft_policy_gets_the_adapter_disabled_reference_and_trains_only_its_adapters(tmp_path):
    module = peft_module()
    assert isinstance(module.reference, AdapterDisabledReference)  # not a frozen copy of the whole model
    assert parameter_bytes(module) == parameter_bytes(module.actor_critic.policy)
    base, adapters = base_and_adapters(module)
    fit(module, tmp_path)
    base_after, adapters_after = base_and_adapters(module)
    assert all(torch.equal(base[k], base_after[k]) for k in base)
    assert any(not torch.equal(adapters[k], adapters_after[k]) for k in adapters)


def test_a_peft_policy_checkpoint_rebuilds_without_arguments_and_saves_merged_or_adapters(tmp_path):
    from transformers import AutoModelForCausalLM

    module = peft_module()
    trainer = fit(module, tmp_path)
    path = tmp_path / "peft.ckpt"
    trainer.save_checkpoint(path)
    loaded = RLHFModule.load_from_checkpoint(path, map_location="cpu")
    assert isinstance(loaded.reference, AdapterDisabledReference)
    assert checksum(loaded.actor_critic.policy) == checksum(module.actor_critic.policy)
    saved = torch.load(path, weights_only=True)  # the spec is plain data: base config + adapter config
    assert saved["hyper_parameters"]["policy"]["peft_config"]["r"] == 4
    loaded.save_policy(str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = module.actor_critic.policy(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, expected)
    loaded.save_policy(str(tmp_path / "adapters"), merge_lora=False)
    assert (tmp_path / "adapters" / "adapter_config.json").is_file()


def test_a_peft_policy_with_lora_settings_or_frozen_adapters_is_refused():
    with pytest.raises(ConfigError, match="model.lora: the policy is already a peft model"):
        peft_module(lora={"r": 4})
    frozen = peft_policy()
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ConfigError, match="adapters are frozen.*is_trainable=True"):
        peft_module(policy=frozen)
