"""`sampling.backend: vllm` with `sampling.vllm.mode: server`: an OpenAI-compatible vLLM server the user started
(`python -m vllm.entrypoints.openai.api_server --model <folder> ...` with `VLLM_SERVER_DEV_MODE=1`, docs/vllm.md).

Sampling is one `/v1/completions` request per batch: token ids in (`prompt` as lists of ids), token ids and the
sampled tokens' log-probs out. After every optimizer step global rank 0 pushes the policy through a folder the
server can read (`weights_dir`; None: a temporary folder in shared memory, for a server on this machine), so no
NCCL is needed and this works on CPUs and across machines with a shared folder:
- a LoRA policy, to a server started with LoRA (`scripts/vllm_server.py --lora-rank r`): the adapters alone, as
  the folder `v<n>` loaded under the name `policy-v<n>` (`/v1/load_lora_adapter`), which every request of that
  version names; the base weights are the server's own model. A server without LoRA, or adapters vLLM cannot
  serve, get merged full weights instead, with the reason logged.
- full weights: safetensors shards of at most `vllm_weights.SHARD_BYTES` taken from the policy's tensors, loaded
  with `/collective_rpc` `reload_weights`, then `/reset_prefix_cache`.
Under DDP every rank keeps a client, and only global rank 0 pushes: the other ranks wait until the server reports
that rank 0's push of the same policy version has finished (a marker file naming the version and the model to
request), so no rank samples stale weights and nothing is pushed twice.

At construction the server is checked: it answers `/health`, serves a model whose folder (when it is a local
folder) has the policy's architecture and vocabulary, and after the first push its log-probs of a probe sequence
match the trainer's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
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
    prompt_requests,
    request_seed,
    response_grid,
    sampling_params,
)
from lit_rlhf.rollout.backends.vllm_weights import (
    AdapterVersions,
    lora_rank,
    serves_adapters,
    shared_memory_folder,
    write_weight_shards,
)
from lit_rlhf.rollout.generation import EosIds, Generation, finish_generation
from lit_rlhf.types import PromptBatch

log = logging.getLogger(__name__)

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
        self._temporary = None if settings.weights_dir else shared_memory_folder("lit_rlhf-vllm-")
        self.weights_dir = settings.weights_dir or self._temporary.name  # type: ignore[union-attr]
        self.pushes = 0  # policy versions synced by this client (the same count on every rank)
        self.versions = AdapterVersions(self.weights_dir)
        self.last_sync = (0.0, 0)  # (seconds, bytes) of rank 0's last push
        self.model = self._check_server(plain_model(policy))
        self.adapters = self._choose_adapters(policy)
        self.served = self.model  # what requests name: the served model, or the current adapter version
        self.sync_weights(policy)
        self._check_probe(policy)

    # ------------------------------------------------------------------ HTTP

    def _request(self, call: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """GET (no body) or POST JSON to the server: its answer's JSON (text where it is not JSON); a `VLLMError`
        naming `call` on a refusal, an error answer or a timeout."""
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
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:  # /v1/load_lora_adapter answers plain text
            return raw.decode(errors="replace")

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
        rows, n = prompt_requests(prompts.input_ids, prompts.attention_mask, group_size, sampling)
        body = {
            "model": self.served,
            "prompt": rows,
            **sampling_params(sampling, n, request_seed(self.generator), self.eos_token_id),
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
        """Rank 0 pushes the adapters or the full weights and has the server load them; every rank counts the
        version."""
        self.pushes += 1
        if self.rank != 0:
            return
        start = time.perf_counter()
        sent = self._push_adapter(policy) if self.adapters else self._push_full_weights(policy)
        with open(self._marker(), "w") as file:  # tells the other ranks this version is loaded, and its name
            json.dump({"version": self.pushes, "model": self.served}, file)
        self.last_sync = (time.perf_counter() - start, sent)

    def _lora_enabled(self) -> bool:
        """Whether the server's engine was started with LoRA (its worker lists its adapters)."""
        try:
            self._request("the LoRA check", "/collective_rpc", {"method": "list_loras"})
        except VLLMError as err:
            if "LoRA is not enabled" in str(err):
                return False
            raise
        return True

    def _loads_adapters(self) -> bool:
        """Whether the server loads adapters at run time: its `/v1/unload_lora_adapter` route exists (an unknown
        name is vLLM's own error, not FastAPI's bare 404)."""
        try:
            self._request("the LoRA check", "/v1/unload_lora_adapter", {"lora_name": "lit_rlhf-no-such-adapter"})
        except VLLMError as err:
            return re.search(r'"detail":\s*"Not Found"', str(err)) is None
        return True

    def _choose_adapters(self, policy: nn.Module) -> bool:
        """Push adapters (the policy's LoRA, which vLLM serves, to a server that loads adapters) or full weights
        (logged with the reason for a LoRA policy). Full weights to a server started with LoRA are refused: vLLM
        0.32 reloads them wrongly into its LoRA layers (the probe scored 15 nats away)."""
        adapters, reason = serves_adapters(policy, self.settings.lora_adapters)
        lora_server = self._lora_enabled()
        restart = f"start it with scripts/vllm_server.py --lora-rank {lora_rank(policy) if adapters else 'r'}"
        if adapters and not lora_server:
            adapters, reason = False, f"the server at {self.url} was started without LoRA ({restart})"
        if adapters and not self._loads_adapters():
            raise ConfigError(
                f"sampling.vllm.server_url: the server at {self.url} serves LoRA but cannot load adapters at run "
                f"time; {restart}, which sets VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
            )
        if reason is not None:
            log.warning("sampling.vllm: the LoRA policy is pushed as merged full weights: %s", reason)
        if lora_server and not adapters:
            raise ConfigError(
                f"sampling.vllm.server_url: the server at {self.url} was started with LoRA (--lora-rank), but this "
                f"policy's weights go as full weights ({reason or 'the policy has no LoRA adapters'}), which vLLM "
                "does not reload correctly into a LoRA server; start it without --lora-rank"
            )
        return adapters

    def _push_adapter(self, policy: nn.Module) -> int:
        """The next adapter version, loaded under its own name; the previous one is unloaded."""
        name, _, folder, sent = self.versions.write(policy)
        body = {"lora_name": name, "lora_path": folder}
        self._request("sync_weights (load_lora_adapter)", "/v1/load_lora_adapter", body)
        if self.served != self.model:
            self._request("sync_weights (unload_lora_adapter)", "/v1/unload_lora_adapter", {"lora_name": self.served})
        self.served = name
        self.versions.drop_older()
        return sent

    def _push_full_weights(self, policy: nn.Module) -> int:
        """The policy's weights as shards in `v<n>`, loaded in place by the server (the prefix cache cleared)."""
        folder = os.path.join(self.weights_dir, f"v{self.pushes}")
        sent = write_weight_shards(policy_weights(policy).items(), folder)
        plain_model(policy).config.to_json_file(os.path.join(folder, "config.json"))
        body = {"method": "reload_weights", "kwargs": {"weights_path": folder}}
        self._request("sync_weights (reload_weights)", "/collective_rpc", body)
        self._request("sync_weights (reset_prefix_cache)", "/reset_prefix_cache", {})
        for old in range(1, self.pushes):  # keep only the current version
            shutil.rmtree(os.path.join(self.weights_dir, f"v{old}"), ignore_errors=True)
        return sent

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
                    pushed = json.load(file)
                if pushed["version"] >= self.pushes:
                    self.served = pushed["model"]
                    return
            except (OSError, ValueError, KeyError):
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
        body = {"model": self.served, "prompt": probe, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
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
