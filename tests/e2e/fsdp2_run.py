"""Run a short GRPO or PPO fit under `ModelParallelStrategy` (FSDP2) or `ddp` on 2 CPU processes (gloo) and save
the full weights after it (`<out>/<tag>.pt`, `<tag>` defaulting to the strategy). Not a test file:
`tests/e2e/test_fsdp2.py` starts both ranks with LOCAL_RANK, MASTER_PORT, ... set (as torchrun would).

--checkpoints DIR saves a checkpoint after every step (FSDP2: a distributed checkpoint folder per step),
--resume PATH resumes from one, --export DIR adds a `SavePolicy(DIR)` callback (--adapter-export DIR: one with
merge_lora=False), --lora trains LoRA adapters (the reference: the policy with the adapters off).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

from lit_rlhf import AlgorithmConfig, AtomicCheckpointIO, RLHFModule, RolloutDataModule, SamplingConfig, SavePolicy  # noqa: E402
from lit_rlhf.cli import leave_process_group  # noqa: E402
from lit_rlhf.config import ConfigError  # noqa: E402
from lit_rlhf.training import rank0_weights  # noqa: E402

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

    def __init__(self, out: str, tag: str):
        self.path = os.path.join(out, f"{tag}_initial.pt")

    def on_train_start(self, trainer, pl_module):
        state = full_state(pl_module.actor_critic)
        if trainer.global_rank == 0:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            torch.save(state, self.path)


def count_policy_loads() -> list[str]:
    """Record each model this rank loads with weights under FSDP2 (rank 0 alone should)."""
    loads: list[str] = []
    load = rank0_weights.load_causal_lm

    def counted(spec, field, *args, **kwargs):
        loads.append(field)
        return load(spec, field, *args, **kwargs)

    rank0_weights.load_causal_lm = counted
    return loads


def validate(trainer: L.Trainer, module: RLHFModule) -> dict:
    """Held-out answers on 4 prompts (2 batches of 1 per rank), then on 3 (2 batches on rank 0, 1 on rank 1:
    refused under FSDP2, where each batch gathers the policy)."""
    out: dict = {}
    for prompts in (["312>", "9051>", "77>", "4820>"], ["312>", "9051>", "77>"]):
        data = RolloutDataModule(prompts="builtin:digits", val_prompts=prompts, val_batch_size=1, max_prompt_length=16)
        try:
            (metrics,) = trainer.validate(module, datamodule=data, verbose=False)
            out[str(len(prompts))] = {"val/reward_mean": metrics["val/reward_mean"]}
        except ConfigError as err:
            out[str(len(prompts))] = {"error": str(err)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=("fsdp2", "ddp"), required=True)
    parser.add_argument("--algorithm", choices=("grpo", "ppo"), default="grpo")
    parser.add_argument("--policy", default="builtin:digits", help="a name or folder (its reference is rebuilt)")
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--tag", help="the output files' name (default: the strategy)")
    parser.add_argument("--checkpoints", help="save a checkpoint after every step into this folder")
    parser.add_argument("--resume", help="a checkpoint to resume from")
    parser.add_argument("--export", help="a SavePolicy folder")
    parser.add_argument("--adapter-export", help="a SavePolicy folder of the LoRA adapters (merge_lora=False)")
    parser.add_argument("--validate", action="store_true", help="after the fit, validate on 4 prompts, then on 3")
    parser.add_argument("--full-checkpoints", action="store_true", help="FSDP2: full checkpoints, AtomicCheckpointIO")
    parser.add_argument(
        "--lora", action="store_true", help="train LoRA adapters (r 4, alpha 8) instead of every weight"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tag = args.tag or args.strategy
    L.seed_everything(0)
    loads = count_policy_loads()
    algorithm = AlgorithmConfig(name=args.algorithm, group_size=2, micro_batch_size=2, kl_coef=0.05)
    module = RLHFModule(
        policy=args.policy,
        reward_fns=[REWARD],
        algorithm=algorithm,
        sampling=SamplingConfig(max_new_tokens=5),
        lr=1e-2,
        lora={"r": 4, "alpha": 8} if args.lora else None,
    )
    data = RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16)
    if args.strategy == "fsdp2":
        strategy = ModelParallelStrategy(
            data_parallel_size=2,
            tensor_parallel_size=1,
            process_group_backend="gloo",
            save_distributed_checkpoint=not args.full_checkpoints,
        )
    else:
        strategy = "ddp"
    callbacks: list[L.Callback] = [SaveInitial(args.out, tag)]
    if args.checkpoints:
        callbacks.append(ModelCheckpoint(dirpath=args.checkpoints, every_n_train_steps=1, save_top_k=-1))
    if args.export:
        callbacks.append(SavePolicy(args.export))
    if args.adapter_export:
        callbacks.append(SavePolicy(args.adapter_export, merge_lora=False))
    trainer = L.Trainer(
        max_steps=args.rollouts,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_checkpointing=bool(args.checkpoints),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()] if args.full_checkpoints else None,
    )
    start = time.perf_counter()
    trainer.fit(module, data, ckpt_path=args.resume)
    seconds = time.perf_counter() - start
    state = full_state(module.actor_critic)
    os.makedirs(args.out, exist_ok=True)
    if trainer.global_rank == 0:
        torch.save(state, os.path.join(args.out, f"{tag}.pt"))
    optimized = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
    record: dict = {
        "seconds": seconds,
        "global_step": trainer.global_step,
        "length_groups": module.actor_critic.length_groups,
        "loads": loads,
        "optimized": {"tensors": len(optimized), "dtensors": sum(hasattr(p, "full_tensor") for p in optimized)},
    }
    if module.reference is not None:  # after the fit: its forwards must not leave any unit gathered
        frozen = list(module.reference.parameters())
        record["reference"] = {"tensors": len(frozen), "dtensors": sum(hasattr(p, "full_tensor") for p in frozen)}
    if args.validate:
        record["validate"] = validate(trainer, module)
    with open(os.path.join(args.out, f"{tag}_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(record, f)
    leave_process_group()  # as train.py does: both ranks together, before the interpreter exits


if __name__ == "__main__":
    main()
