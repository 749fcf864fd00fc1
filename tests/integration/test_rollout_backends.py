"""The rollout-backend contract: every sampler in the table is a `sampling.backend` value and returns a
post-processed `Generation`; the module syncs a backend to each new policy version before it samples and closes
it at teardown; single-turn, multi-turn, dynamic sampling, overlapped scoring and held-out evaluation all sample
through the backend and nothing else."""

from __future__ import annotations

from typing import ClassVar, get_args

import pytest
import torch

from conftest import make_policy, make_trainer, prompt_batch
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.config import SamplingBackend
from lit_rlhf.rollout.backends import registry
from lit_rlhf.rollout.backends.base import BackendContext
from lit_rlhf.rollout.backends.lean import LeanBackend
from lit_rlhf.rollout.environment import EnvironmentConfig

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"


def test_the_table_holds_every_sampling_backend_value():
    assert sorted(registry.BACKENDS) == sorted(get_args(SamplingBackend))
    for name in registry.BACKENDS:
        assert SamplingConfig(backend=name).backend == name


@pytest.mark.parametrize("name", ["lean", "generate"])  # 'compiled': tests/unit/test_compiled_sampling.py
def test_every_backend_returns_a_post_processed_generation(tokenizer, name):
    policy = make_policy().eval()
    sampling = SamplingConfig(max_new_tokens=5, backend=name)
    backend = registry.make_backend(BackendContext(policy, tokenizer.eos_token_id, tokenizer.pad_token_id, sampling))
    batch = prompt_batch(tokenizer, ["3142>", "90>"])
    torch.manual_seed(0)
    gen = backend.generate(batch, 3, sampling)
    B, P = 6, batch.input_ids.shape[1]
    assert gen.prompt_ids.shape == gen.prompt_mask.shape == (B, P)
    assert torch.equal(gen.prompt_ids[3:], batch.input_ids[1:].expand(3, -1))  # rows b*G .. b*G+G-1: prompt b
    assert gen.response_ids.shape == gen.response_mask.shape and gen.response_ids.shape[0] == B
    for row, mask, truncated in zip(gen.response_ids, gen.response_mask, gen.truncated, strict=True):
        eos = (row == tokenizer.eos_token_id).nonzero()
        end = int(eos[0]) + 1 if len(eos) else row.numel()
        assert mask.tolist() == [True] * end + [False] * (row.numel() - end)
        assert (row[end:] == tokenizer.pad_token_id).all()
        assert bool(truncated) == (len(eos) == 0)
    assert backend.device == torch.device("cpu")


class RecordingBackend(LeanBackend):
    """The lean sampler, recording each call with the module's policy version at that moment."""

    events: ClassVar[list[tuple[str, int]]] = []
    module: ClassVar[RLHFModule | None] = None

    def _record(self, event: str) -> None:
        assert self.module is not None
        self.events.append((event, self.module.state.policy_version))

    def generate(self, prompts, group_size, sampling):
        self._record(f"generate G={group_size}")
        return super().generate(prompts, group_size, sampling)

    def sync_weights(self, policy):
        assert policy is self.module.actor_critic.policy
        self._record("sync")
        super().sync_weights(policy)

    def close(self):
        self._record("close")


@pytest.fixture
def recording(monkeypatch):
    RecordingBackend.events = []
    monkeypatch.setitem(registry.BACKENDS, "lean", RecordingBackend.from_context)
    return RecordingBackend


def fit(module, recording, steps, **data):
    recording.module = module
    settings = dict(prompts="builtin:digits", batch_size=2, max_prompt_length=16) | data
    make_trainer(max_steps=steps, num_sanity_val_steps=0).fit(module, RolloutDataModule(**settings))
    return [event for event, _ in recording.events], recording.events


def test_the_module_syncs_before_each_new_policy_samples_and_closes_at_teardown(tokenizer, recording):
    module = RLHFModule(
        policy=make_policy(), tokenizer=tokenizer, reward_fns=[REWARD], metric_fns=[REWARD],
        algorithm=AlgorithmConfig(group_size=2), sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    names, events = fit(module, recording, steps=4, val_prompts="builtin:digits", val_size=2, rollouts_per_epoch=2)
    # rollout 1 samples the first weights (the backend is built over them); each update is synced before the next
    # rollout; validation at the end of each epoch (2 rollouts) samples the latest weights, one answer per prompt
    assert names == [
        "generate G=2", "sync", "generate G=2",  # epoch 1: versions 0 and 1
        "sync", "generate G=1",  # validation after version 2
        "generate G=2", "sync", "generate G=2",  # epoch 2: versions 2 and 3
        "sync", "generate G=1", "close",  # validation after version 4, then the end of fit
    ]  # fmt: skip
    synced = 0
    for event, version in events:  # every sampling call sees the version most recently synced (0: as built)
        if event == "sync":
            synced = version
        elif event.startswith("generate"):
            assert version == synced


@pytest.mark.parametrize(
    "settings",
    [
        dict(algorithm=AlgorithmConfig(group_size=2, dynamic_sampling=True, kl_coef=0.0)),
        dict(algorithm=AlgorithmConfig(group_size=2), overlap_scoring=True),
        dict(
            algorithm=AlgorithmConfig(group_size=2, kl_coef=0.0),
            environment=EnvironmentConfig("builtin:peek", max_turns=2, max_total_tokens=8),
            reward_fns=None,
        ),
    ],
    ids=["dynamic-sampling", "overlap-scoring", "multi-turn"],
)
def test_every_collection_path_samples_through_the_backend(tokenizer, recording, settings):
    settings = {"reward_fns": ["lit_rlhf.tasks.digits.sorted_exactly"]} | settings
    module = RLHFModule(
        policy=make_policy(), tokenizer=tokenizer, sampling=SamplingConfig(max_new_tokens=2), **settings
    )
    names, _ = fit(module, recording, steps=2)
    assert names[-1] == "close" and names.count("sync") == 1
    generated = [name for name in names if name.startswith("generate")]
    if "environment" in settings:
        assert generated and all(name == "generate G=1" for name in generated)  # one policy turn at a time
    elif settings["algorithm"].dynamic_sampling:
        assert len(generated) > 2  # sorted_exactly ties every group of a random policy: refills were sampled
    else:
        assert generated == ["generate G=2"] * 2


def test_a_rollout_without_a_trainer_builds_its_backend_over_the_policy(tokenizer):
    module = RLHFModule(policy=make_policy(), tokenizer=tokenizer, reward_fns=[REWARD], algorithm={"group_size": 2})
    rollout, _ = module.make_rollout(prompt_batch(tokenizer, ["31>"]))
    assert rollout.batch_size == 2
    backend = module.backend(module.sampling)
    assert isinstance(backend, LeanBackend) and backend.policy is module.actor_critic.policy
    assert module.backend(module.sampling) is backend  # built once
