"""The README's drop-in example runs as written, against a tiny model saved to a local folder."""

import re
from pathlib import Path

import torch

from lit_rlhf.tasks.digits import builtin_policy, builtin_tokenizer

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_drop_in_example_trains(tmp_path, monkeypatch):
    blocks = [b for b in readme_python_blocks() if "RLHFModule(" in b]
    assert len(blocks) == 1, "the README should hold exactly one drop-in example"
    code = blocks[0]
    assert code.count('"your/model-or-folder"') == 2

    folder = tmp_path / "tiny-model"
    torch.manual_seed(0)
    builtin_policy(n_layer=1, n_embd=32, n_head=2).save_pretrained(folder)
    builtin_tokenizer().save_pretrained(folder)
    monkeypatch.chdir(tmp_path)  # the Trainer writes its logs here

    namespace: dict = {}
    exec(compile(code.replace("your/model-or-folder", str(folder)), str(README), "exec"), namespace)

    module, trainer, best = namespace["module"], namespace["trainer"], namespace["best"]
    assert trainer.current_epoch == 5 and trainer.global_step == 10  # 5 epochs of 2 rollouts, one update each
    assert module.state.policy_version == 10
    assert (tmp_path / "lightning_logs").is_dir()
    # validation ran every epoch and the best checkpoint is the one with the highest val/short_answer
    assert "val/short_answer" in trainer.callback_metrics
    assert best.best_model_path and float(best.best_model_score) == max(best.best_k_models.values())

    # the export loads with plain transformers and answers greedily exactly as the best checkpoint's module
    from transformers import AutoModelForCausalLM

    best_module = namespace["best_module"]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "trained-policy").eval()
    prompts = ["Describe the sea.", "Say goodbye."]
    enc = best_module.tokenizer(prompts, padding=True, return_tensors="pt")
    out = exported.generate(**enc, max_new_tokens=32, do_sample=False, pad_token_id=best_module.tokenizer.pad_token_id)
    eos = best_module.tokenizer.eos_token_id
    rows = [ids.tolist() for ids in out[:, enc["input_ids"].shape[1] :]]
    up_to_eos = [row[: row.index(eos)] if eos in row else row for row in rows]
    by_transformers = best_module.tokenizer.batch_decode(up_to_eos, skip_special_tokens=False)
    assert by_transformers == best_module.generate(prompts)
