"""GRPO on the built-in task through Ray Train's Lightning integration: a Ray cluster places the workers, Lightning
and `RayDDPStrategy` train, lit_rlhf is unchanged. Needs the `ray` extra (`pip install -e ".[ray]"`,
docs/distributed.md).

    python scripts/ray_train.py --workers 2 --steps 3 --out runs/ray   # a local cluster of 2 CPU workers
    RAY_ADDRESS=auto python scripts/ray_train.py ...                   # an existing cluster (`ray start` on each node)
    python scripts/ray_train.py --workers 2 --config configs/grpo.yaml --seed 1 --out runs/ray  # any train.py config

Every worker runs `train_func`: the same module and DataModule as a `strategy: ddp` run, with Ray's strategy and
environment, passed through `ray.train.lightning.prepare_trainer`. The trained weights (every trainable parameter)
go to `<out>/ray.pt` from global rank 0, and each rank's global step and world size to `<out>/ray_rank<r>.json`.
The settings are those of `tests/e2e/fsdp2_run.py`, so the weights can be compared with its DDP run.

With `--config`, every worker runs `fit_config` instead: the config as `train.py fit` reads it (its logger,
callbacks and limits), with `--seed` as `seed_everything`, `trainer.devices: auto` and Ray's strategy and
environment in place of the config's strategy. `data.batch_size` is per worker, as under `strategy: ddp`. Paths in
the config (logs, checkpoints) are read by each worker where Ray starts it: make them absolute.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def write_rank_record(trainer: Any, out: str) -> None:
    """This rank's global step and world size to `<out>/ray_rank<r>.json`."""
    with open(os.path.join(out, f"ray_rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"global_step": trainer.global_step, "world_size": trainer.world_size}, f)


def train_func(config: dict[str, Any]) -> None:
    import lightning as L
    import torch
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

    from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig

    torch.set_num_threads(1)
    L.seed_everything(0)
    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
        algorithm=AlgorithmConfig(name="grpo", group_size=2, micro_batch_size=2, kl_coef=0.05),
        sampling=SamplingConfig(max_new_tokens=5),
        lr=1e-2,
    )
    data = RolloutDataModule(prompts="builtin:digits", batch_size=2, max_prompt_length=16)
    trainer = L.Trainer(
        max_steps=config["steps"],
        accelerator="cpu",
        devices="auto",
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(module, data)
    out = config["out"]
    weights = {n: p.detach().clone() for n, p in module.actor_critic.named_parameters() if p.requires_grad}
    if trainer.global_rank == 0:
        torch.save(weights, os.path.join(out, "ray.pt"))
    write_rank_record(trainer, out)


def fit_config(config: dict[str, Any]) -> None:
    import torch
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

    from lit_rlhf import RLHFModule, RolloutDataModule
    from lit_rlhf.cli import CheckedCLI, quiet_known_notices

    torch.set_num_threads(1)
    args = ["--config", config["config"], f"--seed_everything={config['seed']}", "--trainer.devices=auto"]
    with quiet_known_notices():
        cli = CheckedCLI(RLHFModule, RolloutDataModule, run=False, args=args, save_config_callback=None)
    plugins = [*(cli.config_init["trainer"].get("plugins") or []), RayLightningEnvironment()]
    ray_trainer = prepare_trainer(cli.instantiate_trainer(strategy=RayDDPStrategy(), plugins=plugins))
    ray_trainer.fit(cli.model, cli.datamodule)
    write_rank_record(ray_trainer, config["out"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", help="a train.py config to fit on every worker (instead of the 3-step run)")
    parser.add_argument("--seed", type=int, default=0, help="--config: its seed_everything")
    args = parser.parse_args()
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    if "RAY_ADDRESS" not in os.environ:  # a local cluster with one CPU per worker
        ray.init(num_cpus=args.workers, include_dashboard=False)
    if args.config:
        work, loop_config = fit_config, {"config": os.path.abspath(args.config), "seed": args.seed, "out": out}
    else:
        work, loop_config = train_func, {"steps": args.steps, "out": out}
    trainer = TorchTrainer(
        work,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(storage_path=os.path.join(out, "ray_results"), name="grpo"),
    )
    trainer.fit()


if __name__ == "__main__":
    main()
