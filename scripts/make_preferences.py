"""Write the built-in digit-sorting preference set as JSONL files (train.jsonl and val.jsonl).

    python scripts/make_preferences.py --out data/digits_prefs            # train.jsonl (4000) + val.jsonl (500)
    python scripts/make_preferences.py --out data/p --train 1000 --val 200 --seed 3

Rows are `{"prompt": "3142>", "chosen": "1234", "rejected": "1324"}`: the format `PreferenceDataModule`
reads. `PreferenceDataModule(train="builtin:digits")` makes the same rows in memory without files; the pairs
are made by `lit_rlhf.tasks.digits.digits_preference_pairs`.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from lit_rlhf.tasks.digits import digits_preference_pairs
from lit_rlhf.training.reward_model_training import HELD_OUT_SEED_OFFSET


def write_jsonl(rows: list[dict[str, Any]], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/digits_prefs", help="folder for train.jsonl and val.jsonl")
    parser.add_argument("--train", type=int, default=4000, help="training pairs")
    parser.add_argument("--val", type=int, default=500, help="held-out pairs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_jsonl(digits_preference_pairs(args.train, args.seed), os.path.join(args.out, "train.jsonl"))
    val_rows = digits_preference_pairs(args.val, args.seed + HELD_OUT_SEED_OFFSET)
    write_jsonl(val_rows, os.path.join(args.out, "val.jsonl"))
    print(f"wrote {args.train} training and {args.val} held-out pairs to {args.out}/(train|val).jsonl")


if __name__ == "__main__":
    main()
