"""Train a reward model from a YAML config: `python train_reward.py fit --config configs/reward_model.yaml`
(the same as `python -m lit_rlhf.train_reward ...`)."""

from lit_rlhf.train_reward import main

if __name__ == "__main__":
    main()
