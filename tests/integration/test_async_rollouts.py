"""Asynchronous rollouts (`algorithm.max_staleness: k`): each step trains on the prompts the synchronous loop
would, sampled with the weights of k updates earlier (checked against a forward of those saved weights), corrected
by TIS; a resumed run trains on exactly the rollouts the stopped run would have; a producer error reaches `fit`
with its type; no producer thread outlives `fit`; dynamic sampling, multi-turn and skipping dataloaders keep their
semantics; the settings it cannot run with are refused before any model loads."""

from __future__ import annotations

import threading

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from conftest import checksum, full_logprobs, make_trainer
from lit_rlhf import AlgorithmConfig, ConfigError, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.rewards.functions import RewardError
from lit_rlhf.rollout.dynamic import refill_position
from lit_rlhf.rollout.environment import EnvironmentConfig
from lit_rlhf.tasks.digits import builtin_policy, sort_digits_reward
from lit_rlhf.training.rollouts import IN_FLIGHT_KEY

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"
PRODUCER = "lit_rlhf-rollout-producer"


class Recording(RLHFModule):
    """Keeps every experience's prompts, tokens, sampler log-probs and policy version."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[dict] = []

    def on_experience(self, experience):
        self.seen.append(
            {
                "prompts": list(dict.fromkeys(experience.prompts)),
                "input_ids": experience.input_ids().clone(),
                "attention_mask": experience.attention_mask().clone(),
                "response_ids": experience.response_ids.clone(),
                "response_mask": experience.response_mask.clone(),
                "sampler_logprobs": experience.sampler_logprobs,
                "policy_version": experience.policy_version,
            }
        )


class WeightsAndMetrics(Callback):
    """The policy's weights at the start of every step, and the metrics logged after it."""

    def __init__(self):
        self.weights: list[dict[str, torch.Tensor]] = []
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.weights.append({k: v.detach().clone() for k, v in pl_module.actor_critic.policy.state_dict().items()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def module_and_data(k: int, **options):
    L.seed_everything(0, verbose=False)
    algorithm = {"name": "grpo", "group_size": 2, "max_staleness": k, **options.pop("algorithm", {})}
    module = Recording(
        policy="builtin:digits",
        reward_fns=options.pop("reward_fns", [REWARD]),
        algorithm=AlgorithmConfig(**algorithm),
        sampling=SamplingConfig(max_new_tokens=4),
        lr=1e-2,
        log_samples_every_n_steps=0,
        **options,
    )
    return module, RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16)


def producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == PRODUCER]


@pytest.mark.parametrize("k", [1, 2])
def test_each_step_trains_the_synchronous_prompts_sampled_k_updates_earlier(k):
    steps = 5
    sync, sync_data = module_and_data(0)
    make_trainer(steps).fit(sync, sync_data)
    module, data = module_and_data(k)
    record = WeightsAndMetrics()
    make_trainer(steps, callbacks=[record]).fit(module, data)

    assert [s["prompts"] for s in module.seen] == [s["prompts"] for s in sync.seen]  # the same prompts, in order
    policy = builtin_policy().eval()
    for step, seen in enumerate(module.seen):
        sampled_at = max(0, step - k)  # one optimizer update per step here
        assert seen["policy_version"] == sampled_at
        assert record.metrics[step]["async/staleness"] == step - sampled_at
        # the behaviour log-probs are those of the weights of step `sampled_at`, recomputed here independently
        policy.load_state_dict(record.weights[sampled_at])
        mask = seen["attention_mask"]
        with torch.no_grad():
            logits = policy(
                input_ids=seen["input_ids"], attention_mask=mask, position_ids=mask.cumsum(1).sub(1).clamp(min=0)
            ).logits
        width = seen["response_ids"].shape[1]
        expected = full_logprobs(logits[:, -width - 1 : -1], seen["response_ids"]).float() * seen["response_mask"]
        torch.testing.assert_close(seen["sampler_logprobs"], expected, atol=2e-5, rtol=0)
    assert record.metrics[-1]["policy/tis_weight_mean"] > 0  # the correction ran
    assert not producer_threads()  # rollouts still queued at the end of fit: dropped, the thread is gone


def test_held_out_evaluation_during_fit_answers_with_the_live_weights():
    """Validation at the end of the last step shares the producer's (paused) sampler, which holds older weights
    for the rollouts it sampled ahead: it must answer with the weights of that moment, as a later `validate`
    does."""
    module, _ = module_and_data(1, metric_fns=[REWARD])
    data = RolloutDataModule(
        prompts="builtin:digits", batch_size=2, max_prompt_length=16, val_prompts="builtin:digits", val_size=20
    )
    data.rollouts_per_epoch = 3
    answered_with: list[tuple[str, str]] = []

    class SamplerWeights(Callback):
        def on_validation_batch_end(self, trainer, pl_module, *args):
            if trainer.training or pl_module._async is not None:  # during fit (not the `validate` below)
                answered_with.append((checksum(pl_module._async.sampler), checksum(pl_module.actor_critic.policy)))

    trainer = make_trainer(3, num_sanity_val_steps=0, callbacks=[SamplerWeights()])
    trainer.fit(module, data)
    assert answered_with and all(sampler == live for sampler, live in answered_with)
    during = float(trainer.callback_metrics["val/sort_digits_reward"])
    after = trainer.validate(module, data, verbose=False)[0]["val/sort_digits_reward"]
    assert during == pytest.approx(after, abs=1e-6)


class Interrupt(Exception):
    pass


class CrashAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.step:
            raise Interrupt(f"stopped at step {trainer.global_step}")


def test_a_resumed_run_trains_on_exactly_the_rollouts_the_stopped_run_would_have(tmp_path):
    steps, stop, k = 6, 3, 2
    full, data = module_and_data(k)
    make_trainer(steps).fit(full, data)

    first, data1 = module_and_data(k)
    saving = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last=True, save_top_k=0)
    trainer1 = make_trainer(steps, enable_checkpointing=True, callbacks=[saving, CrashAt(stop)])
    with pytest.raises(Interrupt):
        trainer1.fit(first, data1)
    assert trainer1.global_step == stop and not producer_threads()
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert [r["index"] for r in saved[IN_FLIGHT_KEY]] == [stop, stop + 1]  # sampled ahead, kept
    assert [r["weights_step"] for r in saved[IN_FLIGHT_KEY]] == [stop - 2, stop - 1]

    resumed, data2 = module_and_data(k)
    make_trainer(steps).fit(resumed, data2, ckpt_path=tmp_path / "last.ckpt")
    for before, after in zip(full.seen[stop:], resumed.seen, strict=True):
        assert torch.equal(before["response_ids"], after["response_ids"])
        assert before["policy_version"] == after["policy_version"]
    assert checksum(resumed.actor_critic) == checksum(full.actor_critic)


class RewardBroke(Exception):
    pass


def breaks_on_third_call():
    calls = {"n": 0}

    def reward(prompts, responses, **meta):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RewardBroke("the grader's database went away")
        return sort_digits_reward(prompts, responses)

    return reward


@pytest.mark.parametrize("k", [0, 1])
def test_a_producer_error_reaches_fit_as_the_synchronous_loop_raises_it_and_no_thread_survives(k):
    module, data = module_and_data(k, reward_fns=[breaks_on_third_call()])
    with pytest.raises(RewardError, match="raised RewardBroke: the grader's database went away") as raised:
        make_trainer(6).fit(module, data)
    assert isinstance(raised.value.__cause__, RewardBroke)
    assert not producer_threads()


def test_dynamic_sampling_refills_from_the_synchronous_slots():
    """Each rollout holds groups of its own training batch or of its own refill slots (read on the training thread
    at the positions the synchronous loop reads), never another step's."""
    rounds, batch = 3, 2
    module, data = module_and_data(1, algorithm={"dynamic_sampling": True, "max_sampling_rounds": rounds})
    make_trainer(4).fit(module, data)
    for step, seen in enumerate(module.seen):
        allowed = set(data.batches_after(0, step + 1)[step].texts)
        for j in range(1, rounds):
            allowed |= set(data.refill_batch(refill_position(step + 1, j, rounds, batch)).texts)
        assert set(seen["prompts"]) <= allowed, step
    assert not producer_threads()


def test_multi_turn_rollouts_run_ahead_with_the_environment():
    steps = 3
    environment = EnvironmentConfig("builtin:peek", max_turns=2, max_total_tokens=8)
    sync, sync_data = module_and_data(0, environment=environment, algorithm={"kl_coef": 0.0})
    make_trainer(steps).fit(sync, sync_data)
    module, data = module_and_data(1, environment=environment, algorithm={"kl_coef": 0.0})
    make_trainer(steps).fit(module, data)
    assert [s["prompts"] for s in module.seen] == [s["prompts"] for s in sync.seen]
    assert [s["policy_version"] for s in module.seen] == [0, 0, 1]
    assert not producer_threads()


def test_a_dataloader_that_skips_batches_restarts_the_pipeline_on_the_right_prompts():
    """`limit_train_batches` cuts each epoch of 4 batches to 2: the third step's prompts are not the ones read
    ahead, so the rollouts in flight are dropped (with a warning) and the step samples its own prompts."""
    sync, sync_data = module_and_data(0)
    sync_data.rollouts_per_epoch = 4
    make_trainer(4, limit_train_batches=2).fit(sync, sync_data)
    module, data = module_and_data(1)
    data.rollouts_per_epoch = 4
    with pytest.warns(UserWarning, match="differ from those read ahead"):
        make_trainer(4, limit_train_batches=2).fit(module, data)
    assert [s["prompts"] for s in module.seen] == [s["prompts"] for s in sync.seen]
    assert [s["policy_version"] for s in module.seen] == [0, 0, 2, 2]  # a fresh start at step 2


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"sampling": SamplingConfig(backend="generate")}, "model.sampling.backend: 'generate' cannot sample"),
        ({"sampling": SamplingConfig(backend="compiled")}, "model.sampling.backend: 'compiled' cannot sample"),
        ({"overlap_scoring": True}, "model.overlap_scoring: true with algorithm.max_staleness: 1"),
    ],
)
def test_settings_that_cannot_run_asynchronously_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        RLHFModule(reward_fns=[REWARD], algorithm=AlgorithmConfig(name="grpo", max_staleness=1), **settings)


def test_async_without_a_rollout_datamodule_is_refused_before_the_models_load():
    from conftest import prompt_batch
    from lit_rlhf.tasks.digits import builtin_tokenizer

    module = RLHFModule(reward_fns=[REWARD], algorithm=AlgorithmConfig(name="grpo", group_size=2, max_staleness=1))
    batches = [prompt_batch(builtin_tokenizer(), ["123>"])]
    with pytest.raises(ConfigError, match="algorithm.max_staleness: 1 samples the next prompts ahead"):
        make_trainer(2).fit(module, train_dataloaders=batches)
    assert module.actor_critic is None


def test_max_staleness_fills_in_the_tis_cap_and_is_checked():
    assert AlgorithmConfig(name="grpo", max_staleness=1).tis_cap == 2.0
    assert AlgorithmConfig(name="grpo", max_staleness=1, tis_cap=4.0).tis_cap == 4.0
    assert AlgorithmConfig(name="grpo").tis_cap is None
    with pytest.raises(ConfigError, match="algorithm.max_staleness"):
        AlgorithmConfig(name="grpo", max_staleness=-1)


def test_async_under_fsdp2_is_refused_naming_the_strategy():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import ModelParallelStrategy

    module, _ = module_and_data(1)
    module.prompt_supply = object()  # a RolloutDataModule's supply: only FSDP2 is in the way
    trainer = SimpleNamespace(strategy=ModelParallelStrategy())
    with pytest.raises(ConfigError, match=r"ModelParallelStrategy \(FSDP2\) shards"):
        module.check_async_fit(trainer)
    module.check_async_fit(SimpleNamespace(strategy=L.pytorch.strategies.DDPStrategy()))
