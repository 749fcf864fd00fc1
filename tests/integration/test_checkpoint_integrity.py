"""A checkpoint carries a checksum of its weights and optimizer state, checked before any weight is used; a
checkpoint whose weights do not fit the module is refused naming each difference on one line."""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import GPT2LMHeadModel

from conftest import checksum, make_policy, make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.training.checkpoint_integrity import DIGEST_KEY, payload_digest
from lit_rlhf.training.checkpoint_io import AtomicCheckpointIO, CheckpointError

REWARD = ["lit_rlhf.tasks.digits.sort_digits_reward"]


def module(name: str = "grpo", policy=None, **kwargs) -> RLHFModule:
    return RLHFModule(
        policy=make_policy() if policy is None else policy,
        tokenizer="builtin:digits",
        reward_fns=REWARD,
        algorithm=AlgorithmConfig(name=name, group_size=2, **kwargs.pop("algo", {})),
        sampling=SamplingConfig(max_new_tokens=4),
        **kwargs,
    )


def fit(m: RLHFModule, steps: int, folder: Path, ckpt_path=None):
    trainer = make_trainer(steps, default_root_dir=folder, plugins=[AtomicCheckpointIO()])
    trainer.fit(m, RolloutDataModule(prompts="builtin:digits", batch_size=2), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def grpo_checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("grpo")
    trainer = fit(module(), 1, folder)
    trainer.save_checkpoint(folder / "last.ckpt")
    return folder / "last.ckpt"


def flip_bytes_in_largest_tensor(path: Path, count: int = 64) -> None:
    """Flip `count` bytes inside the largest tensor's data, keeping the size and the zip layout (torch does not
    check the entries' CRCs)."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    assert info.compress_type == zipfile.ZIP_STORED and info.file_size > 256
    with open(path, "r+b") as handle:
        handle.seek(info.header_offset + 26)
        name_length, extra_length = (int.from_bytes(handle.read(2), "little") for _ in range(2))
        start = info.header_offset + 30 + name_length + extra_length + 128
        handle.seek(start)
        data = handle.read(count)
        handle.seek(start)
        handle.write(bytes(b ^ 0xFF for b in data))


def test_the_checksum_is_of_the_weights_and_optimizer_state(grpo_checkpoint):
    saved = torch.load(grpo_checkpoint, weights_only=True)
    assert saved["lit_rlhf"][DIGEST_KEY] == payload_digest(saved)
    assert saved["optimizer_states"], "the optimizer state is part of the payload"
    key = next(iter(saved["state_dict"]))
    saved["state_dict"][key] = saved["state_dict"][key].clone()
    saved["state_dict"][key].view(-1)[0] += 1
    assert payload_digest(saved) != saved["lit_rlhf"][DIGEST_KEY]


def test_flipped_bytes_in_a_weight_are_refused_on_load_and_on_resume_before_any_weight_is_used(
    grpo_checkpoint, tmp_path
):
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(grpo_checkpoint.read_bytes())
    flip_bytes_in_largest_tensor(damaged)
    torch.load(damaged, weights_only=True)  # still a readable file: only the checksum finds the damage
    with pytest.raises(CheckpointError, match=r"damaged.ckpt: its weights or optimizer state do not match"):
        RLHFModule.load_from_checkpoint(damaged)
    m = module()
    m.configure_model()
    before = checksum(m)
    with pytest.raises(CheckpointError, match=r"damaged.ckpt: its weights or optimizer state do not match"):
        fit(m, 2, tmp_path, ckpt_path=damaged)
    assert checksum(m) == before  # nothing was loaded into the module
    assert RLHFModule.load_from_checkpoint(grpo_checkpoint).state.rollouts_done == 1  # the intact file loads


def refusal(m: RLHFModule, checkpoint: Path, folder: Path) -> str:
    with pytest.raises(CheckpointError) as caught:
        fit(m, 2, folder, ckpt_path=checkpoint)
    message = str(caught.value)
    assert "do not fit this module" in message and "size mismatch" not in message and len(message) < 700
    return message


def test_resuming_with_another_algorithm_names_it_on_one_line(grpo_checkpoint, tmp_path):
    message = refusal(module("ppo"), grpo_checkpoint, tmp_path)
    assert "  algorithm: grpo (without a critic) in the checkpoint, ppo (with a critic) here" in message.splitlines()
    assert "model:" not in message  # the critic's weights are explained by the algorithm line


def test_resuming_with_lora_switched_on_names_it(grpo_checkpoint, tmp_path):
    message = refusal(module(lora={"r": 4, "alpha": 8}), grpo_checkpoint, tmp_path)
    assert "  LoRA: off in the checkpoint, on here" in message.splitlines()


def test_resuming_with_another_vocabulary_or_shape_names_them(grpo_checkpoint, tmp_path):
    config = make_policy().config
    vocabulary = config.vocab_size
    config.vocab_size += 8
    message = refusal(module(policy=GPT2LMHeadModel(config)), grpo_checkpoint, tmp_path)
    assert f"  vocabulary: {vocabulary} ids in the checkpoint, {vocabulary + 8} here" in "\n".join(
        line.split(" (")[0] for line in message.splitlines()
    )
    message = refusal(module(policy=make_policy(n_embd=48)), grpo_checkpoint, tmp_path)
    assert any(line.startswith("  model shape: ") and "[" in line for line in message.splitlines())


def test_a_changed_max_staleness_on_resume_is_named():
    saved = module().rollout_fingerprint()
    resumed = module(algo={"max_staleness": 1})
    with pytest.warns(UserWarning, match=r"model.algorithm.max_staleness: 0 -> 1"):
        resumed.check_resumed_rollouts(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module().check_resumed_rollouts(saved)
