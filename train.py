"""Train with PPO or GRPO from a YAML config: `python train.py fit --config configs/grpo.yaml`."""

from lightning.pytorch.cli import LightningCLI

from lit_rlhf import RLHFModule, RolloutDataModule


def main() -> None:
    LightningCLI(
        RLHFModule,
        RolloutDataModule,
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
    )


if __name__ == "__main__":
    main()
