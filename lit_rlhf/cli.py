"""Command lines from YAML configs, through LightningCLI (`fit`, `validate`, ... and `--print_config`).

lit-rlhf fit --config configs/grpo.yaml                  # PPO / GRPO (also: python train.py ...)
lit-rlhf-reward fit --config configs/reward_model.yaml   # a reward model on preference pairs
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from lit_rlhf.data.datamodule import RolloutDataModule
from lit_rlhf.rewards.training import PreferenceDataModule, RewardModelModule
from lit_rlhf.training.module import RLHFModule


def main(args: list[str] | None = None) -> LightningCLI:
    """PPO/GRPO training; `args` replaces sys.argv[1:] (for tests and notebooks)."""
    return LightningCLI(
        RLHFModule, RolloutDataModule, save_config_kwargs={"overwrite": True}, seed_everything_default=0, args=args
    )


def reward_main(args: list[str] | None = None) -> LightningCLI:
    """Reward-model training; `args` replaces sys.argv[1:]."""
    return LightningCLI(
        RewardModelModule,
        PreferenceDataModule,
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
        args=args,
    )


if __name__ == "__main__":
    main()
