"""LoRA on the policy with the reference for free (adapters disabled), gradient checkpointing and bf16-mixed
on CPU, with the tiny built-in GPT-2 (`peft` required; skipped without it)."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import checksum, forward_logits, make_policy, make_trainer

pytest.importorskip("peft")

from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.algorithms.objective import MinibatchTotals
from lit_rlhf.config import ConfigError
from lit_rlhf.models.lora import AdapterDisabledReference, parameter_bytes

REWARD = ["lit_rlhf.tasks.digits.sort_digits_reward"]


class Recorder(RLHFModule):
    """Keeps every rollout."""

    def on_experience(self, exp):
        self.__dict__.setdefault("experiences", []).append(exp)


def lora_module(name: str, policy=None, share_prompt_forward: bool = True, **kwargs) -> Recorder:
    kwargs.setdefault("lora", {"r": 4, "alpha": 8})
    settings = dict(
        group_size=2, ppo_epochs=2, num_minibatches=2, kl_coef=0.05, share_prompt_forward=share_prompt_forward
    )
    return Recorder(
        policy=policy if policy is not None else make_policy(),
        tokenizer="builtin:digits",
        reward_fns=REWARD,
        sampling=SamplingConfig(max_new_tokens=6),
        lr=1e-2,
        algorithm=AlgorithmConfig(name=name, **settings),
        log_samples_every_n_steps=0,
        **kwargs,
    )


def fit(module: RLHFModule, steps: int, **trainer_kwargs) -> None:
    make_trainer(max_steps=steps, **trainer_kwargs).fit(module, RolloutDataModule(batch_size=4, max_prompt_length=16))


def test_lora_reference_holds_no_copy_of_the_weights():
    full = lora_module("ppo", lora=None)
    lora = lora_module("ppo")
    policy_bytes = parameter_bytes(full.actor_critic.policy)
    # without LoRA the reference is a second copy; with LoRA it has no parameters at all
    assert parameter_bytes(full) == pytest.approx(2 * policy_bytes, rel=0.01)
    assert isinstance(lora.reference, AdapterDisabledReference)
    assert list(lora.reference.parameters()) == [] and list(lora.reference.buffers()) == []
    assert lora.reference.policy is lora.actor_critic.policy
    adapters = sum(p.numel() * p.element_size() for n, p in lora.named_parameters() if "lora_" in n)
    value_head = parameter_bytes(lora.actor_critic.value_head)
    assert parameter_bytes(lora) == parameter_bytes(lora.actor_critic) == policy_bytes + adapters + value_head
    assert not any(key.startswith("reference.") for key in lora.state_dict())
    # only adapters and the value head are trained
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("actor_critic.value_head.") for n in trainable)


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_lora_kl_is_zero_on_the_first_step_and_the_base_weights_stay_put(name):
    policy = make_policy()
    original = copy.deepcopy(policy).eval()
    module = lora_module(name, policy=policy)
    base_before = checksum(original)
    fit(module, steps=8)  # 2 rollouts x 2 epochs x 2 minibatches
    if name == "ppo":  # the KL is in the reward, measured in the rollout: exactly 0 before any update
        first = module.experiences[0]
        assert torch.equal(first.ref_logprobs, first.old_logprobs)
        assert first.kl.abs().max().item() == 0.0
        assert module.experiences[-1].kl.abs().max().item() > 0  # the adapters moved the policy
    # the reference is still exactly the original weights, and the LoRA policy is not
    module.eval()
    ids = torch.randint(3, 14, (3, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref_logits = forward_logits(module.reference, ids, mask, 4)
        orig_logits = forward_logits(original, ids, mask, 4)
        lora_logits = forward_logits(module.actor_critic.policy, ids, mask, 4)
    assert torch.equal(ref_logits, orig_logits)
    assert not torch.allclose(lora_logits, orig_logits)
    base = module.actor_critic.policy.get_base_model()
    base_params = {n: p for n, p in base.named_parameters() if "lora_" not in n}
    original_params = dict(original.named_parameters())
    for n, p in base_params.items():
        key = n.replace(".base_layer", "")
        assert torch.equal(p, original_params[key]), n
    assert checksum(original) == base_before


def test_grpo_lora_first_update_reports_zero_kl():
    module = Recorder(
        policy=make_policy(),
        tokenizer="builtin:digits",
        reward_fns=REWARD,
        sampling=SamplingConfig(max_new_tokens=6),
        lr=1e-2,
        lora={"r": 4},
        algorithm=AlgorithmConfig(name="grpo", group_size=2, kl_coef=0.04),
        log_samples_every_n_steps=0,
    )
    fit(module, steps=1)
    stats = module.last_update_stats[0]
    assert stats["policy/kl_loss"] == 0.0 and stats["policy/approx_kl"] == 0.0


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"r": 0}, "model.lora.r"),
        ({"alpha": -1}, "model.lora.alpha"),
        ({"dropout": 1.5}, "model.lora.dropout"),
        ({"no_such_option": 1}, "model.lora"),
    ],
)
def test_bad_lora_settings_fail_before_the_model_loads(settings, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        RLHFModule(policy="./does-not-exist-yet", tokenizer="builtin:digits", reward_fns=REWARD, lora=settings)


def test_lora_target_modules_that_do_not_exist():
    with pytest.raises(ConfigError, match="model.lora"):
        lora_module("grpo", lora={"target_modules": ["q_proj_nowhere"]})


# ----------------------------------------------------------------------------- memory settings on CPU


def _gradients(module: RLHFModule, exp) -> dict[str, torch.Tensor]:
    module.actor_critic.train()
    module.actor_critic.zero_grad(set_to_none=True)
    totals = MinibatchTotals.of(exp, module.sampling.max_new_tokens)
    loss, _ = module.micro_batch_loss(exp, totals)
    loss.backward()
    return {n: p.grad.clone() for n, p in module.actor_critic.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [None, {"r": 4}])
def test_gradient_checkpointing_gives_the_same_gradients(tokenizer, lora):
    """Recomputing activations in backward changes nothing: measured max difference 0 (float32, CPU), so the
    check is exact."""
    from conftest import prompt_batch

    # both on the plain forward: under checkpointing the shared-prompt forward is off (no KV cache there)
    plain = lora_module("ppo", policy=make_policy(seed=3), lora=lora, share_prompt_forward=False)
    checkpointed = lora_module(
        "ppo", policy=make_policy(seed=3), lora=lora, gradient_checkpointing=True, share_prompt_forward=False
    )
    if lora is not None:  # same (random) adapter A matrices in both
        checkpointed.actor_critic.load_state_dict(plain.actor_critic.state_dict())
    checkpointed.actor_critic.value_head.load_state_dict(plain.actor_critic.value_head.state_dict())
    policy = checkpointed.actor_critic.policy
    base = policy.get_base_model() if lora is not None else policy
    assert getattr(base, "is_activation_checkpointing", None) or base.is_gradient_checkpointing
    torch.manual_seed(0)
    exp = plain.make_experience(plain.make_rollout(prompt_batch(tokenizer, ["3142>", "98>", "501>", "7>"]))[0])[0]
    expected, got = _gradients(plain, exp), _gradients(checkpointed, exp)
    assert expected.keys() == got.keys() and len(expected) > 0
    for name in expected:  # the recompute runs the same kernels on the same shapes: bit-identical
        assert torch.equal(got[name], expected[name]), (name, float((got[name] - expected[name]).abs().max()))


def test_bf16_mixed_trains_on_cpu_and_first_ratio_is_one():
    """bf16-mixed (CPU autocast) runs the rollout and the update in bf16; log-probs stay float32.

    Measured on the first minibatch of the first rollout: approx_kl 0 and ratio mean 1 exactly (the update's
    forward repeats the rollout's bf16 kernels on the same rows), so the check is exact."""
    module = lora_module("ppo", lora=None)
    before = checksum(module.actor_critic)
    fit(module, steps=4, precision="bf16-mixed")  # one rollout: 2 epochs x 2 minibatches
    assert module.state.policy_version == 4 and checksum(module.actor_critic) != before
    exp = module.experiences[0]
    assert exp.old_logprobs.dtype == torch.float32 and torch.isfinite(exp.old_logprobs).all()
    first = module.last_update_stats[0]
    assert first["policy/approx_kl"] == 0.0 and first["policy/ratio_mean"] == 1.0
    assert all(torch.isfinite(torch.tensor(v)) for stats in module.last_update_stats for v in stats.values())
