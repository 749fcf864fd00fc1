"""Peak memory and time per step of SmolLM2-135M RL steps on this CPU: full fine-tuning with a frozen reference
copy against LoRA with the adapter-disabled reference, with and without gradient checkpointing.

    python scripts/prepare_smollm2.py --out models/smollm2-135m      # once
    python benchmarks/memory_smollm2.py [--folder models/smollm2-135m] [--steps 2] [--variants full lora ...]

Each variant runs in its own subprocess, so its peak resident memory (ru_maxrss) is its own; it includes the
Python/torch baseline and the loaded model. Results go to benchmarks/results/memory_smollm2_<time>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

VARIANTS: dict[str, dict[str, Any]] = {
    "full": dict(lora=None, gradient_checkpointing=False),
    "full+gc": dict(lora=None, gradient_checkpointing=True),
    "lora": dict(lora={"r": 8, "alpha": 16}, gradient_checkpointing=False),
    "lora+gc": dict(lora={"r": 8, "alpha": 16}, gradient_checkpointing=True),
}


def baseline_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(job: dict) -> dict:
    import lightning as L
    import torch

    torch.set_num_threads(job["threads"])
    from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
    from lit_rlhf.models.lora import parameter_bytes

    imported_mb = baseline_rss_mb()
    L.seed_everything(0)
    step_times: list[float] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            step_times.append(time.perf_counter() - self.start)

    variant = VARIANTS[job["variant"]]
    module = RLHFModule(
        policy=job["folder"],
        reward_fns=["lit_rlhf.tasks.chat.vader_sentiment_reward"],
        algorithm=AlgorithmConfig(name=job["algorithm"], group_size=job["group_size"]),
        sampling=SamplingConfig(max_new_tokens=job["max_new_tokens"]),
        lr=1e-5,
        log_samples_every_n_steps=0,
        **variant,
    )
    data = RolloutDataModule(
        prompts=os.path.join(ROOT, "configs", "prompts", "smollm2_topics.jsonl"),
        batch_size=job["batch_size"],
        max_prompt_length=64,
    )
    trainer = L.Trainer(
        max_steps=job["steps"],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Timer()],
        precision=job["precision"],
    )
    start = time.perf_counter()
    trainer.fit(module, data)
    total = time.perf_counter() - start
    reference_bytes = parameter_bytes(module.reference) if module.reference is not None else 0
    return {
        **{k: v for k, v in job.items() if k != "folder"},
        "peak_rss_mb": round(baseline_rss_mb(), 1),
        "after_imports_rss_mb": round(imported_mb, 1),
        "parameter_mb": round(parameter_bytes(module) / 2**20, 1),
        "reference_parameter_mb": round(reference_bytes / 2**20, 1),
        "trainable_parameters": sum(p.numel() for p in module.trainable_parameters()),
        "step_s": [round(t, 2) for t in step_times],
        "fit_s": round(total, 1),
        **{
            key: round(module.step_metrics[key], 2)
            for key in (  # the last step's own values
                "rollout/reward_mean",
                "time/generate_s",
                "time/score_s",
                "time/evaluate_s",
                "time/update_s",
            )
            if key in module.step_metrics
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=os.path.join(ROOT, "models", "smollm2-135m"))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--algorithm", default="ppo", choices=("ppo", "grpo"))
    parser.add_argument("--steps", type=int, default=2, help="rollouts (1 optimizer step each)")
    parser.add_argument("--batch-size", type=int, default=2, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=None, help="default: 1 for PPO, 2 for GRPO")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: a shared 2-core machine stalls with more)"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    if not os.path.isfile(os.path.join(args.folder, "config.json")):
        sys.exit(f"{args.folder} holds no checkpoint; run: python scripts/prepare_smollm2.py --out {args.folder}")
    group = args.group_size or (1 if args.algorithm == "ppo" else 2)
    results = []
    for name in args.variants:
        job = dict(
            variant=name,
            folder=os.path.abspath(args.folder),
            algorithm=args.algorithm,
            steps=args.steps,
            batch_size=args.batch_size,
            group_size=group,
            max_new_tokens=args.max_new_tokens,
            precision=args.precision,
            threads=args.threads,
        )
        out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode or not lines:
            print(f"{name}: failed\n{out.stderr[-3000:]}", flush=True)
            continue
        result = json.loads(lines[-1][len("RESULT ") :])
        results.append(result)
        print(
            f"{name:8s} peak RSS {result['peak_rss_mb']:7.0f} MB  parameters {result['parameter_mb']:6.0f} MB "
            f"(reference {result['reference_parameter_mb']:4.0f} MB)  "
            f"trainable {result['trainable_parameters']:>10,d}  step s {result['step_s']}",
            flush=True,
        )
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = os.path.join(HERE, "results", f"memory_smollm2_{stamp}.json")
    with open(path, "w") as handle:
        json.dump({"load_average": os.getloadavg(), "results": results}, handle, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
