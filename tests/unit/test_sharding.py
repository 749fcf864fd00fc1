"""FSDP2 helpers on a one-process gloo group: generation keeps the policy unsharded for the whole rollout
(no all-gather per decoding step), and it is resharded afterwards; a sharded LoRA policy keeps its adapter-disabled
reference, its generations and its exports (merged or adapters only)."""

from __future__ import annotations

import json

import pytest
import torch

from lit_rlhf.training.sharding import shard_model, transformer_blocks, unsharded_for_rollout

fsdp = pytest.importorskip("torch.distributed.fsdp")


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(next(model.parameters()), DTensor)


def test_a_rollout_gathers_once_and_reshards_after(one_process_group):
    from lit_rlhf.tasks.digits import builtin_policy

    policy = builtin_policy()
    assert len(transformer_blocks(policy)) == policy.config.n_layer
    shard_model(policy, None)
    ids = torch.tensor([[3, 4, 5]])
    block = transformer_blocks(policy)[0]
    with torch.no_grad():
        policy(ids)
        assert is_sharded(block)  # outside a rollout: each forward frees the gathered weights again
        with unsharded_for_rollout(policy):
            for _ in range(3):  # decoding steps
                policy(ids)
                assert not is_sharded(block)  # still gathered: the next step gathers nothing
        assert is_sharded(block)


def test_save_policy_of_a_sharded_policy_gathers_a_folder_plain_transformers_loads(one_process_group, tmp_path):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from lit_rlhf.models.export import save_module_policy
    from lit_rlhf.tasks.digits import builtin_policy, builtin_tokenizer

    policy = builtin_policy()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        expected = policy(ids).logits
    shard_model(policy, None)
    assert is_sharded(policy) and type(policy).__name__.startswith("FSDP")
    module = SimpleNamespace(actor_critic=SimpleNamespace(policy=policy), tokenizer=builtin_tokenizer())
    path = save_module_policy(module, str(tmp_path / "policy"))
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert type(loaded).__name__ == "GPT2LMHeadModel"  # not the FSDP class
    assert loaded.config.architectures == ["GPT2LMHeadModel"]
    assert sorted(loaded.state_dict()) == sorted(before)
    assert all(torch.equal(loaded.state_dict()[k], before[k]) for k in before)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied again
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected)
    assert is_sharded(policy)  # the live policy stays sharded


def test_an_existing_export_folder_is_refused_on_every_rank_before_the_gather(one_process_group, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from lit_rlhf.models import export
    from lit_rlhf.tasks.digits import builtin_policy, builtin_tokenizer

    policy = builtin_policy()
    shard_model(policy, None)
    folder = tmp_path / "taken"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")

    def no_gather(model):
        raise AssertionError("gathered before the folder was checked")

    monkeypatch.setattr(export, "gathered_copy", no_gather)  # rank 0 alone would refuse only after gathering
    module = SimpleNamespace(actor_critic=SimpleNamespace(policy=policy), tokenizer=builtin_tokenizer())
    with pytest.raises(export.ExportError, match="already exists"):
        export.save_module_policy(module, str(folder))
    assert (folder / "notes.txt").read_text() == "mine"


def test_unsupported_fsdp2_combinations_are_refused_before_loading():
    from types import SimpleNamespace

    from lit_rlhf.config import ConfigError
    from lit_rlhf.training.sharding import check_fsdp2_settings

    class Mesh:
        ndim = 2

        def __init__(self, tensor_parallel: int) -> None:
            self.tensor_parallel = tensor_parallel

        def __getitem__(self, name):
            return SimpleNamespace(size=lambda: self.tensor_parallel)

    def module(tensor_parallel: int = 1, overlap_scoring: bool = False, reward_model: str | None = None):
        strategy = SimpleNamespace(_save_distributed_checkpoint=True, checkpoint_io=None)
        return SimpleNamespace(
            hparams={"overlap_scoring": overlap_scoring},
            device_mesh=Mesh(tensor_parallel),
            trainer=SimpleNamespace(strategy=strategy),
            specs=SimpleNamespace(reward_model=reward_model),
        )

    with pytest.raises(ConfigError, match="tensor_parallel_size > 1 is not supported"):
        check_fsdp2_settings(module(tensor_parallel=2), True)
    overlapped = module(overlap_scoring=True, reward_model="builtin:digits")
    with pytest.raises(ConfigError, match="model.overlap_scoring: true .*'builtin:digits'.*shard_frozen = False"):
        check_fsdp2_settings(overlapped, True)
    check_fsdp2_settings(overlapped, False)  # a whole reward model on every rank gathers nothing
    check_fsdp2_settings(module(overlap_scoring=True), True)  # reward functions only
    check_fsdp2_settings(module(reward_model="builtin:digits"), True)  # scored on the training thread


def test_atomic_checkpoint_io_with_distributed_checkpoints_is_refused():
    from types import SimpleNamespace

    from lit_rlhf.config import ConfigError
    from lit_rlhf.training.checkpoint_io import AtomicCheckpointIO
    from lit_rlhf.training.sharding import check_checkpoint_writer

    with pytest.raises(ConfigError, match="save_distributed_checkpoint: false"):
        check_checkpoint_writer(SimpleNamespace(_save_distributed_checkpoint=True, checkpoint_io=AtomicCheckpointIO()))
    check_checkpoint_writer(SimpleNamespace(_save_distributed_checkpoint=False, checkpoint_io=AtomicCheckpointIO()))
    check_checkpoint_writer(SimpleNamespace(_save_distributed_checkpoint=True, checkpoint_io=None))


def test_held_out_generation_gathers_each_unit_once_per_batch(one_process_group, monkeypatch):
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from lit_rlhf import RLHFModule, SamplingConfig

    module = RLHFModule(policy="builtin:digits", reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"])
    module.configure_model()
    shard_model(module.actor_critic.policy, None)
    gathers = []
    unshard = FSDPParamGroup.unshard

    def counting_unshard(group, *args, **kwargs):
        if not group.is_unsharded:
            gathers.append(group)
        return unshard(group, *args, **kwargs)

    monkeypatch.setattr(FSDPParamGroup, "unshard", counting_unshard)
    sampling = SamplingConfig(max_new_tokens=6)
    assert len(module.generate(["312>", "90>"], sampling=sampling)) == 2
    # one all-gather per unit (2 blocks + the root) for the whole batch, not one per unit and decoding step
    assert len(gathers) == module.actor_critic.policy.config.n_layer + 1
    assert is_sharded(transformer_blocks(module.actor_critic.policy)[0])  # resharded after


def test_uneven_held_out_batches_under_fsdp2_are_refused_on_every_rank():
    from types import SimpleNamespace

    from lit_rlhf import RLHFModule
    from lit_rlhf.config import ConfigError

    class ModelParallelStrategy:  # what `is_fsdp2` recognises; all_gather returns both ranks' counts
        def __init__(self, other: int):
            self.other = other

        def all_gather(self, mine):
            return torch.stack([mine, torch.tensor(self.other)])

    module = RLHFModule(policy="builtin:digits", reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"])
    module._trainer = SimpleNamespace(strategy=ModelParallelStrategy(other=2), world_size=2)
    with pytest.raises(ConfigError, match=r"data.val_prompts: .* the ranks have \[3, 2\]"):
        module.check_even_held_out_batches([3], "val")
    module.check_even_held_out_batches([2], "val")  # as many batches on each rank
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(), world_size=2)  # DDP: no collective per batch
    module.check_even_held_out_batches([3], "val")


def trained_lora_policy(r: int = 4) -> torch.nn.Module:
    """The built-in GPT-2 with LoRA adapters whose B matrices are no longer 0 (as after training)."""
    pytest.importorskip("peft")  # the lora extra; the README installs only .[dev]
    from lit_rlhf.models.lora import apply_lora
    from lit_rlhf.tasks.digits import builtin_policy

    torch.manual_seed(0)
    policy = apply_lora(builtin_policy(), {"r": r})
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return policy


def test_the_adapter_disabled_reference_of_a_sharded_lora_policy_is_the_base_model(one_process_group):
    from lit_rlhf.models.lora import AdapterDisabledReference

    policy = trained_lora_policy()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        with policy.disable_adapter():
            base = policy(ids).logits
        adapted = policy(ids).logits
    assert not torch.allclose(base, adapted)
    reference = AdapterDisabledReference(policy)
    shard_model(policy, None)
    assert is_sharded(policy)
    with torch.no_grad():
        torch.testing.assert_close(reference(ids).logits, base)
        torch.testing.assert_close(policy(ids).logits, adapted)  # the adapters are on again after it


def test_a_sharded_lora_policy_generates_as_unsharded(one_process_group):
    from lit_rlhf import RLHFModule

    module = RLHFModule(
        policy=trained_lora_policy(),
        tokenizer="builtin:digits",
        reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
    )
    prompts = ["312>", "9051>", "77>"]
    expected = module.generate(prompts)  # greedy
    shard_model(module.actor_critic.policy, None)
    assert module.generate(prompts) == expected


def test_a_gathered_lora_policy_keeps_every_adapter_its_settings_and_the_active_one(one_process_group):
    from lit_rlhf.models.full_weights import gathered_copy
    from lit_rlhf.models.lora import lora_config

    policy = trained_lora_policy()
    policy.add_adapter("second", lora_config({"r": 2}))
    policy.peft_config["default"].base_model_name_or_path = "org/base"  # not the config's name: kept as it is
    policy.set_adapter("second")
    expected = {k: v.clone() for k, v in policy.state_dict().items()}
    configs = {name: config.to_dict() for name, config in policy.peft_config.items()}
    shard_model(policy, None)
    plain = gathered_copy(policy)
    assert type(plain).__name__ == "PeftModelForCausalLM" and not is_sharded(plain)
    assert sorted(plain.state_dict()) == sorted(expected)
    assert all(torch.equal(plain.state_dict()[k], expected[k]) for k in expected)
    assert {name: config.to_dict() for name, config in plain.peft_config.items()} == configs
    assert plain.active_adapter == "second"


@pytest.mark.parametrize("merge_lora", [True, False])
def test_save_policy_of_a_sharded_lora_policy_writes_the_unsharded_export(one_process_group, tmp_path, merge_lora):
    from types import SimpleNamespace

    PeftModel = pytest.importorskip("peft").PeftModel  # the lora extra; the README installs only .[dev]
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lit_rlhf.models.export import save_module_policy
    from lit_rlhf.tasks.digits import builtin_policy, builtin_tokenizer

    policy = trained_lora_policy()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        expected = policy(ids).logits
    unsharded = SimpleNamespace(actor_critic=SimpleNamespace(policy=policy), tokenizer=builtin_tokenizer())
    save_module_policy(unsharded, str(tmp_path / "unsharded"), merge_lora)
    base = {k: v.clone() for k, v in policy.get_base_model().state_dict().items() if "lora_" not in k}
    shard_model(policy, None)
    module = SimpleNamespace(actor_critic=SimpleNamespace(policy=policy), tokenizer=unsharded.tokenizer)
    path = save_module_policy(module, str(tmp_path / "sharded"), merge_lora)
    names = sorted(p.name for p in (tmp_path / "unsharded").iterdir())
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == names
    weights = "model.safetensors" if merge_lora else "adapter_model.safetensors"
    want, got = load_file(tmp_path / "unsharded" / weights), load_file(tmp_path / "sharded" / weights)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    if merge_lora:
        loaded = AutoModelForCausalLM.from_pretrained(path)
        assert type(loaded).__name__ == "GPT2LMHeadModel"
    else:
        configs = [json.loads((tmp_path / f / "adapter_config.json").read_text()) for f in ("unsharded", "sharded")]
        for config in configs:
            config["target_modules"] = sorted(config["target_modules"])  # a set: written in its iteration order
        assert configs[0] == configs[1]
        plain = builtin_policy()
        plain.load_state_dict({k.replace(".base_layer", ""): v for k, v in base.items()})
        loaded = PeftModel.from_pretrained(plain, path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected)
