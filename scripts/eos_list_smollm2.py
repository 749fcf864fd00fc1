"""GRPO on a chat model whose end of turn is in its generation config's EOS list, not its tokenizer's EOS: do the
responses end at end of turn? SmolLM2-135M-Instruct re-shipped the way Llama-3 and Qwen checkpoints are
(tokenizer `eos_token: <|endoftext|>`, generation config `eos_token_id: [<|im_end|>, <|endoftext|>]`), trained
for a few GRPO steps on `builtin:arithmetic_chat`; `rollout/frac_truncated` per step is printed beside the share
of Hugging Face `generate` answers (the model's own generation config) that run to `max_new_tokens`.

    python scripts/eos_list_smollm2.py                  # the stop ids lit_rlhf uses (union of all three)
    python scripts/eos_list_smollm2.py --tokenizer-eos-only   # as before the fix: the tokenizer's EOS only

Needs the prepared folder models/smollm2-135m (scripts/prepare_smollm2.py). Results: docs/real-models.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import lightning as L
import torch

from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.training import rollouts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
END_OF_TURN, END_OF_TEXT = "<|im_end|>", "<|endoftext|>"


def reship(source: str, folder: str) -> str:
    """A copy of the SmolLM2 folder with the tokenizer's EOS (and pad) `<|endoftext|>` and the generation config's
    EOS list [`<|im_end|>`, `<|endoftext|>`], as Llama-3 and Qwen2.5 chat checkpoints ship."""
    shutil.copytree(source, folder, dirs_exist_ok=True)
    with open(os.path.join(folder, "tokenizer.json")) as handle:
        ids = {t["content"]: t["id"] for t in json.load(handle)["added_tokens"]}
    edit(os.path.join(folder, "tokenizer_config.json"), eos_token=END_OF_TEXT, pad_token=END_OF_TEXT)
    edit(
        os.path.join(folder, "generation_config.json"),
        eos_token_id=[ids[END_OF_TURN], ids[END_OF_TEXT]],
        pad_token_id=ids[END_OF_TEXT],
    )
    return folder


def edit(path: str, **values: object) -> None:
    with open(path) as handle:
        settings = json.load(handle)
    settings.update(values)
    with open(path, "w") as handle:
        json.dump(settings, handle, indent=2)


def hf_generate_truncated(folder: str, max_new_tokens: int, n_prompts: int, temperature: float = 1.0) -> float:
    """The share of `generate` answers (sampled, the model's own generation config) with no stop id in them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_rlhf.tasks.arithmetic import arithmetic_prompts

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    stops = set(model.generation_config.eos_token_id)
    rows = [row for _, row in zip(range(n_prompts), arithmetic_prompts(seed=1, chat=True), strict=False)]
    truncated = 0
    torch.manual_seed(0)
    for row in rows:
        ids = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature)
        truncated += not stops & set(out[0, ids.shape[1] :].tolist())
    return truncated / len(rows)


class FracTruncated(L.Callback):
    """Collects `rollout/frac_truncated` after every rollout."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(trainer.callback_metrics["rollout/frac_truncated"]))


def train(folder: str, steps: int, max_new_tokens: int, root: str, temperature: float = 1.0) -> list[float]:
    """`rollout/frac_truncated` of each of `steps` GRPO steps (2 prompts x 4 answers, LoRA, one thread)."""
    torch.manual_seed(0)
    module = RLHFModule(
        policy=folder,
        reward_fns=["lit_rlhf.rewards.verifiable.exact_answer"],
        algorithm=AlgorithmConfig(name="grpo", group_size=4, kl_coef=0.04),
        sampling=SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature),
        lr=5e-4,
        lora={"r": 8, "alpha": 16, "target_modules": "all-linear"},
        log_samples_every_n_steps=0,
    )
    data = RolloutDataModule(prompts="builtin:arithmetic_chat", batch_size=2, max_prompt_length=128)
    frac = FracTruncated()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        default_root_dir=root,
        callbacks=[frac],
    )
    trainer.fit(module, data)
    return frac.values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--hf-prompts", type=int, default=8, help="prompts for the HF generate check (0: skip it)")
    parser.add_argument("--tokenizer-eos-only", action="store_true", help="stop at the tokenizer's EOS only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.tokenizer_eos_only:  # the stop ids before the fix
        rollouts.stop_token_ids = lambda tokenizer, config=None: (tokenizer.eos_token_id,)  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as root:
        folder = reship(args.model, os.path.join(root, "model"))
        start = time.perf_counter()
        if args.hf_prompts:
            share = hf_generate_truncated(folder, args.max_new_tokens, args.hf_prompts, args.temperature)
            print(f"HF generate: {share:.2f} of {args.hf_prompts} answers ran to {args.max_new_tokens} tokens")
        values = train(folder, args.steps, args.max_new_tokens, root, args.temperature)
        stops = "tokenizer EOS only" if args.tokenizer_eos_only else "union of stop ids"
        print(f"GRPO ({stops}): rollout/frac_truncated per step {[round(v, 2) for v in values]}")
        print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
