"""The lean sampler with and without skipping finished rows (`sample(skip_finished=...)`), in one process:
SmolLM2-135M-Instruct in float32 with a LoRA (r 8, alpha 16, every linear layer), 4 chat prompts from
configs/prompts/smollm2_arithmetic_train.jsonl x 8 samples, up to 24 new tokens, temperature 1.

    OMP_NUM_THREADS=1 python benchmarks/decode_compaction.py --rounds 3

Two cases: the tokenizer's EOS (the untrained model's responses are long), and an `early` EOS, the token that
ends the most rows before the last step when taken as EOS (the shape of a trained policy: most rows end early, a
few run to the limit). Each round times, per case, the loop without skipping, then with it for each
`--compact-below` value (`sampler.COMPACT_BELOW`), all from the same generator seed, so machine load hits them
alike; it prints the median seconds, the ratio to skipping off, and the rows each decode step ran. Needs
models/smollm2-135m (scripts/prepare_smollm2.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from lit_rlhf.rollout import sampler
from smollm2_lora import FOLDER, chat_prompts, lora_policy

GROUP, MAX_NEW_TOKENS, SEED = 8, 24, 0


@dataclass
class Batch:
    """One case: the prompts and the EOS (and pad) the sampler is given."""

    input_ids: Tensor  # (4, P) left-padded prompts
    attention_mask: Tensor  # (4, P)
    eos: int
    pad: int


def timed_sample(model: nn.Module, batch: Batch, skip_finished: bool) -> tuple[float, Tensor]:
    """(seconds, response ids (B, T)) of one `sample` call from generator seed SEED."""
    start = time.perf_counter()
    out = sampler.sample(
        model,
        batch.input_ids,
        batch.attention_mask,
        MAX_NEW_TOKENS,
        batch.eos,
        batch.pad,
        generator=torch.Generator().manual_seed(SEED),
        group_size=GROUP,
        skip_finished=skip_finished,
    )
    return time.perf_counter() - start, out.response_ids


def decode_rows(model: nn.Module, batch: Batch) -> list[int]:
    """The rows of each decode-step forward (one new column) with skipping on."""
    rows: list[int] = []

    def record(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, Tensor]) -> None:
        if kwargs["input_ids"].shape[1] == 1:
            rows.append(kwargs["input_ids"].shape[0])

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        timed_sample(model, batch, skip_finished=True)
    finally:
        handle.remove()
    return rows


def early_eos(response_ids: Tensor, pad: int) -> int:
    """The token of `response_ids` (B, T) that, taken as EOS, ends the most rows before the last step while
    leaving at least one row to run to the limit."""
    before_last = response_ids[:, :-1]
    counts = {v: int((before_last == v).any(1).sum()) for v in before_last.unique().tolist() if v != pad}
    return max((v for v in counts if counts[v] < response_ids.shape[0]), key=lambda v: counts[v])


def response_lengths(response_ids: Tensor, eos: int) -> Tensor:
    """(B, T) -> (B,) float: the tokens up to and including each row's first EOS."""
    is_eos = (response_ids == eos).long()
    return ((is_eos.cumsum(1) - is_eos) == 0).sum(1).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compact-below", type=float, nargs="+", default=[sampler.COMPACT_BELOW])
    parser.add_argument("--model", default=FOLDER)
    args = parser.parse_args()
    torch.set_num_threads(1)
    policy, tokenizer = lora_policy(args.model)
    model = policy.eval()
    tokenizer.padding_side = "left"
    enc = tokenizer(chat_prompts(tokenizer), return_tensors="pt", padding=True, add_special_tokens=False)
    batch = Batch(enc["input_ids"], enc["attention_mask"], tokenizer.eos_token_id, tokenizer.pad_token_id)
    _, never_ending = timed_sample(model, replace(batch, eos=-1), skip_finished=False)
    early = early_eos(never_ending, batch.pad)
    cases = {"eos": batch, "early": replace(batch, eos=early)}
    print(f"prompts {tuple(batch.input_ids.shape)} x group {GROUP}; early EOS: {early} {tokenizer.decode([early])!r}")

    variants = {"off": None, **{f"on@{f}": f for f in args.compact_below}}
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    responses: dict[str, Tensor] = {}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for case, case_batch in cases.items():
            for variant, compact_below in variants.items():
                if compact_below is not None:
                    sampler.COMPACT_BELOW = compact_below
                seconds, ids = timed_sample(model, case_batch, skip_finished=compact_below is not None)
                assert torch.equal(ids, responses.setdefault(case, ids)), (case, variant)  # the same draws
                if round_:
                    times[case, variant].append(seconds)
    for case, case_batch in cases.items():
        ids, lengths = responses[case], response_lengths(responses[case], case_batch.eos)
        print(f"\n{case}: {ids.shape[1]} steps, response length mean {lengths.mean():.1f}, max {lengths.max():.0f}")
        off = statistics.median(times[case, "off"])
        for variant, compact_below in variants.items():
            median = statistics.median(times[case, variant])
            line = f"  {variant}: median {median:.2f} s of {args.rounds}, {median / off:.2f}x of off"
            if compact_below is not None:
                sampler.COMPACT_BELOW = compact_below
                line += f"; decode rows per step {decode_rows(model, case_batch)}"
            print(line)
    print("\nuptime:", os.popen("uptime").read().strip())


if __name__ == "__main__":
    main()
