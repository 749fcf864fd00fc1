"""Every Lightning strategy a CPU runs: `ddp_spawn` sends the module to fresh processes (so everything on it must
pickle, the update's shuffling generator included) and hands the trained weights back."""

from __future__ import annotations

from conftest import checksum, make_policy, make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig

REWARD = ["lit_rlhf.tasks.digits.sort_digits_reward"]


def test_ddp_spawn_trains_on_two_cpu_processes_and_returns_the_weights(tmp_path):
    module = RLHFModule(
        policy=make_policy(),
        tokenizer="builtin:digits",
        reward_fns=REWARD,
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
        lr=1e-2,
    )
    before = checksum(module.actor_critic)
    trainer = make_trainer(1, strategy="ddp_spawn", devices=2, default_root_dir=tmp_path)
    trainer.fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=2))
    assert checksum(module.actor_critic) != before  # the trained weights came back from rank 0
