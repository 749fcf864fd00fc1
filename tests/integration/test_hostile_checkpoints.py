"""A shared checkpoint is data: one that names code (reward functions, an environment, `trust_remote_code`) or
paths (a logger version, tokenizer file names) runs nothing and writes nowhere it chose, through every entry point:
`RLHFModule.load_from_checkpoint`, `Trainer.fit(ckpt_path=...)`, `lit-rlhf-export` and the CLI's resume."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import make_policy, make_trainer
from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.rewards.functions import RewardError
from lit_rlhf.training.checkpoint_io import AtomicCheckpointIO, CheckpointError

ROOT = Path(__file__).resolve().parents[2]
PLANTED = "lit_rlhf_planted_code"


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """An importable module whose import (or whose function, when called) writes a marker file: proof it ran."""
    marker = tmp_path / "code_ran"
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / f"{PLANTED}.py").write_text(
        f"open({str(marker)!r}, 'a').write('imported\\n')\n"
        "def reward(prompts, responses, **meta):\n    return [0.0] * len(responses)\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, PLANTED, raising=False)
    yield marker
    sys.modules.pop(PLANTED, None)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One tiny run's checkpoint (a policy named by builtin: name, so the file rebuilds without arguments)."""
    folder = tmp_path_factory.mktemp("trained")
    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
    )
    trainer = make_trainer(1, default_root_dir=folder)
    trainer.fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=2))
    trainer.save_checkpoint(folder / "run.ckpt")
    return folder / "run.ckpt"


def tampered(source: Path, target: Path, **hparams) -> Path:
    """A copy of `source` whose hyperparameters are updated with `hparams` (and `lit_rlhf` entries with those
    passed as `state_<key>`)."""
    checkpoint = torch.load(source, weights_only=True)
    for key, value in hparams.items():
        if key.startswith("state_"):
            checkpoint["lit_rlhf"][key.removeprefix("state_")] = value
        else:
            checkpoint["hyper_parameters"][key] = value
    torch.save(checkpoint, target)
    return target


def popen_environment(marker: Path) -> dict:
    return {"name": "subprocess.Popen", "options": {"args": ["touch", str(marker)]}, "max_turns": 2}


def test_load_imports_no_reward_or_metric_function_the_checkpoint_names(trained, tmp_path, planted):
    path = tampered(trained, tmp_path / "x.ckpt", reward_fns=[f"{PLANTED}.reward"], metric_fns=[f"{PLANTED}.reward"])
    with pytest.warns(UserWarning, match=rf"not imported.*model.reward_fns: '{PLANTED}.reward'"):
        loaded = RLHFModule.load_from_checkpoint(path)
    assert not planted.exists() and PLANTED not in sys.modules
    assert loaded.generate(["31 4"])  # loading to generate works
    with pytest.raises(RewardError, match=r"model.reward_fns: .* was not imported: a checkpoint is data.*reward_fns="):
        loaded.reward.reward_fns[0](["a"], ["b"])
    # the library's own functions are still imported and used
    own = RLHFModule.load_from_checkpoint(trained)
    assert own.reward.reward_fns[0].__name__ == "sort_digits_reward"


def test_the_opt_in_imports_what_a_file_you_made_names(trained, tmp_path, planted):
    path = tampered(trained, tmp_path / "x.ckpt", reward_fns=[f"{PLANTED}.reward"])
    loaded = RLHFModule.load_from_checkpoint(path, trust_checkpoint_code=True)
    assert planted.read_text() == "imported\n"
    assert loaded.reward.reward_fns[0](["a"], ["b"]) == [0.0]


def test_load_refuses_an_environment_the_checkpoint_names_and_starts_nothing(trained, tmp_path, planted):
    marker = tmp_path / "popen_ran"
    path = tampered(trained, tmp_path / "x.ckpt", environment=popen_environment(marker))
    with pytest.raises(CheckpointError, match=r"model.environment.name is 'subprocess.Popen'.*Pass environment="):
        RLHFModule.load_from_checkpoint(path)
    assert not marker.exists()
    assert RLHFModule.load_from_checkpoint(path, environment=None).hparams["environment"] is None
    builtin = tampered(trained, tmp_path / "b.ckpt", environment={"name": "builtin:peek", "max_turns": 2})
    assert RLHFModule.load_from_checkpoint(builtin).conversations is not None


def test_load_refuses_trust_remote_code_the_checkpoint_switches_on(trained, tmp_path):
    path = tampered(trained, tmp_path / "x.ckpt", trust_remote_code=True)
    with pytest.raises(CheckpointError, match=r"model.trust_remote_code is True.*Pass trust_remote_code=True"):
        RLHFModule.load_from_checkpoint(path)
    assert RLHFModule.load_from_checkpoint(path, trust_remote_code=True).hparams["trust_remote_code"] is True


def test_a_vllm_server_the_checkpoint_names_is_refused_and_export_ignores_it(trained, tmp_path):
    """A checkpoint's vLLM server would receive the prompts, and its weights folder the policy's weights."""
    checkpoint = torch.load(trained, weights_only=True)
    server = {"mode": "server", "server_url": "http://attacker:8000", "weights_dir": str(tmp_path / "escaped")}
    sampling = {**checkpoint["hyper_parameters"]["sampling"], "backend": "vllm", "vllm": server}
    path = tampered(trained, tmp_path / "x.ckpt", sampling=sampling)
    with pytest.raises(CheckpointError, match=r"model.sampling.vllm names a vLLM server .*attacker.*Pass sampling="):
        RLHFModule.load_from_checkpoint(path)
    from lit_rlhf.cli import export_main

    export_main(["--ckpt", str(path), "--out", str(tmp_path / "policy")])
    assert (tmp_path / "policy" / "config.json").is_file() and not (tmp_path / "escaped").exists()


def test_tokenizer_files_with_a_path_for_a_name_are_refused(trained, tmp_path):
    """A module built from instances carries its tokenizer's files; a name that is a path would choose where the
    file is written when the checkpoint is loaded."""
    module = RLHFModule(
        policy=make_policy(),
        tokenizer="builtin:digits",
        reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
        sampling=SamplingConfig(max_new_tokens=4),
    )
    trainer = make_trainer(1, default_root_dir=tmp_path)
    trainer.fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=2))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    checkpoint = torch.load(tmp_path / "run.ckpt", weights_only=True)
    escaped = tmp_path / "escaped.json"
    checkpoint["hyper_parameters"]["tokenizer"] = {"tokenizer_files": {str(escaped): torch.zeros(3, dtype=torch.uint8)}}
    torch.save(checkpoint, tmp_path / "x.ckpt")
    with pytest.raises(ValueError, match=r"tokenizer files include .*escaped.json.*not a plain file name"):
        RLHFModule.load_from_checkpoint(tmp_path / "x.ckpt")
    assert not escaped.exists()


def test_export_runs_nothing_the_checkpoint_names(trained, tmp_path, planted):
    from lit_rlhf.cli import export_main

    marker = tmp_path / "popen_ran"
    path = tampered(
        trained, tmp_path / "x.ckpt", environment=popen_environment(marker), reward_fns=[f"{PLANTED}.reward"]
    )
    export_main(["--ckpt", str(path), "--out", str(tmp_path / "policy")])
    assert (tmp_path / "policy" / "config.json").is_file()
    assert not marker.exists() and not planted.exists()
    remote = tampered(trained, tmp_path / "r.ckpt", trust_remote_code=True)
    with pytest.raises(SystemExit, match="model.trust_remote_code.*lit-rlhf-export --trust-remote-code"):
        export_main(["--ckpt", str(remote), "--out", str(tmp_path / "other")])


def test_resuming_with_ckpt_path_runs_nothing_the_checkpoint_names(trained, tmp_path, planted):
    """`Trainer.fit(ckpt_path=...)` builds nothing from the checkpoint's hyperparameters; a pickled callable is
    refused by the weights-only load, naming the file."""
    marker = tmp_path / "popen_ran"
    path = tampered(
        trained,
        tmp_path / "x.ckpt",
        environment=popen_environment(marker),
        reward_fns=[f"{PLANTED}.reward"],
        state_logger_version="../../escaped",
    )
    module = RLHFModule(
        policy="builtin:digits",
        reward_fns=["lit_rlhf.tasks.digits.sort_digits_reward"],
        algorithm=AlgorithmConfig(name="grpo", group_size=2),
        sampling=SamplingConfig(max_new_tokens=4),
    )
    trainer = make_trainer(2, default_root_dir=tmp_path, plugins=[AtomicCheckpointIO()])
    trainer.fit(module, RolloutDataModule(prompts="builtin:digits", batch_size=2), ckpt_path=path)
    assert trainer.global_step == 2 and not marker.exists() and not planted.exists()

    checkpoint = torch.load(trained, weights_only=True)
    checkpoint["lit_rlhf"]["payload"] = print  # a pickled global: code a full unpickling would call
    torch.save(checkpoint, tmp_path / "pickled.ckpt")
    with pytest.raises(CheckpointError, match=r"pickled.ckpt: holds Python objects"):
        make_trainer(3, plugins=[AtomicCheckpointIO()]).fit(
            module, RolloutDataModule(prompts="builtin:digits", batch_size=2), ckpt_path=tmp_path / "pickled.ckpt"
        )


def test_the_command_line_resume_logs_nowhere_the_checkpoint_chose(tmp_path, monkeypatch, planted):
    """`lit-rlhf fit --ckpt_path last` reads the logger version from the checkpoint: a path there is ignored
    (with a warning), so the logs stay in the logger's folder."""
    from lit_rlhf.cli import main

    monkeypatch.chdir(tmp_path)
    common = ["fit", "--config", str(ROOT / "configs" / "debug.yaml"), "--ckpt_path", "last"]
    common += ["--trainer.enable_progress_bar", "false", "--model.log_samples_every_n_steps", "0"]
    with pytest.warns(UserWarning, match="no last checkpoint"):
        main([*common, "--trainer.max_steps", "4"])
    last = tmp_path / "runs" / "debug" / "checkpoints" / "last.ckpt"
    outside = tmp_path / "outside"
    tampered(
        last,
        last,
        reward_fns=[f"{PLANTED}.reward"],
        state_logger_version=str(outside),
        environment=popen_environment(outside),
    )
    with pytest.warns(UserWarning, match="logger version .*outside.* is not a plain folder name"):
        main([*common, "--trainer.max_steps", "8"])
    assert not outside.exists() and not planted.exists()
    assert sorted(p.name for p in (tmp_path / "runs" / "debug").iterdir() if p.name.startswith("version_")) == [
        "version_0",
        "version_1",
    ]
