"""Every YAML file in configs/ parses and runs one rollout through the real CLI."""

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest
import yaml

from lit_rlhf import RLHFModule

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def _load_train():
    spec = importlib.util.spec_from_file_location("lit_rlhf_train_script", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _needs(config: dict) -> str | None:
    """Why this test leaves a config to another test: it names a folder that a preparation step makes
    (SmolLM2 from tests/test_smollm2.py, a trained reward model from tests/test_reward_training.py). Skipped
    whether or not the folder happens to exist here, so the suite does the same work on every machine."""
    model = config.get("model", {})
    for key in ("policy", "reward_model"):
        value = model.get(key)
        if isinstance(value, str) and not value.startswith("builtin:"):
            return f"{key} {value!r} is a prepared folder; its own test runs this config"
    return None


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_runs_one_rollout(path, tmp_path, monkeypatch):
    config = yaml.safe_load(path.read_text())
    accepted = set(inspect.signature(RLHFModule.__init__).parameters)
    if not set(config.get("model", {})) <= accepted:
        pytest.skip("a config of another entry point (the reward-model trainer tests its own)")
    reason = _needs(config)
    if reason:
        pytest.skip(reason)
    # paths in a config are relative to the repository root, where users run it; the run itself goes to tmp_path
    paths = [(f"model.{key}", config.get("model", {}).get(key)) for key in ("policy", "reward_model")]
    paths.append(("data.prompts", config.get("data", {}).get("prompts")))
    rooted = [
        f"--{key}={ROOT / value}"
        for key, value in paths
        if isinstance(value, str) and not value.startswith("builtin:") and (ROOT / value).exists()
    ]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py"])  # the CLI reads only `args`, not pytest's own arguments
    train = _load_train()
    cli = train.main(
        [
            "fit",
            "--config",
            str(path),
            *rooted,
            "--trainer.max_steps",
            "1",
            "--trainer.max_time",
            "null",
            "--trainer.logger",
            "false",
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.callbacks",
            "null",
            "--trainer.enable_progress_bar",
            "false",
        ]
    )
    module = cli.model
    # one rollout ran all of its optimizer steps
    algo = module.algorithm
    assert cli.trainer.global_step == algo.ppo_epochs * algo.num_minibatches
    assert module.state.policy_version == cli.trainer.global_step
