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

    module, trainer = namespace["module"], namespace["trainer"]
    assert trainer.global_step == 10
    assert module.state.policy_version == 10  # ten optimizer updates applied (one per rollout with these settings)
    assert (tmp_path / "lightning_logs").is_dir()
