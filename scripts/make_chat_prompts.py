"""Write a ChatML prompt set for SmolLM2-Instruct as JSONL (rows from `lit_rlhf.tasks.chat`).

python scripts/make_chat_prompts.py --task sentiment --out configs/prompts/smollm2_topics.jsonl
python scripts/make_chat_prompts.py --task arithmetic --out configs/prompts/smollm2_arithmetic.jsonl
"""

from __future__ import annotations

import argparse
import json
import os

from lit_rlhf.tasks.chat import arithmetic_rows, sentiment_rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a ChatML prompt set for SmolLM2 as JSONL.")
    parser.add_argument("--task", choices=("sentiment", "arithmetic"), default="sentiment")
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=64, help="arithmetic prompts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = sentiment_rows(args.seed) if args.task == "sentiment" else arithmetic_rows(args.n, args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
