"""Ray Train's Lightning integration (`RayDDPStrategy`, `RayLightningEnvironment`, `prepare_trainer`) on a local
Ray cluster of 2 CPU workers: `scripts/ray_train.py` trains the built-in GRPO task for 3 steps, and its weights
equal those of a plain `strategy: ddp` run of the same settings on 2 processes (`tests/e2e/fsdp2_run.py`).

Runs in an environment with Ray installed (`pip install -e ".[ray]"`; `.ci/run` builds `.venv-ray` and runs this
folder there, docs/distributed.md) and skips elsewhere. No conftest.py here: a second one would shadow
tests/conftest.py's helpers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray", reason="Ray is not installed in this environment (docs/distributed.md)")
pytestmark = pytest.mark.slow  # a Ray cluster and two fits

ROOT = Path(__file__).resolve().parents[2]
# both runs are DDP over gloo with the same prompts and sampling streams per rank: only the launcher differs
TOLERANCE = 1e-6


def fsdp2_test_module():
    spec = importlib.util.spec_from_file_location("fsdp2_e2e", ROOT / "tests" / "e2e" / "test_fsdp2.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_ray_train(out: Path, *args: str) -> None:
    """`scripts/ray_train.py` on a local cluster of its own with 2 workers, writing under `out`; must succeed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)  # a local cluster of its own
    command = [sys.executable, str(ROOT / "scripts" / "ray_train.py"), "--workers", "2", *args, "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-4000:]


def test_a_two_worker_ray_train_run_trains_like_ddp(tmp_path):
    run_ray_train(tmp_path, "--steps", "3")
    for rank in (0, 1):
        assert json.loads((tmp_path / f"ray_rank{rank}.json").read_text()) == {"global_step": 3, "world_size": 2}
    fsdp2_test_module().run("ddp", tmp_path)
    ray, ddp = torch.load(tmp_path / "ray.pt"), torch.load(tmp_path / "ddp.pt")
    assert sorted(ray) == sorted(ddp) and ddp
    assert max((ray[k] - ddp[k]).abs().max().item() for k in ddp) < TOLERANCE
    initial = torch.load(tmp_path / "ddp_initial.pt")
    assert max((ddp[k] - initial[k]).abs().max().item() for k in ddp) > 1e-2  # the weights moved


def test_any_train_config_fits_under_ray_with_its_logger_callbacks_and_plugins(tmp_path):
    import yaml

    settings = yaml.safe_load((ROOT / "configs" / "debug.yaml").read_text())
    settings["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(tmp_path / "checkpoints")
    settings["trainer"]["logger"] = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(tmp_path / "logs")},
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(settings))
    run_ray_train(tmp_path, "--config", str(config))
    steps = settings["trainer"]["max_steps"]  # one rollout of ppo_epochs 2 x num_minibatches 2
    for rank in (0, 1):
        assert json.loads((tmp_path / f"ray_rank{rank}.json").read_text()) == {"global_step": steps, "world_size": 2}
    assert (tmp_path / "checkpoints" / "last.ckpt").stat().st_size > 0  # the config's ModelCheckpoint
    assert list((tmp_path / "logs").rglob("metrics.csv"))  # the config's logger, written by rank 0
