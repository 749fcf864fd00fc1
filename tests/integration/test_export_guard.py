"""Exports that cannot destroy: `overwrite` replaces only a previous export (or a folder of Hugging Face files),
killed exports' temporary folders are cleaned up, and a SIGTERM during an export finishes or rolls it back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import make_policy, make_trainer
from lit_rlhf.cli import export_main
from lit_rlhf.models.export import EXPORT_MARKER, STAGING_MARKER, ExportError, save_policy
from lit_rlhf.training.callbacks import SavePolicy

ROOT = Path(__file__).resolve().parents[2]


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def run_folder(folder: Path) -> Path:
    """A folder as a training run leaves it: checkpoints, logs, a config."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    (folder / "config.yaml").write_text("model: {}")
    (folder / "last.ckpt").write_bytes(b"weights")
    return folder


def test_every_export_writes_a_marker_listing_its_files(tmp_path, tokenizer):
    folder = Path(save_policy(make_policy(), tokenizer, str(tmp_path / "policy")))
    marker = json.loads((folder / EXPORT_MARKER).read_text())
    assert marker["lit_rlhf_export"] == 1 and sorted(marker["files"]) == sorted(os.listdir(folder))


def test_overwrite_refuses_a_run_folder_naming_what_is_inside(tmp_path, tokenizer):
    folder = run_folder(tmp_path / "run")
    before = tree(folder)
    with pytest.raises(ExportError, match=r"refusing to replace .*it holds checkpoints/, config.yaml, last.ckpt"):
        save_policy(make_policy(), tokenizer, str(folder), overwrite=True)
    assert tree(folder) == before and sorted(os.listdir(tmp_path)) == ["run"]


def test_overwrite_refuses_the_current_directory_and_its_parents(tmp_path, tokenizer, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "model.safetensors").write_bytes(b"")  # even a folder of Hugging Face files
    monkeypatch.chdir(work)
    for folder in (".", str(work), str(tmp_path)):
        with pytest.raises(ExportError, match="it is \\(or holds\\) the current directory"):
            save_policy(make_policy(), tokenizer, folder, overwrite=True)
    assert os.listdir(work) == ["model.safetensors"]


def test_overwrite_refuses_a_previous_export_with_other_files_added(tmp_path, tokenizer):
    folder = Path(save_policy(make_policy(), tokenizer, str(tmp_path / "policy")))
    (folder / "epoch=3.ckpt").write_bytes(b"weights")
    with pytest.raises(ExportError, match="a previous export plus epoch=3.ckpt"):
        save_policy(make_policy(), tokenizer, str(folder), overwrite=True)
    assert (folder / "epoch=3.ckpt").exists()


def test_overwrite_replaces_a_previous_export_or_a_folder_of_hugging_face_files(tmp_path, tokenizer):
    folder = Path(save_policy(make_policy(seed=0), tokenizer, str(tmp_path / "policy")))
    (folder / "custom_file.py").write_text("")  # not a Hugging Face name, but listed in the marker: the export's
    marker = json.loads((folder / EXPORT_MARKER).read_text())
    (folder / EXPORT_MARKER).write_text(json.dumps({**marker, "files": [*marker["files"], "custom_file.py"]}))
    save_policy(make_policy(seed=1), tokenizer, str(folder), overwrite=True)
    assert "custom_file.py" not in os.listdir(folder)

    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("config.json", "model-00001-of-00002.safetensors", "tokenizer.json"):
        (hf / name).write_text("{}")
    save_policy(make_policy(), tokenizer, str(hf), overwrite=True)
    assert EXPORT_MARKER in os.listdir(hf) and "model-00001-of-00002.safetensors" not in os.listdir(hf)
    assert sorted(os.listdir(tmp_path)) == ["hf", "policy"]


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_temporary_folders_of_killed_exports_are_removed(tmp_path, tokenizer, caplog):
    """Only folders holding the staging marker of that export (its target and its dead process) are removed."""
    dead, alive = dead_pid(), os.getppid()
    for name in (f"policy.tmp-{dead}", f"policy.old-{dead}", f"policy.tmp-{alive}", f"other.tmp-{dead}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"partial")
        target = name.partition(".")[0]
        marker = {"lit_rlhf_staging": target, "pid": alive if "tmp-" + str(alive) in name else dead}
        (tmp_path / name / STAGING_MARKER).write_text(json.dumps(marker))
    backups = [f"policy.old-{dead_pid()}", f"policy.tmp-{dead_pid()}"]  # a user's folders: no marker
    for name in backups:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"my backup")
    (tmp_path / backups[1] / STAGING_MARKER).write_text(json.dumps({"lit_rlhf_staging": "other", "pid": dead}))
    save_policy(make_policy(), tokenizer, str(tmp_path / "policy"))
    assert sorted(os.listdir(tmp_path)) == sorted([f"other.tmp-{dead}", "policy", f"policy.tmp-{alive}", *backups])
    assert (tmp_path / backups[0] / "model.safetensors").read_bytes() == b"my backup"
    assert f"partial export left by a killed process (pid {dead})" in caplog.text
    assert STAGING_MARKER not in os.listdir(tmp_path / "policy")  # the published export is not a temporary


SIGTERM_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from transformers import GenerationConfig
from conftest import make_policy
from lit_rlhf.tasks.digits import builtin_tokenizer
from lit_rlhf.models.export import save_policy

original = GenerationConfig.save_pretrained

def terminated_meanwhile(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # arrives in the middle of the export
    if {fail!r}:
        raise OSError("disk full")
    return original(self, *args, **kwargs)

GenerationConfig.save_pretrained = terminated_meanwhile
{handler}
try:
    save_policy(make_policy(), builtin_tokenizer(), {folder!r})
except OSError as err:
    print("rolled back:", err)
print("not stopped")
"""


@pytest.mark.parametrize("fail", [False, True], ids=["finishes", "rolls-back"])
@pytest.mark.parametrize(
    "handler", ["", "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))"], ids=["default", "own"]
)
def test_sigterm_during_an_export_finishes_or_rolls_back_then_stops_the_process(tmp_path, fail, handler):
    folder = tmp_path / "policy"
    script = SIGTERM_SCRIPT.format(tests=str(ROOT / "tests"), fail=fail, handler=handler, folder=str(folder))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == (143 if handler else -signal.SIGTERM), done.stderr
    assert "not stopped" not in done.stdout
    if fail:
        assert os.listdir(tmp_path) == []  # rolled back: no folder, no temporary
    else:
        assert sorted(os.listdir(tmp_path)) == ["policy"] and EXPORT_MARKER in os.listdir(folder)
        assert "generation_config.json" in os.listdir(folder)


def test_cli_overwrite_refuses_a_run_folder_before_reading_the_checkpoint(tmp_path):
    folder = run_folder(tmp_path / "run")
    before = tree(folder)
    with pytest.raises(SystemExit, match="lit-rlhf-export: error: save_policy: refusing to replace .*last.ckpt"):
        export_main(["--ckpt", str(folder / "last.ckpt"), "--out", str(folder), "--overwrite"])
    assert tree(folder) == before


def test_save_policy_callback_refuses_to_overwrite_a_run_folder_before_training(tmp_path):
    from test_export import data, grpo_module

    folder = run_folder(tmp_path / "run")
    module = grpo_module(make_policy(), tokenizer="builtin:digits")
    with pytest.raises(ExportError, match="SavePolicy: overwrite: true would replace .*it holds checkpoints/"):
        make_trainer(max_steps=2, callbacks=[SavePolicy(str(folder), overwrite=True)]).fit(module, data())
    assert module.global_step == 0 and (folder / "last.ckpt").read_bytes() == b"weights"
