"""Run a short PPO or GRPO fit under `strategy="ddp"` on CPU processes (gloo) and write what each rank saw.

Not a test file. `python tests/e2e/ddp_run.py --out DIR` lets Lightning's DDP launcher start rank 1 by re-running
the command line; `tests/e2e/test_ddp.py` starts both ranks itself with LOCAL_RANK, MASTER_PORT, ... set (as torchrun
would), so that they import in parallel. Each rank writes `<out>/<algorithm>_<run>_rank<r>.json` with the
prompts it sampled for, its unreduced rollout metrics, the metrics Lightning logged (reduced across ranks), a
checksum of its trainable weights and the step time after every step. With --resume, a second fit per algorithm
restarts from the midway checkpoint of the first; --devices 1 gives the single-process baseline for timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for conftest

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from conftest import checksum  # noqa: E402
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig  # noqa: E402
from lit_rlhf.training.checkpoint_io import AtomicCheckpointIO  # noqa: E402
from lit_rlhf.training.metrics import rollout_metrics  # noqa: E402

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"
# held-out prompts that split unevenly over 2 ranks: 3 and 2
VAL_PROMPTS = ["312>", "9051>", "77>", "4820>", "16>"]


def digits_in_prompt(prompts, responses, **meta):
    """A held-out metric that differs between prompts whatever the policy answers: the prompt's digit count."""
    return [float(len(p) - 1) for p in prompts]


class Recorder(RLHFModule):
    """Keeps each rollout's prompts and unreduced metrics."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rollouts: list[dict] = []

    def on_experience(self, experience) -> None:
        self.rollouts.append(
            {
                "global_step": self.global_step,
                "prompts": list(experience.prompts),
                "local": rollout_metrics(experience, self.algorithm),
            }
        )


class StepLog(Callback):
    def __init__(self):
        self.steps: list[dict] = []
        self._start = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(
            {
                "global_step": trainer.global_step,
                "seconds": time.perf_counter() - self._start,
                "checksum": checksum(pl_module.actor_critic),
                "logged": {k: float(v) for k, v in trainer.callback_metrics.items()},
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--algorithms", default="ppo,grpo", help="comma-separated; one fit each, in turn")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2, help="prompts per step and process")
    parser.add_argument("--max-new-tokens", type=int, default=5)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="checkpoint every rollout, then rerun the second half from the midway checkpoint",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    for name in args.algorithms.split(","):
        fit(name, args, "full")
        if args.resume:
            fit(name, args, "resumed")


def fit(name: str, args: argparse.Namespace, run: str) -> None:
    L.seed_everything(0)
    algorithm = AlgorithmConfig(name=name, group_size=2, num_minibatches=2, micro_batch_size=1, kl_coef=0.05)
    module = Recorder(
        policy="builtin:digits",
        reward_fns=[REWARD],
        metric_fns=[digits_in_prompt],
        algorithm=algorithm,
        sampling=SamplingConfig(max_new_tokens=args.max_new_tokens),
        lr=1e-2,
        lr_schedule="linear",
    )
    data = RolloutDataModule(prompts="builtin:digits", batch_size=args.batch_size, max_prompt_length=16)
    log = StepLog()
    steps_per_rollout = algorithm.num_minibatches
    checkpoints = os.path.join(args.out, f"{name}_checkpoints")
    callbacks = [log]
    if args.resume and run == "full":
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=steps_per_rollout, save_top_k=-1))
    trainer = L.Trainer(
        max_steps=args.rollouts * steps_per_rollout,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        logger=False,
        enable_checkpointing=args.resume and run == "full",  # else Lightning adds its own, writing into the cwd
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
        log_every_n_steps=1,
    )
    midway = (args.rollouts // 2) * steps_per_rollout
    ckpt_path = os.path.join(checkpoints, f"epoch=0-step={midway}.ckpt") if run == "resumed" else None
    trainer.fit(module, data, ckpt_path=ckpt_path)
    os.makedirs(args.out, exist_ok=True)
    record = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "group_size": algorithm.group_size,
        "rollouts": module.rollouts,
        "steps": log.steps,
        "global_step": trainer.global_step,
    }
    if run == "full":  # held-out evaluation over uneven shards: the rank's own answers, and the reduced metric
        val = RolloutDataModule(
            prompts="builtin:digits", val_prompts=VAL_PROMPTS, val_batch_size=2, max_prompt_length=16
        )
        (validated,) = trainer.validate(module, datamodule=val, verbose=False)
        prompts = [text for batch in val.val_dataloader() for text in batch.texts]
        scores = digits_in_prompt(prompts, module.generate(prompts))
        record["val"] = {"metric": validated["val/digits_in_prompt"], "prompts": prompts, "scores": scores}
    with open(os.path.join(args.out, f"{name}_{run}_rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(record, handle)


if __name__ == "__main__":
    try:
        main()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip the interpreter's teardown of torch/gloo/transformers: seconds on a busy machine
    except BaseException:  # the launcher does not always show a child's traceback: keep it for the parent
        import traceback

        rank = os.environ.get("LOCAL_RANK", "0")
        out = sys.argv[sys.argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"error_rank{rank}.txt"), "w") as handle:
            handle.write(traceback.format_exc())
        raise
