"""Prompt sources (JSONL/JSON/text files by case-insensitive suffix, lists, `datasets`), the row checks, chat rows
and reward-function columns checked at setup before any model loads; expectations written out by hand."""

from __future__ import annotations

import json

import pytest

from conftest import make_trainer
from lit_rlhf import ConfigError, RLHFModule, RolloutDataModule
from lit_rlhf.data.prompts import PromptTokenizer

REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"


def exact_answer(prompts, responses, answer, **meta):
    return [float(r == a) for r, a in zip(responses, answer, strict=True)]


def test_uppercase_jsonl_suffix_is_read_as_jsonl(tmp_path):
    path = tmp_path / "prompts.JSONL"
    path.write_text('{"prompt": "12>", "target": "12"}\n{"prompt": "3>"}\n')
    assert RolloutDataModule(prompts=str(path)).source == [{"prompt": "12>", "target": "12"}, {"prompt": "3>"}]


def test_json_array_and_text_files(tmp_path):
    array = tmp_path / "p.Json"
    array.write_text(json.dumps(["1>", {"prompt": "2>", "target": "2"}]))
    assert RolloutDataModule(prompts=str(array)).source == [{"prompt": "1>"}, {"prompt": "2>", "target": "2"}]
    text = tmp_path / "p.TXT"
    text.write_bytes(b'\xef\xbb\xbf{"prompt": "1>"}\r\n\r\n3>\r\n')  # BOM and CRLF; a JSON-looking line is text
    assert RolloutDataModule(prompts=str(text)).source == [{"prompt": '{"prompt": "1>"}'}, {"prompt": "3>"}]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("p.csv", b"1>\n", r"data.prompts: cannot tell the format of .*p.csv.* suffix '.csv'; name it .jsonl"),
        ("p.json", b'{"prompt": ["1>"]}', r"data.prompts: .*p.json holds a JSON dict, not an array"),
        ("p.json", b'[\n"1>",\n]', r"data.prompts: .*p.json:3 is not valid JSON"),
        ("p.txt", b"1>\n2>\n\xff3>\n", r"data.prompts: .*p.txt:3 is not UTF-8 \(byte 6 of the file, b'\\xff'\)"),
        ("p.jsonl", b'{"prompt": "1>"}\n{"prompt": "  "}\n', r"data.prompts: .*p.jsonl:2: field 'prompt' is an empty"),
        ("p.json", b'["1>", ""]', r"data.prompts: .*p.json item 1: field 'prompt' is an empty prompt"),
        ("p.jsonl", b'{"text": "1>", "id": 3}\n', r"p.jsonl:1 has no field 'prompt'.*its fields are \['id', 'text'\]"),
        ("p.jsonl", b'"1>"\n7\n', r"p.jsonl:2 is a int, not an object"),  # a JSON string line is a prompt
    ],
)
def test_bad_prompt_files_name_field_file_and_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        RolloutDataModule(prompts=str(path))


def test_a_folder_is_named_a_folder(tmp_path):
    with pytest.raises(ConfigError, match=r"data.val_prompts: .* is a folder, not a prompt file"):
        RolloutDataModule(prompts=["1>"], val_prompts=str(tmp_path))


@pytest.mark.parametrize(
    "prompts, message",
    [
        (["1>", "", "2>"], r"data.prompts: row 1: field 'prompt' is an empty prompt \(''\)"),
        (["1>", " \n"], r"data.prompts: row 1: field 'prompt' is an empty prompt"),
        ({"prompt": ["1>", "2>"]}, r"data.prompts: got a dict \(\['prompt'\]\), not a list of rows"),
        ([{"prompt": [{"role": "bot", "content": "1"}]}], r"row 0: field 'prompt', message 0 has role 'bot'; use one"),
        ([{"messages": [{"role": "system", "content": "1"}]}], r"row 0: field 'messages' has no user message"),
        (
            [{"messages": [{"role": "user", "content": ["1"]}]}],
            r"message 0 \(user\): content must be a string, got list",
        ),
        ([{"messages": []}], r"row 0: field 'messages' is an empty message list"),
    ],
)
def test_bad_rows_in_python_are_refused_when_the_datamodule_is_made(prompts, message):
    with pytest.raises(ConfigError, match=message):
        RolloutDataModule(prompts=prompts)


def test_datasets_dataset_and_split_of_a_dataset_dict():
    datasets = pytest.importorskip("datasets")
    train = datasets.Dataset.from_dict({"prompt": ["1>", "2>"], "target": ["1", "2"]})
    val = datasets.Dataset.from_dict({"prompt": ["3>"], "target": ["3"]})
    dm = RolloutDataModule(
        prompts=datasets.DatasetDict(train=train, dev=val),
        val_prompts=val,
        test_split="dev",
        test_prompts=datasets.DatasetDict(train=train, dev=val),
    )
    assert dm.source == [{"prompt": "1>", "target": "1"}, {"prompt": "2>", "target": "2"}]
    assert dm.val_rows == dm.test_rows == [{"prompt": "3>", "target": "3"}]
    both = datasets.DatasetDict(train=train, dev=val)
    with pytest.raises(
        ConfigError,
        match=r"data.val_split: the DatasetDict given as data.val_prompts has no split "
        r"'validation'; its splits: \['dev', 'train'\]",
    ):
        RolloutDataModule(prompts=train, val_prompts=both)
    with pytest.raises(
        ConfigError,
        match=r"data.prompts: got a DatasetDict with splits \['dev', 'train'\]; choose "
        "one with data.prompt_split",
    ):
        RolloutDataModule(prompts=both, prompt_split=None)
    with pytest.raises(ConfigError, match="data.prompts: row 1: field 'prompt' is an empty prompt"):
        RolloutDataModule(prompts=datasets.Dataset.from_dict({"prompt": ["1>", ""]}))


def test_extra_columns_reach_each_row_even_when_only_some_rows_have_them(tokenizer):
    rows = [{"prompt": "1>", "a": 1}, {"prompt": "2>"}, {"prompt": "3>", "b": "x", "a": 3}]
    batch = PromptTokenizer(tokenizer, 8, "error", "prompt")(rows)
    assert batch.meta == {"a": [1, None, 3], "b": [None, None, "x"]}


def test_special_token_spelling_in_a_prompt_is_not_the_special_token(tokenizer):
    dm = RolloutDataModule(prompts=["1<eos>2>"], batch_size=1, tokenizer=tokenizer, max_prompt_length=16)
    with pytest.raises(ConfigError, match="row 0 spells the special token '<eos>'"):
        dm.setup("fit")  # ambiguous by default: typed text, or a template rendered by hand
    dm = RolloutDataModule(
        prompts=["1<eos>2>"], batch_size=1, tokenizer=tokenizer, max_prompt_length=16, special_tokens_in_prompts="text"
    )
    dm.setup("fit")
    ids = next(iter(dm.train_dataloader())).input_ids[0].tolist()
    assert len(ids) == 8 and tokenizer.eos_token_id not in ids  # 8 characters, '<', 'e', 'o', 's' as <unk>


def test_chat_rows_without_a_chat_template_fail_at_setup(tokenizer):
    dm = RolloutDataModule(prompts=["1>", {"messages": [{"role": "user", "content": "2"}]}], tokenizer=tokenizer)
    with pytest.raises(ConfigError, match="data.prompts: row 1 is a chat prompt .*no chat template"):
        dm.setup("fit")


def test_reward_function_needing_a_column_some_rows_lack_fails_in_fit_before_any_model_loads():
    module = RLHFModule(policy="builtin:digits", reward_fns=[exact_answer])
    rows = [{"prompt": "1>", "answer": "1"}, {"prompt": "2>"}, {"prompt": "3>"}, {"prompt": "4>", "answer": "4"}]
    dm = RolloutDataModule(prompts=rows, batch_size=2)
    with pytest.raises(
        ConfigError,
        match=r"data.prompts: the reward function .*exact_answer needs the column "
        r"'answer'.*2 of 4 rows lack it \(rows 1, 2\)",
    ):
        make_trainer(max_steps=1).fit(module, dm)
    assert module.actor_critic is None


def test_metric_function_needing_a_column_checks_the_held_out_rows_only():
    module = RLHFModule(policy="builtin:digits", reward_fns=[REWARD], metric_fns=[exact_answer])
    dm = RolloutDataModule(prompts=["1>", "2>"], batch_size=2, val_prompts=[{"prompt": "3>", "answer": "3"}, "4>"])
    with pytest.raises(ConfigError, match=r"data.val_prompts: the reward function .*exact_answer.*\(rows 1\)"):
        make_trainer(max_steps=1).fit(module, dm)
    assert module.actor_critic is None
