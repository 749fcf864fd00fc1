"""Phase 3 and the update of a GRPO step with the rows in one padded batch against in length groups
(`algorithm.length_groups`), on SmolLM2-135M-Instruct with LoRA, in one process, alternating.

    python scripts/prepare_smollm2.py --out models/smollm2-135m      # once
    OMP_NUM_THREADS=1 python benchmarks/length_groups.py [--repeats 3]

The workload is the side by side with TRL's (docs/migrating-from-trl.md): 4 chat prompts of the arithmetic task x 8
samples, responses of at most 24 tokens, LoRA r 8 on every linear layer, fp32. What is timed is what a step does
after sampling: the reference's forward (adapters off, no grad), the policy's forward with grad and its backward
through the response log-probs. The response lengths (`PROFILES`) have the mean, the longest and the number of at
most 12 tokens measured in rollouts of ours on seed 1 of that run at steps 1 and 20; the tokens are random (the
cost does not depend on them), the rows shuffled. Prints the median seconds of each variant and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from smollm2_lora import FOLDER, chat_prompts, lora_policy

MAX_NEW_TOKENS = 24
PROFILES = {  # measured: step 1 mean 18.5, 8 of 32 at most 12 tokens; step 20 mean 11.2, 28 of 32; both longest 24
    "step 1": [24] * 17 + [19, 17, 15, 15, 14, 14, 13] + [12, 11, 10, 10, 9, 9, 8, 8],
    "step 20": [24, 24, 17, 14] + [12] * 2 + [11] * 2 + [10] * 17 + [9] * 7,
}


def build(folder: str) -> tuple[torch.nn.Module, torch.nn.Module, list[list[int]]]:
    from lit_rlhf.models.lora import AdapterDisabledReference

    policy, tokenizer = lora_policy(folder)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in chat_prompts(tokenizer)]
    return policy, AdapterDisabledReference(policy), prompts


def batch(prompts: list[list[int]], lengths: list[int], group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts, each `group_size` times, and random responses of `lengths` tokens: (B, P+T) twice."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(lengths), width + MAX_NEW_TOKENS, dtype=torch.long)
    mask = torch.zeros_like(ids)
    generator = torch.Generator().manual_seed(0)
    for row, length in enumerate(lengths):
        prompt = prompts[row // group_size]
        ids[row, width - len(prompt) : width] = torch.tensor(prompt)
        mask[row, width - len(prompt) : width + length] = 1
        ids[row, width : width + length] = torch.randint(100, 40000, (length,), generator=generator)
    return ids, mask


def step_after_sampling(policy, reference, ids, mask, groups: int) -> float:
    from lit_rlhf.algorithms.chunked_logprobs import head_stats
    from lit_rlhf.models.forward import causal_lm_response_forward

    valid = mask[:, -MAX_NEW_TOKENS:].bool()
    tokens = ids[:, -MAX_NEW_TOKENS:][valid]
    start = time.perf_counter()
    with torch.no_grad():
        ref = causal_lm_response_forward(reference, ids, mask, MAX_NEW_TOKENS, True, groups)
        head_stats(ref.head_inputs[valid], tokens, ref.head, entropy=False)
    forward = causal_lm_response_forward(policy, ids, mask, MAX_NEW_TOKENS, True, groups)
    head_stats(forward.head_inputs[valid], tokens, forward.head).logprobs.sum().backward()
    policy.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default=FOLDER)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    policy, reference, prompts = build(args.folder)
    print(f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    for name, lengths in PROFILES.items():
        assert len(lengths) == 32, (name, len(lengths))
        shuffled = [lengths[i] for i in torch.randperm(32, generator=torch.Generator().manual_seed(1)).tolist()]
        ids, mask = batch(prompts, shuffled, 8)
        step_after_sampling(policy, reference, ids, mask, 1)  # warm-up
        times: dict[int, list[float]] = {1: [], 4: []}
        for _ in range(args.repeats):
            for groups in times:
                times[groups].append(step_after_sampling(policy, reference, ids, mask, groups))
        padded, grouped = statistics.median(times[1]), statistics.median(times[4])
        print(
            f"{name}: padded {padded:.2f} s, 4 length groups {grouped:.2f} s, ratio {grouped / padded:.2f} "
            f"(runs {[round(t, 2) for t in times[1]]} / {[round(t, 2) for t in times[4]]})"
        )


if __name__ == "__main__":
    main()
