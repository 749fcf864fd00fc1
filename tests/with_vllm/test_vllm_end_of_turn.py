"""`sampling.backend: vllm` stops at the first of several stop ids (vLLM's `stop_token_ids`), in both modes.

Runs where vLLM is installed (`.venv-vllm`, docs/vllm.md) with SmolLM2-135M-Instruct at models/smollm2-135m; skips
elsewhere. The stop ids are the tokenizer's EOS and the token greedy decoding writes first, so every response must
end after one token, with no truncation, and the response grid is one column wide (vLLM stopped there: the
post-processing alone would mask the rest but keep the columns)."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (docs/vllm.md)")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the colocated engine in the test process

from lit_rlhf import SamplingConfig
from lit_rlhf.rollout.backends.base import BackendContext
from lit_rlhf.rollout.backends.registry import make_backend
from lit_rlhf.types import PromptBatch

MODEL = pathlib.Path(__file__).resolve().parents[2] / "models" / "smollm2-135m"


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_vllm_stops_at_the_first_of_several_stop_ids(request, tmp_path, mode):
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"no SmolLM2 folder at {MODEL}: python scripts/prepare_smollm2.py --out models/smollm2-135m")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    tokenizer.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    text = "The capital of France is"
    encoded = tokenizer([text], return_tensors="pt", padding=True)
    with torch.no_grad():
        first = int(policy(**encoded).logits[0, -1].argmax())  # greedy's first token
    assert first != tokenizer.eos_token_id
    vllm = {"mode": mode, "max_model_len": 256}
    if mode == "server":
        from vllm_server import start_server, stop_server  # scripts/ (tests/conftest.py puts it on the path)

        log = open(tmp_path / "server.log", "w")  # noqa: SIM115
        process, vllm["server_url"] = start_server(str(MODEL), log)
        request.addfinalizer(lambda: (stop_server(process), log.close()))
    sampling = SamplingConfig(max_new_tokens=10, backend="vllm", do_sample=False, vllm=vllm)
    stops = tuple(sorted({tokenizer.eos_token_id, first}))
    backend = make_backend(BackendContext(policy, stops, tokenizer.pad_token_id, sampling))
    try:
        batch = PromptBatch(encoded["input_ids"], encoded["attention_mask"], [text])
        gen = backend.generate(batch, 1, sampling)  # vLLM takes n=1 only when greedy
    finally:
        backend.close()
    assert gen.response_ids.shape == (1, 1)
    assert gen.response_ids[:, 0].tolist() == [first]
    assert gen.response_mask.all() and not gen.truncated.any()
