"""TensorBoard event files hold the metrics of docs/design.md and sample texts."""

import lightning as L
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import make_policy
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig

COMMON = {
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/score_mean",
    "rollout/response_len_mean",
    "rollout/frac_truncated",
    "objective/kl",
    "objective/entropy",
    "policy/loss",
    "policy/approx_kl",
    "policy/clipfrac",
    "optim/lr",
    "optim/grad_norm",
    "time/rollout_s",
    "time/update_s",
    "perf/tokens_per_s",
}
PPO_ONLY = {"value/loss", "value/clipfrac", "value/explained_variance"}
GRPO_ONLY = {"rollout/frac_reward_zero_std"}


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_event_file_holds_design_metrics(tokenizer, tmp_path, name):
    L.seed_everything(0)
    module = RLHFModule(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
        algorithm=AlgorithmConfig(name=name, group_size=2, kl_coef=0.05),
        sampling=SamplingConfig(max_new_tokens=4),
        lr=1e-3,
        log_samples_every_n_steps=1,
    )
    data = RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16)
    logger = TensorBoardLogger(save_dir=tmp_path, name="run")
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(module, data)

    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    expected = COMMON | (PPO_ONLY if name == "ppo" else GRPO_ONLY)
    assert expected <= scalars, f"missing: {sorted(expected - scalars)}"
    # one value per rollout (two rollouts of one optimizer step each)
    assert len(events.Scalars("rollout/reward_mean")) == 2
    # the KL to the reference is live (kl_coef > 0) and finite
    assert all(abs(e.value) < 1e3 for e in events.Scalars("objective/kl"))
    texts = [t for t in events.Tags()["tensors"] if "samples" in t]
    assert texts, "sample prompt/response texts were not logged"


class StepMetrics(L.Callback):
    """Each step's own metrics (`step_metrics`) and the progress-bar reward, as the step ends."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []
        self.progress_bar: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(dict(pl_module.step_metrics))
        self.progress_bar.append(float(trainer.progress_bar_metrics["reward"]))


def test_metrics_written_every_n_steps_are_the_mean_of_the_steps_since_the_last_write(tokenizer, tmp_path):
    L.seed_everything(0)
    module = RLHFModule(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
        algorithm=AlgorithmConfig(name="grpo", group_size=2, kl_coef=0.05),
        sampling=SamplingConfig(max_new_tokens=4),
        lr=1e-2,
        warmup_steps=10,
        log_samples_every_n_steps=0,
    )
    recorder = StepMetrics()
    logger = TensorBoardLogger(save_dir=tmp_path, name="run")
    trainer = L.Trainer(
        max_steps=7,
        accelerator="cpu",
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=3,
        callbacks=[recorder],
    )
    trainer.fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16))
    logger.experiment.flush()

    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    events.Reload()
    steps = recorder.steps
    assert len(steps) == 7
    windows = [steps[0:3], steps[3:6]]  # written after steps 3 and 6; step 7 starts a window never closed
    for key in ("rollout/reward_mean", "policy/loss", "objective/entropy", "time/generate_s"):
        written = [e.value for e in events.Scalars(key)]
        means = [sum(s[key] for s in window) / 3 for window in windows]
        assert written == pytest.approx(means, rel=1e-5, abs=1e-7), key
        assert len({s[key] for s in steps[:3]}) > 1, key  # the window really mixes different values
    # the learning rate (warming up) reports its latest value, not a mean
    assert [e.value for e in events.Scalars("optim/lr")] == pytest.approx([w[-1]["optim/lr"] for w in windows])
    assert [e.value for e in events.Scalars("optim/lr")] == pytest.approx([3e-3, 6e-3])
    # the progress bar shows every step's own reward
    assert recorder.progress_bar == pytest.approx([s["rollout/reward_mean"] for s in steps], rel=1e-6)
