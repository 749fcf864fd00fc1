"""Greedy held-out sampling with several answers per prompt on `sampling.backend: vllm` (which refuses greedy with
n > 1): each prompt is sent once per answer, and the answers of a prompt are the same, greedy's.

Runs where vLLM is installed (`.venv-vllm`, docs/vllm.md) with SmolLM2-135M-Instruct at models/smollm2-135m; skips
elsewhere."""

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


def test_greedy_with_three_answers_per_prompt_repeats_greedys_answer():
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"no SmolLM2 folder at {MODEL}: python scripts/prepare_smollm2.py --out models/smollm2-135m")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    tokenizer.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    texts = ["The capital of France is", "Two plus two equals"]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        firsts = policy(**encoded).logits[:, -1].argmax(-1).tolist()  # greedy's first token of each prompt
    sampling = SamplingConfig(max_new_tokens=6, backend="vllm", do_sample=False, vllm={"max_model_len": 256})
    backend = make_backend(BackendContext(policy, tokenizer.eos_token_id, tokenizer.pad_token_id, sampling))
    try:
        batch = PromptBatch(encoded["input_ids"], encoded["attention_mask"], texts)
        gen = backend.generate(batch, 3, sampling)
    finally:
        backend.close()
    ids = gen.response_ids.tolist()
    assert len(ids) == 6
    assert ids[0] == ids[1] == ids[2] and ids[3] == ids[4] == ids[5] and ids[0] != ids[3]
    assert [ids[0][0], ids[3][0]] == firsts
