"""The built-in offline task: sort a short string of digits.

Everything is made locally: a character tokenizer trained with `tokenizers`, a from-scratch tiny GPT-2,
an endless seeded prompt stream, and a partial-credit reward. Select it with `builtin:digits` as the
policy/tokenizer name and `lit_rlhf.builtin.sort_digits_reward` as the reward function.

A prompt is the digits followed by '>', e.g. '3142>'; the right answer is '1234' then EOS.
"""

from __future__ import annotations

import random
from typing import Any, Iterator, Sequence

DIGITS = "0123456789"
SEPARATOR = ">"
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"

TASKS = ("digits",)


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown built-in task {task!r}; available: {', '.join('builtin:' + t for t in TASKS)}")


def builtin_tokenizer(task: str = "digits"):
    """A character-level fast tokenizer over digits and '>', trained offline with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    _check_task(task)
    core = Tokenizer(models.WordLevel(unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(special_tokens=[PAD, EOS, UNK])
    core.train_from_iterator([DIGITS + SEPARATOR], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    tokenizer.padding_side = "left"
    return tokenizer


def builtin_policy(task: str = "digits", n_layer: int = 2, n_embd: int = 128, n_head: int = 4):
    """A from-scratch GPT-2 small enough for a CPU (about 400k parameters), no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = builtin_tokenizer(task)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=64,
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
    hits = sum(1 for a, b in zip(target, response) if a == b)
    right_length = len(response) == len(target)
    return (hits + right_length) / (max(len(target), len(response)) + 1)


def sort_digits_reward(prompts: Sequence[str], responses: Sequence[str], **meta: Any) -> list[float]:
    """Reward function for the built-in task: one partial-credit score per (prompt, response)."""
    return [sort_digits_score(p, r) for p, r in zip(prompts, responses)]


def builtin_reward_model(task: str = "digits", n_layer: int = 2, n_embd: int = 64, n_head: int = 4):
    """A from-scratch GPT-2 sequence classifier with one output, on the config of `builtin_policy` (same
    vocabulary and special ids, pad_token_id set), to train as a reward model with `lit_rlhf.reward_training`."""
    from transformers import GPT2ForSequenceClassification

    config = builtin_policy(task, n_layer=n_layer, n_embd=n_embd, n_head=n_head).config
    config.num_labels = 1
    return GPT2ForSequenceClassification(config)
