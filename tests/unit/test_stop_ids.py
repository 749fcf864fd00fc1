"""stop_token_ids: the union of the tokenizer's EOS, the generation config's and the chat template's end of turn."""

from __future__ import annotations

import os

import pytest

from chat_models import llama3_style, qwen_style
from lit_rlhf.models.stop_ids import chat_end_of_turn_id, stop_id_disagreement, stop_token_ids

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_llama3_style_stops_at_end_of_text_and_end_of_turn():
    tok, generation_config = llama3_style()
    end_of_text, end_of_turn = tok.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
    assert tok.eos_token_id == end_of_text  # the tokenizer alone names only end of text
    assert chat_end_of_turn_id(tok) == end_of_turn
    assert stop_token_ids(tok) == (end_of_text, end_of_turn)  # the template's end of turn even without the config
    assert stop_token_ids(tok, generation_config) == (end_of_text, end_of_turn)


def test_qwen_style_adds_the_generation_configs_end_of_text():
    tok, generation_config = qwen_style()
    end_of_text, end_of_turn = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert stop_token_ids(tok) == (end_of_turn,)  # the template ends a reply with the tokenizer's own EOS
    assert stop_token_ids(tok, generation_config) == tuple(sorted((end_of_text, end_of_turn)))


def test_one_id_in_the_generation_config_and_no_template():
    from transformers import GenerationConfig

    from lit_rlhf.tasks.text import text_tokenizer

    tok = text_tokenizer()  # its template writes a newline after each message: no end-of-turn token
    assert chat_end_of_turn_id(tok) is None
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=7)) == tuple(sorted({tok.eos_token_id, 7}))
    tok.chat_template = None
    assert stop_token_ids(tok, None) == (tok.eos_token_id,)


@pytest.mark.parametrize("make", [llama3_style, qwen_style])
def test_disagreement_names_both_sides_and_the_union(make):
    tok, generation_config = make()
    text = stop_id_disagreement(tok, generation_config)
    assert text is not None and "\n" not in text
    assert repr(tok.eos_token) in text
    for token_id in generation_config.eos_token_id:
        assert repr(tok.convert_ids_to_tokens(token_id)) in text
    assert str(sorted(generation_config.eos_token_id)) in text


def test_no_disagreement_when_the_config_repeats_the_tokenizer():
    from transformers import GenerationConfig

    tok, _ = qwen_style()
    assert stop_id_disagreement(tok, None) is None
    assert stop_id_disagreement(tok, GenerationConfig()) is None
    assert stop_id_disagreement(tok, GenerationConfig(eos_token_id=tok.eos_token_id)) is None
    assert stop_id_disagreement(tok, GenerationConfig(eos_token_id=[tok.eos_token_id])) is None


def test_smollm2_stops_at_im_end():
    folder = os.environ.get("LIT_RLHF_SMOLLM2", os.path.join(ROOT, "models", "smollm2-135m"))
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):
        pytest.skip(f"no prepared SmolLM2 at {folder} (python scripts/prepare_smollm2.py)")
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(folder)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert chat_end_of_turn_id(tok) == im_end
    assert im_end in stop_token_ids(tok, GenerationConfig.from_pretrained(folder))
