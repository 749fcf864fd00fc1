"""The model and tokenizer section: chat template, stop ids, pad token, and the vocabularies of every model, read
from the tokenizer and the models' configs (`meta`-device builds: no weight is read)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from torch import nn

from lit_rlhf.models.stop_ids import chat_end_of_turn_id, stop_id_disagreement, stop_token_ids
from lit_rlhf.preflight.report import Section
from lit_rlhf.training.memory_plan import meta_model

PROBE = [{"role": "user", "content": "What is 2 + 3?"}]


def model_configs(module: Any) -> dict[str, nn.Module]:
    """`meta`-device builds of the policy, the reference (when one is used and given apart) and the reward model."""
    specs, trust = module.specs, bool(module.hparams.get("trust_remote_code"))
    models = {"policy": meta_model(specs.policy, "model.policy", "causal", trust)}
    if specs.reference is not None and module.algorithm.uses_reference:
        models["reference"] = meta_model(specs.reference, "model.reference", "causal", False)
    if specs.reward_model is not None:
        models["reward model"] = meta_model(specs.reward_model, "model.reward_model", "classifier", trust)
    return models


def generation_config(spec: Any, policy: nn.Module) -> Any:
    """The policy's generation config: a folder's generation_config.json, else the one its config implies."""
    if isinstance(spec, str) and os.path.isfile(os.path.join(os.path.expanduser(spec), "generation_config.json")):
        from transformers import GenerationConfig

        with contextlib.suppress(OSError, ValueError):
            return GenerationConfig.from_pretrained(os.path.expanduser(spec))
    return getattr(policy, "generation_config", None)


def input_vocab(model: Any) -> int:
    """Rows of the model's input embedding (its config's `vocab_size` when it has no such method)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    return int(rows if rows is not None else getattr(model.config, "vocab_size", 0))


def check_model(section: Section, module: Any, models: dict[str, nn.Module], chat_prompts: bool) -> None:
    """Describe the tokenizer and the models; block on ids the models or the tokenizer do not have."""
    tokenizer = module.tokenizer
    size = len(tokenizer)
    same = " = eos" if tokenizer.pad_token_id == tokenizer.eos_token_id else ""
    section.line(
        f"tokenizer: {size} ids, eos {tokenizer.eos_token!r} ({tokenizer.eos_token_id}), pad "
        f"{tokenizer.pad_token!r} ({tokenizer.pad_token_id}){same}"
    )
    _check_chat_template(section, tokenizer, chat_prompts)
    _check_stop_ids(section, tokenizer, generation_config(module.specs.policy, models["policy"]), size)
    _check_vocabularies(section, models, size, module.specs.reward_tokenizer is not None)


def _check_chat_template(section: Section, tokenizer: Any, chat_prompts: bool) -> None:
    if not getattr(tokenizer, "chat_template", None):
        used = "the prompts are message lists: they need one" if chat_prompts else "the prompts are plain text"
        section.line(f"chat template: none ({used})")
        if chat_prompts:
            section.block("the tokenizer has no chat template, but the prompts are message lists", "model.tokenizer")
        return
    with_prompt = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, tokenize=False)
    without = tokenizer.apply_chat_template(PROBE, add_generation_prompt=False, tokenize=False)
    honoured = with_prompt != without
    if not honoured:
        shown = "IGNORED (the same text with and without it)"
    elif with_prompt.startswith(without):
        shown = f"adds {with_prompt[len(without) :]!r}"
    else:
        shown = "honoured"
    plain = "" if chat_prompts else " (the prompts are plain text: not used)"
    section.line(f"chat template: present; add_generation_prompt {shown}{plain}")
    if chat_prompts and not honoured:
        section.warn(
            "the chat template renders the same text with and without add_generation_prompt: the prompts end "
            "without the assistant's header, so the policy continues the user's turn",
            "model.tokenizer",
        )


def _check_stop_ids(section: Section, tokenizer: Any, generation: Any, size: int) -> None:
    stops = stop_token_ids(tokenizer, generation)
    configured = getattr(generation, "eos_token_id", None)
    turn = chat_end_of_turn_id(tokenizer)
    section.line(
        f"stop ids {list(stops)}: tokenizer eos {tokenizer.eos_token_id}, generation config eos {configured}, "
        f"chat template end of turn {turn}"
    )
    disagreement = stop_id_disagreement(tokenizer, generation)
    if disagreement:
        section.line(disagreement)
    unknown = [i for i in stops if not 0 <= i < size]
    if unknown:
        section.block(
            f"stop ids {unknown} (generation config eos_token_id {configured}) are not ids of the tokenizer "
            f"({size} ids): responses can never end on them; fix eos_token_id in the policy folder's "
            "generation_config.json, or give the model's own tokenizer",
            "model.policy (generation_config.json eos_token_id)",
        )


def _check_vocabularies(section: Section, models: dict[str, nn.Module], size: int, own_reward_tokenizer: bool) -> None:
    vocab = {name: input_vocab(model) for name, model in models.items()}
    section.line("vocabulary: " + ", ".join(f"{name} {n}" for name, n in vocab.items()) + f", tokenizer {size}")
    for name, n in vocab.items():
        if name == "reward model" and own_reward_tokenizer:
            continue
        if n < size:
            setting = {"policy": "model.tokenizer", "reference": "model.reference"}.get(name, "model.reward_tokenizer")
            section.block(
                f"the {name} has {n} input ids but the tokenizer has {size}: ids {n}..{size - 1} would index past "
                f"its embeddings; use the {name}'s own tokenizer (or resize its embeddings)",
                setting,
            )
    if "reference" in vocab and vocab["reference"] != vocab["policy"]:
        section.block(
            f"the reference's vocabulary ({vocab['reference']}) is not the policy's ({vocab['policy']}): their "
            "log-probs cannot be compared token by token",
            "model.reference",
        )
