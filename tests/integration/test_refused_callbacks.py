"""Lightning callbacks that cannot act on an RL step are refused when fit starts, before any model loads, naming
the setting that does the job; TRL's None score gets a pointer."""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import BackboneFinetuning, GradientAccumulationScheduler

from conftest import make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.config import ConfigError
from lit_rlhf.rewards.functions import RewardError, call_reward_fn


@pytest.mark.parametrize(
    ("callback", "says"),
    [
        (BackboneFinetuning(unfreeze_backbone_at_epoch=1), r"BackboneFinetuning .*has none .*model.lora"),
        (GradientAccumulationScheduler({0: 2}), r"GradientAccumulationScheduler .*model.algorithm.micro_batch_size"),
    ],
)
def test_a_callback_that_cannot_act_is_refused_before_the_models_load(callback, says):
    module = RLHFModule(
        policy="builtin:digits",
        reward_fns="lit_rlhf.tasks.digits.sort_digits_reward",
        algorithm=AlgorithmConfig(group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
    )
    data = RolloutDataModule(prompts=["3142>", "907>"], batch_size=2, max_prompt_length=8)
    with pytest.raises(ConfigError, match=r"trainer.callbacks: " + says):
        make_trainer(max_steps=1, callbacks=[callback]).fit(module, data)
    assert module.actor_critic is None  # refused before configure_model


def test_trls_none_score_gets_a_pointer():
    def some_none(completions, **kwargs):
        return [None, 1.0]

    with pytest.raises(RewardError, match=r"element 0 is None .*TRL's None.*is not taken: return a neutral score"):
        call_reward_fn(some_none, ["a", "b"], ["x", "y"], {})
