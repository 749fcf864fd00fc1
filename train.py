"""Train with PPO or GRPO from a YAML config: `python train.py fit --config configs/grpo.yaml`
(the same as the console script `lit-rlhf fit --config configs/grpo.yaml`)."""

from lit_rlhf.cli import main, main_script

__all__ = ["main", "main_script"]  # `main(args)` returns the LightningCLI (notebooks and tests)

if __name__ == "__main__":
    main_script()
