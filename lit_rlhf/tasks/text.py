"""What the English-text tasks (`arithmetic`, `word_problems`, `countdown`) share: the prompt row format, the
answer instructions, and a character tokenizer with a tiny GPT-2 so their `builtin:<name>` works offline.

A row is `{"prompt": text, ...columns}` or, with `chat=True`, `{"messages": [{"role": "user", "content": text}],
...columns}` for a policy with a chat template. The tiny model cannot read English: it makes the tasks runnable in
tests; train a pretrained chat model on them for results.
"""

from __future__ import annotations

import string
from typing import Any

from lit_rlhf.rewards.verifiable import FORMATS
from lit_rlhf.tasks.digits import tiny_gpt2

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARACTERS = "".join(sorted(set(string.printable) - set("\t\r\x0b\x0c")))
"""The character vocabulary: printable ASCII, space and newline."""

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
"""The tiny tokenizer's chat template: each message's text on its own line (no roles)."""

INSTRUCTIONS = {
    "####": "Give the final answer on the last line as '#### <number>'.",
    "boxed": "Put the final answer in \\boxed{}.",
    "number": "Answer with just the number.",
}
"""What each prompt adds to say how to answer, per answer format (see `lit_rlhf.rewards.verifiable`)."""


def check_format(answer_format: str) -> str:
    if answer_format not in FORMATS:
        raise ValueError(f"answer_format must be one of {FORMATS}, got {answer_format!r}")
    return answer_format


def make_row(text: str, chat: bool, **columns: Any) -> dict[str, Any]:
    """A prompt row: the user text as `prompt`, or as one user message in `messages` when `chat`."""
    if chat:
        return {"messages": [{"role": "user", "content": text}], **columns}
    return {"prompt": text, **columns}


def text_tokenizer():
    """A character-level fast tokenizer over printable ASCII with `<pad>`, `<eos>`, `<unk>` and `CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.train_from_iterator([CHARACTERS], trainer=trainers.WordLevelTrainer(special_tokens=[PAD, EOS, UNK]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    tokenizer.padding_side = "left"
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def text_policy(n_layer: int = 2, n_embd: int = 128, n_head: int = 4, n_positions: int = 512):
    """A from-scratch GPT-2 over `text_tokenizer`'s vocabulary, no dropout; prompts here run to ~300 characters."""
    return tiny_gpt2(text_tokenizer(), n_layer, n_embd, n_head, n_positions)
