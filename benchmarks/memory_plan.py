"""The memory plan (`lit_rlhf.training.memory_plan`, `lit-rlhf-plan`) against the measured peak resident memory
of a short fit on this CPU, one configuration per subprocess.

    python benchmarks/memory_plan.py [--configs tiny-grpo tiny-ppo smollm2-full smollm2-lora] [--steps 2]

Measured = peak RSS (`ru_maxrss`) of a child process that fits `--steps` rollouts, minus the peak RSS of a
baseline child that imports the same libraries (torch, lightning, transformers, peft, lit_rlhf), builds the
tokenizer and fits an 8 x 8 linear layer for as many steps with Lightning (the interpreter, the libraries, torch's
first kernels and Lightning's loop). The plan is computed in the fit's child from the same settings before the
fit. Results go to benchmarks/results/memory_plan_<time>.json and a markdown table to stdout. SmolLM2
configurations need models/smollm2-135m (python scripts/prepare_smollm2.py --out models/smollm2-135m), or the
folder in $LIT_RLHF_SMOLLM2, and are skipped without it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SMOLLM2 = os.environ.get("LIT_RLHF_SMOLLM2", os.path.join(ROOT, "models", "smollm2-135m"))
TOPICS = os.path.join(ROOT, "configs", "prompts", "smollm2_topics.jsonl")
DIGITS_REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"
VADER = "lit_rlhf.tasks.chat.vader_sentiment_reward"

CONFIGS: dict[str, dict] = {
    "tiny-grpo": dict(
        model=dict(policy="builtin:digits", reward_fns=[DIGITS_REWARD], algorithm=dict(name="grpo", group_size=8)),
        sampling=dict(max_new_tokens=8),
        data=dict(prompts="builtin:digits", batch_size=16, max_prompt_length=7),
    ),
    "tiny-ppo": dict(
        model=dict(policy="builtin:digits", reward_fns=[DIGITS_REWARD], algorithm=dict(name="ppo")),
        sampling=dict(max_new_tokens=8),
        data=dict(prompts="builtin:digits", batch_size=64, max_prompt_length=7),
    ),
    "tiny-minimal": dict(  # nearly no terms: what an RL fit costs beyond the baseline whatever the model
        model=dict(policy="builtin:digits", reward_fns=[DIGITS_REWARD], algorithm=dict(name="grpo", group_size=2)),
        sampling=dict(max_new_tokens=2),
        data=dict(prompts="builtin:digits", batch_size=1, max_prompt_length=7),
    ),
    "smollm2-full": dict(
        model=dict(policy=SMOLLM2, reward_fns=[VADER], algorithm=dict(name="grpo", group_size=4, kl_coef=0.04)),
        sampling=dict(max_new_tokens=24),
        data=dict(prompts=TOPICS, batch_size=4, max_prompt_length=48),
    ),
    "smollm2-lora": dict(
        model=dict(
            policy=SMOLLM2,
            reward_fns=[VADER],
            algorithm=dict(name="grpo", group_size=4, kl_coef=0.04),
            lora=dict(r=8, alpha=16),
        ),
        sampling=dict(max_new_tokens=24),
        data=dict(prompts=TOPICS, batch_size=4, max_prompt_length=48),
    ),
}


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fit_tiny_layer(steps: int, **trainer_args: Any) -> Any:
    """A `steps`-step Lightning fit of an 8 x 8 linear layer (manual AdamW steps): Lightning's loop and torch's
    first kernels, for a baseline. Returns the Trainer."""
    import lightning as L
    import torch

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.layer = torch.nn.Linear(8, 8)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            (inputs,) = batch
            self.manual_backward(self.layer(inputs).log_softmax(-1).sum())
            optimizer = self.optimizers()
            assert not isinstance(optimizer, list)
            optimizer.step()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters())

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4 * steps, 8)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, **trainer_args)
    trainer.fit(Tiny(), data)
    return trainer


def baseline(steps: int) -> dict:
    """The same libraries and a `steps`-step Lightning fit of an 8 x 8 linear layer."""
    import lightning  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import lit_rlhf  # noqa: F401
    from lit_rlhf.tasks.digits import builtin_tokenizer

    builtin_tokenizer()
    fit_tiny_layer(steps)
    return {"peak_mib": peak_mib()}


def fit(name: str, steps: int) -> dict:
    import lightning as L

    from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
    from lit_rlhf.training.memory_plan import plan_memory, plan_settings

    config = CONFIGS[name]
    model = dict(config["model"])
    algorithm = AlgorithmConfig(**model.pop("algorithm"))
    sampling = SamplingConfig(**config["sampling"])
    module = RLHFModule(**model, algorithm=algorithm, sampling=sampling, log_samples_every_n_steps=0, lr=1e-5)
    data = RolloutDataModule(**config["data"])
    widths: list[int] = []

    class Widths(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            widths.append(int(batch.input_ids.shape[1]))

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Widths()],
    )
    plan = plan_memory(plan_settings(module, data, trainer))
    trainer.fit(module, data)
    terms = {t.name: round(t.bytes / 2**20, 1) for t in plan.terms}
    return {"peak_mib": peak_mib(), "plan_mib": plan.total / 2**20, "terms": terms, "prompt_widths": widths}


def child(kind: str, steps: int) -> dict:
    command = [sys.executable, __file__, "--worker", kind, "--steps", str(steps)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{kind} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=2, help="rollouts per fit (one optimizer step each)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(1)
        result = baseline(args.steps) if args.worker == "baseline" else fit(args.worker, args.steps)
        print("RESULT " + json.dumps(result), flush=True)
        return
    base = child("baseline", args.steps)["peak_mib"]
    rows = []
    for name in args.configs:
        if name.startswith("smollm2") and not os.path.isfile(os.path.join(SMOLLM2, "config.json")):
            print(f"{name}: skipped, {SMOLLM2} is missing", file=sys.stderr)
            continue
        result = child(name, args.steps)
        measured = result["peak_mib"] - base
        error = 100 * (result["plan_mib"] - measured) / measured
        rows.append({"config": name, "baseline_mib": base, "measured_mib": measured, "error_pct": error, **result})
        print(f"| {name} | {result['plan_mib']:.0f} | {measured:.0f} | {error:+.0f}% |", flush=True)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    with open(os.path.join(HERE, "results", f"memory_plan_{stamp}.json"), "w", encoding="utf-8") as f:
        json.dump({"baseline_mib": base, "steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
