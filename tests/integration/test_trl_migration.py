"""TRL users: TRL's option names get an error naming ours (constructors and the CLI), the migration page's table
is the code's, and TRL's quick-start GRPO script and its lit_rlhf translation both run on a tiny model."""

import inspect
import json
import re
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from lit_rlhf import AlgorithmConfig, RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.cli import main
from lit_rlhf.config import ConfigError
from lit_rlhf.tasks.digits import builtin_policy, builtin_tokenizer
from lit_rlhf.trl_names import TRL_NAMES

PAGE = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-trl.md"
REWARD = "lit_rlhf.tasks.digits.sort_digits_reward"
CONSTRUCTORS = {
    "model": lambda **kw: RLHFModule(reward_fns=[REWARD], **kw),
    "model.algorithm": lambda **kw: AlgorithmConfig(**kw),
    "model.sampling": lambda **kw: SamplingConfig(**kw),
    "data": lambda **kw: RolloutDataModule(**kw),
}
SIGNATURES = {
    "model": RLHFModule,
    "model.algorithm": AlgorithmConfig,
    "model.sampling": SamplingConfig,
    "data": RolloutDataModule,
    "trainer": L.Trainer,
}


def accepts(where: str, key: str) -> bool:
    return key in inspect.signature(SIGNATURES[where]).parameters


FOREIGN = [(where, key) for where in CONSTRUCTORS for key in TRL_NAMES if not accepts(where, key)]


@pytest.mark.parametrize(("where", "key"), FOREIGN, ids=[f"{w}.{k}" for w, k in FOREIGN])
def test_constructors_refuse_trl_names_naming_ours(where, key):
    ours = TRL_NAMES[key].ours or "without a counterpart"
    with pytest.raises(ConfigError, match=re.escape(f"{where}.{key}: ") + ".*" + re.escape(ours)):
        CONSTRUCTORS[where](**{key: 1})


def test_unknown_names_that_are_not_trl_keep_pythons_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_setting'"):
        AlgorithmConfig(no_such_setting=1)


def test_every_lit_rlhf_name_in_the_table_is_a_real_setting():
    for key, name in TRL_NAMES.items():
        if name.ours is None or not name.ours.startswith(("model.", "data.", "trainer.")):
            continue
        where, _, setting = name.ours.rpartition(".")
        assert accepts(where, setting), f"{key} -> {name.ours}: not a setting of {where}"


def test_the_migration_page_table_is_the_code_table():
    rows = re.findall(r"^\| `(\w+)` \| (`[\w.]+`|\(none\)) \| (.*) \|$", PAGE.read_text(encoding="utf-8"), flags=re.M)
    table = {key: (ours.strip("`") if ours != "(none)" else None, how) for key, ours, how in rows}
    assert table == {key: (name.ours, name.how) for key, name in TRL_NAMES.items()}


@pytest.mark.parametrize(
    "how",
    ["yaml", "dotted", "dict"],
)
def test_the_cli_refuses_trl_names_before_lightning_cli_naming_ours(tmp_path, how):
    config = {"model": {"reward_fns": [REWARD], "algorithm": {"name": "grpo", "epsilon_high": 0.28}}}
    path = tmp_path / "trl.yaml"
    path.write_text(yaml.safe_dump(config))
    args = {
        "yaml": ["fit", "--config", str(path)],
        "dotted": ["fit", f"--model.reward_fns=[{REWARD}]", "--model.algorithm.epsilon_high", "0.28"],
        "dict": {"fit": config},
    }[how]
    expected = r"model\.algorithm\.epsilon_high: is TRL's name; .* model\.algorithm\.clip_eps_high"
    with pytest.raises(ConfigError, match=expected):
        main(args)
    with pytest.raises(ConfigError, match=r"trainer\.learning_rate: .* model\.lr"):
        main(["fit", f"--model.reward_fns=[{REWARD}]", "--trainer.learning_rate=1e-6"])


def page_scripts(tmp_path: Path) -> tuple[str, str]:
    """The page's TRL script and its translation, with a tiny local model and prompt file, 2 steps, 8 tokens."""
    folder, prompts = tmp_path / "tiny", tmp_path / "prompts.jsonl"
    torch.manual_seed(0)
    builtin_policy(n_layer=1, n_embd=32, n_head=2).save_pretrained(folder)
    builtin_tokenizer().save_pretrained(folder)
    prompts.write_text("".join(json.dumps({"prompt": f"Say {i} things.", "completion": "x"}) + "\n" for i in range(8)))
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) == 2 and "from trl import" in blocks[0] and "from lit_rlhf import" in blocks[1]
    small = [
        ('load_dataset("trl-lib/tldr", split="train")', f'load_dataset("json", data_files="{prompts}", split="train")'),
        ("Qwen/Qwen2-0.5B-Instruct", str(folder)),
        ("max_steps=100", "max_steps=2"),
        ("=256", "=8"),
    ]
    scripts = []
    for block in blocks:
        for old, new in small:
            assert old in block
            block = block.replace(old, new)
        scripts.append(block)
    return scripts[0].replace("max_steps=2,", "max_steps=2, use_cpu=True, bf16=False, report_to=[],"), scripts[1]


def test_the_lit_rlhf_translation_of_trls_quick_start_runs(tmp_path, monkeypatch):
    pytest.importorskip("datasets", reason="the page's script loads its data with datasets (pip install -e '.[data]')")
    _, ours = page_scripts(tmp_path)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(ours, str(PAGE), "exec"), namespace)
    module, trainer = namespace["module"], namespace["trainer"]
    assert trainer.global_step == 2 and module.algorithm.filled.group_size == 8
    assert module.algorithm.filled.kl_coef == 0.04 and module.hparams["lr"] == 1e-6
    assert (tmp_path / "Qwen2-0.5B-GRPO" / "final" / "config.json").is_file()


def test_trls_quick_start_runs_as_the_page_shows_it(tmp_path, monkeypatch):
    pytest.importorskip("trl", reason="TRL is not a dependency; its side runs where trl is installed")
    trl_script, _ = page_scripts(tmp_path)
    monkeypatch.chdir(tmp_path)
    exec(compile(trl_script, str(PAGE), "exec"), {})
    assert (tmp_path / "Qwen2-0.5B-GRPO" / "final" / "config.json").is_file()
