"""Checkpoints and resume: an interrupted run resumed from its checkpoint ends exactly where the uninterrupted run
ends (weights and logged metrics); `train.py fit --ckpt_path last`; frozen weights rebuilt from their folder are
left out of checkpoints and put back bit-identical; a SIGKILL while a checkpoint is written leaves the previous
one loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from conftest import checksum
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.training.checkpoint_io import PARTIAL_SUFFIX, AtomicCheckpointIO, CheckpointError, load_checkpoint_file
from lit_rlhf.training.run_folder import LOCK_NAME

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"
ROOT = Path(__file__).resolve().parents[2]
UNTIMED = ("time/", "perf/")  # wall-clock metrics differ between any two runs

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*dirpath has changed.*"),
    pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*"),
    pytest.mark.filterwarnings("ignore:.*LightningCLI's args parameter.*"),
    pytest.mark.filterwarnings("ignore:.*ModelCheckpoint with manual optimization.*"),  # after the step is right
]


class MetricRecorder(Callback):
    """What the Trainer logged after every training batch, keyed by global step."""

    def __init__(self):
        self.by_step: dict[int, dict[str, float]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.by_step[trainer.global_step] = {
            k: float(v) for k, v in trainer.callback_metrics.items() if not k.startswith(UNTIMED)
        }


class Interrupt(Exception):
    pass


class CrashAt(Callback):
    """Stands for a crash: raises before the first batch at or past `step`."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.step:
            raise Interrupt(f"stopped at step {trainer.global_step}")


def make_run(name: str, max_steps: int, ckpt_dir: Path, callbacks=(), backend: str = "lean"):
    L.seed_everything(0, verbose=False)
    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=[REWARD],
        # two minibatches: the update shuffle generator matters; a warm-up + linear decay: the scheduler matters
        algorithm=AlgorithmConfig(name=name, group_size=2, num_minibatches=2, kl_coef=0.05),
        sampling=SamplingConfig(max_new_tokens=4, backend=backend),
        lr=1e-2,
        warmup_steps=2,
        lr_schedule="linear",
    )
    data = RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16)
    recorder = MetricRecorder()
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[AtomicCheckpointIO()],
        log_every_n_steps=1,
        callbacks=[recorder, ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1), *callbacks],
    )
    return module, data, trainer, recorder


@pytest.mark.parametrize("name, backend", [("ppo", "lean"), ("grpo", "lean"), ("grpo", "generate")])
def test_interrupted_run_resumed_from_its_checkpoint_matches_the_uninterrupted_run(tmp_path, name, backend):
    steps, midway = 8, 4  # 4 rollouts of 2 optimizer steps; interrupted after the second rollout
    module, data, trainer, full = make_run(name, steps, tmp_path / "full", backend=backend)
    trainer.fit(module, data)
    assert trainer.global_step == steps

    first, data1, trainer1, _ = make_run(name, steps, tmp_path / "half", [CrashAt(midway)], backend=backend)
    with pytest.raises(Interrupt):
        trainer1.fit(first, data1)
    ckpt = tmp_path / "half" / f"epoch=0-step={midway}.ckpt"
    # the checkpoint is plain data: it loads weights-only, settings included
    raw = torch.load(ckpt, weights_only=True)
    assert raw["hyper_parameters"]["algorithm"]["name"] == name
    assert raw["RolloutDataModule"] == {"prompt_stream": {"rows_consumed": 2 * midway // 2}}

    resumed, data2, trainer2, second = make_run(name, steps, tmp_path / "resumed", backend=backend)
    trainer2.fit(resumed, data2, ckpt_path=ckpt)
    assert trainer2.global_step == steps
    assert checksum(resumed.actor_critic) == checksum(module.actor_critic)
    assert (resumed.state.policy_version, resumed.state.skipped_updates) == (
        module.state.policy_version,
        module.state.skipped_updates,
    )
    assert data2.state_dict() == data.state_dict()
    # every metric the resumed run logged equals the uninterrupted run's at the same step
    assert sorted(second.by_step) == [6, 8]
    for step, logged in second.by_step.items():
        assert logged == full.by_step[step], step
    assert {"rollout/score_mean", "policy/loss", "optim/lr", "optim/grad_norm"} <= set(logged)
    # the learning-rate schedule continued, not restarted: the last rollout's first update (optimizer step 6 of
    # 8) ran at lr 1e-2 x (1 - (6 - 2 warm-up) / (8 - 2)), linear decay to 0 at max_steps
    assert second.by_step[8]["optim/lr"] == pytest.approx(1e-2 * (1 - 4 / 6))


def test_train_py_resumes_with_ckpt_path_last(tmp_path, monkeypatch):
    """`python train.py fit --config configs/debug.yaml --ckpt_path last`, twice: the second run continues."""
    import importlib.util

    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("lit_rlhf_train_script_resume", ROOT / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    common = [
        "fit",
        "--config",
        str(ROOT / "configs" / "debug.yaml"),
        "--ckpt_path",
        "last",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger",
        "false",
        "--model.log_samples_every_n_steps",
        "0",
    ]
    # no checkpoint yet: 'last' starts from scratch (Lightning warns)
    with pytest.warns(UserWarning, match="no last checkpoint"):
        first = train.main([*common, "--trainer.max_steps", "4"])
    last = tmp_path / "runs" / "debug" / "checkpoints" / "last.ckpt"
    assert first.trainer.global_step == 4 and last.is_file()
    assert sorted(os.listdir(last.parent)) == ["last.ckpt"]

    second = train.main([*common, "--trainer.max_steps", "8"])
    assert Path(second.trainer.ckpt_path) == last  # it resumed from the file the first run left
    assert second.trainer.global_step == 8 and second.model.state.policy_version == 8
    saved = torch.load(last, weights_only=True)
    assert saved["global_step"] == 8
    assert saved["RolloutDataModule"] == {"prompt_stream": {"rows_consumed": 8}}  # 2 rollouts x 4 prompts


# ----------------------------------------------------------------------------- what checkpoints carry


def fit_and_checkpoint(module: RLHFModule, ckpt_dir: Path) -> Path:
    data = RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16)
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[AtomicCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=0, save_last=True)],
    )
    trainer.fit(module, data)
    return ckpt_dir / "last.ckpt"


def test_frozen_weights_rebuilt_from_folders_are_left_out_and_put_back(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from lit_rlhf.tasks.digits import builtin_policy, builtin_reward_model, builtin_tokenizer

    torch.manual_seed(0)
    policy_dir, rm_dir = tmp_path / "policy", tmp_path / "reward_model"
    builtin_policy().save_pretrained(policy_dir)  # the built-in architecture, so the sizes compare like for like
    builtin_tokenizer().save_pretrained(policy_dir)
    builtin_reward_model().save_pretrained(rm_dir)
    algorithm = AlgorithmConfig(name="grpo", group_size=2, kl_coef=0.05)  # the KL needs the reference
    sampling = SamplingConfig(max_new_tokens=4)

    # the built-in policy is a random init: its reference cannot be rebuilt, so it stays in the checkpoint
    builtin = RLHFModule(policy="builtin:digits", reward_fns=[REWARD], algorithm=algorithm, sampling=sampling)
    builtin_ckpt = fit_and_checkpoint(builtin, tmp_path / "builtin")
    keys = torch.load(builtin_ckpt, weights_only=True)["state_dict"].keys()
    assert any(k.startswith("reference.") for k in keys)

    # a policy and a reward model named by folder: both frozen models are reloaded from there
    named = RLHFModule(
        policy=str(policy_dir), reward_model=str(rm_dir), reward_fns=[REWARD], algorithm=algorithm, sampling=sampling
    )
    named_ckpt = fit_and_checkpoint(named, tmp_path / "named")
    saved = torch.load(named_ckpt, weights_only=True)
    assert not [k for k in saved["state_dict"] if k.startswith(("reference.", "reward_model."))]
    assert saved["lit_rlhf"]["rebuilt_prefixes"] == ["reference.", "reward_model."]
    policy_params = sum(p.numel() for p in named.actor_critic.parameters())
    sizes = {
        "builtin (reference kept)": builtin_ckpt.stat().st_size,
        "folder (reference and reward model dropped)": named_ckpt.stat().st_size,
    }
    with capsys.disabled():
        print(
            f"\ncheckpoint sizes, policy of {policy_params} parameters: "
            + ", ".join(f"{k}: {v / 1e6:.2f} MB" for k, v in sizes.items())
        )
    # policy + Adam's two moments + reference = 4 copies, against 3 without the reference
    assert sizes["folder (reference and reward model dropped)"] < 0.8 * sizes["builtin (reference kept)"]

    # loading: the module reloads the folders and the checkpoint gives the trained policy
    loaded = RLHFModule.load_from_checkpoint(named_ckpt)
    assert checksum(loaded.actor_critic) == checksum(named.actor_critic)
    from_folder = AutoModelForCausalLM.from_pretrained(policy_dir)
    assert checksum(loaded.reference) == checksum(from_folder)  # bit-identical to the folder's weights
    assert checksum(loaded.reward_model.model) == checksum(
        AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1)
    )
    # the trained policy really moved away from the folder's weights it started from
    assert checksum(loaded.actor_critic.policy) != checksum(from_folder)

    # and the Trainer resumes from it
    resumed = RLHFModule(
        policy=str(policy_dir), reward_model=str(rm_dir), reward_fns=[REWARD], algorithm=algorithm, sampling=sampling
    )
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(
        resumed, RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16), ckpt_path=named_ckpt
    )
    assert trainer.global_step == 2 and checksum(resumed.reference) == checksum(from_folder)


# ----------------------------------------------------------------------------- SIGKILL


KILLED_TRAINER = textwrap.dedent(
    """
    import io, os, sys, time
    import torch
    torch.set_num_threads(1)
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    import lit_rlhf.training.checkpoint_io as ckpt_io
    from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig

    out, slow_save = sys.argv[1], int(sys.argv[2])
    saves = []
    write = ckpt_io.write_checkpoint

    def slow_write(obj, handle):  # the `slow_save`-th save writes half the file, then stalls until killed
        saves.append(obj["global_step"])
        if len(saves) < slow_save:
            return write(obj, handle)
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = buffer.getvalue()
        handle.write(data[: len(data) // 2])
        handle.flush()
        with open(os.path.join(out, "WRITING"), "w") as marker:
            marker.write(str(obj["global_step"]))
        time.sleep(300)
        handle.write(data[len(data) // 2 :])

    ckpt_io.write_checkpoint = slow_write
    L.seed_everything(0)
    module = RLHFModule(policy="builtin:digits", reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
                        algorithm=AlgorithmConfig(name="grpo", group_size=2), sampling=SamplingConfig(max_new_tokens=4))
    trainer = L.Trainer(max_steps=100, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[ckpt_io.AtomicCheckpointIO()],
                        callbacks=[ModelCheckpoint(dirpath=os.path.join(out, "checkpoints"), every_n_train_steps=1,
                                                   save_top_k=0, save_last=True)])
    trainer.fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16))
    """
)


def test_sigkill_while_a_checkpoint_is_written_leaves_the_previous_one_loadable(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_TRAINER, str(tmp_path), "3"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    marker = tmp_path / "WRITING"
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(f"the training process ended before the slow save: {proc.stderr.read().decode()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail("the training process never reached the slow save")
            time.sleep(0.1)
        time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)  # in the middle of writing the 3rd last.ckpt
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    assert marker.read_text() == "3"
    ckpt_dir = tmp_path / "checkpoints"
    files = sorted(f for f in os.listdir(ckpt_dir) if f != LOCK_NAME)
    partial = [f for f in files if f != "last.ckpt" and not f.endswith(PARTIAL_SUFFIX)]
    assert f"{partial[0]}{PARTIAL_SUFFIX}" in files  # the library's marker beside its temporary file
    assert files[0] == "last.ckpt" and len(partial) == 1 and partial[0].startswith("last.ckpt.tmp-")
    # the previous checkpoint is whole and loads weights-only
    previous = load_checkpoint_file(str(ckpt_dir / "last.ckpt"))
    assert previous["global_step"] == 2
    # the half-written file is never mistaken for a checkpoint, and reading it says what is wrong
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint_file(str(ckpt_dir / partial[0]))

    # `ckpt_path="last"` picks the intact file and training continues from step 2
    L.seed_everything(0, verbose=False)
    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=[REWARD],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
    )
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[AtomicCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=0, save_last=True)],
    )
    trainer.fit(
        module, RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16), ckpt_path="last"
    )
    assert Path(trainer.ckpt_path) == ckpt_dir / "last.ckpt"
    assert trainer.global_step == 3 and module.state.policy_version == 3
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=True)["global_step"] == 3


def test_a_resumed_command_line_run_logs_into_the_version_of_the_run_it_resumes(tmp_path, monkeypatch):
    """`fit --ckpt_path last` twice with the config's TensorBoard logger: one version folder holds both runs'
    metrics, instead of a new folder splitting the curves. debug.yaml takes 4 optimizer steps per rollout, so
    each run is one rollout, logged at Lightning's batch step: 0, then 1 in the resumed run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lit_rlhf.cli import main

    monkeypatch.chdir(tmp_path)
    common = ["fit", "--config", str(ROOT / "configs" / "debug.yaml"), "--ckpt_path", "last"]
    common += ["--trainer.enable_progress_bar", "false", "--model.log_samples_every_n_steps", "0"]
    with pytest.warns(UserWarning, match="no last checkpoint"):
        main([*common, "--trainer.max_steps", "4"])
    main([*common, "--trainer.max_steps", "8"])
    versions = sorted(p.name for p in (tmp_path / "runs" / "debug").iterdir() if p.name.startswith("version_"))
    assert versions == ["version_0"]
    steps = set()
    for events in (tmp_path / "runs" / "debug" / "version_0").glob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        steps |= {event.step for event in accumulator.Scalars("rollout/reward_mean")}
    assert steps == {0, 1}


def test_a_resumed_run_gets_its_whole_max_time(tmp_path):
    """A checkpoint restores the Timer's elapsed time; the resumed process still gets all of `max_time` (here a
    checkpoint that says 61 of 60 minutes were used would otherwise stop the resumed run at once)."""

    def fit(max_steps: int, ckpt_path: str | None = None) -> L.Trainer:
        L.seed_everything(0, verbose=False)
        module = RLHFModule(
            policy="builtin:digits",
            reward_fns=[REWARD],
            algorithm=AlgorithmConfig(name="grpo", group_size=2),
            sampling=SamplingConfig(max_new_tokens=4),
        )
        trainer = L.Trainer(
            max_steps=max_steps,
            max_time={"minutes": 60},
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)],
        )
        trainer.fit(module, RolloutDataModule(batch_size=4, max_prompt_length=16), ckpt_path=ckpt_path)
        return trainer

    assert fit(2).global_step == 2
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    (timer_key,) = [key for key in checkpoint["callbacks"] if key.startswith("Timer")]
    assert checkpoint["callbacks"][timer_key]["time_elapsed"]["train"] < 60
    checkpoint["callbacks"][timer_key]["time_elapsed"]["train"] = 61 * 60.0
    torch.save(checkpoint, tmp_path / "out_of_time.ckpt")
    assert fit(4, str(tmp_path / "out_of_time.ckpt")).global_step == 4
