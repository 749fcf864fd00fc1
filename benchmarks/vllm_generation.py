"""Generation on W4's rollouts through three rollout backends in one process: the lean sampler, a colocated vLLM
engine and a vLLM server (SmolLM2-135M-Instruct, float32, 2 chat prompts x 8 samples, up to 48 new tokens).

    python benchmarks/vllm_generation.py --rounds 3      # in the vLLM environment (docs/vllm.md)

Each round samples one batch with each backend in turn (the same prompts; different random draws), so machine
load hits all three alike; it prints the median seconds per batch, the sampled tokens per second and each
backend's speed relative to the lean sampler. Needs models/smollm2-135m (scripts/prepare_smollm2.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "scripts")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m"))
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_rlhf.config import SamplingConfig, VLLMConfig
    from lit_rlhf.rollout.backends.base import BackendContext
    from lit_rlhf.rollout.backends.registry import make_backend
    from lit_rlhf.types import PromptBatch
    from run import w4_prompts  # benchmarks/run.py: W4's chat prompts
    from vllm_server import start_server, stop_server  # scripts/vllm_server.py

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    texts = w4_prompts(tokenizer, 2)
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    prompts = PromptBatch(encoded["input_ids"], encoded["attention_mask"], texts)
    with open(os.devnull, "w") as log:
        server, url = start_server(args.model, log)
        try:
            settings = {
                "lean": SamplingConfig(max_new_tokens=48),
                "vllm-colocate": SamplingConfig(max_new_tokens=48, backend="vllm", vllm=VLLMConfig(max_model_len=512)),
                "vllm-server": SamplingConfig(
                    max_new_tokens=48, backend="vllm", vllm=VLLMConfig(mode="server", server_url=url)
                ),
            }
            ids = tokenizer.eos_token_id, tokenizer.pad_token_id
            backends = {name: make_backend(BackendContext(policy, *ids, s)) for name, s in settings.items()}
            times: dict[str, list[float]] = {name: [] for name in settings}
            tokens: dict[str, list[int]] = {name: [] for name in settings}
            for round_ in range(args.rounds + 1):  # the first round warms up
                for name, backend in backends.items():
                    start = time.perf_counter()
                    gen = backend.generate(prompts, 8, settings[name])
                    if round_:
                        times[name].append(time.perf_counter() - start)
                        tokens[name].append(int(gen.response_mask.sum()))
        finally:
            stop_server(server)
    lean = statistics.median(t / n for t, n in zip(times["lean"], tokens["lean"], strict=True))
    print("| backend | s per batch (median) | tokens per batch (median) | tokens/s | speed vs lean |")
    print("|---|---|---|---|---|")
    for name in settings:
        per_token = statistics.median(t / n for t, n in zip(times[name], tokens[name], strict=True))
        print(
            f"| {name} | {statistics.median(times[name]):.2f} | {statistics.median(tokens[name]):.0f} | "
            f"{1 / per_token:.1f} | {lean / per_token:.2f}x |"
        )


if __name__ == "__main__":
    main()
