"""Broken checkpoint folders, hub ids that cannot be fetched, reward modules that fail on import, and vocabularies
that do not match: each a `ConfigError` naming the setting, the path and the fix (offline; folders under tmp_path)."""

from __future__ import annotations

import json
import sys
import time

import pytest

from lit_rlhf.config import ConfigError
from lit_rlhf.models.loading import load_causal_lm, load_sequence_classifier, load_tokenizer
from lit_rlhf.rewards.functions import resolve_reward_fns

LOADERS = {
    "model.policy": load_causal_lm,
    "model.reference": load_causal_lm,
    "model.reward_model": load_sequence_classifier,
}


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from tests.conftest import make_policy

    folder = tmp_path_factory.mktemp("model")
    make_policy(n_embd=16).save_pretrained(folder)
    return folder


def copy_of(saved_model, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for f in saved_model.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


@pytest.mark.parametrize("field", sorted(LOADERS))
def test_truncated_safetensors_names_the_setting_and_the_file(saved_model, tmp_path, field):
    folder = copy_of(saved_model, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ConfigError, match=f"{field}: a weights file of .*ckpt.* cannot be read") as info:
        LOADERS[field](str(folder), field)
    assert "truncated or damaged" in str(info.value) and "again" in str(info.value)


@pytest.mark.parametrize("field", sorted(LOADERS))
def test_config_json_that_is_not_json_names_the_setting(saved_model, tmp_path, field):
    folder = copy_of(saved_model, tmp_path)
    config = folder / "config.json"
    config.write_text(config.read_text()[:-20])
    with pytest.raises(ConfigError, match=f"{field}: .*config.json is not valid JSON"):
        LOADERS[field](str(folder), field)


@pytest.mark.parametrize("field", sorted(LOADERS))
def test_config_json_without_model_type_names_the_setting(saved_model, tmp_path, field):
    folder = copy_of(saved_model, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["model_type"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"{field}: .*config.json has no 'model_type'"):
        LOADERS[field](str(folder), field)


def test_the_loaders_still_load_a_good_folder(saved_model):
    assert load_causal_lm(str(saved_model), "model.policy").config.n_embd == 16
    assert load_sequence_classifier(str(saved_model), "model.reward_model").config.num_labels == 1


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.mark.parametrize("field", [*sorted(LOADERS), "model.tokenizer"])
def test_uncached_hub_id_fails_at_once_when_offline(empty_hub_cache, monkeypatch, field):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    load = LOADERS.get(field, load_tokenizer)
    start = time.monotonic()
    with pytest.raises(ConfigError, match=f"{field}: 'someorg/not-downloaded' is not a local folder and not in the"):
        load("someorg/not-downloaded", field)
    assert time.monotonic() - start < 5  # it used to retry for about 49 s


def test_uncached_hub_id_fails_at_once_when_the_hub_is_unreachable(empty_hub_cache, monkeypatch):
    from huggingface_hub import constants

    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    start = time.monotonic()
    with pytest.raises(ConfigError, match="model.policy: .*cannot be reached.*hf download someorg/not-downloaded"):
        load_causal_lm("someorg/not-downloaded", "model.policy")
    assert time.monotonic() - start < 10


def test_a_cached_hub_id_passes_the_check_offline(empty_hub_cache, monkeypatch):
    from lit_rlhf.models.loading import MODEL_FILES, check_hub_id

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = empty_hub_cache / "models--someorg--downloaded"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        check_hub_id("someorg/downloaded", "model.policy", MODEL_FILES)  # no config.json yet
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text("{}")
    check_hub_id("someorg/downloaded", "model.policy", MODEL_FILES)


def test_reward_module_that_fails_on_import_names_the_field_path_and_error(tmp_path, monkeypatch):
    package = tmp_path / "brokenpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rewards.py").write_text("raise RuntimeError('missing API key')\n")
    (package / "exits.py").write_text("import sys\nsys.exit(3)\n")
    (package / "needs_dep.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ConfigError,
        match="reward_fns: importing module 'brokenpkg.rewards' for 'brokenpkg.rewards.fn' "
        "raised RuntimeError: missing API key",
    ) as info:
        resolve_reward_fns(["brokenpkg.rewards.fn"])
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(ConfigError, match="model.metric_fns: importing module 'brokenpkg.exits' .* raised SystemExit"):
        resolve_reward_fns(["brokenpkg.exits.fn"], "model.metric_fns")
    with pytest.raises(ConfigError, match="importing module 'brokenpkg.needs_dep' .*not_installed_dependency_xyz"):
        resolve_reward_fns(["brokenpkg.needs_dep.fn"])
    with pytest.raises(ConfigError, match="cannot import module 'brokenpkg.nothere'.*PYTHONPATH"):
        resolve_reward_fns(["brokenpkg.nothere.fn"])
    for name in [m for m in sys.modules if m.startswith("brokenpkg")]:
        monkeypatch.delitem(sys.modules, name)


# ----------------------------------------------------------------------------- vocabularies


def test_a_sampled_id_the_tokenizer_cannot_decode_is_an_error_not_a_dropped_token(tokenizer):
    import torch

    from lit_rlhf.rollout.generation import decode_responses

    n = len(tokenizer)
    digit = tokenizer.convert_tokens_to_ids("7")
    ids = torch.tensor([[digit, digit, tokenizer.eos_token_id], [digit, n + 2, digit]])
    mask = torch.tensor([[True, True, True], [True, True, True]])
    assert decode_responses(tokenizer, ids[:1], mask[:1]) == ["77"]
    with pytest.raises(ConfigError, match=f"model.tokenizer: the policy sampled token id {n + 2} \\(response 1, posi"):
        decode_responses(tokenizer, ids, mask)
    # after the EOS the ids are padding and not read
    ids[0, 2], ids[1] = tokenizer.eos_token_id, torch.tensor([tokenizer.eos_token_id, n + 2, n + 2])
    assert decode_responses(tokenizer, ids, torch.tensor([[True] * 3, [True, False, False]])) == ["77", ""]


def reward_model_folder(folder, vocab_size, tokenizer):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    config = GPT2Config(vocab_size=vocab_size, n_positions=32, n_embd=16, n_layer=1, n_head=2, num_labels=1)
    config.pad_token_id = tokenizer.pad_token_id
    GPT2ForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_reward_model_with_another_vocabulary_needs_reward_tokenizer(tokenizer, tmp_path):
    from lit_rlhf.models.reward_model import build_reward_model, check_shared_tokenizer
    from lit_rlhf.tasks.digits import builtin_tokenizer

    other = builtin_tokenizer()
    other.add_tokens(["x", "y"])  # same ids for the digits, two more tokens: a larger vocabulary
    spec = reward_model_folder(tmp_path / "rm", 20, other)
    rm = build_reward_model(spec, None, False)
    with pytest.raises(
        ConfigError,
        match="model.reward_tokenizer: the reward model .* holds a tokenizer whose vocabulary differs .*16 vs 14",
    ):
        check_shared_tokenizer(rm, tokenizer, spec)
    check_shared_tokenizer(build_reward_model(spec, spec, False), tokenizer, spec)  # its own tokenizer: fine
    same = reward_model_folder(tmp_path / "same", 20, builtin_tokenizer())
    check_shared_tokenizer(build_reward_model(same, None, False), tokenizer, same)


def test_reward_model_instance_with_a_larger_vocabulary_needs_reward_tokenizer(tokenizer):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from lit_rlhf.models.reward_model import build_reward_model, check_shared_tokenizer

    def instance(vocab_size):
        config = GPT2Config(vocab_size=vocab_size, n_positions=32, n_embd=16, n_layer=1, n_head=2, num_labels=1)
        config.pad_token_id = tokenizer.pad_token_id
        return GPT2ForSequenceClassification(config)

    n = len(tokenizer)
    with pytest.raises(
        ConfigError, match=f"the reward model knows {n + 10} token ids but the policy's tokenizer has {n}"
    ):
        check_shared_tokenizer(build_reward_model(instance(n + 10), None, False), tokenizer, None, n)
    check_shared_tokenizer(build_reward_model(instance(n), None, False), tokenizer, None, n)  # same size: fine
    check_shared_tokenizer(build_reward_model(instance(n + 10), None, False), tokenizer, None, n + 10)  # padded
    check_shared_tokenizer(build_reward_model(instance(n + 10), tokenizer, False), tokenizer)  # its own: fine


def test_reward_model_with_another_eos_needs_reward_tokenizer(tokenizer):
    from lit_rlhf.models.reward_model import build_reward_model, check_shared_tokenizer

    tokenizer.eos_token = ">"  # the policy ends its responses with another token than the reward model
    rm = build_reward_model("builtin:digits", None, False)
    with pytest.raises(
        ConfigError,
        match="model.reward_tokenizer: the reward model 'builtin:digits' reads its score "
        "at its EOS '<eos>' \\(id 1\\), but the policy ends responses with '>'",
    ):
        check_shared_tokenizer(rm, tokenizer, "builtin:digits")


def test_reward_tokenizer_larger_than_the_reward_model_is_refused(tmp_path):
    from lit_rlhf.models.reward_model import build_reward_model
    from lit_rlhf.tasks.digits import builtin_tokenizer

    spec = reward_model_folder(tmp_path / "rm", 14, builtin_tokenizer())
    bigger = builtin_tokenizer()
    bigger.add_tokens(["x", "y"])
    with pytest.raises(ConfigError, match="model.reward_tokenizer: 16 tokens, but model.reward_model knows only 14"):
        build_reward_model(spec, bigger, False)
