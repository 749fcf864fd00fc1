"""One run per checkpoint folder (a lock file taken at fit start, before any model loads, released at the end
even on an exception; a dead run's lock is taken over), stale temporary checkpoint files cleaned, and checkpoint
files that are empty, truncated, foreign or cannot be written (full disk) named with the cause."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lit_rlhf.training.checkpoint_io as ckpt_io
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.cli import main
from lit_rlhf.config import ConfigError
from lit_rlhf.training.checkpoint_io import (
    PARTIAL_SUFFIX,
    AtomicCheckpointIO,
    CheckpointError,
    atomic_torch_save,
    load_checkpoint_file,
)
from lit_rlhf.training.run_folder import LOCK_NAME, FolderLock, RunFolderLocked, remove_stale_temp_files

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LightningCLI's args parameter.*"),
    pytest.mark.filterwarnings("ignore:.*ModelCheckpoint with manual optimization.*"),
]


@pytest.fixture
def live_pid():
    """The pid of another process that runs for the whole test."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture
def dead_pid():
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_lock(folder: Path, pid: int, host: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    path.write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid}))
    return path


# ----------------------------------------------------------------------------- the lock itself


def test_lock_holds_host_and_pid_and_is_released(tmp_path):
    lock = FolderLock(str(tmp_path / "ckpts"))
    lock.acquire()
    path = tmp_path / "ckpts" / LOCK_NAME
    assert json.loads(path.read_text()) == {"host": socket.gethostname(), "pid": os.getpid()}
    lock.acquire()  # the same process again (a second fit in a notebook): allowed
    lock.release()
    assert not path.exists()


def test_lock_of_a_live_run_is_refused_naming_folder_pid_and_fix(tmp_path, live_pid):
    path = write_lock(tmp_path, live_pid)
    with pytest.raises(RunFolderLocked, match=rf"checkpoint folder {tmp_path}: another run \(pid {live_pid} on host"):
        FolderLock(str(tmp_path)).acquire()
    with pytest.raises(RunFolderLocked, match="default_root_dir.*dirpath.*or wait"):
        FolderLock(str(tmp_path)).acquire()
    assert json.loads(path.read_text())["pid"] == live_pid  # untouched


def test_lock_from_another_host_is_refused(tmp_path, dead_pid):
    write_lock(tmp_path, dead_pid, host="some-other-host")
    with pytest.raises(RunFolderLocked, match=f"pid {dead_pid} on host some-other-host.*delete"):
        FolderLock(str(tmp_path)).acquire()


def test_lock_of_a_dead_run_is_taken_over_with_a_warning(tmp_path, dead_pid):
    path = write_lock(tmp_path, dead_pid)
    lock = FolderLock(str(tmp_path))
    with pytest.warns(UserWarning, match=f"taking over the lock of run pid {dead_pid}"):
        lock.acquire()
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()


def test_release_leaves_a_lock_that_is_not_ours(tmp_path, live_pid):
    lock = FolderLock(str(tmp_path))
    lock.acquire()
    path = write_lock(tmp_path, live_pid)  # e.g. deleted by hand and taken by another run
    lock.release()
    assert json.loads(path.read_text())["pid"] == live_pid


def partial_file(path, pid: int, marked: bool = True) -> None:
    """A temporary checkpoint file of process `pid`, with the marker the library writes beside it (or without)."""
    path.write_bytes(b"partial")
    if marked:
        (path.parent / (path.name + PARTIAL_SUFFIX)).write_text(json.dumps({"lit_rlhf_partial": path.name, "pid": pid}))


def test_stale_temp_files_are_removed_only_for_dead_processes(tmp_path, dead_pid, live_pid, caplog):
    partial_file(tmp_path / f"last.ckpt.tmp-{dead_pid}", dead_pid)
    partial_file(tmp_path / f"last.ckpt.tmp-{live_pid}", live_pid)
    partial_file(tmp_path / f"backup.ckpt.tmp-{dead_pid}", dead_pid, marked=False)  # a user's file: only the name
    (tmp_path / "last.ckpt").write_bytes(b"kept")
    removed = remove_stale_temp_files(str(tmp_path))
    assert removed == [str(tmp_path / f"last.ckpt.tmp-{dead_pid}")]
    assert sorted(os.listdir(tmp_path)) == [
        f"backup.ckpt.tmp-{dead_pid}",
        "last.ckpt",
        f"last.ckpt.tmp-{live_pid}",
        f"last.ckpt.tmp-{live_pid}{PARTIAL_SUFFIX}",
    ]
    assert f"removed {tmp_path / f'last.ckpt.tmp-{dead_pid}'}" in caplog.text


# ----------------------------------------------------------------------------- the lock in fit


def make_module(**kwargs) -> RLHFModule:
    return RLHFModule(
        policy="builtin:digits",
        reward_fns=[REWARD],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
        log_samples_every_n_steps=0,
        **kwargs,
    )


def fit(module: RLHFModule, ckpt_dir: Path, max_steps: int = 1) -> L.Trainer:
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[AtomicCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=1, save_top_k=0, save_last=True)],
    )
    trainer.fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16))
    return trainer


def test_a_second_run_in_a_locked_folder_fails_before_any_model_loads(tmp_path, live_pid):
    ckpt_dir = tmp_path / "checkpoints"
    write_lock(ckpt_dir, live_pid)
    module = make_module()
    with pytest.raises(RunFolderLocked, match=f"checkpoint folder {ckpt_dir}.*pid {live_pid}"):
        fit(module, ckpt_dir)
    assert module.actor_critic is None  # refused in setup, before configure_model
    assert not (ckpt_dir / "last.ckpt").exists()


def test_fit_releases_the_lock_and_cleans_stale_temp_files(tmp_path, dead_pid):
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    partial_file(ckpt_dir / f"last.ckpt.tmp-{dead_pid}", dead_pid)  # left by a killed run
    fit(make_module(), ckpt_dir)
    assert sorted(os.listdir(ckpt_dir)) == ["last.ckpt"]  # no lock left, no stale temp file


def exploding_reward(prompts, responses, **meta):
    raise KeyError("target")


def test_the_lock_is_released_when_fit_raises(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=[exploding_reward],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
    )
    with pytest.raises(Exception, match="target"):
        fit(module, ckpt_dir)
    assert not (ckpt_dir / LOCK_NAME).exists()


# ----------------------------------------------------------------------------- unreadable checkpoint files


def debug_fit_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "fit",
        "--config",
        str(ROOT / "configs" / "debug.yaml"),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger",
        "false",
        "--model.log_samples_every_n_steps",
        "0",
        *extra,
    ]


def test_an_empty_checkpoint_under_the_default_io_is_named_before_any_model_loads(tmp_path, monkeypatch):
    """Lightning's own loader says only `EOFError` (no file, no cause) for a 0-byte file."""
    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(EOFError):
        torch.load(empty, weights_only=True)  # what a user would see otherwise
    args = debug_fit_args(tmp_path, "--trainer.plugins", "null", "--ckpt_path", str(empty))
    with pytest.raises(CheckpointError, match=rf"checkpoint {empty}: the file is empty \(0 bytes\)"):
        main(args)


def test_an_empty_last_checkpoint_is_named_for_ckpt_path_last(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    last = tmp_path / "runs" / "debug" / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    last.write_bytes(b"")
    with pytest.raises(CheckpointError, match="checkpoint runs/debug/checkpoints/last.ckpt: the file is empty"):
        main(debug_fit_args(tmp_path, "--ckpt_path", "last"))


def test_text_truncated_and_empty_files_get_their_own_messages(tmp_path):
    text = tmp_path / "notes.ckpt"
    text.write_text("hello, this is not a checkpoint\n")
    with pytest.raises(
        CheckpointError,
        match=r"notes.ckpt: not a torch checkpoint \(torch.save writes a zip archive; this file starts with "
        r"b'hello, t'\)",
    ) as err:
        load_checkpoint_file(str(text))
    assert "Python objects" not in str(err.value)
    whole = tmp_path / "whole.ckpt"
    torch.save({"w": torch.ones(100)}, whole)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(whole.read_bytes()[:300])
    assert zipfile.is_zipfile(whole) and not zipfile.is_zipfile(cut)
    with pytest.raises(
        CheckpointError,
        match=r"cut.ckpt: truncated or not a torch checkpoint \(a zip archive of 300 bytes without its end\)",
    ):
        load_checkpoint_file(str(cut))
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty.ckpt: the file is empty"):
        load_checkpoint_file(str(empty))
    assert torch.equal(load_checkpoint_file(str(whole))["w"], torch.ones(100))


@pytest.mark.parametrize(
    "message",
    [
        "[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file data/3: file write failed",
        "[enforce fail at inline_container.cc:603] . unexpected pos 4480 vs 4374",
    ],
)
def test_a_full_disk_while_saving_names_the_path_and_keeps_the_previous_file(tmp_path, monkeypatch, message):
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1}, str(path))
    before = path.read_bytes()

    def full_disk(obj, handle):
        handle.write(b"PK partial")
        raise RuntimeError(message)

    monkeypatch.setattr(ckpt_io, "write_checkpoint", full_disk)
    with pytest.raises(OSError, match=rf"checkpoint {path}: writing it failed .*the disk may be full") as err:
        AtomicCheckpointIO().save_checkpoint({"step": 2}, str(path))
    assert isinstance(err.value.__cause__, RuntimeError)
    assert path.read_bytes() == before and load_checkpoint_file(str(path)) == {"step": 1}
    assert os.listdir(tmp_path) == ["last.ckpt"]  # the temporary file is gone


def test_other_save_errors_pass_unchanged(tmp_path, monkeypatch):
    def bad_object(obj, handle):
        raise TypeError("cannot pickle 'generator' object")

    monkeypatch.setattr(ckpt_io, "write_checkpoint", bad_object)
    with pytest.raises(TypeError, match="cannot pickle"):
        atomic_torch_save({"step": 2}, str(tmp_path / "last.ckpt"))


# ----------------------------------------------------------------------------- the context window


LONG = "3" * 58 + ">"  # 59 tokens for the built-in character tokenizer; its policy has n_positions=64


@pytest.mark.parametrize(
    "sampling_field, module_kwargs, data_kwargs",
    [
        (
            "model.sampling.max_new_tokens",
            dict(sampling=SamplingConfig(max_new_tokens=6)),  # 59 + 6: one over
            dict(prompts=[LONG] * 2, max_prompt_length=64),
        ),
        (
            "model.val_sampling.max_new_tokens",
            dict(val_sampling=SamplingConfig(max_new_tokens=6, do_sample=False)),
            dict(prompts=["12>"] * 2, val_prompts=[LONG], max_prompt_length=60),
        ),
    ],
)
def test_a_prompt_plus_new_tokens_over_the_context_fails_before_it_is_sampled(
    sampling_field, module_kwargs, data_kwargs
):
    """59 + 6 > 64 would fail in the sampler with `IndexError: index out of range`; it is named before sampling."""
    calls = []

    def counting_reward(prompts, responses, **meta):
        calls.append(len(prompts))
        return [0.0] * len(prompts)

    settings = {"sampling": SamplingConfig(max_new_tokens=4), **module_kwargs}
    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=[counting_reward],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        **settings,
    )
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    datamodule = RolloutDataModule(batch_size=2, **data_kwargs)
    limit = data_kwargs["max_prompt_length"]
    new_tokens = settings[sampling_field.split(".")[1]].max_new_tokens
    expected = (
        rf"this batch's prompt tokens \+ {sampling_field}: 59 \+ {new_tokens} = {59 + new_tokens} tokens, but "
        r"model.policy takes at most 64 \(max_position_embeddings in its config\); lower data.max_prompt_length"
    )
    warning = rf"data.max_prompt_length \+ {sampling_field}: {limit} \+ {new_tokens}"
    with pytest.warns(UserWarning, match=warning), pytest.raises(ConfigError, match=expected):
        trainer.fit(module, datamodule)
    assert calls == []  # nothing was sampled and scored


def test_a_limit_over_the_context_only_warns_when_the_prompts_fit():
    """The default data.max_prompt_length (256) is over the built-in policy's 64 positions, but its prompts are
    short: training runs, with a warning naming the prompt length that would fail."""
    module = make_module()
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    with pytest.warns(UserWarning, match=r"256 \+ 4 = 260 tokens, but model.policy takes at most 64"):
        trainer.fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=2))
    assert trainer.global_step == 1


def test_a_prompt_that_exactly_fills_the_context_trains():
    module = make_module()  # max_new_tokens=4
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*max_new_tokens.*")
        trainer.fit(module, RolloutDataModule(prompts=["3" * 59 + ">"] * 2, batch_size=2, max_prompt_length=60))
    assert trainer.global_step == 1  # 60 + 4 = 64: exactly the window, no warning


# ----------------------------------------------------------------------------- non-finite weights after a step


class OverflowingSGD(torch.optim.SGD):
    """A custom optimizer whose step overflows one weight tensor (finite gradients, non-finite result)."""

    def step(self, closure=None):
        loss = super().step(closure)
        with torch.no_grad():
            self.param_groups[0]["params"][0].fill_(float("inf"))
        return loss


class OverflowingModule(RLHFModule):
    def configure_optimizers(self):
        return OverflowingSGD(list(self.trainable_parameters()), lr=1e-3)


def test_a_step_that_makes_the_weights_non_finite_stops_training(tmp_path):
    module = OverflowingModule(
        policy="builtin:digits",
        reward_fns=[REWARD],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
    )
    expected = r"after optimizer step 1 \(learning rate 0.001\), 1 parameter tensors hold NaN or inf, first "
    with pytest.raises(FloatingPointError, match=expected) as err:
        fit(module, tmp_path / "checkpoints")
    first = next(name for name, p in module.named_parameters() if p.requires_grad)
    assert f"first {first};" in str(err.value)
    assert module.state.policy_version == 0
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()  # the broken weights were never saved
