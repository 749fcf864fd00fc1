"""Chat tokenizers and tiny policies built offline in the shapes of Llama-3's and Qwen2.5's.

Both keep what makes real chat models stop late when only the tokenizer's EOS is read: the generation config
lists two EOS ids while the tokenizer names one, and the chat template ends a reply with its own token.
"""

from __future__ import annotations

import string

import torch

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _char_tokenizer(specials: list[str], template: str, eos: str, pad: str):
    """A character-level fast tokenizer over printable ASCII whose special tokens come first (ids 0..)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*specials, "<unk>", *dict.fromkeys(string.printable)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos, pad_token=pad, unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": [s for s in specials if s not in (eos, pad)]})
    tok.chat_template = template
    tok.padding_side = "left"
    return tok


def llama3_style():
    """Llama-3 (base-model tokenizer): eos_token `<|end_of_text|>`; a reply ends with `<|eot_id|>`;
    the generation config stops at both. Returns (tokenizer, GenerationConfig)."""
    from transformers import GenerationConfig

    tok = _char_tokenizer(LLAMA3_SPECIALS, LLAMA3_TEMPLATE, eos="<|end_of_text|>", pad="<|end_of_text|>")
    ids = tok.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
    return tok, GenerationConfig(eos_token_id=ids, bos_token_id=tok.convert_tokens_to_ids("<|begin_of_text|>"))


def qwen_style():
    """Qwen2.5-Instruct: eos_token `<|im_end|>`, pad `<|endoftext|>`; the generation config lists
    [`<|im_end|>`, `<|endoftext|>`]. Returns (tokenizer, GenerationConfig)."""
    from transformers import GenerationConfig

    tok = _char_tokenizer(QWEN_SPECIALS, QWEN_TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>")
    ids = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    return tok, GenerationConfig(eos_token_id=ids, pad_token_id=tok.pad_token_id)


def chat_policy(tokenizer, generation_config, seed: int = 0):
    """A seeded one-layer GPT-2 over `tokenizer`'s vocabulary carrying `generation_config` (as from a hub folder)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=256, n_embd=32, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    policy = GPT2LMHeadModel(config)
    policy.generation_config = generation_config
    return policy
