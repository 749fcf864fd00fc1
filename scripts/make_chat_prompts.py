"""Write a prompt set as JSONL: chat rows (`messages`, rendered by the policy tokenizer's chat template) or
plain prompts. Rows come from `lit_rlhf.tasks.chat` (sentiment) and the verifiable tasks (arithmetic,
word_problems, countdown), with their answer columns.

python scripts/make_chat_prompts.py --task sentiment --out configs/prompts/smollm2_topics.jsonl
python scripts/make_chat_prompts.py --task arithmetic --digits 2 --ops '+-' --unique --n 1200 \
    --holdout 200 --holdout-out configs/prompts/smollm2_arithmetic_val.jsonl \
    --out configs/prompts/smollm2_arithmetic_train.jsonl

`--unique` keeps the first occurrence of each prompt; `--holdout N` writes the first N rows to `--holdout-out`
and the rest to `--out`, so no held-out prompt is trained on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from collections.abc import Iterator
from typing import Any

from lit_rlhf.tasks.arithmetic import arithmetic_prompts
from lit_rlhf.tasks.chat import sentiment_rows
from lit_rlhf.tasks.countdown import countdown_prompts
from lit_rlhf.tasks.word_problems import word_problem_prompts

MAX_DRAWS_PER_ROW = 100
"""`--unique` stops after this many draws per wanted row (a small task has fewer distinct prompts than asked)."""


def task_stream(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The rows the arguments ask for, in the chosen format."""
    chat = args.format == "messages"
    if args.task == "sentiment":
        return iter(sentiment_rows(chat))
    if args.task == "arithmetic":
        return arithmetic_prompts(
            args.seed, args.digits, args.ops, args.steps, args.answer_format, chat, args.max_operand
        )
    if args.task == "word_problems":
        return word_problem_prompts(args.seed, answer_format=args.answer_format, chat=chat)
    return countdown_prompts(args.seed, args.count, args.max_number, args.max_target, chat)


def unique_rows(stream: Iterator[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """Up to `n` rows of `stream` with distinct prompts, in order of first appearance."""
    seen: dict[str, dict[str, Any]] = {}
    for row in itertools.islice(stream, n * MAX_DRAWS_PER_ROW):
        seen.setdefault(json.dumps(row.get("messages", row.get("prompt")), sort_keys=True), row)
        if len(seen) == n:
            break
    return list(seen.values())


def write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} prompts to {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a prompt set as JSONL.")
    parser.add_argument(
        "--task", choices=("sentiment", "arithmetic", "word_problems", "countdown"), default="sentiment"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--format", choices=("messages", "plain"), default="messages")
    parser.add_argument("--n", type=int, default=64, help="prompts (all but sentiment), held-out ones included")
    parser.add_argument("--unique", action="store_true", help="no prompt twice")
    parser.add_argument("--holdout", type=int, default=0, help="the first HOLDOUT rows go to --holdout-out")
    parser.add_argument("--holdout-out", help="file of the held-out rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--answer-format", choices=("####", "boxed", "number"), default="####")
    parser.add_argument("--digits", type=int, default=2, help="arithmetic: operands have 1 to DIGITS digits")
    parser.add_argument("--max-operand", type=int, help="arithmetic: operands 1..MAX_OPERAND instead of --digits")
    parser.add_argument("--ops", default="+", help="arithmetic: operators among + - * /")
    parser.add_argument("--steps", type=int, default=1, help="arithmetic: operators per expression")
    parser.add_argument("--count", type=int, default=4, help="countdown: numbers per instance")
    parser.add_argument("--max-number", type=int, default=50, help="countdown")
    parser.add_argument("--max-target", type=int, default=200, help="countdown")
    args = parser.parse_args(argv)
    if args.holdout and not args.holdout_out:
        parser.error("--holdout needs --holdout-out")
    stream = task_stream(args)
    rows = unique_rows(stream, args.n) if args.unique else list(itertools.islice(stream, args.n))
    if args.holdout >= len(rows):
        parser.error(f"--holdout {args.holdout} leaves no training rows out of {len(rows)}")
    if args.holdout:
        write_jsonl(args.holdout_out, rows[: args.holdout])
    write_jsonl(args.out, rows[args.holdout :])


if __name__ == "__main__":
    main()
