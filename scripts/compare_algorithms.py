"""Reproduce the README's algorithm comparison: GRPO, GRPO + dynamic sampling, DAPO, GSPO and REINFORCE++ on the
built-in task, the same seeds and rollout budget, in one run.

python scripts/compare_algorithms.py --seeds 0 1 --rollouts 300

Each variant is its config (`configs/<name>.yaml`) trained for `--rollouts` rollouts with held-out greedy accuracy
(`val/sorted_exactly`, 200 prompts) every `--every` rollouts, CSV logs under `--out`. Printed per variant and
seed: the accuracy curve, the training reward of the last 20 rollouts, and the first rollout after which held-out
accuracy reached GRPO's final accuracy for the same seed. Every variant but GSPO (2 minibatches) takes one optimizer
step per rollout.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRIC = "val/sorted_exactly"
VARIANTS = {  # name: (config, algorithm overrides)
    "grpo": ("grpo", {}),
    "grpo+dynamic": ("grpo", {"dynamic_sampling": True, "max_sampling_rounds": 3}),
    "dapo": ("dapo", {}),
    "gspo": ("gspo", {}),
    "reinforce_pp": ("reinforce_pp", {}),
}


def run_config(name: str, overrides: dict, out: str, rollouts: int, every: int) -> str:
    """A copy of configs/<name>.yaml for a fixed rollout budget: no checkpoints, CSV logs under `out`."""
    with open(os.path.join(ROOT, "configs", f"{name}.yaml")) as handle:
        settings = yaml.safe_load(handle)
    trainer = settings["trainer"]
    for key in ("callbacks", "plugins", "max_time", "max_steps"):
        trainer.pop(key, None)
    trainer.update(max_epochs=rollouts // every, log_every_n_steps=1, enable_checkpointing=False)
    settings["model"]["algorithm"].update(overrides)
    return save_run_config(settings, out, every)


def save_run_config(settings: dict, out: str, every: int) -> str:
    """Write `settings` with CSV logs under `out` and `every` rollouts per epoch to `out`/config.yaml; its path."""
    settings["trainer"]["logger"] = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": out},
    }
    settings["data"]["rollouts_per_epoch"] = every
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "config.yaml")
    with open(path, "w") as handle:
        yaml.safe_dump(settings, handle, sort_keys=False)
    return path


def latest_log(out: str) -> str:
    """The newest `version_N` folder a CSVLogger with save_dir `out` wrote."""
    folder = os.path.join(out, "lightning_logs")
    version = sorted(os.listdir(folder), key=lambda name: int(name.split("_")[1]))[-1]
    return os.path.join(folder, version)


def read_metrics(out: str) -> list[dict[str, str]]:
    with open(os.path.join(latest_log(out), "metrics.csv")) as handle:
        return list(csv.DictReader(handle))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rollouts", type=int, default=300)
    parser.add_argument("--every", type=int, default=25, help="rollouts between held-out evaluations")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "compare_algorithms"))
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    results: dict[tuple[str, int], tuple[list[tuple[int, float]], float]] = {}
    for seed in args.seeds:
        for variant in args.variants:
            config, overrides = VARIANTS[variant]
            out = os.path.join(args.out, f"{variant}_seed{seed}")
            path = run_config(config, overrides, out, args.rollouts, args.every)
            cmd = [sys.executable, "train.py", "fit", "--config", path, f"--seed_everything={seed}"]
            cmd.append("--trainer.enable_progress_bar=false")
            subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
            rows = read_metrics(out)
            curve = [(int(r["step"]) + 1, float(r[METRIC])) for r in rows if r.get(METRIC)]  # (rollouts done, accuracy)
            rewards = [float(r["rollout/reward_mean"]) for r in rows if r.get("rollout/reward_mean")]
            results[variant, seed] = curve, sum(rewards[-20:]) / len(rewards[-20:])
    for seed in args.seeds:
        target = results["grpo", seed][0][-1][1] if ("grpo", seed) in results else None
        for variant in args.variants:
            curve, reward = results[variant, seed]
            reached = next((step for step, acc in curve if target is not None and acc >= target), None)
            points = " ".join(f"{acc:.2f}" for _, acc in curve)
            print(
                f"seed {seed} {variant:13s} accuracy every {args.every} rollouts: {points} | reward (last 20) "
                f"{reward:.3f} | rollouts {curve[-1][0]} | reached GRPO's final accuracy after rollout {reached}"
            )


if __name__ == "__main__":
    main()
