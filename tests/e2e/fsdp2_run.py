"""Run a short GRPO fit under `ModelParallelStrategy` (FSDP2) or `ddp` on 2 CPU processes (gloo) and save the
full weights after it. Not a test file: `tests/e2e/test_fsdp2.py` starts both ranks with LOCAL_RANK, MASTER_PORT,
... set (as torchrun would) and compares the weights of the two strategies.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig  # noqa: E402

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter as a full tensor (DTensor shards gathered)."""
    out = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.detach().clone()
    return out


class SaveInitial(L.Callback):
    """The full weights before the first step (rank 0), to check that training moved them."""

    def __init__(self, out: str, strategy: str):
        self.path = os.path.join(out, f"{strategy}_initial.pt")

    def on_train_start(self, trainer, pl_module):
        state = full_state(pl_module.actor_critic)
        if trainer.global_rank == 0:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            torch.save(state, self.path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=("fsdp2", "ddp"), required=True)
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    L.seed_everything(0)
    algorithm = AlgorithmConfig(name="grpo", group_size=2, micro_batch_size=2, kl_coef=0.05)
    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=[REWARD],
        algorithm=algorithm,
        sampling=SamplingConfig(max_new_tokens=5),
        lr=1e-2,
    )
    data = RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16)
    if args.strategy == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo")
    else:
        strategy = "ddp"
    trainer = L.Trainer(
        max_steps=args.rollouts,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.callbacks.append(SaveInitial(args.out, args.strategy))
    start = time.perf_counter()
    trainer.fit(module, data)
    seconds = time.perf_counter() - start
    state = full_state(module.actor_critic)
    os.makedirs(args.out, exist_ok=True)
    if trainer.global_rank == 0:
        torch.save(state, os.path.join(args.out, f"{args.strategy}.pt"))
    record = {"seconds": seconds, "global_step": trainer.global_step}
    with open(os.path.join(args.out, f"{args.strategy}_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
