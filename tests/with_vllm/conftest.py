"""The vLLM backend's tests: they run in an environment with vLLM installed (`.ci/run` builds `.venv-vllm` and
runs `pytest tests/with_vllm` there, docs/vllm.md) and skip elsewhere. They need SmolLM2-135M-Instruct as a Hugging Face
folder at models/smollm2-135m (`python scripts/prepare_smollm2.py --out models/smollm2-135m`)."""

from __future__ import annotations

import os
import pathlib

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the colocated engine in the test process

MODEL = pathlib.Path(__file__).resolve().parents[2] / "models" / "smollm2-135m"


@pytest.fixture(scope="session")
def model_folder() -> str:
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"no SmolLM2 folder at {MODEL}: python scripts/prepare_smollm2.py --out models/smollm2-135m")
    return str(MODEL)


@pytest.fixture(scope="session")
def vllm_server(model_folder, tmp_path_factory):
    """One server for the session's server-mode tests, started as docs/vllm.md says (killed at the end)."""
    from vllm_server import start_server  # scripts/vllm_server.py (tests/conftest.py puts scripts/ on the path)

    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with open(log_path, "w") as log:
        process, url = start_server(model_folder, log)
        yield url
        process.kill()
        process.wait()
