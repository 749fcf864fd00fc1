"""Shared fixtures for the integration tests: the built-in char tokenizer, tiny GPT-2 policies, seeds,
and a quiet CPU Trainer factory. Everything is CPU, single-threaded and seeded."""

from __future__ import annotations

import hashlib
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

torch.set_num_threads(1)
# the one-off preparation scripts (scripts/*.py) are tested too
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end runs (tests/e2e); skip them with -m 'not slow'")
    # Lightning's notes about the experimental `dataloader_iter` signature and the eval-mode frozen modules
    # are expected in every fit; keep the output readable.
    for pattern in (".*dataloader_iter.*", ".*module\\(s\\) in eval mode.*", ".*LeafSpec.*"):
        config.addinivalue_line("filterwarnings", f"ignore:{pattern}")


PAD_ID, EOS_ID = 0, 1  # the built-in tokenizer's special ids (checked by the `tokenizer` fixture)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def free_port() -> int:
    """A local TCP port nothing listens on now (for MASTER_PORT or a server the test starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(
    commands: list[list[str]], envs: list[dict[str, str]], cwd, timeout: int, hang: str
) -> list[subprocess.CompletedProcess]:
    """Start one process per rank (`commands[r]` with `envs[r]`, all at once), wait for them all and return each
    one's exit code and stderr; `hang` is the failure message when one is still running after `timeout` seconds.
    No rank outlives the call, whatever happens in it."""
    procs = [
        subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for command, env in zip(commands, envs, strict=True)
    ]
    try:
        stderr = [proc.communicate(timeout=timeout)[1] for proc in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(hang)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [subprocess.CompletedProcess(proc.args, proc.returncode, "", err) for proc, err in zip(procs, stderr)]


@pytest.fixture
def one_process_group(monkeypatch):
    """A one-process gloo group on a free local port, destroyed after the test unless the test did it."""
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def tokenizer():
    from lit_rlhf.tasks.digits import builtin_tokenizer

    tok = builtin_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id) == (PAD_ID, EOS_ID)
    return tok


def make_policy(seed: int = 0, n_layer: int = 1, n_embd: int = 32, n_head: int = 2):
    """A fresh, seeded, from-scratch GPT-2 over the built-in vocabulary."""
    from lit_rlhf.tasks.digits import builtin_policy

    torch.manual_seed(seed)
    return builtin_policy(n_layer=n_layer, n_embd=n_embd, n_head=n_head)


@pytest.fixture
def tiny_policy():
    return make_policy()


def make_trainer(max_steps: int, **kwargs):
    """A quiet CPU Trainer that hands every step's metrics to Lightning (`log_every_n_steps=1`)."""
    import lightning as L

    settings = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "log_every_n_steps": 1,
    }
    return L.Trainer(max_steps=max_steps, **{**settings, **kwargs})


def prompt_batch(tok, texts: list[str], meta: dict | None = None):
    """Left-padded PromptBatch built straight from the tokenizer (not through the DataModule)."""
    from lit_rlhf.types import PromptBatch

    tok.padding_side = "left"
    enc = tok(texts, padding=True, return_tensors="pt")
    return PromptBatch(enc["input_ids"], enc["attention_mask"], list(texts), dict(meta or {}))


def checksum(module: torch.nn.Module) -> str:
    """Exact fingerprint of every parameter's bytes."""
    h = hashlib.sha1()
    for name, p in sorted(module.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def generate(policy, prompts, group_size, sampling, eos_token_id, pad_token_id, generator=None):
    """`group_size` responses per prompt from the backend `sampling.backend` names, over `policy`."""
    from lit_rlhf.rollout.backends.base import BackendContext
    from lit_rlhf.rollout.backends.registry import make_backend

    backend = make_backend(BackendContext(policy, eos_token_id, pad_token_id, sampling, generator))
    return backend.generate(prompts, group_size, sampling)


# The slow, obvious reference for everything the library computes from logits (it never builds them itself:
# lit_rlhf/algorithms/chunked_logprobs.py): the full (B, T, V) tensor and a log-softmax over it.


def response_logits(forward) -> torch.Tensor:
    """The full logits (B, T, V) of a `ResponseForward`, built by hand from its head (before the temperature)."""
    if forward.logits is not None:
        return forward.logits
    head = forward.head
    logits = forward.hidden @ head.weight.T
    if head.bias is not None:
        logits = logits + head.bias
    logits = logits * head.scale
    if head.softcap is not None:
        logits = torch.tanh(logits / head.softcap) * head.softcap
    return logits if head.vocab is None else logits[..., : head.vocab]


def full_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[token]: (..., V), (...) -> (...)."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1)


def full_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """-sum p log p over the vocabulary: (..., V) -> (...)."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return -(logp.exp() * logp.clamp(min=torch.finfo(torch.float64).min)).sum(-1)


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """sum p (log p - log q) over the vocabulary: (..., V) x2 -> (...)."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    logq = torch.log_softmax(ref_logits.double() / temperature, dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def forward_logits(model, input_ids, attention_mask, response_len, **kwargs) -> torch.Tensor:
    """`causal_lm_response_forward`'s full logits (B, T, V) on the response grid (`response_logits`)."""
    from lit_rlhf.models.forward import causal_lm_response_forward

    return response_logits(causal_lm_response_forward(model, input_ids, attention_mask, response_len, **kwargs))


def forward_from_logits(logits, tokens, logprobs=None, values=None, temperature=1.0, ref_logits=None):
    """A `PolicyForward` over (B, T, V) `logits` (a head without weight, the model's own logits), its entropy,
    log-probs (unless given) and, with `ref_logits`, exact KL computed from them at `temperature` by the library."""
    from lit_rlhf.algorithms.chunked_logprobs import Head, head_stats
    from lit_rlhf.algorithms.experience import PolicyForward
    from lit_rlhf.models.forward import ResponseForward

    B, T, V = logits.shape
    reference = None if ref_logits is None else (ref_logits.reshape(-1, V), Head(None))
    stats = head_stats(logits.reshape(-1, V), tokens.reshape(-1), Head(None), temperature, reference)
    grid = {name: None if value is None else value.view(B, T) for name, value in vars(stats).items()}
    logprobs = grid["logprobs"] if logprobs is None else logprobs
    response = ResponseForward(logits, Head(None), logits)
    return PolicyForward(response, values, logprobs, grid["entropy"], grid["kl"], grid["ref_logprobs"])
