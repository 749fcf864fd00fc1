"""The built-in offline task: sort a short string of digits.

Everything is made locally: a character tokenizer trained with `tokenizers`, a from-scratch tiny GPT-2,
an endless seeded prompt stream, a partial-credit reward, and rule-labelled preference pairs for reward-model
training. Select it with `builtin:digits` as the policy/tokenizer/prompts/preference name and
`lit_rlhf.tasks.digits.sort_digits_reward` as the reward function.

A prompt is the digits followed by '>', e.g. '3142>'; the right answer is '1234' then EOS.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lit_rlhf.registry import Task

DIGITS = "0123456789"
SEPARATOR = ">"
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


def builtin_tokenizer():
    """A character-level fast tokenizer over digits and '>', trained offline with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(special_tokens=[PAD, EOS, UNK])
    core.train_from_iterator([DIGITS + SEPARATOR], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_gpt2(tokenizer: Any, n_layer: int, n_embd: int, n_head: int, n_positions: int):
    """A from-scratch GPT-2 over `tokenizer`'s vocabulary (its EOS as BOS, its pad token), no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPT2LMHeadModel(config)


def builtin_policy(n_layer: int = 2, n_embd: int = 128, n_head: int = 4):
    """A from-scratch GPT-2 small enough for a CPU (about 400k parameters), no dropout."""
    return tiny_gpt2(builtin_tokenizer(), n_layer, n_embd, n_head, n_positions=64)


def sort_digits_prompts(seed: int = 0, min_digits: int = 3, max_digits: int = 5) -> Iterator[dict[str, Any]]:
    """An endless, seeded stream of prompts {'prompt': '3142>', 'target': '1234'}."""
    rng = random.Random(seed)
    while True:
        n = rng.randint(min_digits, max_digits)
        digits = "".join(rng.choice(DIGITS) for _ in range(n))
        yield {"prompt": digits + SEPARATOR, "target": "".join(sorted(digits))}


def sort_digits_score(prompt: str, response: str) -> float:
    """Partial credit in [0, 1]: one point per digit in its sorted place, one for the right length,
    over (the longer of answer and response) + 1. '1234' for '3142>' scores 1; '12' scores 2/5."""
    target = "".join(sorted(prompt.split(SEPARATOR)[0]))
    response = response.strip()
    hits = sum(1 for a, b in zip(target, response, strict=False) if a == b)
    right_length = len(response) == len(target)
    return (hits + right_length) / (max(len(target), len(response)) + 1)


def sort_digits_reward(prompts: Sequence[str], responses: Sequence[str], **meta: Any) -> list[float]:
    """Reward function for the built-in task: one partial-credit score per (prompt, response)."""
    return [sort_digits_score(p, r) for p, r in zip(prompts, responses, strict=True)]


def sorted_exactly(prompts: Sequence[str], responses: Sequence[str], **meta: Any) -> list[float]:
    """Held-out metric: 1.0 when the response is exactly the sorted digits (surrounding spaces aside), else 0.0."""
    return [float(r.strip() == "".join(sorted(p.split(SEPARATOR)[0]))) for p, r in zip(prompts, responses, strict=True)]


def builtin_reward_model(n_layer: int = 2, n_embd: int = 64, n_head: int = 4):
    """A from-scratch GPT-2 sequence classifier with one output, on the config of `builtin_policy` (same
    vocabulary and special ids, pad_token_id set), to train as a reward model with
    `lit_rlhf.training.reward_model_training`."""
    from transformers import GPT2ForSequenceClassification

    config = builtin_policy(n_layer=n_layer, n_embd=n_embd, n_head=n_head).config
    config.num_labels = 1
    return GPT2ForSequenceClassification(config)


# ----------------------------------------------------------------------------- preference pairs
# Each pair is two candidate responses to one prompt of `sort_digits_prompts`; the one with the higher
# `sort_digits_score` is `chosen`, the other `rejected` (ties are redrawn). Candidates mix the kinds of answers
# a policy produces while it learns: random strings, the prompt's digits copied, partly sorted answers,
# answers with wrong digits, too short or too long, and the right one.


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


TASK = Task(
    name="digits",
    tokenizer=builtin_tokenizer,
    policy=builtin_policy,
    prompts=lambda seed: sort_digits_prompts(seed=seed),
    reward_model=builtin_reward_model,
    preference_pairs=digits_preference_pairs,
)
