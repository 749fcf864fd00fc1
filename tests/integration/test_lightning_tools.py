"""Lightning's own tools on an RLHFModule: the LR finder and a compiled module are refused before anything runs,
`overfit_batches` pins the batches, a checkpoint written by an exception inside a step resumes into that step
(resumed == uninterrupted), and a ModelCheckpoint counting optimizer steps is checked against a rollout's."""

from __future__ import annotations

import time
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.tuner import Tuner

from conftest import checksum, make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.config import ConfigError
from lit_rlhf.tasks.digits import sort_digits_reward
from lit_rlhf.training.checkpoint_io import AtomicCheckpointIO

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*ModelCheckpoint with manual optimization.*"),
    pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*"),
]


def make_module(reward=sort_digits_reward, **algorithm):
    L.seed_everything(0, verbose=False)
    settings = {"name": "grpo", "group_size": 2, "num_minibatches": 2, **algorithm}
    return RLHFModule(
        policy="builtin:digits",
        reward_fns=[reward],
        algorithm=AlgorithmConfig(**settings),
        sampling=SamplingConfig(max_new_tokens=4),
        lr=1e-2,
    )


def make_data():
    return RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16, seed=0)


class Batches(Callback):
    """The prompt texts of every training batch."""

    def __init__(self):
        self.texts: list[list[str]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.texts.append(list(batch.texts))


def test_lr_find_is_refused_before_any_model_loads():
    module = make_module()
    trainer = make_trainer(max_steps=4)
    with pytest.raises(ConfigError, match="LearningRateFinder .*Tuner.*lr_find.*reads the loss.*model.lr"):
        Tuner(trainer).lr_find(module, datamodule=make_data())
    assert module.actor_critic is None  # refused before configure_model


def test_a_compiled_module_is_refused_at_once():
    module = make_module()
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"torch.compile\(module\).*sampling.backend: compiled"):
        make_trainer(max_steps=2).fit(torch.compile(module), make_data())
    assert time.perf_counter() - start < 30  # no compiling happened
    assert module.actor_critic is None


def test_overfit_batches_trains_on_the_same_batch_every_epoch():
    batches = Batches()
    trainer = make_trainer(max_steps=-1, max_epochs=3, overfit_batches=1, callbacks=[batches], num_sanity_val_steps=0)
    trainer.fit(make_module(), make_data())
    first_of_a_plain_run = Batches()
    make_trainer(max_steps=2, callbacks=[first_of_a_plain_run]).fit(make_module(), make_data())
    assert len(batches.texts) == 3
    assert batches.texts == [first_of_a_plain_run.texts[0]] * 3


class RewardFailsOnce:
    """sort_digits_reward, raising at its `at`-th call the first time it gets there."""

    def __init__(self, at: int):
        self.at, self.calls, self.failed = at, 0, False

    def __call__(self, prompts, responses, **meta):
        self.calls += 1
        if self.calls == self.at and not self.failed:
            self.failed = True
            raise RuntimeError("reward service down")
        return sort_digits_reward(prompts, responses, **meta)


def fit(module, steps, callbacks=(), ckpt_path=None, data=None):
    trainer = make_trainer(
        max_steps=steps, callbacks=list(callbacks), plugins=[AtomicCheckpointIO()], enable_checkpointing=bool(callbacks)
    )
    trainer.fit(module, data or make_data(), ckpt_path=ckpt_path)
    return trainer


def test_a_checkpoint_from_an_exception_inside_a_step_resumes_into_that_step(tmp_path):
    steps = 8  # 4 rollouts of 2 optimizer steps
    full = make_module()
    fit(full, steps)

    failing = RewardFailsOnce(at=3)  # the third rollout's reward raises
    interrupted = make_module(reward=failing)
    with pytest.raises(RuntimeError, match="reward service down"):
        fit(interrupted, steps, [OnExceptionCheckpoint(dirpath=tmp_path, filename="on_exception")])
    ckpt = tmp_path / "on_exception.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert saved["global_step"] == 4  # the weights after two rollouts ...
    assert saved["lit_rlhf"]["rollouts_done"] == 2  # ... and the counters ...
    assert saved["RolloutDataModule"] == {"prompt_stream": {"rows_consumed": 2 * 2}}  # ... and the prompts with them

    resumed = make_module(reward=failing)
    trainer = fit(resumed, steps, ckpt_path=ckpt)
    assert trainer.global_step == steps
    assert resumed.state.rollouts_done == full.state.rollouts_done == 4
    assert checksum(resumed.actor_critic) == checksum(full.actor_critic)


@pytest.mark.parametrize(("every", "warned"), [(3, True), (4, False), (2, False)])
def test_a_step_counting_checkpoint_is_checked_against_a_rollouts_optimizer_steps(tmp_path, every, warned):
    module = make_module(ppo_epochs=1, num_minibatches=2)  # 2 optimizer steps per rollout
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every, save_top_k=-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(max_steps=12, callbacks=[checkpoints], enable_checkpointing=True).fit(module, make_data())
    messages = [str(w.message) for w in caught if "counts optimizer steps" in str(w.message)]
    saved = sorted(int(p.stem.split("step=")[1]) for p in tmp_path.glob("*.ckpt"))
    if warned:
        assert len(messages) == 1
        assert "Use a multiple of 2" in messages[0] and "saves every 6 optimizer steps" in messages[0]
        assert saved == [6, 12]  # what the warning said: every lcm(3, 2) = 6, not every 3
    else:
        assert messages == []
        assert saved == list(range(every, 13, every))


@pytest.mark.parametrize(("max_steps", "ends_at"), [(3, 4), (4, 4)])
def test_max_steps_that_is_not_a_multiple_of_a_rollouts_steps_is_warned(max_steps, ends_at):
    module = make_module(ppo_epochs=1, num_minibatches=2)  # 2 optimizer steps per rollout
    trainer = make_trainer(max_steps=max_steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, make_data())
    messages = [str(w.message) for w in caught if str(w.message).startswith("trainer.max_steps")]
    assert trainer.global_step == ends_at  # a rollout's 2 steps are never cut
    if max_steps % 2:
        assert len(messages) == 1 and "the run ends at step 4 (2 rollouts). Use a multiple of 2" in messages[0]
    else:
        assert messages == []
