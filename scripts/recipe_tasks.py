"""The recipe on tasks it was not tuned on: each reasoning-gym task trained with `configs/smollm2_recipe.yaml` for
a fixed wall-clock budget per seed, with held-out exact accuracy before and after, and a few held-out replies.

python scripts/recipe_tasks.py --seeds 0 1 --minutes 30 --jobs 2   # the README's table (3 tasks x 2 seeds)
python scripts/recipe_tasks.py --report-only                        # re-print the table from finished runs
python scripts/recipe_tasks.py --set model.algorithm.kl_coef=0.04   # the recipe with one setting changed

For every task and seed the recipe is trained unchanged except for its two `data` lines (the task), its seed and
its time limit, with CSV logs and a `last.ckpt` under `--out/<task>/seed<N>`. Then `train.py validate` scores the
final weights on the task's 200 held-out problems (greedy), and once per task the untrained model: the held-out
problems are drawn with a fixed seed of their own, so both seeds are scored on the same problems and "before" is
one number per task. Runs go `--jobs` at a time, each with OMP_NUM_THREADS=1 and PYTHONHASHSEED=0 unless set (the
latter so that datasets whose problems follow the string-hash seed make the same problems in every run).

Printed per task: before (and the dataset scorer's mean, partial credit included), per seed the final accuracy
(the best of the in-training evaluations in brackets) and the optimizer steps done; then two held-out replies of
each seed's final weights (the same two problems). A JSON summary goes to `--out/summary.json`.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

import yaml

from compare_algorithms import latest_log, read_metrics  # scripts/ is on the path when run as a script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "configs", "smollm2_recipe.yaml")
TASKS = (
    "products?max_digits=2",
    "gcd?max_value=60",
    "basic_arithmetic?max_terms=2&max_digits=2&allow_negation=false&allow_parentheses=false",
)
HELD_OUT = "val/solved"
SCORER_MEAN = "val/score_answer"  # the dataset's own score, partial credit included


def slug(task: str) -> str:
    """A folder name for a task spec: its dataset name and knob values, each run of other characters than letters,
    digits, '.' and '-' (JSON lists' brackets, quotes, commas) made one '_'."""
    name, _, knobs = task.partition("?")
    values = [pair.partition("=")[2] for pair in knobs.split("&") if pair]
    folder = "_".join([name, *values]).replace("false", "f").replace("true", "t")
    return re.sub(r"[^A-Za-z0-9.-]+", "_", folder).strip("_")


def override(settings: dict[str, Any], assignment: str) -> None:
    """Apply one `--set dotted.key=value` to the recipe's settings (the value read as YAML). The section must exist;
    a key new to it is added, and `train.py` rejects a misspelled one before training."""
    key, sep, value = assignment.partition("=")
    *parents, leaf = key.split(".")
    node: Any = settings
    for name in parents:
        node = node.get(name) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            break
    if not sep or not isinstance(node, dict) or not leaf:
        raise SystemExit(f"--set {assignment!r}: expected KEY=VALUE with KEY in a section of {RECIPE}")
    node[leaf] = yaml.safe_load(value)


def run_config(task: str, seed: int, minutes: int, out: str, checkpoint: bool, changes: list[str]) -> str:
    """The recipe for `task` and `seed` with `changes` applied, CSV logs under `out` (and `last.ckpt` when
    `checkpoint`); its path."""
    with open(RECIPE) as handle:
        settings = yaml.safe_load(handle)
    for assignment in changes:
        override(settings, assignment)
    settings["seed_everything"] = seed
    settings["data"]["prompts"] = settings["data"]["val_prompts"] = f"builtin:reasoning_gym/{task}"
    trainer = settings["trainer"]
    trainer["max_time"] = f"00:00:{minutes:02d}:00"
    trainer["enable_progress_bar"] = False
    trainer["logger"] = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": out}}
    trainer["enable_checkpointing"] = checkpoint
    trainer["callbacks"] = []
    if checkpoint:
        last_only = {"dirpath": os.path.join(out, "checkpoints"), "save_top_k": 0, "save_last": True}
        last_only["save_on_train_epoch_end"] = True  # also when the time limit stops training mid-epoch
        trainer["callbacks"].append(
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": last_only}
        )
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "config.yaml")
    with open(path, "w") as handle:
        yaml.safe_dump(settings, handle, sort_keys=False)
    return path


def metric(out: str, key: str) -> list[float]:
    return [float(row[key]) for row in read_metrics(out) if row.get(key)]


def jobs(args: argparse.Namespace) -> list[tuple[str, list[list[str]]]]:
    """(folder, commands) per job: every seed's training then its final validation, then each task's "before"."""
    todo = []
    for task in args.tasks:
        for seed in args.seeds:
            out = os.path.join(args.out, slug(task), f"seed{seed}")
            fit = run_config(task, seed, args.minutes, out, True, args.set)
            final = run_config(task, seed, args.minutes, os.path.join(out, "final"), False, args.set)
            last = os.path.join(out, "checkpoints", "last.ckpt")
            todo.append((out, [["fit", "--config", fit], ["validate", "--config", final, f"--ckpt_path={last}"]]))
    for task in args.tasks:
        out = os.path.join(args.out, slug(task), "before")
        todo.append((out, [["validate", "--config", run_config(task, 0, args.minutes, out, False, args.set)]]))
    return todo


def run_jobs(args: argparse.Namespace) -> None:
    """Each job's commands in order, `--jobs` jobs at once; a failed command stops every other run."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["PYTHONHASHSEED"] = os.environ.get("PYTHONHASHSEED", "0")
    pending = jobs(args)
    running: dict[str, tuple[subprocess.Popen, io.TextIOWrapper, list[list[str]], float]] = {}
    while pending or running:
        while pending and len(running) < args.jobs:
            out, commands = pending.pop(0)
            log = open(os.path.join(out, "train.log"), "w")  # noqa: SIM115  closed when the job ends
            command = [sys.executable, "train.py", *commands[0]]
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)
            running[out] = (proc, log, commands[1:], time.time())
        time.sleep(2.0)
        for out, (proc, log, rest, start) in list(running.items()):
            if proc.poll() is None:
                continue
            if proc.returncode:
                for other, other_log, _, _ in running.values():
                    other.terminate()
                    other.wait()
                    other_log.close()
                raise SystemExit(f"{out}: exit {proc.returncode}; see {out}/train.log")
            if rest:
                command = [sys.executable, "train.py", *rest[0]]
                proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)
                running[out] = (proc, log, rest[1:], start)
                continue
            log.close()
            del running[out]
            with open(os.path.join(out, "wall_s.txt"), "w") as handle:
                handle.write(f"{time.time() - start:.1f}\n")


def held_out_replies(out: str, count: int) -> list[dict[str, Any]]:
    with open(os.path.join(latest_log(out), "samples.jsonl")) as handle:
        rows = [json.loads(line) for line in handle]
    return rows[:count]


def report(args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for task in args.tasks:
        folder = os.path.join(args.out, slug(task))
        before = metric(os.path.join(folder, "before"), HELD_OUT)[-1]
        before_score = metric(os.path.join(folder, "before"), SCORER_MEAN)[-1]
        line = f"{task}\n  before {before:.3f} (scorer's mean {before_score:.3f})"
        summary[task] = {"before": before, "before_scorer_mean": before_score, "seeds": {}}
        for seed in args.seeds:
            out = os.path.join(folder, f"seed{seed}")
            final = metric(os.path.join(out, "final"), HELD_OUT)[-1]
            during, steps = metric(out, HELD_OUT), metric(out, "rollout/reward_mean")
            best = max(during, default=final)
            summary[task]["seeds"][seed] = {"final": final, "best_during": best, "rollouts_logged": len(steps)}
            line += f" | seed {seed}: {final:.3f} (best {best:.3f}), {final - before:+.3f}, {len(steps)} rollouts"
        print(line)
        for seed in args.seeds:  # the same held-out problems for every seed
            for row in held_out_replies(os.path.join(folder, f"seed{seed}", "final"), 2):
                question = row["prompt"].rsplit("user\n", 1)[-1].split("<|im_end|>")[0]  # SmolLM2's chat template
                print(f"    seed {seed}: {question!r} -> {row['response']!r} (score {row['score']:.2f})")
    with open(os.path.join(args.out, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), help="reasoning-gym specs: name?knob=value&...")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--minutes", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "recipe_tasks"))
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="change a recipe setting")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if not args.report_only:
        run_jobs(args)
    report(args)


if __name__ == "__main__":
    main()
