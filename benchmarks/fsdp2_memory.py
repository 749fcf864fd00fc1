"""Per-process memory and step time of FSDP2 (`ModelParallelStrategy`) against DDP on 2 CPU processes (gloo), the
same global batch (each rank samples for its own prompts), the same GRPO settings.

    python benchmarks/fsdp2_memory.py [--policy smollm2|builtin] [--steps 3] [--strategies ddp fsdp2]

Each strategy runs as 2 worker processes of this script (LOCAL_RANK, MASTER_PORT, ... set as torchrun would),
one after the other. Every rank records, after the fit, the bytes it holds itself (a `DTensor`'s local shard, a
plain tensor whole) of the trainable parameters, the frozen ones (reference) and AdamW's state, its peak RSS
(`ru_maxrss`, libraries included: after the models are built and sharded, after each step, after the fit), each
step's wall time and the memory plan (`lit_rlhf.training.memory_plan`) for its settings. A baseline of 2 processes
measured the same way (DDP over gloo, the same imports and tokenizer, a 3-step fit of an 8 x 8 linear layer) is
subtracted from each peak before it is compared with the plan. Results go to
benchmarks/results/fsdp2_memory_<time>.json and a markdown table to stdout. `--policy smollm2` needs
models/smollm2-135m (or $LIT_RLHF_SMOLLM2).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SMOLLM2 = os.environ.get("LIT_RLHF_SMOLLM2", os.path.join(ROOT, "models", "smollm2-135m"))
TOPICS = os.path.join(ROOT, "configs", "prompts", "smollm2_topics.jsonl")
SETUPS: dict[str, dict[str, Any]] = {
    "smollm2": dict(
        policy=SMOLLM2,
        reward="lit_rlhf.tasks.chat.vader_sentiment_reward",
        prompts=TOPICS,
        max_new_tokens=16,
        max_prompt_length=48,
    ),
    "builtin": dict(
        policy="builtin:digits",
        reward="lit_rlhf.tasks.digits.sort_digits_reward",
        prompts="builtin:digits",
        max_new_tokens=8,
        max_prompt_length=16,
    ),
}
MIB = 2**20


def local_bytes(tensors: Any) -> int:
    """Bytes this process holds for `tensors`: a DTensor's local shard, a plain tensor whole."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def baseline_worker(args: argparse.Namespace) -> None:
    """What every rank holds besides the RL fit: the interpreter, the libraries, the tokenizer, gloo and
    Lightning's DDP loop (an 8 x 8 linear layer)."""
    import torch

    torch.set_num_threads(1)
    import lit_rlhf  # noqa: F401
    from lit_rlhf.models.loading import load_tokenizer
    from lit_rlhf.rewards.functions import resolve_reward_fns
    from memory_plan import fit_tiny_layer  # benchmarks/ is on the path when run as a script

    setup = SETUPS[args.policy]
    load_tokenizer(setup["policy"])
    resolve_reward_fns([setup["reward"]])
    trainer = fit_tiny_layer(
        args.steps, devices=2, strategy="ddp", enable_progress_bar=False, enable_model_summary=False
    )
    with open(os.path.join(args.out, f"baseline_rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"strategy": "baseline", "rank": trainer.global_rank, "peak_rss_mib": peak_rss_mib()}, f)


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
    from lit_rlhf.training.memory_plan import plan_memory, plan_settings

    setup = SETUPS[args.policy]
    L.seed_everything(0)
    module = RLHFModule(
        policy=setup["policy"],
        reward_fns=[setup["reward"]],
        algorithm=AlgorithmConfig(name="grpo", group_size=2, micro_batch_size=2, kl_coef=0.04),
        sampling=SamplingConfig(max_new_tokens=setup["max_new_tokens"]),
        lr=1e-5,
        memory_check="off",
    )
    data = RolloutDataModule(prompts=setup["prompts"], batch_size=1, max_prompt_length=setup["max_prompt_length"])
    if args.strategy == "fsdp2":
        strategy: Any = ModelParallelStrategy(2, 1, process_group_backend="gloo")  # data x tensor parallel sizes
    else:
        strategy = "ddp"
    steps: list[float] = []
    rss: dict[str, float] = {}
    step_peaks: list[float] = []

    class StepClock(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            rss["setup"] = peak_rss_mib()  # the models built and sharded
            rss["plan"] = plan_memory(plan_settings(pl_module, data, trainer)).total / MIB

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps.append(time.perf_counter() - self.start)
            step_peaks.append(peak_rss_mib())  # after each rollout and its update

    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepClock()],
    )
    trainer.fit(module, data)
    params = list(module.parameters())
    optimizer = trainer.optimizers[0]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    record = {
        "strategy": args.strategy,
        "rank": trainer.global_rank,
        "trainable_mib": local_bytes(p for p in params if p.requires_grad) / MIB,
        "frozen_mib": local_bytes(p for p in params if not p.requires_grad) / MIB,
        "optimizer_mib": local_bytes(state) / MIB,
        "peak_rss_mib": peak_rss_mib(),
        "peak_rss_after_setup_mib": rss["setup"],
        "peak_rss_after_each_step_mib": step_peaks,
        "step_s": steps,
        "plan_mib": rss["plan"],
    }
    with open(os.path.join(args.out, f"{args.strategy}_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(record, f)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(strategy: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", NODE_RANK="0")
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    command = [sys.executable, __file__, "--worker", "--strategy", strategy, "--policy", args.policy]
    command += ["--steps", str(args.steps), "--out", args.out]
    procs = [subprocess.Popen(command, env=dict(env, LOCAL_RANK=str(rank))) for rank in (0, 1)]
    if any(proc.wait() != 0 for proc in procs):
        raise SystemExit(f"the {strategy} run failed")
    records = []
    for rank in (0, 1):
        with open(os.path.join(args.out, f"{strategy}_rank{rank}.json")) as f:
            records.append(json.load(f))
    return records


def table(records: list[dict[str, Any]], baseline: list[float]) -> str:
    rows = [
        f"baseline peak RSS (rank 0 / 1): {baseline[0]:.0f} / {baseline[1]:.0f} MiB",
        "| strategy | rank | trainable params (MiB) | optimizer state (MiB) | params + optimizer (MiB) | frozen "
        "reference (MiB) | peak RSS after setup / step 1 / fit (MiB) | median step (s) | plan (MiB) | fit peak "
        "minus baseline (MiB) | plan error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        both = r["trainable_mib"] + r["optimizer_mib"]
        measured = r["peak_rss_mib"] - baseline[r["rank"]]
        setup, first, fit = r["peak_rss_after_setup_mib"], r["peak_rss_after_each_step_mib"][0], r["peak_rss_mib"]
        peaks = f"{setup:.0f} / {first:.0f} / {fit:.0f}"
        rows.append(
            f"| {r['strategy']} | {r['rank']} | {r['trainable_mib']:.1f} | {r['optimizer_mib']:.1f} | {both:.1f} | "
            f"{r['frozen_mib']:.1f} | {peaks} | {statistics.median(r['step_s']):.2f} | {r['plan_mib']:.0f} | "
            f"{measured:.0f} | {(r['plan_mib'] - measured) / measured:+.0%} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", choices=sorted(SETUPS), default="smollm2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--strategies", nargs="+", choices=("ddp", "fsdp2"), default=["ddp", "fsdp2"])
    parser.add_argument("--strategy", choices=("ddp", "fsdp2", "baseline"), help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)  # the workers' per-rank records
    args = parser.parse_args()
    if args.worker:
        baseline_worker(args) if args.strategy == "baseline" else worker(args)
        return
    with tempfile.TemporaryDirectory() as args.out:
        baseline = [r["peak_rss_mib"] for r in launch("baseline", args)]
        records = [r for strategy in args.strategies for r in launch(strategy, args)]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", f"fsdp2_memory_{stamp}.json"), "w") as f:
        summary = {"policy": args.policy, "steps": args.steps, "baseline_mib": baseline, "records": records}
        json.dump(summary, f, indent=1)
    print(table(records, baseline))


if __name__ == "__main__":
    main()
