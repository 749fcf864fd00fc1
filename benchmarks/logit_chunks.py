"""The chunk size of the log-probs computed from the LM head's input (`algorithm.logit_chunk_tokens`,
`lit_rlhf/algorithms/chunked_logprobs.py`): time of one forward + backward of `head_stats` (log-prob and entropy
of every token, gradients for the hidden states and a trainable head) per chunk size and vocabulary slice, against
the same computed from the full (N, V) logits with autograd, in one process, the settings interleaved.

    python benchmarks/logit_chunks.py                       # the shapes below, 3 repeats each
    python benchmarks/logit_chunks.py --shapes smollm2 --repeats 5

The workspace a block needs (its logits in float32 and the few temporaries of the same size) is what the memory
plan counts; the peak resident memory of each setting is measured in a child process of its own (`--memory`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

SHAPES = {  # name: (tokens N, hidden H, vocabulary V)
    "smollm2": (512, 576, 49152),  # SmolLM2-135M: 16 rows x 32 tokens
    "tiny-qwen-vocab": (2048, 128, 151936),  # issue 48's workload at 128 tokens: 16 rows x 128
    "qwen-0.5b": (1024, 896, 151936),  # Qwen2.5-0.5B's head
}
CHUNKS = [128, 256, 512, 1024]
SLICES = [4096, 8192, 16384, 32768]


def inputs(shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N, H, V = shape
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=generator)
    weight = torch.randn(V, H, generator=generator) / H**0.5
    tokens = torch.randint(0, V, (N,), generator=generator)
    return hidden, weight, tokens


def chunked_step(hidden, weight, tokens, chunk: int, vocab_slice: int) -> float:
    from lit_rlhf.algorithms.chunked_logprobs import Head, head_stats

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    start = time.perf_counter()
    stats = head_stats(h, tokens, Head(w), 1.0, None, True, chunk, vocab_slice)
    assert stats.entropy is not None
    (stats.logprobs.sum() + 0.01 * stats.entropy.sum()).backward()
    return time.perf_counter() - start


def full_step(hidden, weight, tokens) -> float:
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    start = time.perf_counter()
    logp = torch.log_softmax(h @ w.T, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    (logp.gather(1, tokens[:, None]).sum() + 0.01 * entropy.sum()).backward()
    return time.perf_counter() - start


def settings() -> list[tuple[int, int] | None]:
    return [None, *[(c, s) for c in CHUNKS for s in SLICES]]


def label(setting: tuple[int, int] | None) -> str:
    return "full logits" if setting is None else f"{setting[0]} x {setting[1]}"


def run_one(data: tuple[torch.Tensor, torch.Tensor, torch.Tensor], setting: tuple[int, int] | None) -> float:
    if setting is None:
        return full_step(*data)
    return chunked_step(*data, *setting)


def memory_child(shape: str, setting: tuple[int, int] | None) -> float:
    """Peak RSS growth (MiB) of one step over its inputs, in a process of its own."""
    data = inputs(SHAPES[shape])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run_one(data, setting)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory", action="store_true", help="also the peak RSS of each setting (a child each)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        shape, chunk, vocab_slice = args.child
        setting = None if chunk == "full" else (int(chunk), int(vocab_slice))
        print(json.dumps({"peak_mib": memory_child(shape, setting)}))
        return
    print(f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    for shape in args.shapes:
        times: dict[str, list[float]] = {label(s): [] for s in settings()}
        data = inputs(SHAPES[shape])
        run_one(data, (1024, 32768))  # warm-up
        for _ in range(args.repeats):
            for setting in settings():  # interleaved: load hits every setting alike
                times[label(setting)].append(run_one(data, setting))
        N, H, V = SHAPES[shape]
        print(f"\n{shape}: N {N}, H {H}, V {V}\n\n| chunk x slice | step s (median) | vs full logits | peak MiB |")
        print("|---|---|---|---|")
        full = statistics.median(times["full logits"])
        for setting in settings():
            peak = ""
            if args.memory:
                chunk, vocab_slice = ("full", "0") if setting is None else map(str, setting)
                command = [sys.executable, __file__, "--child", shape, chunk, vocab_slice, "--threads", "1"]
                out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
                peak = f"{json.loads(out.splitlines()[-1])['peak_mib']:.0f}"
            median = statistics.median(times[label(setting)])
            print(f"| {label(setting)} | {median:.3f} | {median / full:.2f}x | {peak} |")


if __name__ == "__main__":
    main()
