"""The memory plan: exact parameter counts from meta-device builds (no weights loaded), which models it counts
(no reference with LoRA or kl_coef 0), sharding, and the refusal at fit start and in `lit-rlhf-plan`."""

from __future__ import annotations

import pathlib

import pytest

from conftest import make_policy, make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.config import ConfigError
from lit_rlhf.training import memory_plan
from lit_rlhf.training.memory_plan import PlanSettings, plan_memory

ROOT = pathlib.Path(__file__).resolve().parents[2]
REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"


def terms(plan) -> dict[str, int]:
    return {t.name: t.bytes for t in plan.terms}


def test_the_plan_counts_the_policy_exactly_without_loading_it():
    from lit_rlhf.tasks.digits import builtin_policy

    real = sum(p.numel() for p in builtin_policy().parameters())
    plan = plan_memory(PlanSettings(policy="builtin:digits", uses_reference=True))
    assert terms(plan)["policy weights"] == real * 4
    assert terms(plan)["reference weights (frozen)"] == real * 4
    assert terms(plan)["optimizer state (AdamW, fp32)"] == 2 * 4 * real
    assert terms(plan)["gradients"] == real * 4


def test_lora_counts_the_adapters_and_drops_the_reference():
    pytest.importorskip("peft")
    from lit_rlhf.models.lora import apply_lora
    from lit_rlhf.tasks.digits import builtin_policy

    adapters = sum(p.numel() for p in apply_lora(builtin_policy(), {"r": 4}).parameters() if p.requires_grad)
    plan = plan_memory(PlanSettings(policy="builtin:digits", lora={"r": 4}, uses_reference=True))
    assert terms(plan)["optimizer state (AdamW, fp32)"] == 2 * 4 * adapters
    assert "reference weights (frozen)" not in terms(plan)
    no_kl = plan_memory(PlanSettings(policy="builtin:digits", uses_reference=False))
    assert "reference weights (frozen)" not in terms(no_kl) and "reference logits of the rollout" not in terms(no_kl)


def test_sharding_divides_weights_gradients_and_optimizer_by_the_world_size():
    one = terms(plan_memory(PlanSettings(policy="builtin:digits")))
    two = terms(plan_memory(PlanSettings(policy="builtin:digits", world_size=2, sharded=True)))
    for name in ("policy weights", "optimizer state (AdamW, fp32)", "gradients", "reference weights (frozen)"):
        assert two[name] == one[name] // 2, name
    replicated = PlanSettings(policy="builtin:digits", world_size=2, sharded=True, shard_frozen=False)
    assert terms(plan_memory(replicated))["reference weights (frozen)"] == one["reference weights (frozen)"]


def test_sharding_counts_what_fsdp2_gathers_beside_the_shards():
    from lit_rlhf.tasks.digits import builtin_policy

    model = builtin_policy()  # GPT-2: the blocks in transformer.h; wte, wpe, ln_f (and the tied head) outside
    total = sum(p.numel() for p in model.parameters())
    root = total - sum(p.numel() for p in model.transformer.h.parameters())
    assert 0 < root < total
    two = terms(plan_memory(PlanSettings(policy="builtin:digits", world_size=2, sharded=True)))
    assert two["policy unsharded while sampling"] == total * 4  # a whole copy, the shard stays
    assert two["root unit gathered in the update"] == 3 * root * 4  # weights, gradient, reduce-scatter copy
    assert "root unit gathered in the update" not in terms(plan_memory(PlanSettings(policy="builtin:digits")))


def test_lora_under_sharding_counts_the_adapters_with_the_weights_and_divides_both():
    pytest.importorskip("peft")
    from lit_rlhf.models.lora import apply_lora
    from lit_rlhf.tasks.digits import builtin_policy

    model = apply_lora(builtin_policy(), {"r": 4})
    total = sum(p.numel() for p in model.parameters())  # base weights and adapters
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    one = terms(plan_memory(PlanSettings(policy="builtin:digits", lora={"r": 4})))
    two = terms(plan_memory(PlanSettings(policy="builtin:digits", lora={"r": 4}, world_size=2, sharded=True)))
    assert one["policy weights"] == total * 4
    assert two["policy weights"] == total * 4 // 2
    assert two["gradients"] == adapters * 4 // 2 and two["optimizer state (AdamW, fp32)"] == 2 * 4 * adapters // 2
    assert two["policy unsharded while sampling"] == total * 4
    root = sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for p in model.base_model.model.transformer.h.parameters()
    )
    assert two["root unit gathered in the update"] == root * 4  # frozen under LoRA: no gradient of its own


def test_lora_modules_to_save_train_in_the_root_unit_under_sharding():
    pytest.importorskip("peft")
    from lit_rlhf.tasks.digits import builtin_policy

    model = builtin_policy()
    embedding = model.transformer.wte.weight.numel()
    outside_blocks = sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for p in model.transformer.h.parameters()
    )
    lora = {"r": 4, "modules_to_save": ["wte"]}  # a trained copy of the embedding beside the frozen one
    two = terms(plan_memory(PlanSettings(policy="builtin:digits", lora=lora, world_size=2, sharded=True)))
    # the root now holds the copy too, and the copy has a whole gradient and a reduce-scatter copy of it
    assert two["root unit gathered in the update"] == (outside_blocks + embedding + 2 * embedding) * 4


def test_gradient_checkpointing_and_micro_batches_shrink_the_activations():
    base = dict(policy="builtin:digits", prompts_per_device=8, group_size=4, prompt_tokens=16, new_tokens=8)
    full = plan_memory(PlanSettings(**base))
    key = "activations (micro-batch of 32 rows)"
    assert terms(plan_memory(PlanSettings(**base, gradient_checkpointing=True)))[key] < terms(full)[key]
    assert "activations (micro-batch of 8 rows)" in terms(plan_memory(PlanSettings(**base, micro_batch_size=8)))


def digits_fit(memory_check: str = "error"):
    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=[REWARD],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
        memory_check=memory_check,  # type: ignore[arg-type]
    )
    return module, RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=8)


def test_a_plan_over_the_device_memory_is_refused_at_fit_start_before_any_model_loads(monkeypatch):
    monkeypatch.setattr(memory_plan, "available_bytes", lambda device, processes=1: 2**20)  # a 1 MiB device
    module, data = digits_fit()
    with pytest.raises(ConfigError, match=r"memory plan: .* the largest term is .*model.memory_check: warn"):
        make_trainer(1).fit(module, data)
    assert module.actor_critic is None  # refused before anything loaded
    module, data = digits_fit("warn")
    with pytest.warns(UserWarning, match="memory plan"):
        make_trainer(1).fit(module, data)
    assert module.actor_critic is not None


def test_a_plan_that_fits_starts():
    module, data = digits_fit()
    make_trainer(1).fit(module, data)
    assert module.global_step == 1


def test_memory_check_must_be_a_known_mode():
    with pytest.raises(ConfigError, match="model.memory_check: must be one of"):
        RLHFModule(policy=make_policy(), tokenizer="builtin:digits", reward_fns=[REWARD], memory_check="maybe")  # type: ignore[arg-type]


def test_lit_rlhf_plan_prints_the_table_and_refuses_a_small_device(capsys):
    from lit_rlhf.cli import plan_main

    config = str(ROOT / "configs" / "grpo.yaml")
    plan_main(["--config", config, "--device-memory-gb", "8"])
    assert "policy weights" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="lit-rlhf-plan: error: memory plan: .* the largest term is"):
        plan_main(["--config", config, "--device-memory-gb", "0.001"])


def test_ddp_adds_its_gradient_buckets_and_fsdp2_on_cpu_is_marked_a_lower_bound():
    one = plan_memory(PlanSettings(policy="builtin:digits"))
    ddp = plan_memory(PlanSettings(policy="builtin:digits", world_size=2))
    assert terms(ddp)["DDP gradient buckets"] == terms(one)["gradients"]  # a flat copy of every gradient
    assert ddp.total == one.total + terms(one)["gradients"]
    assert "DDP gradient buckets" not in terms(one)
    fsdp2 = plan_memory(PlanSettings(policy="builtin:digits", world_size=2, sharded=True))
    assert "DDP gradient buckets" not in terms(fsdp2) and "a lower bound" in fsdp2.table()
    assert "lower bound" not in ddp.table()


def test_asynchronous_rollouts_add_the_producers_copies_and_overlap_the_phases():
    from lit_rlhf.tasks.digits import builtin_policy

    real = sum(p.numel() for p in builtin_policy().parameters())
    sync = plan_memory(PlanSettings(policy="builtin:digits"))
    two_ahead = plan_memory(PlanSettings(policy="builtin:digits", max_staleness=2))
    added = {name: size for name, size in terms(two_ahead).items() if name not in terms(sync)}
    # a full fp32 copy the producer samples with, and one copy of the trainable weights per queued step (k + 1)
    expected = {"the producer's copy of the policy": real * 4, "weights of queued rollouts (3 copies)": 3 * real * 4}
    assert added == expected
    rollout, update = two_ahead.phase("rollout"), two_ahead.phase("update")
    assert two_ahead.total == two_ahead.phase("persistent") + rollout + update  # sampling runs during the update
    assert sync.total == sync.phase("persistent") + max(sync.phase("rollout"), sync.phase("update"))
    assert "persistent + rollout + update" in two_ahead.table()


def test_asynchronous_rollouts_with_lora_queue_copies_of_the_adapters_only():
    pytest.importorskip("peft")
    from lit_rlhf.models.lora import apply_lora
    from lit_rlhf.tasks.digits import builtin_policy

    model = apply_lora(builtin_policy(), {"r": 4})
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    plan = terms(plan_memory(PlanSettings(policy="builtin:digits", lora={"r": 4}, max_staleness=1)))
    assert plan["weights of queued rollouts (2 copies)"] == 2 * adapters * 4
    assert plan["the producer's copy of the policy"] == sum(p.numel() for p in model.parameters()) * 4


def test_the_module_hands_its_staleness_to_the_plan():
    module = RLHFModule(
        policy="builtin:digits", reward_fns=[REWARD], algorithm=AlgorithmConfig(name="grpo", max_staleness=1)
    )
    settings = memory_plan.plan_settings(module, None, make_trainer(1))
    assert settings.max_staleness == 1


def test_vllm_colocated_on_a_cpu_adds_its_weights_and_kv_cache_instead_of_the_rollouts_kv_cache():
    from lit_rlhf.tasks.digits import builtin_policy

    real = sum(p.numel() for p in builtin_policy().parameters())
    lean = terms(plan_memory(PlanSettings(policy="builtin:digits")))
    vllm = plan_memory(PlanSettings(policy="builtin:digits", backend="vllm", vllm_kv_cache_gib=2))
    added = {name: size for name, size in terms(vllm).items() if name not in lean}
    cache = "vLLM KV cache (kv_cache_gib)"
    assert added == {"vLLM engine's copy of the policy": real * 4, cache: 2 * 2**30}
    assert "KV cache of a rollout" in lean and "KV cache of a rollout" not in terms(vllm)  # vLLM samples, not HF
    assert vllm.largest.name == cache
    small = plan_memory(PlanSettings(policy="builtin:digits", backend="vllm", vllm_kv_cache_gib=2), available=2**30)
    assert "the largest term is vLLM KV cache" in (small.refusal() or "")


def test_vllm_colocated_on_a_gpu_takes_its_share_of_the_devices_total_memory():
    total = 80 * 2**30
    share = {"vllm_gpu_memory_utilization": 0.25, "device_total": total}
    plan = plan_memory(PlanSettings(policy="builtin:digits", backend="vllm", device="cuda", **share))
    assert terms(plan)["vLLM engine (gpu_memory_utilization)"] == 20 * 2**30
    unknown = plan_memory(PlanSettings(policy="builtin:digits", backend="vllm", device="cuda"))
    assert "device's total memory is unknown" in unknown.table()


def test_a_vllm_server_takes_nothing_here_and_lora_syncs_add_a_merged_copy():
    pytest.importorskip("peft")
    from lit_rlhf.tasks.digits import builtin_policy

    base = sum(p.numel() for p in builtin_policy().parameters())
    server = terms(plan_memory(PlanSettings(policy="builtin:digits", backend="vllm", vllm_mode="server")))
    assert not any("vLLM" in name for name in server) and "KV cache of a rollout" not in server
    lora = terms(plan_memory(PlanSettings(policy="builtin:digits", backend="vllm", lora={"r": 4})))
    assert lora["vLLM engine's copy of the policy"] == base * 4  # adapters merged into the base weights
    assert lora["merged policy for the vLLM weight sync"] == base * 4


def test_the_module_hands_its_vllm_settings_to_the_plan():
    from lit_rlhf.config import VLLMConfig

    sampling = SamplingConfig(backend="vllm", vllm=VLLMConfig(kv_cache_gib=3))
    module = RLHFModule(policy="builtin:digits", reward_fns=[REWARD], sampling=sampling)
    settings = memory_plan.plan_settings(module, None, make_trainer(1))
    assert (settings.backend, settings.vllm_mode, settings.vllm_kv_cache_gib) == ("vllm", "colocate", 3)
