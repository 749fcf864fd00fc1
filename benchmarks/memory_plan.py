"""The memory plan (`lit_rlhf.training.memory_plan`, `lit-rlhf-plan`) against the measured peak resident memory
of a short fit on this CPU, one configuration per subprocess.

    python benchmarks/memory_plan.py                       # the six configurations of docs/memory.md
    python benchmarks/memory_plan.py --configs tiny-grpo tiny-ppo --repeats 5
    python benchmarks/memory_plan.py --configs smollm2-arithmetic smollm2-arithmetic-full-length
    python benchmarks/memory_plan.py --plan-only           # the plans' tables, nothing fitted

Measured = peak RSS of a child process that fits `--steps` rollouts (seeded: the same prompts and draws each run),
minus the peak RSS (`ru_maxrss`) of a baseline child that imports the same libraries (torch, lightning,
transformers, peft, lit_rlhf), builds the tokenizer and fits an 8 x 8 linear layer for as many steps with Lightning
(the interpreter, the libraries, torch's first kernels and Lightning's loop). The large-vocabulary rows
(`benchmarks/large_vocab.py`'s workload: a tiny Qwen2-shaped model over 151,936 ids, 2 prompts x 8 samples, k3 KL
at 0.04, every response forced to full length by an EOS bias) build its 151,936-word tokenizer too, so their
baseline child builds it as well. `--repeats` fits each configuration that many times and reports the median and
the range (the tiny rows vary by several MiB between runs). The fit's child reads its peak per phase (`VmHWM`,
reset through /proc/self/clear_refs after each phase): before the first rollout (the models load), sampling,
phase 3 (the reference's and the policy's forwards) and the update; its peak is the largest (`--trim` returns the
allocator's free memory at each phase's end, to see the phases apart). The plan is computed in the fit's child from
the same settings before the fit, and again at the widest prompt batch met (the plan counts `max_prompt_length`).
Results go to benchmarks/results/memory_plan_<time>.json and a markdown table to stdout. SmolLM2 configurations
need models/smollm2-135m (python scripts/prepare_smollm2.py --out models/smollm2-135m), or the folder in
$LIT_RLHF_SMOLLM2, and are skipped without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
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
ARITHMETIC = os.path.join(ROOT, "configs", "prompts", "smollm2_arithmetic_train.jsonl")

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
    "smollm2-arithmetic": dict(  # configs/smollm2_arithmetic.yaml's training settings (no held-out evaluation)
        model=dict(
            policy=SMOLLM2,
            reward_fns=["lit_rlhf.rewards.verifiable.exact_answer", "lit_rlhf.rewards.verifiable.format_reward"],
            reward_weights=[1.0, 0.1],
            algorithm=dict(name="grpo", group_size=8, kl_coef=0.04),
            lora=dict(r=8, alpha=16, target_modules="all-linear"),
            lr=5e-4,
        ),
        sampling=dict(max_new_tokens=24, temperature=1.0),
        data=dict(prompts=ARITHMETIC, batch_size=4, max_prompt_length=128),
    ),
    # the same with every response forced to max_new_tokens (EOS never sampled: large_vocab.py's EOS bias), as the
    # plan assumes
    "smollm2-arithmetic-full-length": dict(full_length=True),
    "large-vocab-128": dict(large_vocab=128),  # benchmarks/large_vocab.py's workload, 128 response tokens
    "large-vocab-512": dict(large_vocab=512),
}
DEFAULT_CONFIGS = ["tiny-grpo", "tiny-ppo", "smollm2-full", "smollm2-lora", "large-vocab-128", "large-vocab-512"]
PHASES = ("setup", "rollout", "experience", "update")


def status_mib(field: str) -> float:
    """`field` (VmRSS, VmHWM) of /proc/self/status in MiB (nan where there is none)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class PhasePeaks:
    """The peak RSS of each phase of a fit: VmHWM read at the phase's end, then reset to the current RSS
    (5 > /proc/self/clear_refs). The reset lowers `ru_maxrss` too, so the fit's peak is the largest phase's.
    `trim`: glibc's `malloc_trim(0)` before each reset, so a phase starts without the memory the allocator kept from
    the one before (a diagnosis of the phases; a fit's real peak includes what the allocator keeps)."""

    def __init__(self, trim: bool = False) -> None:
        self.peaks: dict[str, float] = {}
        self.trim = trim

    def mark(self, phase: str) -> None:
        self.peaks[phase] = max(self.peaks.get(phase, 0.0), status_mib("VmHWM"))
        if self.trim:
            import ctypes

            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
                handle.write("5")
        except OSError:
            pass

    def peak(self) -> float:
        values = [*self.peaks.values(), status_mib("VmHWM"), peak_mib() if not self.peaks else 0.0]
        return max(value for value in values if value == value)  # nan (no /proc) left out


def large_vocab_module() -> Any:
    """benchmarks/large_vocab.py, imported from this folder."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import large_vocab

    return large_vocab


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


def baseline(steps: int, word_tokenizer: bool = False) -> dict:
    """The same libraries and a `steps`-step Lightning fit of an 8 x 8 linear layer (`word_tokenizer`: and the
    large-vocabulary rows' 151,936-word tokenizer)."""
    import lightning  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import lit_rlhf  # noqa: F401
    from lit_rlhf.tasks.digits import builtin_tokenizer

    builtin_tokenizer()
    tokenizer = large_vocab_module().word_tokenizer() if word_tokenizer else None
    fit_tiny_layer(steps)
    del tokenizer
    return {"peak_mib": peak_mib()}


def build(name: str, steps: int, module_class: Any = None) -> tuple[Any, Any, Any]:
    """The module (of `module_class`, an `RLHFModule` subclass; None: RLHFModule), DataModule and Trainer of
    configuration `name`, for `steps` rollouts."""
    import lightning as L

    from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig

    module_class = module_class or RLHFModule
    config = CONFIGS[name]
    L.seed_everything(0, verbose=False)  # the same prompts and draws in every run
    if "large_vocab" in config:
        lv = large_vocab_module()
        tokenizer = lv.word_tokenizer()
        policy = lv.build_model(tokenizer)
        lv.forbid_eos(policy, tokenizer.eos_token_id)
        algorithm = AlgorithmConfig(name="grpo", group_size=lv.GROUP, kl_coef=lv.KL_COEF)
        module = module_class(
            policy=policy,
            tokenizer=tokenizer,
            reward_fns=[lv.vowel_reward],
            algorithm=algorithm,
            sampling=SamplingConfig(max_new_tokens=config["large_vocab"]),
            lr=lv.LR,
            log_samples_every_n_steps=0,
        )
        prompts = lv.make_prompts() * steps  # one batch of the two prompts per step
        data = RolloutDataModule(prompts=prompts, batch_size=lv.PROMPTS, max_prompt_length=64, shuffle=False)
    else:
        if config.get("full_length"):
            config = full_length(CONFIGS["smollm2-arithmetic"])
        model = dict(config["model"])
        algorithm = AlgorithmConfig(**model.pop("algorithm"))
        sampling = SamplingConfig(**config["sampling"])
        model.setdefault("lr", 1e-5)
        module = module_class(**model, algorithm=algorithm, sampling=sampling, log_samples_every_n_steps=0)
        data = RolloutDataModule(**config["data"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return module, data, trainer


def full_length(config: dict) -> dict:
    """`config` with its policy loaded (float32) and given large_vocab.py's EOS bias, so every response runs to
    max_new_tokens; the tokenizer stays the folder's."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = config["model"]["policy"]
    policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    large_vocab_module().forbid_eos(policy, policy.config.eos_token_id)
    return {**config, "model": {**config["model"], "policy": policy, "tokenizer": folder}}


def plan_only(name: str) -> Any:
    """Configuration `name`'s memory plan (nothing fitted)."""
    from lit_rlhf.training.memory_plan import plan_memory, plan_settings

    module, data, trainer = build(name, 1)
    return plan_memory(plan_settings(module, data, trainer))


def fit(name: str, steps: int) -> dict:
    import lightning as L

    from lit_rlhf import RLHFModule
    from lit_rlhf.training.memory_plan import plan_memory, plan_settings

    phases = PhasePeaks(trim=os.environ.get("MEMORY_PLAN_TRIM") == "1")
    lengths: list[float] = []
    widths: list[int] = []

    class Measured(RLHFModule):
        """Marks the end of each phase of a training step, and keeps the prompt widths and response lengths."""

        def make_rollout(self, prompts: Any) -> Any:
            phases.mark("setup" if not phases.peaks else "update")
            widths.append(int(prompts.input_ids.shape[1]))
            out = super().make_rollout(prompts)
            phases.mark("rollout")
            return out

        def make_experience(self, rollout: Any) -> Any:
            out = super().make_experience(rollout)
            phases.mark("experience")
            return out

        def on_experience(self, experience: Any) -> None:
            lengths.extend(experience.response_mask.sum(1).float().tolist())

    module, data, trainer = build(name, steps, Measured)
    assert isinstance(trainer, L.Trainer)
    settings = plan_settings(module, data, trainer)
    plan = plan_memory(settings)
    trainer.fit(module, data)
    phases.mark("update")
    terms = {t.name: round(t.bytes / 2**20, 1) for t in plan.terms}
    phase_plan = {p: plan.phase(p) / 2**20 for p in ("persistent", "rollout", "update")}
    # the plan counts `max_prompt_length` prompt tokens; the batches were only as wide as their longest prompt
    at_width = plan_memory(dataclasses.replace(settings, prompt_tokens=max(widths)))
    return {
        "peak_mib": phases.peak(),
        "phase_peaks_mib": phases.peaks,
        "plan_mib": plan.total / 2**20,
        "plan_at_prompt_width_mib": at_width.total / 2**20,
        "plan_phases_mib": phase_plan,
        "terms": terms,
        "prompt_widths": widths,
        "response_lengths": lengths,
    }


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
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=2, help="rollouts per fit (one optimizer step each)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="fits per configuration, each in a fresh child: the median is reported"
    )
    parser.add_argument(
        "--trim",
        action="store_true",
        help="malloc_trim(0) at each phase's end: the phases' own peaks, not the fit's real one (a diagnosis)",
    )
    parser.add_argument("--plan-only", action="store_true", help="print each configuration's plan, fit nothing")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plan_only:
        for name in args.configs:
            print(f"{name}:\n{plan_only(name).table()}\n", flush=True)
        return
    if args.trim:
        os.environ["MEMORY_PLAN_TRIM"] = "1"
    if args.worker:
        import torch

        torch.set_num_threads(1)
        if args.worker.startswith("baseline"):
            result = baseline(args.steps, word_tokenizer=args.worker == "baseline-words")
        else:
            result = fit(args.worker, args.steps)
        print("RESULT " + json.dumps(result), flush=True)
        return
    baselines: dict[str, float] = {}
    rows = []
    print(
        "| configuration | plan MiB | measured MiB | error | plan at the prompts' width MiB | "
        "phase peaks (setup / rollout / experience / update) |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.configs:
        if name.startswith("smollm2") and not os.path.isfile(os.path.join(SMOLLM2, "config.json")):
            print(f"{name}: skipped, {SMOLLM2} is missing", file=sys.stderr)
            continue
        kind = "baseline-words" if "large_vocab" in CONFIGS[name] else "baseline"
        if kind not in baselines:
            baselines[kind] = child(kind, args.steps)["peak_mib"]
        base = baselines[kind]
        runs = [child(name, args.steps) for _ in range(args.repeats)]
        result = sorted(runs, key=lambda run: run["peak_mib"])[(len(runs) - 1) // 2]  # the median (lower middle)
        measured = result["peak_mib"] - base
        error = 100 * (result["plan_mib"] - measured) / measured
        spread = [run["peak_mib"] - base for run in runs]
        rows.append(
            {"config": name, "baseline_mib": base, "measured_mib": measured, "error_pct": error, **result}
            | {"measured_runs_mib": spread}
        )
        peaks = " / ".join(f"{result['phase_peaks_mib'].get(p, float('nan')) - base:.0f}" for p in PHASES)
        at_width, width = result["plan_at_prompt_width_mib"], max(result["prompt_widths"])
        runs_text = f" ({min(spread):.0f}-{max(spread):.0f})" if len(runs) > 1 else ""
        cells = f"{result['plan_mib']:.0f} | {measured:.0f}{runs_text} | {error:+.0f}% | {at_width:.0f} (P {width})"
        print(f"| {name} | {cells} | {peaks} |", flush=True)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    with open(os.path.join(HERE, "results", f"memory_plan_{stamp}.json"), "w", encoding="utf-8") as f:
        report = {"baselines_mib": baselines, "steps": args.steps, "repeats": args.repeats, "rows": rows}
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
