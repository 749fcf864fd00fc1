"""FSDP2 (`ModelParallelStrategy`, `fully_shard` in `configure_model`) on two CPU processes (gloo): GRPO with a sharded
reference and PPO with a sharded value head, 3 steps each, give the weights of DDP on the same two processes (same
prompts per rank, same sampling streams) within float tolerance, with rank 0 alone reading the policy's weights (the
PPO one from a save_pretrained folder) and rank 1 receiving its shards; the `SavePolicy` export and `lit-rlhf-export`
of a distributed checkpoint folder load in plain transformers with the trained weights; a run resumed from the
distributed checkpoint of step 2 ends with the weights of the uninterrupted run, bit for bit, and then answers
held-out prompts (uneven batch counts over the ranks are refused); so does one resumed from a full checkpoint file
written by `AtomicCheckpointIO` (`save_distributed_checkpoint=False`). The same for GRPO with LoRA adapters (the
reference: the sharded policy with the adapters off): the adapters of DDP, its exports (merged, and adapters only), and
exact resumes from distributed and full checkpoints.

The fits run in `tests/e2e/fsdp2_run.py`, one process per rank, as `test_ddp.py` runs `ddp_run.py`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import lit_rlhf
from conftest import free_port, run_ranks
from lit_rlhf.registry import get_task

pytestmark = pytest.mark.slow  # end-to-end: several processes

SCRIPT = Path(__file__).with_name("fsdp2_run.py")
# Adam at lr 1e-2 amplifies the summation-order differences of reduce-scatter against all-reduce in coordinates
# whose gradient is near 0; each step moves a weight by up to ~1e-2, so 1e-3 still tells a wrong update apart.
TOLERANCE = 1e-3
# LoRA: the adapters differ from DDP's by 2.6e-7 at most (3 steps, torch 2.13 CPU); 1e-4 leaves room for other
# summation orders, and one lora_A scaled by 1% before training ends 1.5e-2 away.
LORA_TOLERANCE = 1e-4
SOURCE = Path(lit_rlhf.__file__).resolve().parents[1]  # the ranks import the lit_rlhf this test imported


def launch(strategy: str, out: Path, *options: str, timeout: int = 300) -> tuple[list[int], list[str]]:
    """Both ranks of an fsdp2_run.py fit; their exit codes and stderr."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", NODE_RANK="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SOURCE), os.environ.get("PYTHONPATH")) if p)
    command = [sys.executable, str(SCRIPT), "--strategy", strategy, "--out", str(out), *options]
    ranks = run_ranks(
        [command, command],
        [dict(env, LOCAL_RANK=str(r)) for r in (0, 1)],
        out,
        timeout,
        f"the {strategy} run did not finish in time (a hung collective?)",
    )
    return [rank.returncode for rank in ranks], [rank.stderr for rank in ranks]


def run(strategy: str, out: Path, *options: str) -> None:
    codes, stderr = launch(strategy, out, *options)
    assert codes == [0, 0], stderr[0][-3000:] + stderr[1][-3000:]


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory) -> Path:
    """3 GRPO steps under FSDP2 with a distributed checkpoint after each and a `SavePolicy` export."""
    out = tmp_path_factory.mktemp("fsdp2")
    run("fsdp2", out, "--checkpoints", str(out / "checkpoints"), "--export", str(out / "policy"))
    return out


def assert_like_ddp(out: Path, fsdp2_tag: str, ddp_tag: str, tolerance: float = TOLERANCE) -> None:
    fsdp2, ddp = torch.load(out / f"{fsdp2_tag}.pt"), torch.load(out / f"{ddp_tag}.pt")
    assert sorted(fsdp2) == sorted(ddp) and fsdp2
    worst = max((fsdp2[k] - ddp[k]).abs().max().item() for k in ddp)
    assert worst < tolerance
    for rank in (0, 1):
        assert json.loads((out / f"{fsdp2_tag}_rank{rank}.json").read_text())["global_step"] == 3
    initial = torch.load(out / f"{fsdp2_tag}_initial.pt")
    assert all(torch.equal(initial[k], torch.load(out / f"{ddp_tag}_initial.pt")[k]) for k in ddp)
    assert max((ddp[k] - initial[k]).abs().max().item() for k in ddp) > 10 * TOLERANCE  # the weights moved


def loads(out: Path, tag: str) -> list[list[str]]:
    """The models each rank loaded with their weights, rank 0 first."""
    return [json.loads((out / f"{tag}_rank{rank}.json").read_text())["loads"] for rank in (0, 1)]


def test_grpo_under_fsdp2_on_two_cpu_processes_trains_like_ddp(grpo_run):
    run("ddp", grpo_run)
    assert_like_ddp(grpo_run, "fsdp2", "ddp")
    assert loads(grpo_run, "fsdp2") == [["model.policy"], []]  # rank 1 built it on the meta device
    for tag, groups in (("fsdp2", 1), ("ddp", 4)):  # each rank must call a sharded model as many times
        records = [json.loads((grpo_run / f"{tag}_rank{rank}.json").read_text()) for rank in (0, 1)]
        assert [record["length_groups"] for record in records] == [groups, groups]


def tiny_llama_folder(folder: Path) -> Path:
    """A 2-block Llama (rotary tables: non-persistent buffers no state dict carries; tied embeddings) with the
    digits task's tokenizer, saved as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = get_task("builtin:digits", "model.tokenizer").tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_when_rank_0_cannot_read_the_weights_every_rank_stops_with_its_error(tmp_path):
    folder = tiny_llama_folder(tmp_path / "llama")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # an interrupted download
    codes, stderr = launch("fsdp2", tmp_path, "--policy", str(folder), timeout=120)
    assert codes[0] != 0 and codes[1] != 0
    assert "a weights file of" in stderr[0] and "truncated or damaged" in stderr[0]
    quoted = f"model.policy: rank 0 could not load {str(folder)!r} (ConfigError: model.policy: a weights file"
    assert quoted in stderr[1]


def test_ppo_from_a_folder_under_fsdp2_with_a_sharded_value_head_trains_like_ddp(tmp_path):
    """A Llama read from a save_pretrained folder by rank 0 alone (rank 1 gets its shards and rotary tables from
    rank 0); the reference is its frozen copy; the value head is sharded as its own unit."""
    folder = tiny_llama_folder(tmp_path / "llama")
    run("fsdp2", tmp_path, "--algorithm", "ppo", "--policy", str(folder), "--tag", "ppo_fsdp2")
    run("ddp", tmp_path, "--algorithm", "ppo", "--policy", str(folder), "--tag", "ppo_ddp")
    assert_like_ddp(tmp_path, "ppo_fsdp2", "ppo_ddp")
    assert loads(tmp_path, "ppo_fsdp2") == [["model.policy"], []]
    assert {"value_head.weight", "value_head.bias"} <= set(torch.load(tmp_path / "ppo_fsdp2.pt"))
    for rank in (0, 1):  # the frozen reference's root is resharded after each forward, not left whole to the end
        reference = json.loads((tmp_path / f"ppo_fsdp2_rank{rank}.json").read_text())["reference"]
        assert reference["dtensors"] == reference["tensors"] > 0


def exported(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


def exported_weights(folder: Path) -> dict[str, torch.Tensor]:
    return exported(folder).state_dict()


def test_the_export_and_lit_rlhf_export_of_a_distributed_checkpoint_hold_the_trained_policy(grpo_run):
    from lit_rlhf.cli import export_checkpoint

    trained = {k.removeprefix("policy."): v for k, v in torch.load(grpo_run / "fsdp2.pt").items()}
    saved = exported_weights(grpo_run / "policy")  # SavePolicy at the end of fit: gathered on rank 0
    assert all(torch.equal(saved[k], trained[k]) for k in trained)
    step3 = grpo_run / "checkpoints" / "epoch=0-step=3.ckpt"
    assert step3.is_dir()  # a distributed checkpoint: one file of shards per rank
    from_ckpt = exported_weights(Path(export_checkpoint(str(step3), str(grpo_run / "exported"))))
    assert all(torch.equal(from_ckpt[k], trained[k]) for k in trained)


def test_a_resume_from_a_distributed_checkpoint_is_exact(grpo_run):
    step2 = grpo_run / "checkpoints" / "epoch=0-step=2.ckpt"
    run("fsdp2", grpo_run, "--resume", str(step2), "--tag", "resumed", "--validate")
    full, resumed = torch.load(grpo_run / "fsdp2.pt"), torch.load(grpo_run / "resumed.pt")
    assert sorted(full) == sorted(resumed)
    assert all(torch.equal(full[k], resumed[k]) for k in full)  # same data position, RNG streams and optimizer
    for rank in (0, 1):
        record = json.loads((grpo_run / f"resumed_rank{rank}.json").read_text())
        assert record["global_step"] == 3
        # then held-out answers, each batch gathering the policy once: 2 batches per rank work, 2 and 1 are refused
        assert 0.0 <= record["validate"]["4"]["val/reward_mean"] <= 1.0
        assert "the ranks have [2, 1]" in record["validate"]["3"]["error"]


def test_full_checkpoints_written_by_atomic_checkpoint_io_resume_exactly(grpo_run, tmp_path):
    """`save_distributed_checkpoint: false`: each save gathers a full checkpoint that `AtomicCheckpointIO` writes as
    one file; a run of 2 steps resumed from its step-2 file ends with the 3-step run's weights, bit for bit."""
    checkpoints = tmp_path / "checkpoints"
    options = ["--full-checkpoints", "--checkpoints", str(checkpoints)]
    run("fsdp2", tmp_path, *options, "--rollouts", "2", "--tag", "first")
    step2 = checkpoints / "epoch=0-step=2.ckpt"
    assert step2.is_file() and sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0-step=1.ckpt", step2.name]
    run("fsdp2", tmp_path, "--full-checkpoints", "--resume", str(step2), "--tag", "resumed")
    full, resumed = torch.load(grpo_run / "fsdp2.pt"), torch.load(tmp_path / "resumed.pt")
    assert sorted(full) == sorted(resumed)
    assert all(torch.equal(full[k], resumed[k]) for k in full)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """3 GRPO steps of LoRA adapters under FSDP2 (a distributed checkpoint after each) and under DDP, each with
    `SavePolicy` exports merged and of the adapters only."""
    pytest.importorskip("peft")  # the lora extra; the README installs only .[dev]
    out = tmp_path_factory.mktemp("fsdp2_lora")
    for strategy in ("fsdp2", "ddp"):
        exports = ["--export", str(out / f"{strategy}_merged"), "--adapter-export", str(out / f"{strategy}_adapters")]
        checkpoints = ["--checkpoints", str(out / "checkpoints")] if strategy == "fsdp2" else []
        run(strategy, out, "--lora", "--tag", f"lora_{strategy}", *exports, *checkpoints)
    return out


def test_lora_under_fsdp2_trains_the_adapters_like_ddp(lora_run):
    assert_like_ddp(lora_run, "lora_fsdp2", "lora_ddp", LORA_TOLERANCE)
    trained = torch.load(lora_run / "lora_fsdp2.pt")
    assert all(".lora_A." in k or ".lora_B." in k for k in trained)  # the base weights stay frozen
    for rank in (0, 1):  # AdamW steps the adapters only, as DTensor shards
        record = json.loads((lora_run / f"lora_fsdp2_rank{rank}.json").read_text())
        assert record["optimized"] == {"tensors": len(trained), "dtensors": len(trained)}


def test_lora_exports_under_fsdp2_hold_the_adapters_ddp_trained(lora_run):
    from peft import PeftModel
    from safetensors.torch import load_file

    from lit_rlhf.cli import export_checkpoint
    from lit_rlhf.tasks.digits import builtin_policy

    merged, ddp_merged = exported_weights(lora_run / "fsdp2_merged"), exported_weights(lora_run / "ddp_merged")
    assert sorted(merged) == sorted(ddp_merged) and not any("lora" in k for k in merged)  # a plain GPT-2
    assert max((merged[k] - ddp_merged[k]).abs().max().item() for k in merged) < LORA_TOLERANCE
    step3 = lora_run / "checkpoints" / "epoch=0-step=3.ckpt"
    from_ckpt = exported_weights(Path(export_checkpoint(str(step3), str(lora_run / "exported"))))
    assert all(torch.equal(from_ckpt[k], merged[k]) for k in merged)

    adapters = lora_run / "fsdp2_adapters"
    assert adapter_config(adapters) == adapter_config(lora_run / "ddp_adapters")
    trained = torch.load(lora_run / "lora_fsdp2.pt")
    saved = load_file(adapters / "adapter_model.safetensors")
    assert sorted(saved) == sorted(k.removeprefix("policy.").replace(".default.", ".") for k in trained)
    assert all(torch.equal(saved[k.removeprefix("policy.").replace(".default.", ".")], v) for k, v in trained.items())
    torch.manual_seed(0)  # the run's base model: its first draws after seed_everything(0)
    base = builtin_policy()
    assert torch.equal(base.transformer.wte.weight, merged["transformer.wte.weight"])  # no adapter on it
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():  # peft on the base model gives the merged export's outputs
        expected = exported(lora_run / "fsdp2_merged")(ids).logits
        torch.testing.assert_close(PeftModel.from_pretrained(base, adapters)(ids).logits, expected)


def adapter_config(folder: Path) -> dict:
    config = json.loads((folder / "adapter_config.json").read_text())
    config["target_modules"] = sorted(config["target_modules"])  # a set, written in each process's hash order
    return config


def test_a_lora_resume_from_a_distributed_checkpoint_is_exact(lora_run):
    step2 = lora_run / "checkpoints" / "epoch=0-step=2.ckpt"
    run("fsdp2", lora_run, "--lora", "--resume", str(step2), "--tag", "lora_resumed", "--validate")
    full, resumed = torch.load(lora_run / "lora_fsdp2.pt"), torch.load(lora_run / "lora_resumed.pt")
    assert sorted(full) == sorted(resumed)
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    for rank in (0, 1):  # then held-out answers from the sharded adapters
        record = json.loads((lora_run / f"lora_resumed_rank{rank}.json").read_text())
        assert 0.0 <= record["validate"]["4"]["val/reward_mean"] <= 1.0


def test_lora_full_checkpoints_resume_exactly(lora_run, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    options = ["--lora", "--full-checkpoints"]
    run("fsdp2", tmp_path, *options, "--checkpoints", str(checkpoints), "--rollouts", "2", "--tag", "first")
    step2 = checkpoints / "epoch=0-step=2.ckpt"
    assert step2.is_file()
    run("fsdp2", tmp_path, *options, "--resume", str(step2), "--tag", "resumed")
    full, resumed = torch.load(lora_run / "lora_fsdp2.pt"), torch.load(tmp_path / "resumed.pt")
    assert sorted(full) == sorted(resumed)
    assert all(torch.equal(full[k], resumed[k]) for k in full)
