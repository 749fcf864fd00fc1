"""Side by side with TRL on a real model: lit_rlhf's GRPO and TRL's `GRPOTrainer` train SmolLM2-135M-Instruct on
the README's worked example (arithmetic, `configs/prompts/smollm2_arithmetic_*.jsonl`) with the same settings,
and one evaluator scores both on the same held-out problems.

python scripts/trl_side_by_side.py --trl-python .venv-trl/bin/python --seeds 0 1 --steps 30 --every 5 \\
    --plot docs/img/trl_side_by_side.png
python scripts/trl_side_by_side.py --report-only --seeds 0 1 --steps 30 --every 5 --plot docs/img/trl_side_by_side.png
python scripts/trl_side_by_side.py --trl-python .venv-trl/bin/python --seeds 2 --steps 30 --every 5 --ours-extra-steps 5
python scripts/trl_side_by_side.py --plot-from docs/data/trl_side_by_side.json --plot docs/img/trl_side_by_side.png

The TRL interpreter needs `pip install torch==2.13.0` (first), then `pip install -e . "trl==1.16.*" peft` from this
repository (its reward functions are ours, imported). Shared by both: LoRA r 8 / alpha 16 / dropout 0 on every
linear layer (the reference is the adapters switched off), 4 prompts x 8 samples per optimizer step, at most 24
new tokens at temperature 1, rewards `exact_answer` + 0.1 `format_reward`, group-normalised advantages, the
token-mean loss (TRL's 'dapo'), one update per rollout, k3 KL at 0.04 in the loss, AdamW at a constant 5e-4,
gradient norm clipped at 1, seed N for both. The prompt order differs (each library's own seeded sampler).

Each run saves its adapters every `--every` optimizer steps with the training wall-clock up to that step (saving
excluded) under `--out/<ours|trl>_seed<N>/step<K>`. Then each saved adapter (and the untrained model once) is
scored by the same plain-transformers evaluator, outside both libraries: greedy, the chat template, 200 held-out
problems, `exact_answer`. Training runs go `--jobs` at a time with OMP_NUM_THREADS=1 unless set.

`--ours-extra-steps K`: ours goes on for K more steps (adapters after each), TRL stops at `--steps`, to see when
ours reaches TRL's final accuracy on TRL's wall-clock. The first `--steps` are the same run either way (a constant
learning rate, seeded: the adapters are bit-identical); the table keeps to the shared steps.

`--plot` (matplotlib, `pip install -e ".[plots]"`) draws the held-out accuracy against optimizer steps, the mean
over seeds with their min-max band, and each seed's training seconds per step; `--plot-from` draws it from a
summary.json alone (docs/data/trl_side_by_side.json holds the runs recorded in docs/migrating-from-trl.md).
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
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "smollm2-135m")
TRAIN = os.path.join(ROOT, "configs", "prompts", "smollm2_arithmetic_train.jsonl")
HELD_OUT = os.path.join(ROOT, "configs", "prompts", "smollm2_arithmetic_val.jsonl")
SHARED: dict[str, Any] = dict(
    group_size=8, prompts_per_step=4, max_new_tokens=24, lr=5e-4, kl_coef=0.04, max_grad_norm=1.0
)
LORA: dict[str, Any] = dict(r=8, alpha=16, dropout=0.0, target_modules="all-linear")
IMPLEMENTATIONS = ("ours", "trl")


def read_rows(path: str) -> list[dict[str, Any]]:
    with open(path) as handle:
        return [json.loads(line) for line in handle]


class Checkpoints:
    """Adapters every `every` optimizer steps (and after every step past `each_after`) under `out`/step<K>, and
    `out`/timeline.json: per saved step the training wall-clock up to it, the time spent saving left out."""

    def __init__(self, out: str, every: int, each_after: int | None = None):
        self.out, self.every, self.each_after, self.saving_s = out, every, each_after, 0.0
        self.timeline: list[dict[str, float]] = []
        self.start = time.perf_counter()

    def after_step(self, step: int, model: Any) -> None:
        if step % self.every and (self.each_after is None or step <= self.each_after):
            return
        begin = time.perf_counter()
        self.timeline.append({"step": step, "train_s": begin - self.start - self.saving_s})
        model.save_pretrained(os.path.join(self.out, f"step{step}"))
        with open(os.path.join(self.out, "timeline.json"), "w") as handle:
            json.dump(self.timeline, handle, indent=1)
        self.saving_s += time.perf_counter() - begin


def train_ours(out: str, seed: int, steps: int, every: int, each_after: int | None = None) -> None:
    import lightning as L

    from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig

    module = RLHFModule(
        policy=MODEL,
        reward_fns=["lit_rlhf.rewards.verifiable.exact_answer", "lit_rlhf.rewards.verifiable.format_reward"],
        reward_weights=[1.0, 0.1],
        algorithm=AlgorithmConfig(
            name="grpo",
            group_size=SHARED["group_size"],
            kl_coef=SHARED["kl_coef"],
            loss_aggregation="token_mean",
            max_grad_norm=SHARED["max_grad_norm"],
        ),
        sampling=SamplingConfig(max_new_tokens=SHARED["max_new_tokens"], temperature=1.0),
        lr=SHARED["lr"],
        lora=LORA,
        log_samples_every_n_steps=0,
    )
    data = RolloutDataModule(prompts=TRAIN, batch_size=SHARED["prompts_per_step"], max_prompt_length=128, seed=seed)
    checkpoints = Checkpoints(out, every, each_after)

    class SaveAdapters(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            checkpoints.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            checkpoints.after_step(trainer.global_step, pl_module.actor_critic.policy)

    L.seed_everything(seed)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[SaveAdapters()],
    )
    trainer.fit(module, data)


def train_trl(out: str, seed: int, steps: int, every: int) -> None:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lit_rlhf.rewards.verifiable import exact_answer, format_reward

    def texts(completions: list[Any]) -> list[str]:  # conversational data: each completion is a message list
        return [completion[0]["content"] for completion in completions]

    def exact(prompts: list[Any], completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
        return exact_answer(prompts, texts(completions), answer=answer)

    def formatted(prompts: list[Any], completions: list[Any], answer_format: list[str], **kwargs: Any) -> list[float]:
        return format_reward(prompts, texts(completions), answer_format=answer_format)

    rows = read_rows(TRAIN)
    dataset = Dataset.from_list(
        [{"prompt": r["messages"], "answer": r["answer"], "answer_format": r["answer_format"]} for r in rows]
    )
    checkpoints = Checkpoints(out, every)

    class SaveAdapters(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            checkpoints.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            checkpoints.after_step(state.global_step, model)

    config = GRPOConfig(
        output_dir=os.path.join(out, "trl"),
        per_device_train_batch_size=SHARED["prompts_per_step"] * SHARED["group_size"],  # completions, not prompts
        num_generations=SHARED["group_size"],
        max_completion_length=SHARED["max_new_tokens"],
        temperature=1.0,
        beta=SHARED["kl_coef"],
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        learning_rate=SHARED["lr"],
        lr_scheduler_type="constant",
        max_grad_norm=SHARED["max_grad_norm"],
        reward_weights=[1.0, 0.1],
        max_steps=steps,
        seed=seed,
        use_cpu=True,
        gradient_checkpointing=False,  # TRL's default is on; ours keeps activations
        logging_steps=10**6,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    rewards: list[Callable[..., list[float]]] = [exact, formatted]
    trainer = GRPOTrainer(
        model=MODEL,
        reward_funcs=rewards,
        args=config,
        train_dataset=dataset,
        peft_config=LoraConfig(
            r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"], target_modules=LORA["target_modules"]
        ),
        callbacks=[SaveAdapters()],
    )
    trainer.train()


def evaluate(adapter: str | None) -> float:
    """Held-out exact accuracy of the base model with `adapter` (a peft folder) merged in, or of the base alone:
    greedy, 24 new tokens, the chat template, `exact_answer`; plain transformers and peft only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_rlhf.rewards.verifiable import exact_answer

    tokenizer = AutoTokenizer.from_pretrained(MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    rows = read_rows(HELD_OUT)
    replies: list[str] = []
    for start in range(0, len(rows), 100):
        chats = [row["messages"] for row in rows[start : start + 100]]
        prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            output = model.generate(**batch, max_new_tokens=SHARED["max_new_tokens"], do_sample=False)
        replies += tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    scores = exact_answer([""] * len(rows), replies, answer=[row["answer"] for row in rows])
    return statistics.fmean(scores)


def run_all(commands: list[tuple[str, list[str]]], jobs: int) -> None:
    """(log path, command) pairs, `jobs` at a time; a failure stops the others and the script."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    pending = list(commands)
    running: list[tuple[subprocess.Popen, io.TextIOWrapper, str]] = []
    while pending or running:
        while pending and len(running) < jobs:
            log_path, command = pending.pop(0)
            log = open(log_path, "w")  # noqa: SIM115  closed when the run ends
            running.append((subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log), log, log_path))
        time.sleep(2.0)
        for entry in list(running):
            proc, log, log_path = entry
            if proc.poll() is None:
                continue
            log.close()
            running.remove(entry)
            if proc.returncode:
                for other, other_log, _ in running:
                    other.terminate()
                    other.wait()
                    other_log.close()
                raise SystemExit(f"exit {proc.returncode}; see {log_path}")


def run_folder(args: argparse.Namespace, implementation: str, seed: int) -> str:
    return os.path.join(args.out, f"{implementation}_seed{seed}")


def train_and_evaluate(args: argparse.Namespace) -> None:
    me = os.path.abspath(__file__)
    training = []
    for seed in args.seeds:
        for implementation in IMPLEMENTATIONS:
            out = run_folder(args, implementation, seed)
            os.makedirs(out, exist_ok=True)
            python = args.trl_python if implementation == "trl" else sys.executable
            worker = [python, me, "--worker", implementation, "--seed", str(seed), "--out", out]
            steps = [f"--steps={args.steps}", f"--every={args.every}"]
            if implementation == "ours" and args.ours_extra_steps:
                steps = [f"--steps={args.steps + args.ours_extra_steps}", f"--every={args.every}"]
                steps.append(f"--each-after={args.steps}")
            training.append((os.path.join(out, "train.log"), [*worker, *steps]))
    run_all(training, args.jobs)
    evaluations = [(os.path.join(args.out, "base.log"), [sys.executable, me, "--worker", "eval", "--out", args.out])]
    for seed in args.seeds:
        for implementation in IMPLEMENTATIONS:
            extra = args.ours_extra_steps if implementation == "ours" else 0
            saved = [*range(args.every, args.steps + 1, args.every), *range(args.steps + 1, args.steps + extra + 1)]
            for step in saved:
                folder = os.path.join(run_folder(args, implementation, seed), f"step{step}")
                evaluations.append((folder + ".log", [sys.executable, me, "--worker", "eval", "--out", folder]))
    run_all([job for job in evaluations if not os.path.exists(job[1][-1] + "/accuracy.json")], args.jobs)


def curves(args: argparse.Namespace) -> dict[tuple[str, int], list[dict[str, float]]]:
    """Per run, the points (step, train_s, accuracy) from step 0 (the untrained model, at 0 s)."""
    with open(os.path.join(args.out, "accuracy.json")) as handle:
        base = json.load(handle)["accuracy"]
    runs = {}
    for implementation in IMPLEMENTATIONS:
        for seed in args.seeds:
            folder = run_folder(args, implementation, seed)
            with open(os.path.join(folder, "timeline.json")) as handle:
                timeline = json.load(handle)
            points = [{"step": 0, "train_s": 0.0, "accuracy": base}]
            for entry in timeline:
                with open(os.path.join(folder, f"step{entry['step']}", "accuracy.json")) as handle:
                    points.append({**entry, "accuracy": json.load(handle)["accuracy"]})
            runs[implementation, seed] = points
    return runs


def report(args: argparse.Namespace) -> None:
    runs = curves(args)
    shared = {key: [point for point in points if point["step"] <= args.steps] for key, points in runs.items()}
    steps = [point["step"] for point in next(iter(shared.values()))]
    print("held-out exact accuracy (200 problems, greedy) after optimizer step:")
    print("run          " + " ".join(f"{step:>6d}" for step in steps) + "   train s (s/step)")
    for (implementation, seed), points in shared.items():
        total = points[-1]["train_s"]
        values = " ".join(f"{point['accuracy']:6.3f}" for point in points)
        print(f"{implementation:4s} seed {seed}  {values}   {total:7.0f} ({total / points[-1]['step']:.1f})")
    for seed in args.seeds:
        ours, trl = runs["ours", seed], runs["trl", seed]
        past = [point for point in ours if point["step"] > args.steps]
        if past:
            values = ", ".join(
                f"{p['step']}: {p['accuracy']:.3f} ({p['train_s'] / trl[-1]['train_s']:.2f}x)" for p in past
            )
            print(f"seed {seed}: ours past step {args.steps} (step: accuracy (x TRL's wall-clock)): {values}")
        target = trl[-1]["accuracy"]
        reached = next((point for point in ours if point["accuracy"] >= target), None)
        when = (
            f"at step {reached['step']}, {reached['train_s'] / trl[-1]['train_s']:.2f}x TRL's wall-clock"
            if reached
            else "not reached"
        )
        print(f"seed {seed}: TRL's final accuracy {target:.3f}; ours reaches it {when}")
    with open(os.path.join(args.out, "summary.json"), "w") as handle:
        json.dump({f"{impl}_seed{seed}": points for (impl, seed), points in runs.items()}, handle, indent=1)
    if args.plot:
        plot(runs, args.plot, args.steps)


def load_runs(path: str) -> dict[tuple[str, int], list[dict[str, float]]]:
    """Runs from a summary.json this script wrote, or a recorded file of the same shape under "runs"."""
    with open(path) as handle:
        data = json.load(handle)
    runs = {}
    for name, points in data.get("runs", data).items():
        implementation, _, seed = name.rpartition("_seed")
        runs[implementation, int(seed)] = points
    return runs


def plot(runs: dict[tuple[str, int], list[dict[str, float]]], path: str, steps: int) -> None:
    """Two panels: held-out accuracy against optimizer steps (mean over seeds, min-max band, each seed thin),
    and each seed's training seconds per optimizer step over the first `steps` steps."""
    from plotting import pyplot, save, seed_band  # scripts/ is on the path when run as a script

    plt = pyplot()
    figure, (curves, speed) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    colours, names = {"ours": "tab:blue", "trl": "tab:orange"}, {"ours": "lit_rlhf", "trl": "TRL 1.16"}
    seeds = sorted({seed for _, seed in runs})
    for implementation in IMPLEMENTATIONS:
        shared = {
            seed: [(p["step"], p["accuracy"]) for p in runs[implementation, seed] if p["step"] <= steps]
            for seed in seeds
        }
        seed_band(curves, shared, names[implementation], colours[implementation])
        last = [next(p for p in runs[implementation, seed] if p["step"] == steps) for seed in seeds]
        offset = -0.2 if implementation == "ours" else 0.2
        per_step = [p["train_s"] / steps for p in last]
        speed.bar([i + offset for i in range(len(seeds))], per_step, width=0.4, color=colours[implementation])
        speed.plot([], [], color=colours[implementation], linewidth=6, label=names[implementation])
    curves.set(xlabel="optimizer step", ylabel="held-out exact accuracy (200 problems, greedy)", ylim=(0, 1))
    curves.set_title("SmolLM2-135M-Instruct, LoRA GRPO, arithmetic")
    curves.grid(alpha=0.3)
    curves.legend(loc="lower right", fontsize=8)
    speed.set(xlabel="seed", ylabel=f"training seconds per step (first {steps})", xticks=range(len(seeds)))
    speed.set_xticklabels([str(seed) for seed in seeds])
    speed.set_title("wall-clock, 2-core CPU, one core each")
    speed.grid(axis="y", alpha=0.3)
    speed.set_ylim(0, speed.get_ylim()[1] * 1.2)  # room for the legend above the bars
    speed.legend(loc="upper right", ncol=2, fontsize=8)
    save(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-python", help="an interpreter with trl 1.16, peft and this package installed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="optimizer steps between saved adapters")
    parser.add_argument(
        "--ours-extra-steps", type=int, default=0, help="ours trains this many steps past --steps (TRL does not)"
    )
    parser.add_argument("--each-after", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "trl_side_by_side"))
    parser.add_argument("--plot", help="write the curves to this PNG (matplotlib: the plots extra)")
    parser.add_argument("--plot-from", help="draw --plot from this summary.json (or recorded runs) alone")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--worker", choices=(*IMPLEMENTATIONS, "eval"), help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "eval":  # --out: an adapter folder, or the run folder for the untrained model
        adapter = args.out if os.path.exists(os.path.join(args.out, "adapter_config.json")) else None
        accuracy = evaluate(adapter)  # before the file is opened: a failed evaluation leaves none
        with open(os.path.join(args.out, "accuracy.json"), "w") as handle:
            json.dump({"accuracy": accuracy}, handle)
        return
    if args.worker:
        if args.worker == "ours":
            train_ours(args.out, args.seed, args.steps, args.every, args.each_after)
        else:
            train_trl(args.out, args.seed, args.steps, args.every)
        return
    if args.steps % args.every:
        raise SystemExit(f"--steps {args.steps} must be a multiple of --every {args.every}")
    if args.plot_from:
        if not args.plot:
            raise SystemExit("--plot-from: give --plot, the PNG to write")
        plot(load_runs(args.plot_from), args.plot, args.steps)
        return
    if not args.report_only:
        if not args.trl_python:
            raise SystemExit("--trl-python: give an interpreter with trl installed (see this script's docstring)")
        train_and_evaluate(args)
    report(args)


if __name__ == "__main__":
    main()
