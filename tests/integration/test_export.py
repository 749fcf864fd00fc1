"""Getting the trained policy out: `save_policy` writes a Hugging Face folder that `AutoModelForCausalLM` reloads
with identical logits and greedy outputs; LoRA merged (in a copy: the live policy keeps its adapters) or as
adapters for peft; existing folders refused; the tokenizer passed in untouched; the `SavePolicy` callback; and
the `lit-rlhf-export` command line from a checkpoint."""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from conftest import checksum, make_policy, make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.cli import export_main
from lit_rlhf.config import ConfigError
from lit_rlhf.models.export import ExportError, save_module_policy, save_policy
from lit_rlhf.models.lora import has_adapters
from lit_rlhf.rewards.functions import RewardError
from lit_rlhf.training.callbacks import SavePolicy

ROOT = Path(__file__).resolve().parents[2]
REWARD = ["lit_rlhf.tasks.digits.sort_digits_reward"]
TEXTS = ["3142>", "97>", "5>", "80816>"]

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*ModelCheckpoint with manual optimization.*"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
]


def batch(tokenizer) -> dict[str, torch.Tensor]:
    """A left-padded batch (prompts of different lengths), without touching the caller's tokenizer."""
    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "left"
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def logits(model, tokenizer) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**batch(tokenizer)).logits


def greedy(model, tokenizer, **kwargs) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model.generate(**batch(tokenizer), **kwargs)


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def lora_module(policy="builtin:digits", **kwargs) -> RLHFModule:
    module = RLHFModule(
        policy=policy,
        reward_fns=REWARD,
        lora={"r": 4},
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        **kwargs,
    )
    module.configure_model()
    with torch.no_grad():  # LoRA's B starts at zero: make the adapters change the policy
        generator = torch.Generator().manual_seed(1)
        for name, param in module.actor_critic.policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return module


def grpo_module(policy, **kwargs) -> RLHFModule:
    kwargs.setdefault("sampling", SamplingConfig(max_new_tokens=4, temperature=0.8, top_k=0, top_p=0.9))
    return RLHFModule(
        policy=policy,
        reward_fns=REWARD,
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        lr=1e-2,
        log_samples_every_n_steps=0,
        **kwargs,
    )


def data() -> RolloutDataModule:
    return RolloutDataModule(batch_size=2, max_prompt_length=16)


# ----------------------------------------------------------------------------- save_policy


def test_save_policy_reloads_with_identical_logits_and_greedy_outputs(tmp_path, tokenizer):
    policy = make_policy()
    folder = tmp_path / "out" / "policy"  # parent folders are made
    path = save_policy(policy, tokenizer, str(folder), generation={"max_new_tokens": 6, "do_sample": False})
    assert path == str(folder.resolve())
    files = set(os.listdir(folder))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json"} <= files
    assert not any(f.endswith(".bin") for f in files) and leftovers(folder.parent) == []

    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    assert type(reloaded) is type(policy) and checksum(reloaded) == checksum(policy)
    assert torch.equal(logits(reloaded, tokenizer), logits(policy, tokenizer))
    # the folder's generation config alone gives the same greedy outputs as the policy given them explicitly
    expected = greedy(policy, tokenizer, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(greedy(reloaded, tokenizer), expected)
    assert expected.shape[1] > batch(tokenizer)["input_ids"].shape[1]

    config = GenerationConfig.from_pretrained(folder)
    assert (config.max_new_tokens, config.do_sample) == (6, False)
    assert (config.eos_token_id, config.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    saved_tokenizer = AutoTokenizer.from_pretrained(folder)
    assert saved_tokenizer.padding_side == tokenizer.padding_side == "left"
    assert saved_tokenizer(TEXTS)["input_ids"] == tokenizer(TEXTS)["input_ids"]


def test_the_generation_config_is_the_modules_sampling_and_bad_settings_fail_before_writing(tmp_path):
    module = grpo_module(make_policy(), tokenizer="builtin:digits")
    folder = save_module_policy(module, str(tmp_path / "policy"))
    config = GenerationConfig.from_pretrained(folder)
    assert (config.do_sample, config.max_new_tokens, config.temperature, config.top_p) == (True, 4, 0.8, 0.9)
    assert config.top_k == 0  # off, as in the module (unset, transformers would use 50)

    policy, tokenizer = module.actor_critic.policy, module.tokenizer
    with pytest.raises(ConfigError, match="generation: unknown GenerationConfig setting.*'max_tokens'"):
        save_policy(policy, tokenizer, str(tmp_path / "bad"), generation={"max_tokens": 5})
    with pytest.raises(ConfigError, match="generation: .*temperature"):
        save_policy(policy, tokenizer, str(tmp_path / "bad"), generation={"do_sample": False, "temperature": 0.5})
    assert not (tmp_path / "bad").exists() and leftovers(tmp_path) == []


def test_an_existing_folder_is_refused_unless_overwrite(tmp_path, tokenizer):
    folder = tmp_path / "policy"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    policy = make_policy()
    with pytest.raises(ExportError, match=f"save_policy: '{folder}' already exists.*overwrite=True"):
        save_policy(policy, tokenizer, str(folder))
    assert os.listdir(folder) == ["notes.txt"]

    with pytest.raises(ExportError, match="refusing to replace .*not a previous export: it holds notes.txt"):
        save_policy(policy, tokenizer, str(folder), overwrite=True)  # not an export (test_export_guard.py)
    (folder / "notes.txt").unlink()
    save_policy(policy, tokenizer, str(folder), overwrite=True)
    assert "model.safetensors" in os.listdir(folder)
    assert leftovers(tmp_path) == []
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(folder), tokenizer), logits(policy, tokenizer))

    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="it is not a folder"):
        save_policy(policy, tokenizer, str(tmp_path / "file"), overwrite=True)


def test_a_failed_write_leaves_no_folder_behind(tmp_path, tokenizer, monkeypatch):
    policy = make_policy()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(GenerationConfig, "save_pretrained", fail)
    with pytest.raises(OSError, match="disk full"):
        save_policy(policy, tokenizer, str(tmp_path / "policy"))
    assert os.listdir(tmp_path) == []


def test_the_tokenizer_passed_in_is_not_mutated(tmp_path, tokenizer):
    def snapshot(tok):
        return (
            tok.padding_side,
            tok.truncation_side,
            dict(tok.init_kwargs),
            tok.pad_token,
            tok.eos_token,
            tok.get_vocab(),
            tok.model_max_length,
            sorted(vars(tok)),
        )

    tokenizer.padding_side = "right"  # whatever side the caller chose is saved, and left as it was
    before = snapshot(tokenizer)
    assert "padding_side" not in before[2]  # so saving it needs a copy with it in init_kwargs
    folder = save_policy(make_policy(), tokenizer, str(tmp_path / "policy"))
    assert snapshot(tokenizer) == before
    assert AutoTokenizer.from_pretrained(folder).padding_side == "right"


# ----------------------------------------------------------------------------- LoRA


def test_lora_merged_export_equals_the_live_policy_which_keeps_its_adapters(tmp_path):
    pytest.importorskip("peft")
    module = lora_module()
    policy, tokenizer = module.actor_critic.policy, module.tokenizer
    live_before, weights_before = logits(policy, tokenizer), checksum(policy)
    with policy.disable_adapter():
        base = logits(policy, tokenizer)
    assert (live_before - base).abs().max() > 1e-2  # the adapters matter

    folder = save_module_policy(module, str(tmp_path / "merged"))
    assert "adapter_config.json" not in os.listdir(folder)
    merged = AutoModelForCausalLM.from_pretrained(folder)
    assert not has_adapters(merged) and not any("lora_" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, tokenizer), live_before, rtol=0, atol=1e-5)

    # the live policy: still the peft model with active adapters, same weights, same logits
    assert module.actor_critic.policy is policy and has_adapters(policy)
    assert checksum(policy) == weights_before
    assert any("lora_B" in name for name, _ in policy.named_parameters())
    assert torch.equal(logits(policy, tokenizer), live_before)


def test_lora_adapter_export_round_trips_with_peft(tmp_path):
    pytest.importorskip("peft")
    from peft import AutoPeftModelForCausalLM, PeftModel

    base_dir = tmp_path / "base"  # a base model peft can find again by its folder name
    base = make_policy()
    base.save_pretrained(base_dir)
    from lit_rlhf.tasks.digits import builtin_tokenizer

    builtin_tokenizer().save_pretrained(base_dir)
    module = lora_module(policy=str(base_dir))
    policy, tokenizer = module.actor_critic.policy, module.tokenizer
    live = logits(policy, tokenizer)

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the base is named: no warning about it
        folder = save_module_policy(module, str(tmp_path / "adapters"), merge_lora=False)
    files = set(os.listdir(folder))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= files
    assert "model.safetensors" not in files
    reloaded = AutoPeftModelForCausalLM.from_pretrained(folder)
    assert torch.equal(logits(reloaded, tokenizer), live)
    assert torch.equal(logits(PeftModel.from_pretrained(make_policy(), folder), tokenizer), live)
    assert has_adapters(policy) and torch.equal(logits(policy, tokenizer), live)

    # adapters on an unnamed base (the built-in policy): saved, with a warning that says how to load them
    with pytest.warns(UserWarning, match="do not name their base model.*PeftModel.from_pretrained"):
        save_module_policy(lora_module(), str(tmp_path / "unnamed"), merge_lora=False)


# ----------------------------------------------------------------------------- the callback


def test_save_policy_callback_writes_a_loadable_folder_at_the_end_of_fit(tmp_path):
    module = grpo_module(make_policy(), tokenizer="builtin:digits")
    start = checksum(module.actor_critic.policy)
    folder = tmp_path / "policy"
    make_trainer(max_steps=2, callbacks=[SavePolicy(str(folder))]).fit(module, data())
    assert module.global_step == 2 and checksum(module.actor_critic.policy) != start  # trained
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    assert checksum(reloaded) == checksum(module.actor_critic.policy)
    assert torch.equal(logits(reloaded, module.tokenizer), logits(module.actor_critic.policy, module.tokenizer))
    assert GenerationConfig.from_pretrained(folder).max_new_tokens == 4


def test_module_save_policy_and_the_callback_from_yaml(tmp_path, monkeypatch):
    """`module.save_policy(folder)`, and `trainer.callbacks: [{class_path: lit_rlhf.SavePolicy, ...}]`."""
    from lit_rlhf.cli import main

    folder, config = tmp_path / "from_yaml", tmp_path / "config.yaml"
    config.write_text(
        f"""
trainer: {{accelerator: cpu, devices: 1, max_steps: 1, logger: false, enable_checkpointing: false,
          enable_progress_bar: false, enable_model_summary: false,
          callbacks: [{{class_path: lit_rlhf.SavePolicy, init_args: {{folder: {folder}}}}}]}}
model: {{policy: "builtin:digits", reward_fns: {REWARD}, algorithm: {{name: grpo, group_size: 2}},
        sampling: {{max_new_tokens: 3}}, log_samples_every_n_steps: 0}}
data: {{batch_size: 2, max_prompt_length: 16}}
"""
    )
    monkeypatch.setattr(sys, "argv", ["lit-rlhf"])  # the CLI reads only `args`
    module = main(["fit", "--config", str(config)]).model
    policy, tokenizer = module.actor_critic.policy, module.tokenizer
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(folder), tokenizer), logits(policy, tokenizer))
    assert GenerationConfig.from_pretrained(folder).max_new_tokens == 3

    again = module.save_policy(str(tmp_path / "method"))
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(again), tokenizer), logits(policy, tokenizer))
    with pytest.raises(ExportError, match="already exists"):
        module.save_policy(again)


def test_save_policy_callback_refuses_an_existing_folder_before_training(tmp_path):
    folder = tmp_path / "policy"
    folder.mkdir()
    module = grpo_module(make_policy(), tokenizer="builtin:digits")
    with pytest.raises(ExportError, match=f"SavePolicy: the folder '{folder}' already exists.*overwrite: true"):
        make_trainer(max_steps=2, callbacks=[SavePolicy(str(folder))]).fit(module, data())
    assert module.global_step == 0 and os.listdir(folder) == []
    make_trainer(max_steps=1, callbacks=[SavePolicy(str(folder), overwrite=True)]).fit(module, data())
    assert "model.safetensors" in os.listdir(folder)


# ----------------------------------------------------------------------------- the command line


def fit_with_checkpoint(module: RLHFModule, ckpt_dir: Path) -> Path:
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=0, save_last=True)
    make_trainer(max_steps=2, enable_checkpointing=True, callbacks=[checkpoint]).fit(module, data())
    return ckpt_dir / "last.ckpt"


@pytest.mark.parametrize("lora", [None, {"r": 4}])
def test_cli_exports_a_checkpoint_with_the_modules_logits(tmp_path, capsys, lora):
    if lora:
        pytest.importorskip("peft")
    module = grpo_module("builtin:digits", lora=lora)
    ckpt = fit_with_checkpoint(module, tmp_path / "ckpt")
    policy, tokenizer = module.actor_critic.policy, module.tokenizer
    if lora:
        assert any(p.abs().max() > 0 for n, p in policy.named_parameters() if "lora_B" in n)  # trained adapters
    out = tmp_path / "export"
    args = ["--ckpt", str(ckpt), "--out", str(out)]
    if lora:
        export_main(args)
        assert capsys.readouterr().out.strip().splitlines()[-1] == str(out.resolve())  # the folder, printed
    else:  # as the console script runs it: exit status 0, the folder on stdout
        done = run_console_script("lit-rlhf-export", args)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().splitlines()[-1] == str(out.resolve())
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert not has_adapters(reloaded)
    torch.testing.assert_close(logits(reloaded, tokenizer), logits(policy, tokenizer), rtol=0, atol=1e-5 if lora else 0)
    assert GenerationConfig.from_pretrained(out).temperature == 0.8

    with pytest.raises(SystemExit, match=f"lit-rlhf-export: error: save_policy: '{out}' already exists.*--overwrite"):
        export_main(["--ckpt", str(ckpt), "--out", str(out)])
    # the built-in policy is not named by a folder or hub id: peft adapters get a warning that says so
    with pytest.warns(UserWarning, match="do not name their base model") if lora else contextlib.nullcontext():
        export_main(["--ckpt", str(ckpt), "--out", str(out), "--overwrite", "--no-merge-lora"])
    assert ("adapter_config.json" in os.listdir(out)) == bool(lora)


def console_scripts() -> dict[str, str]:
    """pyproject.toml's [project.scripts] table (read by hand: tomllib needs Python 3.11)."""
    table = (ROOT / "pyproject.toml").read_text().split("[project.scripts]\n")[1].split("\n\n")[0]
    return dict(re.fullmatch(r'(\S+) = "(\S+)"', line).groups() for line in table.splitlines())


def run_console_script(name: str, args: list[str]) -> subprocess.CompletedProcess:
    """What the installed console script does: `sys.exit(target())` (so a returned object is an exit status)."""
    module, function = console_scripts()[name].split(":")
    code = f"import sys; sys.argv[1:] = {args!r}; from {module} import {function}; sys.exit({function}())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_console_scripts_return_no_exit_status():
    """`sys.exit(obj)` prints a non-None, non-int `obj` and exits 1, even after a successful run."""
    import lit_rlhf.cli

    scripts = console_scripts()
    assert scripts["lit-rlhf-export"] == "lit_rlhf.cli:export_main"
    for name, target in scripts.items():
        function = getattr(lit_rlhf.cli, target.split(":")[1])
        assert inspect.signature(function).return_annotation in (None, "None"), name


def test_cli_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.ckpt"
    done = run_console_script("lit-rlhf-export", ["--ckpt", str(missing), "--out", str(tmp_path / "out")])
    assert done.returncode == 1 and f"lit-rlhf-export: error: checkpoint {missing}: no such file" in done.stderr
    with pytest.raises(SystemExit, match=f"checkpoint {missing}: no such file"):
        export_main(["--ckpt", str(missing), "--out", str(tmp_path / "out")])
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {"layer.weight": torch.zeros(2)}, "hyper_parameters": {}}, foreign)
    with pytest.raises(SystemExit, match=f"checkpoint {foreign}: not written by lit_rlhf's RLHFModule"):
        export_main(["--ckpt", str(foreign), "--out", str(tmp_path / "out")])
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(foreign.read_bytes()[:200])
    with pytest.raises(SystemExit, match=f"checkpoint {cut}: truncated or not a torch checkpoint"):
        export_main(["--ckpt", str(cut), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_cli_rebuilds_an_instance_built_policy_from_policy_argument(tmp_path):
    module = grpo_module(make_policy(), tokenizer="builtin:digits")  # built from an instance: not named
    ckpt = fit_with_checkpoint(module, tmp_path / "ckpt")
    expected = logits(module.actor_critic.policy, module.tokenizer)
    try:
        export_main(["--ckpt", str(ckpt), "--out", str(tmp_path / "unnamed")])
    except SystemExit as exit:
        assert f"checkpoint {ckpt}: the checkpoint does not name its policy" in str(exit)
        assert "pass --policy NAME_OR_FOLDER" in str(exit)
        assert not (tmp_path / "unnamed").exists()
    else:  # a checkpoint that carries the policy's architecture rebuilds it without --policy
        assert torch.equal(
            logits(AutoModelForCausalLM.from_pretrained(tmp_path / "unnamed"), module.tokenizer), expected
        )

    same_architecture = tmp_path / "arch"  # any model of the same shape: the checkpoint's weights replace its own
    make_policy(seed=5).save_pretrained(same_architecture)
    module.tokenizer.save_pretrained(same_architecture)
    out = tmp_path / "export"
    export_main(["--ckpt", str(ckpt), "--out", str(out), "--policy", str(same_architecture)])
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out), module.tokenizer), expected)


def test_cli_exports_a_checkpoint_whose_reward_functions_cannot_be_imported(tmp_path):
    """Reward and metric functions defined in a script (here: inside this test) are not importable when the
    checkpoint is read elsewhere; exporting needs neither, so it still works."""

    def local_reward(prompts, responses, **meta):
        return [float(len(r)) for r in responses]

    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=[local_reward],
        metric_fns=[local_reward],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
    )
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    make_trainer(max_steps=1, callbacks=[checkpoint], enable_checkpointing=True).fit(
        module, RolloutDataModule(batch_size=2, max_prompt_length=16)
    )
    # rebuilding the whole module needs neither: each becomes a stand-in that raises only when it is called
    loaded = RLHFModule.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    with pytest.raises(RewardError, match="local_reward' was not imported"):
        loaded.reward.reward_fns[0](["a"], ["b"])
    export_main(["--ckpt", str(tmp_path / "ckpt" / "last.ckpt"), "--out", str(tmp_path / "policy")])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, module.actor_critic.policy(ids).logits)
