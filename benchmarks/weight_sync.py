"""What one vLLM weight sync costs: seconds and bytes moved per optimizer step for SmolLM2-135M-Instruct, full
fine-tuning and LoRA (r 8, alpha 16, every linear layer, as configs/smollm2_arithmetic.yaml), colocate and server.

    OMP_NUM_THREADS=1 python benchmarks/weight_sync.py                           # this tree
    OMP_NUM_THREADS=1 python benchmarks/weight_sync.py --tree /tmp/wt_before     # an earlier checkout (git worktree)
    # in the vLLM environment (docs/vllm.md), with models/smollm2-135m (scripts/prepare_smollm2.py)

`--tree` imports lit_rlhf and scripts/vllm_server.py from another checkout, so "before" is the old code path itself.
Each (mode, training) builds the backend once (colocate: an engine; server: a server of its own, started for
LoRA adapters where that tree's script can), then changes the trainable weights and calls `sync_weights` `--syncs`
times. The seconds are measured around `sync_weights`; the bytes are those the backend reports (`last_sync`) or, for
a tree whose backends report none, the full merged state dict, which that code sent at every sync. After the last
sync the largest |log-prob(vLLM) - log-prob(trainer)| over sampled tokens is printed (exactness kept). The load average
before and after is printed: on a shared machine compare ratios from runs under a similar load.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nudge(policy, seed: int) -> None:
    """Change every trainable weight a little, as an optimizer step does."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in policy.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 1e-3)


def measure(mode: str, lora: bool, model: str, url: str | None, syncs: int) -> tuple[list[float], int, float]:
    """(seconds of each sync, bytes per sync, largest log-prob gap after the last sync)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_rlhf import SamplingConfig
    from lit_rlhf.config import VLLMConfig
    from lit_rlhf.models.lora import apply_lora
    from lit_rlhf.rollout.backends.base import BackendContext
    from lit_rlhf.rollout.backends.registry import make_backend
    from lit_rlhf.rollout.backends.vllm_common import policy_weights

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    if lora:
        policy = apply_lora(policy, {"r": 8, "alpha": 16, "target_modules": "all-linear"})
    vllm = VLLMConfig(mode=mode, max_model_len=256, **({"server_url": url} if url else {}))  # type: ignore[arg-type]
    sampling = SamplingConfig(max_new_tokens=8, backend="vllm", vllm=vllm)
    backend = make_backend(BackendContext(policy, tokenizer.eos_token_id, tokenizer.pad_token_id, sampling))
    seconds, sent = [], 0
    try:
        for step in range(syncs):
            nudge(policy, step)
            start = time.perf_counter()
            backend.sync_weights(policy)
            seconds.append(time.perf_counter() - start)
            reported = getattr(backend, "last_sync", None)
            sent = (
                reported[1] if reported else sum(t.numel() * t.element_size() for t in policy_weights(policy).values())
            )
        gap = largest_gap(policy, backend, tokenizer, sampling)
    finally:
        backend.close()
    return seconds, sent, gap


def largest_gap(policy, backend, tokenizer, sampling) -> float:
    """max |trainer log-prob - vLLM's| over the tokens vLLM samples for two prompts."""
    import torch

    from lit_rlhf.types import PromptBatch

    texts = ["Hello, how are", "The capital of France is"]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    gen = backend.generate(PromptBatch(encoded["input_ids"], encoded["attention_mask"], texts), 2, sampling)
    ids = torch.cat([gen.prompt_ids, gen.response_ids], 1)
    mask = torch.cat([gen.prompt_mask, gen.response_mask.long()], 1)
    width = gen.response_ids.shape[1]
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=mask).logits[:, -width - 1 : -1].float()
    ours = torch.log_softmax(logits, -1).gather(-1, gen.response_ids[..., None]).squeeze(-1)
    return float((ours - gen.logprobs).abs()[gen.response_mask].max())


def load_average() -> str:
    with open("/proc/loadavg") as file:
        return " ".join(file.read().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=ROOT, help="the checkout whose lit_rlhf and scripts/ are measured")
    parser.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m"))
    parser.add_argument("--modes", nargs="+", default=["colocate", "server"])
    parser.add_argument("--syncs", type=int, default=4)
    args = parser.parse_args()
    sys.path[:0] = [args.tree, os.path.join(args.tree, "scripts")]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    torch.set_num_threads(1)
    import lit_rlhf
    from vllm_server import start_server, stop_server

    print(f"lit_rlhf from {os.path.dirname(lit_rlhf.__file__)}; load average {load_average()}", flush=True)
    rows = []
    for mode in args.modes:
        for lora in (False, True):
            server, url = None, None
            if mode == "server":  # full weights go to a server without LoRA, adapters to one with it
                lora_ready = lora and "lora_rank" in inspect.signature(start_server).parameters
                log = open(os.path.join("/tmp", f"weight_sync_server_{os.getpid()}.log"), "w")  # noqa: SIM115
                server, url = start_server(args.model, log, **({"lora_rank": 8} if lora_ready else {}))
            try:
                seconds, sent, gap = measure(mode, lora, args.model, url, args.syncs)
            finally:
                if server is not None:
                    stop_server(server)
            rows.append((mode, "LoRA r8" if lora else "full", seconds, sent, gap))
            print(f"{mode} {rows[-1][1]}: {statistics.median(seconds[1:]):.3f} s, {sent / 1e6:.1f} MB", flush=True)
    print(f"load average at the end {load_average()}")
    print("\n| mode | training | sync s (median after the 1st) | each sync s | MB per sync | largest gap after |")
    print("|---|---|---|---|---|---|")
    for mode, training, seconds, sent, gap in rows:
        each = " ".join(f"{s:.2f}" for s in seconds)
        print(f"| {mode} | {training} | {statistics.median(seconds[1:]):.3f} | {each} | {sent / 1e6:.1f} | {gap:.1e} |")


if __name__ == "__main__":
    main()
