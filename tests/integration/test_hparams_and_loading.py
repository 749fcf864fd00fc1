"""hparams.yaml is plain YAML naming every model and reward; a checkpoint loads (and exports) without the reward
functions it was trained with; a reward model instance is checked when the module is made."""

from __future__ import annotations

import pytest
import torch
import yaml
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from conftest import make_policy, make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.config import ConfigError
from lit_rlhf.rewards.functions import RewardError


def script_reward(prompts, responses, **meta):
    return [float(len(r)) for r in responses]


script_reward.__module__ = "a_training_script_not_importable_here"  # as if defined in a script run as __main__


def module(**kwargs) -> RLHFModule:
    settings = dict(
        policy=make_policy(),
        tokenizer="builtin:digits",
        reward_fns=[script_reward],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
    )
    return RLHFModule(**{**settings, **kwargs})


def fit(m, tmp_path, **kwargs):
    trainer = make_trainer(1, default_root_dir=tmp_path, **kwargs)
    trainer.fit(m, RolloutDataModule(prompts="builtin:digits", batch_size=2))
    return trainer


def test_hparams_yaml_is_safe_yaml_naming_every_model_and_reward(tmp_path):
    m = module()
    fit(m, tmp_path, logger=CSVLogger(tmp_path))
    hparams = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text())
    assert hparams["policy"] == "instance:GPT2LMHeadModel"
    assert hparams["tokenizer"] == "builtin:digits"
    assert hparams["reward_fns"] == ["a_training_script_not_importable_here.script_reward"]
    assert hparams["algorithm"]["group_size"] == 2 and hparams["betas"] == [0.9, 0.999]


def test_a_checkpoint_loads_and_exports_without_its_script_reward_function(tmp_path):
    m = module()
    trainer = fit(m, tmp_path)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    loaded = RLHFModule.load_from_checkpoint(tmp_path / "run.ckpt")  # no reward_fns=...
    loaded.save_policy(str(tmp_path / "exported"))
    assert (tmp_path / "exported" / "config.json").is_file()
    assert loaded.generate(["31 4"])  # generating scores nothing
    with pytest.raises(RewardError, match="not imported.* pass reward_fns="):
        loaded.reward.reward_fns[0](["a"], ["b"])


class NotARewardModel(nn.Module):
    def forward(self, input_ids):
        return input_ids.float().sum(-1)


class LengthRewardModel(nn.Module):
    """The reward-model protocol: score_ids over the policy's token ids."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def score_ids(self, input_ids, attention_mask, last_index):
        return self.scale * last_index.float()


def test_a_reward_model_instance_is_checked_when_the_module_is_made():
    with pytest.raises(ConfigError, match="NotARewardModel is neither kind of reward model.*score_ids"):
        RLHFModule(policy="builtin:digits", reward_model=NotARewardModel())


def test_a_reward_model_following_the_protocol_scores_rollouts(tmp_path):
    m = module(reward_fns=None, reward_model=LengthRewardModel())
    fit(m, tmp_path)
    assert m.step_metrics["rollout/score_mean"] > 0
    assert not m.reward_model.scale.requires_grad  # frozen like every reward model
