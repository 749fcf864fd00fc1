"""Train a reward model from a YAML config: `python -m lit_rlhf.train_reward fit --config configs/reward_model.yaml`.

At the end of fit the model and tokenizer are saved to `model.save_dir`; PPO configs name that folder as
`model.reward_model` (see configs/ppo_reward_model.yaml).
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from lit_rlhf.reward_training import PreferenceDataModule, RewardModelModule


def main(args=None) -> LightningCLI:
    return LightningCLI(
        RewardModelModule,
        PreferenceDataModule,
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
        args=args,
    )


if __name__ == "__main__":
    main()
