"""Settings are read strictly: a YAML key given twice, a YAML boolean where a word was meant, `backend: vllm`
without vLLM and a non-finite or negative size to `lit-rlhf-plan` are errors naming the setting, before any model
loads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lit_rlhf import RLHFModule, SamplingConfig
from lit_rlhf.cli import main, plan_main
from lit_rlhf.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug.yaml")
REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_a_second_model_block_is_refused_naming_the_key_and_both_lines(tmp_path):
    path = config(tmp_path, "model:\n  lr: 1.0e-3\ntrainer:\n  max_steps: 2\nmodel:\n  policy: builtin:digits\n")
    with pytest.raises(ConfigError, match=r"run.yaml: the key 'model' is given twice in one mapping, on lines 1 and 5"):
        main(["fit", "--config", DEBUG, "--config", path, "--print_config"])


def test_a_nested_key_given_twice_is_refused(tmp_path):
    path = config(tmp_path, "model:\n  algorithm:\n    group_size: 2\n    group_size: 8\n")
    with pytest.raises(ConfigError, match=r"the key 'group_size' is given twice in one mapping, on lines 3 and 4"):
        main(["fit", "--config", DEBUG, "--config", path, "--print_config"])


def test_a_yaml_boolean_for_a_word_gets_the_hint_to_quote_it(tmp_path, capsys):
    path = config(tmp_path, "model:\n  memory_check: off\n")
    with pytest.raises(ConfigError, match=r"model.memory_check: got the boolean False.*quote it, e.g. 'off'"):
        main(["fit", "--config", DEBUG, "--config", path, "--print_config"])
    with pytest.raises(SystemExit) as printed:  # quoted, it parses (--print_config exits once printed)
        main(
            [
                "fit",
                "--config",
                DEBUG,
                "--config",
                config(tmp_path, "model:\n  memory_check: 'off'\n"),
                "--print_config",
            ]
        )
    assert printed.value.code in (0, None)
    assert "memory_check: 'off'" in capsys.readouterr().out


def test_memory_check_is_checked_with_the_hint_when_the_module_is_made():
    with pytest.raises(ConfigError, match=r"model.memory_check: must be one of .* got False \(YAML reads an unquoted"):
        RLHFModule(policy="/no/such/model", reward_fns=[REWARD], memory_check=False)  # type: ignore[arg-type]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_backend_vllm_without_vllm_is_refused_at_fit_start_before_any_model_loads():
    """Refused in `setup`, before `configure_model` reads the policy (a folder that does not exist: reading it
    would fail with another error). Making the module and planning its memory need no vLLM."""
    import lightning as L

    from lit_rlhf import RolloutDataModule

    sampling = SamplingConfig(max_new_tokens=4, backend="vllm")
    module = RLHFModule(policy="/no/such/model", tokenizer="builtin:digits", reward_fns=[REWARD], sampling=sampling)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False)
    with pytest.raises(ConfigError, match=r"sampling.backend: 'vllm' needs the vllm package.*sampling.backend: lean"):
        trainer.fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=2))
    assert module.actor_critic is None


@pytest.mark.parametrize("size", ["nan", "inf", "-8", "0"])
def test_lit_rlhf_plan_refuses_a_size_that_is_not_positive_and_finite(size, capsys):
    with pytest.raises(SystemExit) as stopped:
        plan_main(["--config", DEBUG, "--device-memory-gb", size])
    assert stopped.value.code == 2
    assert "--device-memory-gb: must be a positive, finite number of GiB" in capsys.readouterr().err
