"""TensorBoard event files hold the DESIGN §4 metrics and sample texts."""

import pytest
import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import make_policy
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig

COMMON = {
    "rollout/reward_mean", "rollout/reward_std", "rollout/score_mean", "rollout/response_len_mean",
    "rollout/frac_truncated", "objective/kl", "objective/entropy", "policy/loss", "policy/approx_kl",
    "policy/clipfrac", "optim/lr", "optim/grad_norm", "time/rollout_s", "time/update_s", "perf/tokens_per_s",
}
PPO_ONLY = {"value/loss", "value/clipfrac", "value/explained_variance"}
GRPO_ONLY = {"rollout/frac_reward_zero_std"}


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_event_file_holds_design_metrics(tokenizer, tmp_path, name):
    L.seed_everything(0)
    module = RLHFModule(
        policy=make_policy(), tokenizer=tokenizer, reward_fns=["lit_rlhf.builtin.sort_digits_reward"],
        algorithm=AlgorithmConfig(name=name, group_size=2, kl_coef=0.05),
        sampling=SamplingConfig(max_new_tokens=4), lr=1e-3, log_samples_every_n_steps=1,
    )
    data = RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16)
    logger = TensorBoardLogger(save_dir=tmp_path, name="run")
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
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
