"""Train with PPO or GRPO from a YAML config: `python train.py fit --config configs/grpo.yaml`."""

from lightning.pytorch.cli import LightningCLI

from lit_rlhf import RLHFModule, RolloutDataModule


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI; `args` replaces sys.argv[1:] (for tests and notebooks)."""
    return LightningCLI(
        RLHFModule,
        RolloutDataModule,
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
        args=args,
    )


if __name__ == "__main__":
    main()
