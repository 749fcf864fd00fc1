"""Dynamic sampling in a real fit: every rollout keeps its size, refill prompts come from the refill stream, a run
checkpointed mid-way and resumed samples the same next rollouts (prompts and tokens) as the uninterrupted run,
and configs/dapo.yaml runs a few steps through the CLI."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.rollout.dynamic import tied_groups
from lit_rlhf.training.checkpoint_io import AtomicCheckpointIO

ROOT = Path(__file__).resolve().parents[2]
REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"
B0, G, ROUNDS = 2, 4, 3

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*dirpath has changed.*"),
    pytest.mark.filterwarnings("ignore:.*ModelCheckpoint with manual optimization.*"),
    pytest.mark.filterwarnings("ignore:.*LightningCLI's args parameter.*"),
]


class Interrupt(Exception):
    pass


class CrashAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.step:
            raise Interrupt(f"stopped at step {trainer.global_step}")


def make_run(max_steps: int, ckpt_dir: Path, callbacks=()):
    """A GRPO run with dynamic sampling; `seen`: per rollout (rollout number, prompts, response ids, its metrics)."""
    L.seed_everything(0, verbose=False)
    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=[REWARD],
        algorithm=AlgorithmConfig(
            name="grpo", group_size=G, num_minibatches=2, kl_coef=0.0, dynamic_sampling=True, max_sampling_rounds=ROUNDS
        ),
        sampling=SamplingConfig(max_new_tokens=4),
        lr=1e-2,
    )
    data = RolloutDataModule(prompts="builtin:digits", batch_size=B0, max_prompt_length=16)
    seen: list[tuple] = []
    module.on_experience = lambda exp: seen.append(
        (module.state.rollouts_done, list(exp.prompts), exp.response_ids.tolist(), exp.scores.clone())
    )
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[AtomicCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1), *callbacks],
    )
    return module, data, trainer, seen


def test_dynamic_sampling_refills_from_its_own_stream_and_resumes_exactly(tmp_path):
    steps, midway = 10, 4  # 5 rollouts of 2 optimizer steps; interrupted after the second rollout
    module, data, trainer, full = make_run(steps, tmp_path / "full")
    rounds: list[float] = []
    module.log_step = lambda metrics, experience: rounds.append(metrics["rollout/sampling_rounds"])
    trainer.fit(module, data)
    assert [k for k, *_ in full] == [1, 2, 3, 4, 5]
    assert all(len(prompts) == B0 * G for _, prompts, _, _ in full)  # every rollout keeps its size
    assert max(rounds) > 1, "no rollout refilled: the test would not cover the refill stream"
    first, data1, trainer1, _ = make_run(steps, tmp_path / "half", [CrashAt(midway)])
    with pytest.raises(Interrupt):
        trainer1.fit(first, data1)
    resumed, data2, trainer2, second = make_run(steps, tmp_path / "resumed")
    trainer2.fit(resumed, data2, ckpt_path=tmp_path / "half" / f"epoch=0-step={midway}.ckpt")
    assert [k for k, *_ in second] == [3, 4, 5]
    for (k, prompts, ids, scores), (k0, prompts0, ids0, scores0) in zip(second, full[2:], strict=True):
        assert (k, prompts, ids) == (k0, prompts0, ids0)
        assert scores.tolist() == scores0.tolist()
    # the prompts of a refilled rollout that are not its own batch's come from its slots of the refill stream
    main = [row["prompt"] for row in data.stream.rows(0, B0 * 5)]
    for (k, prompts, _, scores), used in zip(full, rounds, strict=True):
        own = main[(k - 1) * B0 : k * B0]
        refill = [row["prompt"] for row in data.refill_stream.rows((k - 1) * (ROUNDS - 1) * B0, (ROUNDS - 1) * B0)]
        refill = refill[: int(used - 1) * B0]
        assert set(prompts) <= set(own) | set(refill), k
        if used > 1:
            assert set(prompts) & set(refill), k
        tied = tied_groups(scores, G)
        assert not tied.any() or used == ROUNDS  # tied groups stay only when the rounds ran out


def test_dapo_config_with_dynamic_sampling_runs_a_few_steps_through_the_cli(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("lit_rlhf_train_script", ROOT / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    overrides = ["--trainer.max_steps", "3", "--trainer.max_time", "null", "--trainer.logger", "false"]
    overrides += ["--trainer.enable_checkpointing", "false", "--trainer.callbacks", "null"]
    overrides += ["--trainer.enable_progress_bar", "false", "--trainer.log_every_n_steps", "1"]
    overrides += ["--data.batch_size", "4", "--trainer.limit_val_batches", "0"]
    cli = train.main(["fit", "--config", str(ROOT / "configs" / "dapo.yaml"), *overrides])
    assert cli.model.algorithm.dynamic_sampling
    assert cli.trainer.global_step == 3
    last = cli.model.step_metrics
    assert 1 <= last["rollout/sampling_rounds"] <= cli.model.algorithm.max_sampling_rounds
    assert 0 <= last["rollout/kept_fraction"] <= 1 and last["rollout/dropped_groups"] >= 0
    assert float(cli.trainer.callback_metrics["rollout/sampling_rounds"]) == last["rollout/sampling_rounds"]
