"""The memory plan: exact parameter counts from meta-device builds (no weights loaded), which models it counts
(no reference with LoRA or kl_coef 0), sharding, the terms of the chunked log-probs (no logits tensor: a block
workspace, the head's gradient, the sampling step's last-position logits) checked against hand arithmetic, and
the refusal at fit start and in `lit-rlhf-plan`."""

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
    assert "reference weights (frozen)" not in terms(no_kl)


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
    # the shared-prompt forward is off under grad with checkpointing: compare both without it
    base = dict(policy="builtin:digits", prompts_per_device=8, group_size=4, prompt_tokens=16, new_tokens=8)
    full = plan_memory(PlanSettings(**base, share_prompt_forward=False))
    key = "activations (micro-batch of 32 rows)"
    checkpointed = PlanSettings(**base, gradient_checkpointing=True)
    assert terms(plan_memory(checkpointed))[key] < terms(full)[key]
    assert "activations (micro-batch of 8 rows)" in terms(plan_memory(PlanSettings(**base, micro_batch_size=8)))


def meta_llama(vocab: int = 40000, tied: bool = False):
    """A 2-layer Llama on the meta device (nothing allocated): hidden 16, MLP 48, 4 heads of 4, 2 KV heads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(config)


# 4 prompts x G 2 = 8 rows, P 10, R 6: one micro-batch of the 8 rows, 48 response tokens
LLAMA_BATCH = dict(prompts_per_device=4, group_size=2, prompt_tokens=10, new_tokens=6)


def test_the_activations_and_the_shared_prompts_keys_and_values_by_hand():
    plan = terms(plan_memory(PlanSettings(policy=meta_llama(), **LLAMA_BATCH)))
    per_token_and_layer = 16 * 16 + 6 * 48  # E_h x hidden + E_mlp x intermediate = 544
    tokens = 4 * 10 + 8 * 6  # each distinct prompt once (shared-prompt forward), every row's response: 88
    assert plan["activations (micro-batch of 8 rows)"] == tokens * 2 * per_token_and_layer * 4
    # each of the 8 rows attends over its own copy of its prompt's keys and values, 4 query heads of 4 wide
    assert plan["shared prompts' keys/values per row"] == 8 * 10 * 2 * 4 * 4 * 2 * 4
    plain = terms(plan_memory(PlanSettings(policy=meta_llama(), **LLAMA_BATCH, share_prompt_forward=False)))
    assert plain["activations (micro-batch of 8 rows)"] == (8 * 10 + 8 * 6) * 2 * per_token_and_layer * 4
    assert "shared prompts' keys/values per row" not in plain
    recompute = PlanSettings(policy=meta_llama(), **LLAMA_BATCH, gradient_checkpointing=True)  # no sharing then
    assert "shared prompts' keys/values per row" not in terms(plan_memory(recompute))


def test_the_logit_workspace_is_a_few_blocks_of_chunk_tokens_by_the_vocabulary_slice():
    plan = terms(plan_memory(PlanSettings(policy=meta_llama(40000), **LLAMA_BATCH, logit_chunk_tokens=32)))
    # 2 float32 blocks of min(48 tokens, 32) x min(40000, 4096) (a CPU's slice)
    assert plan["logit chunk workspace"] == 2 * 32 * 4096 * 4
    wider = terms(plan_memory(PlanSettings(policy=meta_llama(80000), **LLAMA_BATCH, logit_chunk_tokens=32)))
    assert wider["logit chunk workspace"] == plan["logit chunk workspace"]  # the vocabulary runs in slices
    gpu = PlanSettings(policy=meta_llama(80000), **LLAMA_BATCH, logit_chunk_tokens=32, device="cuda")
    assert terms(plan_memory(gpu))["logit chunk workspace"] == 2 * 32 * 32768 * 4  # a GPU's wider slice
    few = terms(plan_memory(PlanSettings(policy=meta_llama(1000), **LLAMA_BATCH)))  # default 512-token chunks
    assert few["logit chunk workspace"] == 2 * 48 * 1000 * 4  # only the 48 valid tokens, 1000 ids
    bonus = dict(policy=meta_llama(1000), **LLAMA_BATCH)
    assert terms(plan_memory(PlanSettings(**bonus, entropy_bonus=True)))["logit chunk workspace"] == 4 * 48 * 1000 * 4
    exact = PlanSettings(**bonus, entropy_bonus=True, exact_kl=True, exact_kl_in_loss=True)
    assert terms(plan_memory(exact))["logit chunk workspace"] == 4 * 48 * 1000 * 4


def test_the_exact_kl_keeps_the_references_hidden_states_until_the_policys_forward():
    plan = terms(plan_memory(PlanSettings(policy=meta_llama(), **LLAMA_BATCH, exact_kl=True)))
    assert plan["reference hidden states (exact KL)"] == 8 * 6 * 16 * 4  # rows x R x hidden
    assert "reference hidden states (exact KL)" not in terms(plan_memory(PlanSettings(policy=meta_llama())))


def test_a_trained_head_adds_its_gradient_buffer_and_a_tied_one_the_embeddings_second_gradient():
    untied = plan_memory(PlanSettings(policy=meta_llama(40000, tied=False), **LLAMA_BATCH))
    assert terms(untied)["LM head's gradient buffer"] == 40000 * 16 * 4
    assert "tied embedding's second gradient" not in terms(untied)
    tied = plan_memory(PlanSettings(policy=meta_llama(40000, tied=True), **LLAMA_BATCH))
    assert terms(tied)["LM head's gradient buffer"] == 40000 * 16 * 4
    assert terms(tied)["tied embedding's second gradient"] == 40000 * 16 * 4
    # the update holds the largest moment: the backward's start, its end, or the optimizer step
    t = terms(tied)
    starts = sum(
        t[name]
        for name in (
            "activations (micro-batch of 8 rows)",
            "shared prompts' keys/values per row",
            "logit chunk workspace",
            "LM head's gradient buffer",
        )
    )
    ends = t["gradients"] + t["tied embedding's second gradient"]
    # AdamW on a CPU: a square root and a quotient of the largest trainable parameter, the tied 40000 x 16 table
    assert t["optimizer step's temporaries"] == 2 * 40000 * 16 * 4
    step = t["gradients"] + t["optimizer step's temporaries"]
    assert t["gradients"] == 646224 * 4  # the tied weight counted once
    assert tied.phase("update") == max(starts, ends, step)
    gpu = terms(plan_memory(PlanSettings(policy=meta_llama(40000, tied=True), **LLAMA_BATCH, device="cuda")))
    assert gpu["optimizer step's temporaries"] == 646224 * 4  # foreach: one square root of every second moment


def test_lora_freezes_the_head_so_it_has_no_gradient_buffer():
    pytest.importorskip("peft")
    plan = terms(plan_memory(PlanSettings(policy=meta_llama(40000, tied=True), lora={"r": 4}, **LLAMA_BATCH)))
    assert "LM head's gradient buffer" not in plan and "tied embedding's second gradient" not in plan


def test_sampling_counts_the_last_positions_logits_per_row():
    plan = terms(plan_memory(PlanSettings(policy=meta_llama(40000), **LLAMA_BATCH)))
    name = "last-position logits while sampling"
    assert plan[name] == 3 * 8 * 40000 * 4  # logits, softmax, multinomial's draws: (8 rows, 40000) float32 each
    warm = terms(plan_memory(PlanSettings(policy=meta_llama(40000), **LLAMA_BATCH, temperature=0.7)))
    assert warm[name] == 4 * 8 * 40000 * 4  # the division by the temperature
    nucleus = terms(plan_memory(PlanSettings(policy=meta_llama(40000), **LLAMA_BATCH, top_p=0.9)))
    assert nucleus[name] == 7 * 8 * 40000 * 4  # top-p's sort, softmax and cumulative sum
    assert name not in terms(plan_memory(PlanSettings(policy=meta_llama(), **LLAMA_BATCH, backend="vllm")))


def test_a_cpu_fit_adds_its_fixed_overhead_and_an_accelerator_does_not():
    cpu = terms(plan_memory(PlanSettings(policy="builtin:digits")))
    assert cpu["the fit's own objects (CPU)"] == 5 * 2**20  # host memory: Python objects, autograd nodes, arenas
    assert "the fit's own objects (CPU)" not in terms(plan_memory(PlanSettings(policy="builtin:digits", device="cuda")))


def test_the_module_hands_its_logit_settings_to_the_plan():
    algorithm = AlgorithmConfig(name="grpo", logit_chunk_tokens=256, entropy_coef=0.01, kl_estimator="full")
    sampling = SamplingConfig(temperature=0.7, top_p=0.9)
    module = RLHFModule(policy="builtin:digits", reward_fns=[REWARD], algorithm=algorithm, sampling=sampling)
    s = memory_plan.plan_settings(module, None, make_trainer(1))
    assert (s.logit_chunk_tokens, s.entropy_bonus, s.exact_kl, s.exact_kl_in_loss) == (256, True, True, True)
    assert (s.temperature, s.top_p) == (0.7, 0.9)


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
