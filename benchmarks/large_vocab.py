"""A large vocabulary (issue 48): one GRPO step of a tiny Qwen2-shaped model with Qwen's 151,936-token vocabulary,
ours (RLHFModule + RolloutDataModule in a Lightning Trainer) and, with `--trl-python`, TRL's GRPOTrainer, each
length in its own fresh process.

    python benchmarks/large_vocab.py --lengths 128 256 512 --trl-python /path/to/venv-trl/bin/python
    python benchmarks/large_vocab.py --lengths 128 --ours-python /other/checkout/.venv/bin/python   # ours only

The model: transformers' Qwen2 (width 128, 2 layers, MLP 512, 4 attention heads, 2 KV heads) with tied embeddings
over 151,936 ids (a ~19.4M-parameter table, nearly all of its ~19.9M parameters), fp32, built from seed 0 on the
CPU; the tokenizer: a word-level `tokenizers` vocabulary of exactly 151,936 tokens (<pad>, <unk>, <eos>, then
letter strings), made offline. 2 prompts x 8 samples, GRPO with k3 KL at 0.04 in the loss (a reference model),
one optimizer step (AdamW, lr 1e-4, gradient norm clipped at 1), one thread. Every response runs to exactly the
length asked for: the LM head (still tied to the embeddings) carries a frozen logits bias of -1e4 on EOS, so EOS
has probability 0 in float32 and is never sampled, in both libraries and in both references (TRL loads its
reference from a saved copy of the model, which gets the same bias).

Per length and implementation: the peak resident memory of the child (VmHWM, reset right after the model and the
tokenizer are built) minus its resident memory at that moment; the wall seconds of the one step (ours: from the
epoch's start to the batch's end; TRL: from `on_train_begin` to `on_step_end`), which includes the step's one-time
costs; the mean generated response length. Markdown table on stdout, everything to
benchmarks/results/large_vocab-<date>-<time>.json (gitignored).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from itertools import product
from string import ascii_lowercase
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

VOCAB = 151_936  # Qwen2/2.5's vocab_size
HIDDEN, LAYERS, MLP, HEADS, KV_HEADS = 128, 2, 4 * 128, 4, 2
PROMPTS, GROUP = 2, 8
KL_COEF, LR, MAX_GRAD_NORM, SEED = 0.04, 1e-4, 1.0, 0
PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"
EOS_BIAS = -1e4  # finite: log-probs and entropies stay finite; exp(-1e4) is 0 in float32


# ----------------------------------------------------------------------------- shared set-up (no lit_rlhf imports)


def words(n: int) -> list[str]:
    """The first `n` lowercase letter strings, shortest first: a, b, ..., z, aa, ab, ..."""
    out: list[str] = []
    size = 1
    while len(out) < n:
        out.extend("".join(letters) for letters in product(ascii_lowercase, repeat=size))
        size += 1
    return out[:n]


def word_tokenizer() -> Any:
    """A word-level fast tokenizer of exactly `VOCAB` tokens: <pad> 0, <unk> 1, <eos> 2, then letter strings."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([PAD, UNK, EOS, *words(VOCAB - 3)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, unk_token=UNK, eos_token=EOS)
    tokenizer.padding_side = "left"
    assert len(tokenizer) == VOCAB and tokenizer.eos_token_id == 2, (len(tokenizer), tokenizer.eos_token_id)
    return tokenizer


def make_prompts() -> list[str]:
    """Two prompts of 16 and 12 words drawn (seeded) from the first 5,000 tokens."""
    import random

    rng = random.Random(SEED)
    pool = words(5000)
    return [" ".join(rng.choice(pool) for _ in range(n)) for n in (16, 12)]


def build_model(tokenizer: Any) -> Any:
    """The Qwen2-shaped policy from seed `SEED`, fp32 (attention dropout 0), its LM head tied to the embeddings."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(SEED)
    return Qwen2ForCausalLM(config).float()


def forbid_eos(model: Any, eos_token_id: int) -> None:
    """Give `model`'s LM head a frozen logits bias of `EOS_BIAS` on EOS (its weight stays the tied embedding): EOS
    is never sampled, so every response runs to the full length."""
    import torch
    from torch import nn

    head = model.get_output_embeddings()
    biased = nn.Linear(head.in_features, head.out_features, bias=False, device="meta")
    biased.weight = head.weight
    bias = torch.zeros(head.out_features, dtype=head.weight.dtype)
    bias[eos_token_id] = EOS_BIAS
    biased.bias = nn.Parameter(bias, requires_grad=False)
    model.set_output_embeddings(biased)


def vowel_reward(prompts: list[Any], responses: list[str], **meta: Any) -> list[float]:
    """The fraction of vowels in the response text (cheap, differs between samples, so advantages are non-zero)."""
    return [sum(c in "aeiou" for c in r) / max(1, len(r)) for r in responses]


def parameters() -> int:
    """The policy's parameters (the tied table counted once; the frozen EOS bias left out)."""
    head_dim = HIDDEN // HEADS
    attention = HIDDEN * HIDDEN * 2 + 2 * (HIDDEN * KV_HEADS * head_dim) + HIDDEN + 2 * KV_HEADS * head_dim
    layer = attention + 3 * HIDDEN * MLP + 2 * HIDDEN
    return VOCAB * HIDDEN + LAYERS * layer + HIDDEN


def status_mib(field: str) -> float:
    """`field` (VmRSS, VmHWM) of /proc/self/status in MiB."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux: 5 > /proc/self/clear_refs); whether it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


def gpu_start(device: str) -> float:
    """The CUDA memory allocated now (MiB), with the peak counter reset; 0 on the CPU."""
    if device != "cuda":
        return 0.0
    import torch

    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated() / 2**20


def gpu_peak(device: str, start: float) -> dict[str, float]:
    """On a GPU: the peak allocated since `gpu_start` (MiB) and its growth; nothing on the CPU."""
    if device != "cuda":
        return {}
    import torch

    peak = torch.cuda.max_memory_allocated() / 2**20
    return {"gpu_start_mib": start, "gpu_peak_mib": peak, "gpu_delta_mib": peak - start}


def memory_after(start_rss: float, reset: bool) -> dict[str, float]:
    """Peak RSS since `start_rss` (VmHWM after a reset, else the process's ru_maxrss) and the difference."""
    peak = status_mib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"start_rss_mib": start_rss, "peak_rss_mib": peak, "delta_mib": peak - start_rss}


# ----------------------------------------------------------------------------- ours: RLHFModule in a Trainer


def run_ours(length: int, device: str) -> dict[str, Any]:
    import inspect

    import lightning as L
    import torch

    import lit_rlhf
    from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig

    tokenizer = word_tokenizer()
    model = build_model(tokenizer).to(device)
    forbid_eos(model, tokenizer.eos_token_id)
    start_rss, reset = status_mib("VmRSS"), reset_peak()
    start_gpu = gpu_start(device)

    lengths: list[float] = []

    class Module(RLHFModule):
        def on_experience(self, experience: Any) -> None:
            lengths.extend(experience.response_mask.sum(1).float().tolist())

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.start = self.step_s = 0.0
            self.metrics: dict[str, float] = {}

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.step_s = time.perf_counter() - self.start
            self.metrics = dict(getattr(pl_module, "step_metrics", None) or {})

    optional: dict[str, Any] = {}
    if "memory_check" in inspect.signature(RLHFModule).parameters:  # an older checkout (--ours-python) lacks it
        optional["memory_check"] = "off"
    module = Module(
        policy=model,
        tokenizer=tokenizer,
        reward_fns=[vowel_reward],
        algorithm=AlgorithmConfig(name="grpo", group_size=GROUP, kl_coef=KL_COEF, ppo_epochs=1, num_minibatches=1),
        sampling=SamplingConfig(max_new_tokens=length),
        lr=LR,
        log_samples_every_n_steps=0,
        **optional,
    )
    data = RolloutDataModule(prompts=make_prompts(), batch_size=PROMPTS, max_prompt_length=64, shuffle=False)
    timer = StepTimer()
    trainer = L.Trainer(
        max_steps=1,
        accelerator="gpu" if device == "cuda" else "cpu",
        precision="bf16-mixed" if device == "cuda" else "32-true",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    torch.manual_seed(SEED)
    trainer.fit(module, data)
    assert trainer.global_step == 1, trainer.global_step
    return {
        **memory_after(start_rss, reset),
        **gpu_peak(device, start_gpu),
        "step_s": timer.step_s,
        "response_lengths": lengths,
        "metrics": {k: float(v) for k, v in timer.metrics.items()},
        "lit_rlhf": os.path.dirname(lit_rlhf.__file__ or ""),
    }


# ----------------------------------------------------------------------------- TRL's GRPOTrainer


def run_trl(length: int, device: str) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same model, prompts, reward, group size, KL and learning rate. TRL builds its
    reference with `from_pretrained(config._name_or_path)`, so the model is saved to a temporary folder first (before
    the EOS bias, which that reference then gets after the trainer is built)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = word_tokenizer()
    model = build_model(tokenizer)
    folder = tempfile.TemporaryDirectory(prefix="large_vocab-")
    model.save_pretrained(folder.name)
    model.config._name_or_path = folder.name
    model = model.to(device)
    forbid_eos(model, tokenizer.eos_token_id)
    dataset = Dataset.from_dict({"prompt": make_prompts()})
    start_rss, reset = status_mib("VmRSS"), reset_peak()
    start_gpu = gpu_start(device)

    lengths: list[float] = []

    def vowel_reward_trl(prompts: list[Any], completions: list[str], completion_ids: Any, **kwargs: Any) -> list[float]:
        lengths.extend(float(len(ids)) for ids in completion_ids)
        return vowel_reward(prompts, completions)

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.start = self.step_s = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.step_s = time.perf_counter() - self.start

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=PROMPTS * GROUP,  # completions, not prompts
            num_generations=GROUP,
            max_completion_length=length,
            temperature=1.0,
            beta=KL_COEF,  # k3 KL in the loss, against a reference model
            num_iterations=1,
            learning_rate=LR,
            lr_scheduler_type="constant",
            max_grad_norm=MAX_GRAD_NORM,
            max_steps=1,
            logging_steps=1,  # logs after on_step_end, outside the timing
            save_strategy="no",
            report_to=[],
            use_cpu=device == "cpu",
            bf16=device == "cuda",  # fp32 on the CPU, bf16 mixed precision on a GPU, as ours
            dataloader_num_workers=0,
            seed=SEED,
            disable_tqdm=True,
            gradient_checkpointing=False,  # TRL's default is on; ours keeps activations
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[vowel_reward_trl],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
        )
        reference = trainer.ref_model
        assert reference is not None, "beta > 0 but TRL built no reference model"
        reference = trainer.accelerator.unwrap_model(reference)
        forbid_eos(reference, tokenizer.eos_token_id)
        assert torch.equal(reference.get_output_embeddings().weight, model.get_output_embeddings().weight)
        trainer.train()
        assert trainer.state.global_step == 1, trainer.state.global_step
    folder.cleanup()
    logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    import trl

    return {
        **memory_after(start_rss, reset),
        **gpu_peak(device, start_gpu),
        "step_s": timer.step_s,
        "response_lengths": lengths,
        "metrics": {k: v for k, v in (logs[-1] if logs else {}).items() if isinstance(v, (int, float))},
        "trl": trl.__version__,
    }


# ----------------------------------------------------------------------------- parent: one child per measurement


def worker(job: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    result = (run_trl if job["impl"] == "trl" else run_ours)(job["length"], job["device"])
    import transformers

    result.update(torch=torch.__version__, transformers=transformers.__version__, python_executable=sys.executable)
    print("RESULT " + json.dumps(result), flush=True)


def child(impl: str, length: int, python: str, device: str, pythonpath: str | None = None) -> dict[str, Any]:
    """One measurement in a fresh process of `python` (`pythonpath` first on its path); {'error': ...} when it
    fails."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        TRANSFORMERS_VERBOSITY="error",
        PYTHONWARNINGS="ignore",
    )
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    job = json.dumps({"impl": impl, "length": length, "device": device})
    start = time.perf_counter()
    done = subprocess.run(
        [python, os.path.abspath(__file__), "--worker", job], capture_output=True, text=True, env=env, cwd=ROOT
    )
    wall = time.perf_counter() - start
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]), wall_s=wall)
    return {"error": f"exit {done.returncode}:\n{done.stderr[-4000:]}", "wall_s": wall}


def cell(result: dict[str, Any] | None, key: str, spec: str) -> str:
    if result is None:
        return ""
    if "error" in result:
        return "failed"
    return format(result[key], spec)


def mean_length(result: dict[str, Any] | None) -> str:
    if result is None or "error" in result:
        return cell(result, "", "")
    lengths = result["response_lengths"]
    return f"{sum(lengths) / len(lengths):.1f} ({min(lengths):.0f}-{max(lengths):.0f})"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "length",
        "fp32 logits MiB",
        "ours MiB",
        "trl MiB",
        "ours/trl MiB",
        "ours step s",
        "trl step s",
        "ours/trl time",
        "ours mean length",
        "trl mean length",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        ours, trl = row.get("ours"), row.get("trl")
        both = ours is not None and trl is not None and "error" not in ours and "error" not in trl
        mib_ratio = f"{ours['delta_mib'] / trl['delta_mib']:.2f}x" if both else ""  # type: ignore[index]
        time_ratio = f"{ours['step_s'] / trl['step_s']:.2f}x" if both else ""  # type: ignore[index]
        cells = [
            str(row["length"]),
            f"{row['logits_mib']:.0f}",
            cell(ours, "delta_mib", ".0f"),
            cell(trl, "delta_mib", ".0f"),
            mib_ratio,
            cell(ours, "step_s", ".2f"),
            cell(trl, "step_s", ".2f"),
            time_ratio,
            mean_length(ours),
            mean_length(trl),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512], help="response lengths")
    parser.add_argument(
        "--ours-python", default=sys.executable, help="the interpreter (and so the lit_rlhf) that runs ours"
    )
    parser.add_argument(
        "--trl-python", default=None, help="an interpreter with trl 1.16 installed: also run TRL's GRPOTrainer"
    )
    parser.add_argument(
        "--ours-pythonpath",
        default=None,
        help="a folder put first on ours' PYTHONPATH: another lit_rlhf (e.g. `git archive` of an earlier commit)",
    )
    parser.add_argument("--skip-ours", action="store_true", help="TRL only (with --trl-python)")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: bf16 mixed precision on the GPU, memory as peak allocated (torch.cuda.max_memory_allocated)",
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(json.loads(args.worker))
        return
    if args.skip_ours and not args.trl_python:
        parser.error("--skip-ours needs --trl-python")

    rows_per_step = PROMPTS * GROUP
    n = parameters()
    floor_delta = 4 * n * 4 / 2**20  # grads + AdamW's two moments of the policy + the reference copy
    print(
        f"Qwen2-shaped, vocabulary {VOCAB:,}, width {HIDDEN}, {LAYERS} layers, {n / 1e6:.2f}M parameters (tied); "
        f"{PROMPTS} prompts x {GROUP} samples, GRPO k3 KL {KL_COEF}, fp32, 1 thread",
        flush=True,
    )
    print(
        f"floor: the built policy {n * 4 / 2**20:.0f} MiB (in the start RSS); beyond it grads + AdamW state + the "
        f"reference copy = {floor_delta:.0f} MiB (the floor of the MiB columns)",
        flush=True,
    )
    report: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "workload": {
            "vocab": VOCAB,
            "hidden": HIDDEN,
            "layers": LAYERS,
            "intermediate": MLP,
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "parameters": n,
            "prompts": PROMPTS,
            "group_size": GROUP,
            "kl_coef": KL_COEF,
            "lr": LR,
            "eos_bias": EOS_BIAS,
        },
        "floor_delta_mib": floor_delta,
        "policy_mib": n * 4 / 2**20,
        "ours_python": None if args.skip_ours else args.ours_python,
        "trl_python": args.trl_python,
        "rows": [],
    }
    rows: list[dict[str, Any]] = report["rows"]
    for length in args.lengths:
        row: dict[str, Any] = {"length": length, "logits_mib": rows_per_step * length * VOCAB * 4 / 2**20}
        print(
            f"length {length}: one fp32 logits tensor {rows_per_step} x {length} x {VOCAB:,} x 4 B = "
            f"{row['logits_mib']:.0f} MiB",
            flush=True,
        )
        jobs = ([] if args.skip_ours else [("ours", args.ours_python)]) + (
            [("trl", args.trl_python)] if args.trl_python else []
        )
        for impl, python in jobs:
            print(f"  {impl} ...", flush=True)
            result = child(impl, length, python, args.device, args.ours_pythonpath if impl == "ours" else None)
            row[impl] = result
            if "error" in result:
                print(f"  {impl} failed after {result['wall_s']:.0f} s: {result['error']}", flush=True)
            else:
                print(
                    f"  {impl}: +{result['delta_mib']:.0f} MiB (start {result['start_rss_mib']:.0f}, peak "
                    f"{result['peak_rss_mib']:.0f}), step {result['step_s']:.2f} s, mean response length "
                    f"{mean_length(result)}, process {result['wall_s']:.0f} s",
                    flush=True,
                )
        rows.append(row)
    print()
    print(table(rows))
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = os.path.join(args.out, f"large_vocab-{stamp}.json")
    with open(path, "w") as handle:
        json.dump(report, handle, indent=1, default=str)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
