"""`sampling.backend: vllm` with `sampling.vllm.mode: server`: an OpenAI-compatible vLLM server the user started
(`python -m vllm.entrypoints.openai.api_server --model <folder> ...` with `VLLM_SERVER_DEV_MODE=1`, docs/vllm.md).

Sampling is one `/v1/completions` request per batch: token ids in (`prompt` as lists of ids), token ids and the
sampled tokens' log-probs out. Weights travel through a folder the server can read: after every optimizer step
the policy's weights are written there as a Hugging Face checkpoint (`model.safetensors` + `config.json`) and
the server is told to load it (`/collective_rpc` `reload_weights`, then `/reset_prefix_cache`); no NCCL is
needed, so this works on CPUs and across machines with a shared folder. Under DDP every rank keeps a client, and
only global rank 0 writes and pushes: the other ranks wait until the server reports that rank 0's push of the
same policy version has finished (a marker file), so no rank samples stale weights and nothing is pushed twice.

At construction the server is checked: it answers `/health`, serves a model whose folder (when it is a local
folder) has the policy's architecture and vocabulary, and after the first push its log-probs of a probe sequence
match the trainer's.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

import torch
from torch import nn

from lit_rlhf.config import ConfigError, SamplingConfig, VLLMConfig
from lit_rlhf.models.actor_critic import eval_mode
from lit_rlhf.models.forward import response_positions
from lit_rlhf.rollout.backends.vllm_common import (
    VLLMError,
    plain_model,
    policy_weights,
    prompt_rows,
    request_seed,
    response_grid,
    sampling_params,
)
from lit_rlhf.rollout.generation import EosIds, Generation, finish_generation
from lit_rlhf.types import PromptBatch

PROBE_TOLERANCE = 0.05
"""Largest mean |log-prob difference| (nats) between the trainer and the server on a probe sequence, after the first
push, for the two to count as the same model (float32 agrees to ~1e-4; a wrong model is off by nats)."""


class VLLMServerBackend:
    """A client of a running vLLM server; global rank 0 pushes each policy version through `weights_dir`."""

    def __init__(
        self,
        policy: nn.Module,
        eos_token_id: EosIds,
        pad_token_id: int,
        settings: VLLMConfig,
        rank: int = 0,
        generator: torch.Generator | None = None,
    ) -> None:
        self.settings, self.eos_token_id, self.pad_token_id, self.rank = settings, eos_token_id, pad_token_id, rank
        self.generator = generator  # the request seeds' source (None: the global RNG)
        self.device = next(policy.parameters()).device
        self.url = settings.server_url.rstrip("/")
        self._temporary = None if settings.weights_dir else tempfile.TemporaryDirectory(prefix="lit_rlhf-vllm-")
        self.weights_dir = settings.weights_dir or self._temporary.name  # type: ignore[union-attr]
        self.pushes = 0  # policy versions synced by this client (the same count on every rank)
        self.model = self._check_server(plain_model(policy))
        self.sync_weights(policy)
        self._check_probe(policy)

    # ------------------------------------------------------------------ HTTP

    def _request(self, call: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """GET (no body) or POST JSON to the server; a `VLLMError` naming `call` on a refusal, an error answer or a
        timeout."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.settings.timeout_s) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            raise VLLMError(f"sampling.vllm: {call}: the server at {self.url} answered {err.code}: {detail}") from err
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
            raise VLLMError(
                f"sampling.vllm: {call} got no answer from the vLLM server at sampling.vllm.server_url={self.url} "
                f"within sampling.vllm.timeout_s={self.settings.timeout_s:g} s (server mode): {err}; start the "
                "server (docs/vllm.md), or fix the address"
            ) from err
        return json.loads(raw) if raw.strip() else None

    def _check_server(self, plain: nn.Module) -> str:
        """The id of the model the server serves, once it answers and its architecture and vocabulary (when its
        folder is readable here) are the policy's."""
        self._request("the health check", "/health")
        models = self._request("listing the served models", "/v1/models")["data"]
        model = models[0]["id"]
        config_file = os.path.join(model, "config.json")
        if os.path.isfile(config_file):
            with open(config_file) as file:
                served = json.load(file)
            ours = plain.config
            for key in ("architectures", "vocab_size", "hidden_size", "num_hidden_layers"):
                if served.get(key) != getattr(ours, key, None):
                    raise ConfigError(
                        f"sampling.vllm.server_url: the server at {self.url} serves {model}, whose {key} is "
                        f"{served.get(key)!r}, but the policy's is {getattr(ours, key, None)!r}; start the server "
                        "with the policy's model"
                    )
        return model

    # ------------------------------------------------------------------ the contract

    def generate(self, prompts: PromptBatch, group_size: int, sampling: SamplingConfig) -> Generation:
        self._wait_for_push()
        body = {
            "model": self.model,
            "prompt": prompt_rows(prompts.input_ids, prompts.attention_mask),
            **sampling_params(sampling, group_size, request_seed(self.generator), self.eos_token_id),
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        choices = sorted(self._request("generate", "/v1/completions", body)["choices"], key=lambda c: c["index"])
        samples = [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]
        raw, logprobs = response_grid(samples, self.pad_token_id, self.device)
        prompts = prompts.to(self.device)
        return finish_generation(prompts, group_size, raw, self.eos_token_id, self.pad_token_id, logprobs)

    @torch.no_grad()
    def sync_weights(self, policy: nn.Module) -> None:
        """Rank 0 writes the weights and has the server load them; every rank counts the version."""
        self.pushes += 1
        if self.rank != 0:
            return
        from safetensors.torch import save_file

        folder = os.path.join(self.weights_dir, f"v{self.pushes}")
        os.makedirs(folder, exist_ok=True)
        tensors, seen = {}, set()
        for name, tensor in policy_weights(policy).items():  # tied tensors share storage: each name its own copy
            cpu = tensor.detach().to("cpu").contiguous()
            tensors[name] = cpu.clone() if cpu.data_ptr() in seen else cpu
            seen.add(cpu.data_ptr())
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        plain_model(policy).config.to_json_file(os.path.join(folder, "config.json"))
        body = {"method": "reload_weights", "kwargs": {"weights_path": folder}}
        self._request("sync_weights (reload_weights)", "/collective_rpc", body)
        self._request("sync_weights (reset_prefix_cache)", "/reset_prefix_cache", {})
        with open(self._marker(), "w") as file:  # tells the other ranks this version is loaded
            file.write(str(self.pushes))
        for old in range(1, self.pushes):  # keep only the current version on disk
            _remove_folder(os.path.join(self.weights_dir, f"v{old}"))

    def _marker(self) -> str:
        return os.path.join(self.weights_dir, "pushed_version")

    def _wait_for_push(self) -> None:
        """Ranks other than 0: wait until rank 0's push of this client's version has been loaded."""
        if self.rank == 0:
            return
        deadline = time.monotonic() + self.settings.timeout_s
        while time.monotonic() < deadline:
            try:
                with open(self._marker()) as file:
                    if int(file.read() or 0) >= self.pushes:
                        return
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise VLLMError(
            f"sampling.vllm: rank {self.rank} waited sampling.vllm.timeout_s={self.settings.timeout_s:g} s for rank "
            f"0's push of policy version {self.pushes} to {self.weights_dir} (server mode); every rank must see the "
            "same sampling.vllm.weights_dir"
        )

    @torch.no_grad()
    def _check_probe(self, policy: nn.Module) -> None:
        """After the first push the server must score a probe sequence as the trainer does."""
        if self.rank != 0:
            return
        vocab = plain_model(policy).config.vocab_size
        probe = [(7 * i + 3) % vocab for i in range(12)]
        body = {"model": self.model, "prompt": probe, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        answer = self._request("the probe after the first push", "/v1/completions", body)["choices"][0]
        served = torch.tensor([answer["prompt_logprobs"][i][str(probe[i])]["logprob"] for i in range(1, len(probe))])
        ids = torch.tensor([probe], device=self.device)
        with eval_mode(policy):
            logits = response_positions(policy(input_ids=ids).logits.float(), 1)  # (1, 11, V)
        ours = torch.log_softmax(logits, dim=-1)[0].gather(-1, ids[0, 1:, None]).squeeze(-1).cpu()
        gap = float((served - ours).abs().mean())
        if gap > PROBE_TOLERANCE:
            raise ConfigError(
                f"sampling.vllm.server_url: after loading the policy's weights the server at {self.url} scores a probe "
                f"{gap:.3g} nats per token away from the trainer (at most {PROBE_TOLERANCE} expected); it serves "
                "another architecture or vocabulary: start it with the policy's model"
            )

    def close(self) -> None:
        if self._temporary is not None:
            self._temporary.cleanup()


def _remove_folder(folder: str) -> None:
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)
