"""The first screen of help: every setting of `lit-rlhf fit --help` (and of the nested settings' own help) shows
its default and a description read from the docstrings, and a None default says what None means; a plain
DataLoader given to `fit` is refused naming RolloutDataModule."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
from torch.utils.data import DataLoader

from conftest import make_policy, make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, SamplingConfig
from lit_rlhf.cli import main
from lit_rlhf.config import _ALGORITHM_DEFAULTS, ConfigError
from lit_rlhf.rollout.environment import EnvironmentConfig

NESTED = {"algorithm": AlgorithmConfig, "sampling": SamplingConfig, "environment": EnvironmentConfig}


def help_text(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(["fit", *args])
    assert info.value.code == 0
    return capsys.readouterr().out


def options(text: str) -> dict[str, tuple[str, str]]:
    """Each `--option` of a help text -> (its description, its parenthesis: type and default); options that take a
    config file are left out."""
    found = {}
    for block in re.split(r"\n(?=  --|\S)", text.split("\n\n", 1)[1]):
        first, _, rest = block.partition("\n")
        match = re.match(r"  (--[\w.]+)", first)
        if match is None or " CONFIG" in first.split("  ")[1]:
            continue
        after_name = re.split(r"\s{2,}", first.strip(), maxsplit=1)
        flat = " ".join(((after_name[1] if len(after_name) > 1 else "") + " " + rest).split())
        start = max(flat.rfind("(type:"), flat.rfind("(required"))
        found[match.group(1)] = (flat[:start].strip(), flat[start:]) if start >= 0 else (flat, "")
    return found


def checked(found: dict[str, tuple[str, str]]) -> list[str]:
    """The options without a description, or without a default (or a 'required')."""
    return [
        name
        for name, (description, details) in found.items()
        if not name.endswith(".help")
        and name != "--print_config"
        and (not description or not re.search(r"default: |required", details))
    ]


def test_every_setting_of_fit_help_has_a_description_and_a_default(capsys):
    found = options(help_text(capsys, "--help"))
    assert {"--model.reward_fns", "--model.algorithm", "--data.prompts", "--trainer.max_steps"} <= set(found)
    assert checked(found) == []


@pytest.mark.parametrize("name", sorted(NESTED))
def test_every_nested_setting_has_a_description_and_its_real_default(capsys, name):
    cls = NESTED[name]
    found = options(help_text(capsys, f"--model.{name}.help", cls.__name__))
    assert checked(found) == []
    for field in dataclasses.fields(cls):
        _, details = found[f"--model.{name}.{field.name}"]
        if field.default is not dataclasses.MISSING:
            shown = re.search(r"default: (.*)\)$", details).group(1)
            assert shown in {str(field.default), "null" if field.default is None else "-"}, field.name


def test_a_setting_the_algorithm_fills_in_names_both_defaults(capsys):
    found = options(help_text(capsys, "--model.algorithm.help", "AlgorithmConfig"))
    for key in _ALGORITHM_DEFAULTS["ppo"]:
        description, _ = found[f"--model.algorithm.{key}"]
        for algorithm in ("ppo", "grpo"):
            value = _ALGORITHM_DEFAULTS[algorithm][key]
            assert algorithm.upper() in description and re.search(rf"\b{re.escape(str(value))}\b", description), (
                key,
                algorithm,
                description,
            )


def test_a_module_setting_whose_default_is_none_says_what_none_means(capsys):
    found = options(help_text(capsys, "--help"))
    for name, parameter in inspect.signature(RLHFModule.__init__).parameters.items():
        if parameter.default is None:
            description, _ = found[f"--model.{name}"]
            assert re.search(r"None|default", description), (name, description)


def test_a_plain_dataloader_is_refused_naming_rollout_datamodule(tokenizer):
    module = RLHFModule(
        policy=make_policy(),
        tokenizer=tokenizer,
        reward_fns="lit_rlhf.tasks.digits.sort_digits_reward",
        algorithm=AlgorithmConfig(group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
    )
    prompts = DataLoader(["3142>", "907>", "55>", "1234>"], batch_size=2)
    with pytest.raises(ConfigError, match=r"batches are list, not PromptBatch.*RolloutDataModule\(prompts=rows"):
        make_trainer(max_steps=1).fit(module, prompts)
    assert module.state.rollouts_done == 0  # refused before any sampling
