"""Learning over seeds: N seeds of one config on the built-in task, each for the same number of optimizer steps,
then the final training reward, held-out accuracy and critic fit as mean, min and max, and a PNG of the curves.

python scripts/multi_seed.py --config ppo --seeds 0 1 2 3 4 --steps 1500 --jobs 2 --plot docs/img/ppo_seeds.png
python scripts/multi_seed.py --config ppo --seeds 0 1 2 --steps 600 --set model.algorithm.vf_coef=0.5
python scripts/multi_seed.py --config grpo --seeds 0 1 2 --set data.batch_size=8 --ray-workers 2  # Ray Train, DDP

Each seed trains `configs/<config>.yaml` with its `max_time` removed (the budget is `--steps`; each run's wall
time is printed), no checkpoints, held-out greedy accuracy (`val/sorted_exactly`, 200 prompts) every `--every`
rollouts, CSV logs under `--out/seed<N>`. `--set key.path=value` changes any setting of the config (the value is
read as YAML). Printed per seed and as mean [min, max] over seeds:
  reward       mean `rollout/reward_mean` over the last `--window` rollouts
  held-out     `val/sorted_exactly` after the last step; best: its highest value during the run
  expl. var.   mean `value/explained_variance` over the last `--window` rollouts (critics only)
`--plot` (matplotlib, `pip install -e ".[plots]"`) draws one panel per curve against rollouts: the training reward
(a running mean over `--window` rollouts) and the held-out accuracy, each seed thin, the seeds' min-max band and
their mean. The curves go to `--out/curves.json` too; `--plot-from that.json --plot fig.png` redraws them alone.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time

import yaml

from compare_algorithms import read_metrics, save_run_config  # scripts/ is on the path when run as a script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELD_OUT = "val/sorted_exactly"
REWARD = "rollout/reward_mean"
EXPLAINED = "value/explained_variance"


def set_path(settings: dict, assignment: str) -> None:
    """Apply one `key.path=value` (the value parsed as YAML) to the nested settings."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set {assignment!r}: write key.path=value, e.g. model.algorithm.vf_coef=0.5")
    *parents, leaf = key.split(".")
    node = settings
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = yaml.safe_load(raw)


def updates_per_rollout(settings: dict) -> int:
    algo = settings["model"].get("algorithm", {})
    return int(algo.get("ppo_epochs", 1)) * int(algo.get("num_minibatches", 1))


def write_config(config: str, assignments: list[str], out: str, steps: int, every: int) -> str:
    """configs/<config>.yaml for `steps` optimizer steps: no time limit, no checkpoints, CSV logs under `out`."""
    with open(os.path.join(ROOT, "configs", f"{config}.yaml")) as handle:
        settings = yaml.safe_load(handle)
    for assignment in assignments:
        set_path(settings, assignment)
    updates = updates_per_rollout(settings)
    if steps % (updates * every):
        raise SystemExit(f"--steps {steps} is not a whole number of evaluations ({every} rollouts x {updates} steps)")
    trainer = settings["trainer"]
    for key in ("callbacks", "plugins", "max_time"):
        trainer.pop(key, None)
    trainer.update(max_epochs=steps // (updates * every), max_steps=steps, log_every_n_steps=1)
    trainer.update(enable_checkpointing=False, enable_progress_bar=False)
    return save_run_config(settings, out, every)


def column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(row[key]) for row in rows if row.get(key)]


def run_seeds(args: argparse.Namespace) -> None:
    """Train every seed, at most `--jobs` at once; each run's wall seconds go to seed<N>/wall_s.txt."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    pending = list(args.seeds)
    running: dict[int, tuple[subprocess.Popen, io.TextIOWrapper, float]] = {}
    while pending or running:
        while pending and len(running) < args.jobs:
            seed = pending.pop(0)
            out = os.path.join(args.out, f"seed{seed}")
            path = write_config(args.config, args.set, out, args.steps, args.every)
            cmd = [sys.executable, "train.py", "fit", "--config", path, f"--seed_everything={seed}"]
            if args.ray_workers:  # the same config on a local Ray cluster (scripts/ray_train.py)
                ray = ["--workers", str(args.ray_workers), "--config", path, "--seed", str(seed), "--out", out]
                cmd = [sys.executable, os.path.join("scripts", "ray_train.py"), *ray]
            log = open(os.path.join(out, "train.log"), "w")  # noqa: SIM115  closed when the run ends
            running[seed] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log), log, time.time())
        time.sleep(1.0)
        for seed, (proc, log, start) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[seed]
            if proc.returncode:
                for other, other_log, _ in running.values():  # no run left training after the script stops
                    other.terminate()
                    other.wait()
                    other_log.close()
                raise SystemExit(f"seed {seed} failed (exit {proc.returncode}); see {args.out}/seed{seed}/train.log")
            with open(os.path.join(args.out, f"seed{seed}", "wall_s.txt"), "w") as handle:
                handle.write(f"{time.time() - start:.1f}\n")


def summarise(args: argparse.Namespace) -> dict[str, dict[int, float]]:
    """Per seed: final reward, final and best held-out accuracy, explained variance (when logged), wall time."""
    table: dict[str, dict[int, float]] = {"reward": {}, "held_out": {}, "best_held_out": {}, "expl_var": {}}
    table["wall_s"] = {}
    for seed in args.seeds:
        out = os.path.join(args.out, f"seed{seed}")
        rows = read_metrics(out)
        with open(os.path.join(out, "config.yaml")) as handle:
            rollouts = args.steps // updates_per_rollout(yaml.safe_load(handle))
        if len(column(rows, REWARD)) != rollouts:
            raise SystemExit(f"{out}: {len(column(rows, REWARD))} rollouts logged, not {rollouts} ({args.steps} steps)")
        if os.path.exists(os.path.join(out, "wall_s.txt")):
            with open(os.path.join(out, "wall_s.txt")) as handle:
                table["wall_s"][seed] = float(handle.read())
        held_out, explained = column(rows, HELD_OUT), column(rows, EXPLAINED)
        table["reward"][seed] = statistics.fmean(column(rows, REWARD)[-args.window :])
        table["held_out"][seed], table["best_held_out"][seed] = held_out[-1], max(held_out)
        if explained:
            table["expl_var"][seed] = statistics.fmean(explained[-args.window :])
    return {name: values for name, values in table.items() if values}


def report(args: argparse.Namespace, table: dict[str, dict[int, float]]) -> None:
    settings = " ".join(args.set) or "as shipped"
    print(f"configs/{args.config}.yaml ({settings}), {args.steps} optimizer steps, seeds {args.seeds}")
    for name, values in table.items():
        per_seed = " ".join(f"{values[seed]:.3f}" if seed in values else "-" for seed in args.seeds)
        spread = f"{statistics.fmean(values.values()):.3f} [{min(values.values()):.3f}, {max(values.values()):.3f}]"
        print(f"  {name:14s} mean [min, max] {spread}   per seed: {per_seed}")


def running_mean(values: list[float], window: int) -> list[float]:
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window) for i in range(len(values))]


def curves(args: argparse.Namespace) -> dict[str, dict[int, list[tuple[float, float]]]]:
    """Per panel and seed the (rollout, value) points: the smoothed reward and the held-out accuracy."""
    panels: dict[str, dict[int, list[tuple[float, float]]]] = {"training reward": {}, "held-out accuracy": {}}
    for seed in args.seeds:
        rows = read_metrics(os.path.join(args.out, f"seed{seed}"))
        rewards = running_mean(column(rows, REWARD), args.window)
        panels["training reward"][seed] = [(i + 1.0, r) for i, r in enumerate(rewards)]
        evaluated = [(float(row["step"]) + 1, float(row[HELD_OUT])) for row in rows if row.get(HELD_OUT)]
        panels["held-out accuracy"][seed] = evaluated
    return panels


def plot_title(args: argparse.Namespace) -> str:
    settings = " ".join(args.set) or "as shipped"
    return f"configs/{args.config}.yaml ({settings}), built-in task, {args.steps} optimizer steps"


def plot(panels: dict[str, dict[int, list[tuple[float, float]]]], title: str, path: str) -> None:
    """One panel per curve against rollouts: each seed thin, the seeds' min-max band, their mean."""
    from plotting import pyplot, save, seed_band  # scripts/ is on the path when run as a script

    figure, axes = pyplot().subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for panel, (name, per_seed) in zip(axes[0], panels.items(), strict=True):
        seed_band(
            panel, {int(seed): [(p[0], p[1]) for p in points] for seed, points in per_seed.items()}, name, "tab:blue"
        )
        panel.set(xlabel="rollouts (one optimizer step each)", ylabel=name, ylim=(0, 1))
        panel.grid(alpha=0.3)
        panel.legend(loc="lower right", fontsize=8)
    figure.suptitle(title)
    save(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="ppo", help="a name under configs/")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps per seed")
    parser.add_argument("--every", type=int, default=100, help="rollouts between held-out evaluations")
    parser.add_argument("--window", type=int, default=150, help="rollouts averaged for the final reward")
    parser.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE")
    parser.add_argument("--jobs", type=int, default=1, help="seeds trained at once")
    parser.add_argument(
        "--ray-workers", type=int, default=0, help="train each seed with Ray Train on this many workers (ray extra)"
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "multi_seed"))
    parser.add_argument("--plot", help="write the curves to this PNG (matplotlib: the plots extra)")
    parser.add_argument("--reuse", action="store_true", help="summarise the runs already under --out")
    parser.add_argument("--plot-from", help="draw --plot from this curves.json (written beside summary.json) alone")
    args = parser.parse_args()
    if args.plot_from:
        if not args.plot:
            raise SystemExit("--plot-from: give --plot, the PNG to write")
        with open(args.plot_from) as handle:
            recorded = json.load(handle)
        plot(recorded["panels"], recorded["title"], args.plot)
        return
    args.out = os.path.abspath(args.out)  # the runs' log folders, whatever folder a (Ray) worker runs in
    if not args.reuse:
        run_seeds(args)
    table = summarise(args)
    report(args, table)
    with open(os.path.join(args.out, "summary.json"), "w") as handle:
        json.dump({"config": args.config, "set": args.set, "steps": args.steps, **table}, handle, indent=1)
    panels = curves(args)
    with open(os.path.join(args.out, "curves.json"), "w") as handle:  # what --plot draws, kept for --plot-from
        json.dump({"title": plot_title(args), "panels": panels}, handle)
    if args.plot:
        plot(panels, plot_title(args), args.plot)


if __name__ == "__main__":
    main()
