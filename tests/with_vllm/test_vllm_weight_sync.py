"""Weight syncs that cost what changed, on this CPU with SmolLM2-135M-Instruct: a LoRA policy's adapters alone (a new
adapter version per sync) in both modes, exact after every sync and stale without one; adapters vLLM cannot serve
fall back to merged full weights; and a colocate fit, ended as `lit-rlhf fit` ends it, prints no traceback and
leaves no thread or process behind.

Runs where vLLM is installed (`.venv-vllm`, docs/vllm.md) with models/smollm2-135m; skips elsewhere."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (docs/vllm.md)")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the colocated engine in the test process

from test_vllm_backend import STALE_AT_LEAST, SYNC_TOLERANCE, largest_gap, load, model_folder, prompts, vllm_backend

from lit_rlhf.config import ConfigError
from lit_rlhf.models.lora import apply_lora

ROOT = pathlib.Path(__file__).resolve().parents[2]
__all__ = ["model_folder"]  # the SmolLM2 folder fixture, shared with test_vllm_backend.py


@pytest.fixture(scope="module")
def lora_server(model_folder, tmp_path_factory):
    """A server started for LoRA adapters up to rank 8 (`scripts/vllm_server.py --lora-rank 8`); after it is
    stopped no process of its group is left. (Its own log is not checked: vLLM 0.32's server logs an
    EngineDeadError traceback whenever it is stopped.)"""
    from vllm_server import start_server, stop_server  # scripts/ (tests/conftest.py puts it on the path)

    log_path = tmp_path_factory.mktemp("lora_server") / "server.log"
    with open(log_path, "w") as log:
        process, url = start_server(model_folder, log, lora_rank=8)
        yield url
        stop_server(process)
    assert live_processes_of_group(process.pid) == []  # the server's engine processes went with it


def live_processes_of_group(group: int, wait_s: float = 10) -> list[int]:
    """The processes of a process group that are still running (not zombies), after up to `wait_s` for them to go."""
    deadline = time.monotonic() + wait_s
    while True:
        live = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as file:
                    fields = file.read().rsplit(")", 1)[1].split()  # after the command name: state, ppid, pgrp
            except OSError:
                continue
            if int(fields[2]) == group and fields[0] != "Z":
                live.append(int(pid))
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.5)


def lora_policy(model_folder: str, settings: dict):
    policy, tokenizer = load(model_folder)
    return apply_lora(policy, settings), tokenizer


def nudge_adapters(policy, seed: int, scale: float = 0.05) -> None:
    """Move every LoRA B (A too) as a training step would; the base weights stay."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)


def lora_bytes(policy) -> int:
    return sum(p.numel() * p.element_size() for name, p in policy.named_parameters() if "lora_" in name)


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_lora_syncs_send_the_adapters_alone_and_stay_exact(model_folder, request, mode):
    policy, tokenizer = lora_policy(model_folder, {"r": 4, "alpha": 8})
    nudge_adapters(policy, seed=0)  # trained adapters from the start (a resumed run): the first push carries them
    url = request.getfixturevalue("lora_server") if mode == "server" else None
    backend, sampling = vllm_backend(policy, tokenizer, mode, url)
    try:
        assert backend.adapters
        batch = prompts(tokenizer)
        assert largest_gap(policy, backend.generate(batch, 3, sampling)) < SYNC_TOLERANCE
        full = sum(t.numel() * t.element_size() for t in policy.get_base_model().state_dict().values())
        for seed in (1, 2):
            nudge_adapters(policy, seed)
            assert largest_gap(policy, backend.generate(batch, 3, sampling)) > STALE_AT_LEAST  # a missed sync shows
            backend.sync_weights(policy)
            assert largest_gap(policy, backend.generate(batch, 3, sampling)) < SYNC_TOLERANCE
            sent = backend.last_sync[1]
            assert sent == lora_bytes(policy) and sent * 20 <= full
    finally:
        backend.close()


def test_adapters_vllm_cannot_serve_go_as_merged_weights_with_the_reason_logged(model_folder, caplog):
    policy, tokenizer = lora_policy(model_folder, {"r": 4, "alpha": 8, "use_dora": True})
    nudge_adapters(policy, seed=0)
    with caplog.at_level(logging.WARNING, logger="lit_rlhf"):
        backend, sampling = vllm_backend(policy, tokenizer, "colocate")
    try:
        assert not backend.adapters
        assert "synced as merged full weights: DoRA (use_dora) is not served by vLLM" in caplog.text
        batch = prompts(tokenizer)
        nudge_adapters(policy, seed=1)
        assert largest_gap(policy, backend.generate(batch, 3, sampling)) > STALE_AT_LEAST
        backend.sync_weights(policy)
        assert largest_gap(policy, backend.generate(batch, 3, sampling)) < SYNC_TOLERANCE
        assert backend.last_sync[1] > 20 * lora_bytes(policy)  # the whole model went
    finally:
        backend.close()


def test_full_weights_to_a_server_started_with_lora_are_refused(model_folder, lora_server):
    """vLLM 0.32 reloads full weights wrongly into a LoRA server's layers (the probe scored 15 nats away)."""
    policy, tokenizer = load(model_folder)
    match = "was started with LoRA .*the policy has no LoRA adapters.*without --lora-rank"
    with pytest.raises(ConfigError, match=match):
        vllm_backend(policy, tokenizer, "server", lora_server)


END_OF_FIT = textwrap.dedent(
    """
    import json, os, sys, threading
    import lightning as L
    from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
    from lit_rlhf.cli import leave_process_group

    def brevity(prompts, responses, **meta):
        return [-len(response) / 100 for response in responses]

    module = RLHFModule(
        policy=sys.argv[1], reward_fns=[brevity], algorithm=AlgorithmConfig(group_size=2, kl_coef=0.0),
        sampling=SamplingConfig(max_new_tokens=8, backend="vllm", vllm={"mode": "colocate", "max_model_len": 256}),
        lr=1e-4, lora={"r": 4, "alpha": 8},
    )
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, RolloutDataModule(prompts=["Name a colour.", "Say hi."], batch_size=2, seed=0))
    leave_process_group()  # as `lit-rlhf fit` ends (lit_rlhf.cli.main_script)
    children = []
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children") as file:
            children += file.read().split()
    ours = [t for t in threading.enumerate() if t is not threading.main_thread()]
    threads = sorted(t.name for t in ours if t.name != "tqdm_monitor")  # the loading progress bars' own
    print(json.dumps({"gap": module.step_metrics["sampler/logprob_diff_max"], "children": children,
                      "threads": threads}))
    """
)


def test_a_colocate_fit_ends_without_a_traceback_thread_or_process(model_folder, tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(END_OF_FIT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), model_folder], capture_output=True, text=True, env=env, timeout=1200
    )
    output = done.stdout + done.stderr  # vLLM logs to stdout
    assert done.returncode == 0, output[-3000:]
    assert "Traceback" not in output and "Error:" not in output, output[-3000:]
    ending = json.loads(done.stdout.strip().splitlines()[-1])
    assert ending["children"] == [] and ending["threads"] == [], ending
    assert ending["gap"] < SYNC_TOLERANCE  # the second rollout sampled the first update's adapters
