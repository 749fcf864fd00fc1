"""Nothing silent in the Lightning contract: every training metric is monitorable with the default
`log_every_n_steps`, and an override of a hook the manual update loop never calls is refused."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.config import ConfigError

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"

pytestmark = [pytest.mark.filterwarnings("ignore:.*ModelCheckpoint with manual optimization.*")]


def tiny_module(cls=RLHFModule) -> RLHFModule:
    return cls(
        reward_fns=[REWARD],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
    )


def test_a_checkpoint_monitoring_any_training_metric_saves_with_default_log_every_n_steps(tmp_path):
    L.seed_everything(0, verbose=False)
    data = RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16)
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, monitor="rollout/reward_mean", mode="max", every_n_train_steps=2, save_top_k=1
    )
    trainer = L.Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoint],
    )
    trainer.fit(tiny_module(), data)
    assert checkpoint.best_model_path and list(tmp_path.glob("*.ckpt"))
    assert "rollout/reward_mean" in trainer.callback_metrics and "objective/kl" in trainer.callback_metrics


class OwnStep(RLHFModule):
    def optimizer_step(self, *args, **kwargs):
        raise AssertionError("never called under manual optimisation")


class OwnClipping(RLHFModule):
    def configure_gradient_clipping(self, *args, **kwargs):
        pass


class OwnBackward(RLHFModule):  # still called by manual_backward: allowed
    def backward(self, loss, *args, **kwargs):
        loss.backward(*args, **kwargs)


@pytest.mark.parametrize(
    "cls, hook, instead",
    [
        (OwnStep, "optimizer_step", "override clip_and_step(stats)"),
        (OwnClipping, "configure_gradient_clipping", "set model.algorithm.max_grad_norm"),
    ],
)
def test_overriding_a_hook_the_update_loop_never_calls_is_refused_at_construction(cls, hook, instead):
    with pytest.raises(ConfigError) as info:
        tiny_module(cls)
    message = str(info.value)
    assert f"{cls.__qualname__} overrides {hook}" in message and instead in message


def test_overriding_a_hook_that_is_still_called_is_allowed():
    tiny_module(OwnBackward)
