"""Reproduce the README's SmolLM2 arithmetic measurement: held-out accuracy before training and during 30
minutes of GRPO (configs/smollm2_arithmetic.yaml), for several seeds, with the KL to the reference and the time
per step.

python scripts/measure_smollm2_arithmetic.py --seeds 0 1 --parallel

Each seed trains in its own folder under `--out` (its own checkpoint folder, so the runs do not share a run lock);
`--parallel` runs the seeds at the same time with one thread each (on 2 cores: both within the same 30 minutes).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRIC = "val/exact_answer"


def run_config(config: str, out: str) -> str:
    """A copy of `config` that writes its checkpoints and CSV logs under `out` (TensorBoard off)."""
    with open(config) as handle:
        settings = yaml.safe_load(handle)
    trainer = settings["trainer"]
    for callback in trainer.get("callbacks", []):
        callback["init_args"]["dirpath"] = os.path.join(out, "checkpoints")
    trainer["logger"] = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": out}}
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "config.yaml")
    with open(path, "w") as handle:
        yaml.safe_dump(settings, handle, sort_keys=False)
    return path


def command(subcommand: str, config: str, seed: int) -> list[str]:
    return [sys.executable, "train.py", subcommand, "--config", config, f"--seed_everything={seed}"]


def read_metrics(out: str) -> list[dict[str, str]]:
    folder = os.path.join(out, "lightning_logs")
    version = sorted(os.listdir(folder), key=lambda name: int(name.split("_")[1]))[-1]
    with open(os.path.join(folder, version, "metrics.csv")) as handle:
        return list(csv.DictReader(handle))


def summary(rows: list[dict[str, str]]) -> tuple[list[tuple[int, float]], float, float, float]:
    """(step, held-out accuracy) pairs, the mean KL of the last 5 rollouts, seconds per step, steps trained."""
    curve = [(int(r["step"]) + 1, float(r[METRIC])) for r in rows if r.get(METRIC)]
    train = [r for r in rows if r.get("objective/kl")]
    kl = sum(float(r["objective/kl"]) for r in train[-5:]) / max(len(train[-5:]), 1)
    step_s = sum(float(r["time/rollout_s"]) + float(r["time/update_s"]) for r in train)  # rollout_s spans evaluate
    return curve, kl, step_s / max(len(train), 1), float(len(train))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "smollm2_arithmetic.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "measure_smollm2_arithmetic"))
    parser.add_argument("--parallel", action="store_true", help="train the seeds at the same time")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    base = os.path.join(args.out, "untrained")
    subprocess.run(command("validate", run_config(args.config, base), 0), cwd=ROOT, env=env, check=True)
    before = float(read_metrics(base)[-1][METRIC])

    runs = {seed: os.path.join(args.out, f"seed{seed}") for seed in args.seeds}
    procs = []
    for seed, out in runs.items():
        proc = subprocess.Popen(command("fit", run_config(args.config, out), seed), cwd=ROOT, env=env)
        if args.parallel:
            procs.append(proc)
        elif proc.wait() != 0:
            sys.exit(f"seed {seed}: training failed with status {proc.returncode}")
    for seed, proc in zip(runs, procs, strict=False):
        if proc.wait() != 0:
            sys.exit(f"seed {seed}: training failed with status {proc.returncode}")

    print(f"\nuntrained greedy held-out accuracy ({METRIC}): {before:.3f}")
    for seed, out in runs.items():
        curve, kl, step_s, steps = summary(read_metrics(out))
        points = ", ".join(f"{step}: {acc:.3f}" for step, acc in curve)
        best = max(acc for _, acc in curve)
        print(
            f"seed {seed}: {steps:.0f} steps, {step_s:.1f} s/step, KL {kl:.2f} nats/response (last 5 steps); "
            f"accuracy by step {{{points}}}; final {curve[-1][1]:.3f} ({curve[-1][1] - before:+.3f}), "
            f"best {best:.3f} ({best - before:+.3f})"
        )


if __name__ == "__main__":
    main()
