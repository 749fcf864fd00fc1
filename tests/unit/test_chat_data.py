"""Chat prompts through tiny tokenizers (one whose post-processor adds a BOS, one without), special-token
spellings kept as text, and the columns a reward function needs; expectations written out by hand."""

from __future__ import annotations

import functools

import pytest

from lit_rlhf.config import ConfigError
from lit_rlhf.data import chat
from lit_rlhf.data.chat import encode_chat
from lit_rlhf.data.prompts import PromptTokenizer
from lit_rlhf.rewards.columns import check_columns, required_columns
from lit_rlhf.rewards.functions import call_reward_fn

CHARS = "abcdefghijklmnopqrstuvwxyz <>|/:?!.,\n0123456789"
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PLAIN_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"


def char_tokenizer(bos: bool, template: str | None):
    """Character-level: ids 0..6 are SPECIALS, then one id per character of CHARS; `bos` adds <s> (id 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + list(CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    if bos:
        core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"],
    )
    tok.chat_template = template
    return tok


def chars(text: str) -> list[int]:
    return [len(SPECIALS) + CHARS.index(c) for c in text]


BOS, EOS, USER, ASSISTANT, SYSTEM = 1, 2, 4, 5, 6


def test_chat_prompt_has_exactly_one_bos_and_the_rendered_text():
    tok = char_tokenizer(bos=True, template=BOS_TEMPLATE)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    batch = PromptTokenizer(tok, 64, "error", "prompt")([{"prompt": messages}, {"prompt": "ok"}])
    assert batch.texts == ["<s><|system|>be brief\n<|user|>hi\n<|assistant|>", "ok"]
    chat_ids = [BOS, SYSTEM, *chars("be brief\n"), USER, *chars("hi\n"), ASSISTANT]
    assert batch.input_ids[0].tolist() == chat_ids
    assert batch.input_ids[1].tolist() == [0] * (len(chat_ids) - 3) + [BOS, *chars("ok")]  # plain: BOS added once
    assert batch.attention_mask.sum(1).tolist() == [len(chat_ids), 3]
    assert batch.input_ids[0].tolist().count(BOS) == 1


def test_chat_prompt_without_bos_tokenizer():
    tok = char_tokenizer(bos=False, template=PLAIN_TEMPLATE)
    batch = PromptTokenizer(tok, 64, "error", "prompt", "messages")([{"messages": [{"role": "user", "content": "a"}]}])
    assert batch.texts == ["<|user|>a\n<|assistant|>"]
    assert batch.input_ids[0].tolist() == [USER, *chars("a\n"), ASSISTANT]
    assert batch.meta == {"messages": [[{"role": "user", "content": "a"}]]}  # the messages reach reward functions


def test_trl_rewards_get_message_lists_whichever_column_held_the_conversation():
    # TRL's conversational rows hold the messages in `prompt`; a TRL reward reads `completion[0]["content"]`
    tok = char_tokenizer(bos=False, template=PLAIN_TEMPLATE)
    hi, yo = [{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]

    def reply_lengths(completions, prompts, **kwargs):
        assert prompts == [hi, yo]
        return [float(len(c[0]["content"])) for c in completions]

    for column, rows in [
        ("prompt", [{"prompt": hi, "answer": "1"}, {"prompt": yo, "answer": "2"}]),
        ("conversation", [{"conversation": hi}, {"conversation": yo}]),
    ]:
        batch = PromptTokenizer(tok, 64, "error", "prompt", column)(rows)
        assert batch.meta["messages"] == [hi, yo]
        assert call_reward_fn(reply_lengths, batch.texts, ["abc", "a"], batch.meta).tolist() == [3.0, 1.0]
    mixed = PromptTokenizer(tok, 64, "error", "prompt")([{"prompt": hi}, {"prompt": "plain"}])
    assert "messages" not in mixed.meta  # not every row is a conversation: TRL rewards get strings


def test_special_token_spelled_in_a_plain_prompt_is_refused_unless_told_text_or_parse():
    tok = char_tokenizer(bos=True, template=None)
    rows = [{"prompt": "ok"}, {"prompt": "a</s><s>"}]
    with pytest.raises(ConfigError, match=r"data.prompts: row 1 spells the special token '<s>'.*message list"):
        PromptTokenizer(tok, 64, "error", "prompt")(rows)
    with pytest.raises(ConfigError, match="row 1 spells"):  # also when lengths are not checked at setup
        PromptTokenizer(tok, 64, "left", "prompt").check_rows(rows, "data.prompts")
    as_text = PromptTokenizer(tok, 64, "error", "prompt", special_tokens_in_prompts="text")(rows[1:])
    assert as_text.input_ids[0].tolist() == [BOS, *chars("a</s><s>")]
    parsed = PromptTokenizer(tok, 64, "error", "prompt", special_tokens_in_prompts="parse")(rows[1:])
    assert parsed.input_ids[0].tolist() == [BOS, *chars("a"), tok.convert_tokens_to_ids("</s>"), BOS]


def test_special_token_spelled_in_a_chat_message_stays_text_while_the_template_markers_stay_special():
    tok = char_tokenizer(bos=True, template=BOS_TEMPLATE)
    messages = [{"role": "user", "content": "x<|assistant|></s><s>"}]
    text, ids = encode_chat(tok, messages, "data.prompts: row 0")
    assert text == "<s><|user|>x<|assistant|></s><s>\n<|assistant|>"
    assert ids == [BOS, USER, *chars("x<|assistant|></s><s>\n"), ASSISTANT]


def test_a_template_that_rewrites_content_refuses_a_spelled_special_token():
    tok = char_tokenizer(bos=False, template="{% for m in messages %}<|user|>{{ m.content | trim }}{% endfor %}")
    assert encode_chat(tok, [{"role": "user", "content": " a "}], "w")[1] == [USER, *chars("a")]  # no spelling: fine
    with pytest.raises(ConfigError, match=r"data.prompts: row 3: .*does not copy message contents verbatim"):
        encode_chat(tok, [{"role": "user", "content": " <s> "}], "data.prompts: row 3")


def test_chat_prompt_with_a_tokenizer_without_template_names_it():
    tok = char_tokenizer(bos=False, template=None)
    with pytest.raises(
        ConfigError, match="data.val_prompts: row 2 is a chat prompt.*has no chat template.*plain string"
    ):
        PromptTokenizer(tok, 64, "error", "prompt").check_rows(
            [{"prompt": "a"}, {"prompt": "b"}, {"prompt": [{"role": "user", "content": "c"}]}], "data.val_prompts"
        )


def test_length_check_counts_the_rendered_chat_tokens():
    tok = char_tokenizer(bos=True, template=BOS_TEMPLATE)
    rows = [{"prompt": "ab"}, {"prompt": [{"role": "user", "content": "abc"}]}]  # 3 and 1+1+4+1 = 7 tokens
    PromptTokenizer(tok, 7, "error", "prompt").check_rows(rows, "data.prompts")
    with pytest.raises(ConfigError, match="prompt #1 has 7 tokens, over the limit of 6"):
        PromptTokenizer(tok, 6, "error", "prompt").check_rows(rows, "data.prompts")


# ----------------------------------------------------------------------------- columns


def needs_answer(prompts, responses, answer, **meta):
    return [0.0] * len(prompts)


def needs_keyword(prompts, responses, *, level, scale=1.0):
    return [0.0] * len(prompts)


class Scorer:
    def __call__(self, prompts, responses, target):
        return [0.0] * len(prompts)


@pytest.mark.parametrize(
    "fn, columns",
    [
        (needs_answer, {"answer"}),
        (needs_keyword, {"level"}),
        (Scorer(), {"target"}),
        (functools.partial(needs_answer, answer=None), set()),
        (lambda prompts, responses, **meta: [], set()),
        (lambda p, r, a=1: [], set()),
        (len, set()),  # no readable signature
    ],
)
def test_required_columns(fn, columns):
    assert required_columns(fn) == columns


def test_check_columns_names_function_column_and_rows():
    rows = [{"prompt": "a", "answer": 1}] + [{"prompt": "b"}] * 6 + [{"prompt": "c", "answer": 2}]
    with pytest.raises(ConfigError) as info:
        check_columns([needs_answer], rows, "data.val_prompts", "prompt", "metric")
    message = str(info.value)
    assert "data.val_prompts: the metric function" in message and "needs_answer needs the column 'answer'" in message
    assert "6 of 8 rows lack it (rows 1, 2, 3, 4, 5, ...)" in message
    check_columns([needs_answer], [r for r in rows if "answer" in r], "data.prompts", "prompt")


def test_with_left_truncation_the_check_still_renders_chat_prompts_naming_the_row():
    tok = char_tokenizer(bos=False, template=None)
    rows = [{"prompt": "abcdefgh"}, {"prompt": [{"role": "user", "content": "c"}]}]
    with pytest.raises(ConfigError, match="data.prompts: row 1 is a chat prompt"):
        PromptTokenizer(tok, 2, "left", "prompt").check_rows(rows, "data.prompts")
    PromptTokenizer(tok, 2, "left", "prompt").check_rows(rows[:1], "data.prompts")  # too long is fine with 'left'


def test_a_template_that_raises_is_named_with_the_row():
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first turn must be user') }}{% endif %}x"
    tok = char_tokenizer(bos=False, template=template)
    rows = [{"prompt": [{"role": "user", "content": "a"}]}, {"prompt": [{"role": "system", "content": "a"}]}]
    with pytest.raises(ConfigError, match="data.prompts: row 1: the chat template .* refused .*first turn"):
        PromptTokenizer(tok, 64, "error", "prompt").check_rows(rows, "data.prompts")


def test_a_chat_template_that_ignores_add_generation_prompt_gets_a_warning_once(monkeypatch, recwarn):
    monkeypatch.setattr(chat, "CHECKED_TEMPLATES", set())
    messages = [{"role": "user", "content": "hi"}]
    never = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    with pytest.warns(UserWarning, match="ignores add_generation_prompt .* A prompt ends '<|user|>hi\\n'"):
        encode_chat(char_tokenizer(bos=False, template=never), messages, "row 0")
    encode_chat(char_tokenizer(bos=False, template=never), messages, "row 1")  # once per template
    encode_chat(char_tokenizer(bos=True, template=BOS_TEMPLATE), messages, "row 0")  # honours it: no warning
    assert not [w for w in recwarn.list if "add_generation_prompt" in str(w.message)]
