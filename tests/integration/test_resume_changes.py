"""A resume that would make different rollouts than the checkpoint's run (group size, prompts, rewards, sampling)
says so, setting by setting: a warning by default, an error with `resume_changes: error`; an unchanged resume
says nothing."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from conftest import make_policy
from lit_rlhf import AlgorithmConfig, ConfigError, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.tasks.digits import builtin_tokenizer

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"

pytestmark = [pytest.mark.filterwarnings("ignore:.*ModelCheckpoint with manual optimization.*")]


def fit(tmp_path, steps, ckpt_path=None, group_size=2, max_new_tokens=4, seed=0, **module_settings):
    module = RLHFModule(
        policy=make_policy(),
        tokenizer=builtin_tokenizer(),
        reward_fns=[REWARD],
        algorithm=AlgorithmConfig(group_size=group_size),
        sampling=SamplingConfig(max_new_tokens=max_new_tokens),
        **module_settings,
    )
    data = RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16, seed=seed)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[checkpoints],
    )  # fmt: skip
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return str(tmp_path / "last.ckpt")


def test_a_resume_with_other_rollout_settings_names_each_change(tmp_path):
    last = fit(tmp_path, steps=1)
    with pytest.warns(UserWarning, match="rollouts were made differently") as caught:
        fit(tmp_path, steps=2, ckpt_path=last, group_size=4, max_new_tokens=5, seed=3)
    message = str(next(w.message for w in caught if "made differently" in str(w.message)))
    assert "model.algorithm.group_size: 2 -> 4" in message
    assert "'max_new_tokens': 4" in message and "'max_new_tokens': 5" in message
    assert "data.prompts: builtin:digits, seed 0, shuffled, batch 2 -> builtin:digits, seed 3" in message
    assert "reward_fns" not in message  # unchanged settings are not named


def test_resume_changes_error_refuses_it_and_an_unchanged_resume_is_silent(tmp_path):
    last = fit(tmp_path, steps=1)
    with pytest.raises(ConfigError, match=r"model.algorithm.group_size: 2 -> 4.*Restore them, or set"):
        fit(tmp_path, steps=2, ckpt_path=last, group_size=4, resume_changes="error")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, steps=2, ckpt_path=last, resume_changes="error")
    assert not [w for w in caught if "made differently" in str(w.message)]


def test_resume_changes_is_checked():
    with pytest.raises(ConfigError, match="model.resume_changes: unknown value 'ignore'"):
        RLHFModule(policy=make_policy(), tokenizer=builtin_tokenizer(), reward_fns=[REWARD], resume_changes="ignore")
