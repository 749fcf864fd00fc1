"""A preference set for the built-in digit-sorting task, generated and labelled by a rule.

Each pair is two candidate responses to one prompt of `builtin.sort_digits_prompts`; the one with the higher
`builtin.sort_digits_score` is `chosen`, the other `rejected` (ties are redrawn). Candidates mix the kinds of
answers a policy produces while it learns: random strings (as a from-scratch policy writes), the prompt's
digits copied, partly sorted answers, answers with wrong digits, too short or too long, and the right one.

    python -m lit_rlhf.make_preferences --out data/digits_prefs            # train.jsonl (4000) + val.jsonl (500)
    python -m lit_rlhf.make_preferences --out data/p --train 1000 --val 200 --seed 3

Rows are `{"prompt": "3142>", "chosen": "1234", "rejected": "1324"}`: the format `PreferenceDataModule`
reads. `PreferenceDataModule(train="builtin:digits")` makes the same rows in memory without files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Any, Callable, Iterator

from lit_rlhf.builtin import DIGITS, SEPARATOR, sort_digits_prompts, sort_digits_score

# The validation split draws from a different stream, so held-out pairs are not the training pairs.
VAL_SEED_OFFSET = 1_000_003


def _random_digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(DIGITS) for _ in range(n))


def _swap(rng: random.Random, text: str, times: int) -> str:
    chars = list(text)
    for _ in range(times):
        if len(chars) < 2:
            break
        i, j = rng.sample(range(len(chars)), 2)
        chars[i], chars[j] = chars[j], chars[i]
    return "".join(chars)


def _substitute(rng: random.Random, text: str, times: int) -> str:
    chars = list(text)
    for _ in range(times):
        if chars:
            chars[rng.randrange(len(chars))] = rng.choice(DIGITS)
    return "".join(chars)


def candidate_response(rng: random.Random, digits: str) -> str:
    """One candidate answer to the prompt `digits + '>'`, of a randomly chosen kind."""
    target = "".join(sorted(digits))
    kinds: list[Callable[[], str]] = [
        lambda: target,
        lambda: _swap(rng, target, rng.randint(1, 2)),
        lambda: _substitute(rng, target, rng.randint(1, 2)),
        lambda: target[: rng.randint(0, len(target) - 1)],
        lambda: target + _random_digits(rng, rng.randint(1, 3)),
        lambda: digits,
        lambda: target[::-1],
        lambda: _random_digits(rng, rng.randint(1, 8)),
        lambda: "".join(rng.choice(DIGITS + SEPARATOR) for _ in range(rng.randint(1, 8))),
        lambda: "",
    ]
    return rng.choice(kinds)()


def digits_preference_pairs(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` rows {prompt, chosen, rejected} labelled by `sort_digits_score`, reproducible from `seed`."""
    rng = random.Random(seed)
    prompts: Iterator[dict[str, Any]] = sort_digits_prompts(seed=seed)
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        prompt = next(prompts)["prompt"]
        digits = prompt[: -len(SEPARATOR)]
        for _ in range(20):  # redraw ties
            a, b = candidate_response(rng, digits), candidate_response(rng, digits)
            score_a, score_b = sort_digits_score(prompt, a), sort_digits_score(prompt, b)
            if score_a != score_b:
                break
        else:
            continue
        chosen, rejected = (a, b) if score_a > score_b else (b, a)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


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
    write_jsonl(digits_preference_pairs(args.val, args.seed + VAL_SEED_OFFSET), os.path.join(args.out, "val.jsonl"))
    print(f"wrote {args.train} training and {args.val} held-out pairs to {args.out}/(train|val).jsonl")


if __name__ == "__main__":
    main()
