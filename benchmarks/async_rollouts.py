"""Asynchronous rollouts (`algorithm.max_staleness`) against synchronous ones with a vLLM server, on the SmolLM2
arithmetic recipe (configs/smollm2_arithmetic.yaml: LoRA r 8, GRPO, 4 prompts x 8 samples, <= 24 new tokens).

    OMP_NUM_THREADS=1 python benchmarks/async_rollouts.py --staleness 0 1 2 --seeds 0 1 --rollouts 10
    # in the vLLM environment (docs/vllm.md), with models/smollm2-135m (scripts/prepare_smollm2.py)

The server is pinned to CPU core 0 and training to core 1 (`os.sched_setaffinity`), so sampling and the update
overlap only with max_staleness > 0. Each (staleness, seed) is one fit of `--rollouts` rollouts through the server
(`sampling.vllm.mode: server`), then the held-out exact accuracy on the 200 validation problems (greedy, through
the same server). It prints, per run, the mean seconds per step after the first (the first also pushes the first
weights), rollouts per hour, the ratio to staleness 0 of the same seed, and the held-out accuracy; then where the
time of a step goes (means over the steps after the first, from the module's `time/*` metrics): `rollout` (with
staleness 0: pushing the weights, sampling and scoring; else mostly the wait for the producer),
`generate` (sampling alone, on the producer's thread when staleness > 0), `evaluate` (reference and old log-probs)
and `update`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


PHASES = ("time/rollout_s", "time/generate_s", "time/evaluate_s", "time/update_s")


def run(k: int, seed: int, rollouts: int, url: str, model: str) -> tuple[list[float], float, dict[str, float]]:
    """One fit; (seconds per step, held-out exact accuracy, mean seconds of each phase after the first step)."""
    import lightning as L

    from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
    from lit_rlhf.config import VLLMConfig

    class Times(L.Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.phases: list[dict[str, float]] = []

        def on_train_batch_start(self, *args: object) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(
            self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            assert isinstance(module, RLHFModule)
            self.seconds.append(time.perf_counter() - self.start)
            self.phases.append({name: module.step_metrics[name] for name in PHASES})

    L.seed_everything(seed, verbose=False)
    exact = "lit_rlhf.rewards.verifiable.exact_answer"
    module = RLHFModule(
        policy=model,
        reward_fns=[exact, "lit_rlhf.rewards.verifiable.format_reward"],
        reward_weights=[1.0, 0.1],
        metric_fns=[exact],
        algorithm=AlgorithmConfig(name="grpo", group_size=8, kl_coef=0.04, max_staleness=k),
        sampling=SamplingConfig(max_new_tokens=24, backend="vllm", vllm=VLLMConfig(mode="server", server_url=url)),
        lr=5e-4,
        lora={"r": 8, "alpha": 16, "target_modules": "all-linear"},
        log_samples_every_n_steps=0,
    )
    prompts = os.path.join(ROOT, "configs", "prompts", "smollm2_arithmetic_{}.jsonl")
    data = RolloutDataModule(
        prompts=prompts.format("train"), val_prompts=prompts.format("val"), batch_size=4, val_batch_size=100,
        max_prompt_length=128,
    )  # fmt: skip
    times = Times()
    trainer = L.Trainer(
        max_steps=rollouts, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[times],
    )  # fmt: skip
    trainer.fit(module, data)
    accuracy = trainer.validate(module, data, verbose=False)[0]["val/exact_answer"]
    phases = {name: statistics.mean(step[name] for step in times.phases[1:]) for name in PHASES}
    return times.seconds, float(accuracy), phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rollouts", type=int, default=10)
    parser.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    from vllm_server import start_server, stop_server  # scripts/vllm_server.py

    os.sched_setaffinity(0, {0})  # the server inherits core 0
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "async_vllm_server.log"), "w") as log:
        server, url = start_server(args.model, log)
        os.sched_setaffinity(0, {1})  # training on core 1
        rows = []
        try:
            for seed in args.seeds:
                for k in args.staleness:
                    seconds, accuracy, phases = run(k, seed, args.rollouts, url, args.model)
                    rows.append((k, seed, statistics.mean(seconds[1:]), seconds[0], accuracy, phases))
                    print(f"staleness {k} seed {seed}: {rows[-1][2]:.2f} s/step, held-out {accuracy:.3f}", flush=True)
        finally:
            stop_server(server)
    base = {seed: step for k, seed, step, *_ in rows if k == 0}
    print("\n| max_staleness | seed | s/step (after the 1st) | 1st step s | rollouts/hour | vs 0 | held-out exact |")
    print("|---|---|---|---|---|---|---|")
    for k, seed, step, first, accuracy, _ in rows:
        ratio = f"{base[seed] / step:.2f}x" if seed in base else ""
        print(f"| {k} | {seed} | {step:.2f} | {first:.2f} | {3600 / step:.0f} | {ratio} | {accuracy:.3f} |")
    print("\n| max_staleness | seed | rollout s | generate s | evaluate s | update s |")
    print("|---|---|---|---|---|---|")
    for k, seed, *_, phases in rows:
        print(f"| {k} | {seed} | " + " | ".join(f"{phases[name]:.2f}" for name in PHASES) + " |")


if __name__ == "__main__":
    main()
