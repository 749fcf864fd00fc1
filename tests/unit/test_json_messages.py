"""A `messages` column holding a conversation as a JSON string (CSV exports, many datasets) is parsed into its
message list, or refused with an error naming the row; never used as the raw prompt text."""

from __future__ import annotations

import json

import pytest

from lit_rlhf.config import ConfigError
from lit_rlhf.data.prompts import PromptTokenizer
from lit_rlhf.data.sources import load_prompt_rows
from lit_rlhf.tasks.text import text_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]


def rows_of(spec):
    return load_prompt_rows(spec, "prompt", "messages", "data.prompts", None, "data.split")


def test_a_json_string_in_the_messages_column_is_the_conversation_rendered_by_the_chat_template():
    given = [{"messages": json.dumps(MESSAGES), "answer": "5"}, {"messages": MESSAGES, "answer": "5"}]
    rows = rows_of(given)
    assert rows[0]["messages"] == MESSAGES and isinstance(given[0]["messages"], str)  # the caller's row unchanged
    tokenizer = text_tokenizer()
    encoder = PromptTokenizer(tokenizer, 512, "error", "prompt")
    texts, ids = encoder.encode(rows)
    assert texts[0] == texts[1] == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ids[0] == ids[1]
    # rows that skip the checked loader (a user's own dataloader) are parsed at tokenisation too
    assert encoder.encode(given)[0] == texts


def test_a_json_conversation_in_the_prompt_column_is_parsed_and_other_text_kept():
    rows = rows_of([{"prompt": json.dumps(MESSAGES)}, {"prompt": "[citation needed] explain"}, {"prompt": "[1, 2]"}])
    assert rows[0]["prompt"] == MESSAGES
    assert rows[1]["prompt"] == "[citation needed] explain" and rows[2]["prompt"] == "[1, 2]"


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (
            '[{"role": "user", "content": "hi"',
            r"data.prompts: row 1: field 'messages' holds a string that is not a "
            r"valid JSON message list",
        ),
        ("Hello there", r"data.prompts: row 1: field 'messages' holds a string \('Hello there'\), not a message list"),
        ('[{"role": "robot", "content": "hi"}]', r"data.prompts: row 1: field 'messages', message 0 has role 'robot'"),
        ("[1, 2]", r"data.prompts: row 1: field 'messages', message 0 is 1"),
        ('{"role": "user", "content": "hi"}', r"data.prompts: row 1: field 'messages' holds a string"),
        ("[]", r"data.prompts: row 1: field 'messages' is an empty message list"),
    ],
    ids=["truncated-json", "plain-text", "bad-role", "not-messages", "an-object", "empty"],
)
def test_a_bad_messages_string_is_refused_naming_the_row(value, error):
    with pytest.raises(ConfigError, match=error):
        rows_of([{"messages": MESSAGES}, {"messages": value}])


def test_a_bad_messages_string_from_a_users_own_dataloader_names_the_row_at_tokenisation():
    encoder = PromptTokenizer(text_tokenizer(), 512, "error", "prompt")
    with pytest.raises(ConfigError, match="data.prompts: row 3: field 'messages' holds a string"):
        encoder.encode([{"messages": "[oops"}], first=3)
