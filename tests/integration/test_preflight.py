"""`lit-rlhf check` (lit_rlhf.preflight): each planted fault is named with the setting to change, the shipped
configs pass with no finding, and a dry run reports measured steps and an estimate."""

from __future__ import annotations

import http.server
import inspect
import json
import threading
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Trainer

from lit_rlhf import RLHFModule, RolloutDataModule, SamplingConfig
from lit_rlhf.cli import check_main
from lit_rlhf.preflight.run import check
from lit_rlhf.rewards.verifiable import exact_answer
from lit_rlhf.tasks.digits import builtin_tokenizer, tiny_gpt2

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def prompt_only_reward(prompts, responses, answer, **meta):
    """Planted fault: scores the prompt's length, whatever the response."""
    return [float(len(p)) for p in prompts]


def rows(n: int = 8, answer: bool = True) -> list[dict]:
    return [{"prompt": f"{i}{i + 1}{i + 2}>", **({"answer": str(i)} if answer else {})} for i in range(n)]


def cpu_trainer() -> Trainer:
    return Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False)


def policy_folder(tmp_path: Path, eos_ids: list[int] | None = None) -> str:
    """A saved tiny GPT-2 over the digits vocabulary; `eos_ids` replaces its generation config's EOS list."""
    tokenizer = builtin_tokenizer()
    model = tiny_gpt2(tokenizer, n_layer=1, n_embd=16, n_head=2, n_positions=64)
    folder = tmp_path / "policy"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if eos_ids is not None:
        config = json.loads((folder / "generation_config.json").read_text())
        (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": eos_ids}))
    return str(folder)


def run(module_settings: dict, data_settings: dict, **check_settings):
    module = RLHFModule(**{"policy": "builtin:digits", "reward_fns": [exact_answer], **module_settings})
    data = RolloutDataModule(**{"prompts": rows(), "batch_size": 2, "max_prompt_length": 16, **data_settings})
    return check(module, data, cpu_trainer(), **check_settings)


def only_block(report, section: str):
    assert [f.section for f in report.blocks] == [section], report.render()
    assert report.exit_status() == 1
    return report.blocks[0]


def test_a_clean_config_passes_with_no_finding():
    report = run({}, {})
    assert report.findings == [], report.render()
    assert report.exit_status() == 0 and report.render().endswith("result: ok to run")


def test_an_eos_id_the_tokenizer_lacks_is_named(tmp_path):
    size = len(builtin_tokenizer())
    report = run({"policy": policy_folder(tmp_path, eos_ids=[1, size + 5])}, {})
    found = only_block(report, "model")
    assert str(size + 5) in found.message and "generation_config.json eos_token_id" in found.setting
    assert run({"policy": policy_folder(tmp_path / "ok", eos_ids=[1])}, {}).findings == []


def test_a_reward_that_ignores_the_response_blocks_the_run():
    found = only_block(run({"reward_fns": [prompt_only_reward]}, {}), "rewards")
    assert "prompt_only_reward" in found.message and "cannot tell responses apart" in found.message
    assert found.setting == "model.reward_fns"


def test_a_prompt_only_reward_without_a_reference_column_is_a_warning():
    def no_answer_reward(prompts, responses, **meta):
        return [float(len(p)) for p in prompts]

    report = run({"reward_fns": [no_answer_reward]}, {"prompts": rows(answer=False)})
    assert not report.blocked and [f.setting for f in report.warnings] == ["model.reward_fns"], report.render()
    assert report.exit_status() == 0 and report.exit_status(strict=True) == 1


def test_a_column_missing_from_some_rows_is_named_with_the_rows():
    data = rows(6)
    for i in (2, 5):
        del data[i]["answer"]
    found = only_block(run({}, {"prompts": data}), "data")
    assert "2 of 6 rows lack the column 'answer'" in found.message and "rows 2, 5" in found.message
    assert found.setting == "data.prompts"


def test_prompts_over_the_limit_are_counted():
    tokenizer = builtin_tokenizer()
    data = [{"prompt": "1" * n + ">", "answer": "1"} for n in (3, 12, 20, 4, 30, 5)]
    limit = 10
    over = sum(len(tokenizer(row["prompt"])["input_ids"]) > limit for row in data)  # 3 by hand: 12, 20, 30 digits
    assert over == 3
    found = only_block(run({}, {"prompts": data, "max_prompt_length": limit}), "data")
    assert f"{over} of 6 prompts are longer than data.max_prompt_length={limit}" in found.message
    assert found.setting == "data.max_prompt_length"
    cut = run({}, {"prompts": data, "max_prompt_length": limit, "prompt_truncation": "left"})
    assert not cut.blocked and [f.setting for f in cut.warnings] == ["data.max_prompt_length"]


def test_a_plan_over_the_device_memory_names_what_shrinks_it():
    found = only_block(run({}, {}, device_memory_gb=0.001), "memory")
    assert "GiB per device needed, 0.00 GiB available" in found.message
    assert found.setting.startswith(("model.", "data."))
    warned = run({"memory_check": "warn"}, {}, device_memory_gb=0.001)
    assert not warned.blocked and [f.section for f in warned.warnings] == ["memory"]


class ServedModels(http.server.BaseHTTPRequestHandler):
    """The two GET endpoints of an OpenAI-compatible vLLM server that the check reads."""

    served = ""

    def do_GET(self):
        body = b"" if self.path == "/health" else json.dumps({"data": [{"id": self.served}]}).encode()
        self.send_response(200 if self.path in ("/health", "/v1/models") else 404)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ServedModels)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def vllm_server_settings(port: int) -> dict:
    return {
        "sampling": SamplingConfig(backend="vllm", vllm={"mode": "server", "server_url": f"http://127.0.0.1:{port}"})
    }


def test_a_vllm_server_serving_another_model_is_named(tmp_path, stub_server):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 50257}))
    ServedModels.served = str(other)
    found = only_block(run(vllm_server_settings(stub_server.server_port), {}), "backends")
    assert "vocab_size is 50257" in found.message and found.setting == "model.sampling.vllm.server_url"
    ServedModels.served = policy_folder(tmp_path)
    same = run({**vllm_server_settings(stub_server.server_port), "policy": ServedModels.served}, {})
    assert same.findings == [], same.render()


def test_an_unreachable_vllm_server_blocks_the_run(stub_server):
    port = stub_server.server_port
    stub_server.shutdown()
    stub_server.server_close()
    found = only_block(run(vllm_server_settings(port), {}), "backends")
    assert "did not answer" in found.message and found.setting == "model.sampling.vllm.server_url"


def _prepared_folder(config: dict) -> str | None:
    model = config.get("model", {})
    for key in ("policy", "reward_model"):
        value = model.get(key)
        if isinstance(value, str) and not value.startswith("builtin:") and not (ROOT / value).exists():
            return f"{key} {value!r} is a folder a preparation step makes (scripts/prepare_smollm2.py)"
    return None


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_passes_with_no_finding(path, monkeypatch, capsys):
    config = yaml.safe_load(path.read_text())
    if not set(config.get("model", {})) <= set(inspect.signature(RLHFModule.__init__).parameters):
        pytest.skip("a config of another entry point (lit-rlhf-reward)")
    reason = _prepared_folder(config)
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(ROOT)
    status = check_main(["--config", str(path), "--strict"])
    out = capsys.readouterr().out
    assert status == 0 and "warning" not in out and "BLOCKED" not in out, out


def test_the_command_line_exits_1_naming_a_refused_setting(capsys):
    status = check_main(["--config", str(ROOT / "configs" / "grpo.yaml"), "--model.sampling.temperature", "0"])
    out = capsys.readouterr().out
    assert status == 1 and "sampling.temperature" in out and "BLOCKED" in out, out


def test_a_negative_dry_run_is_refused(capsys):
    with pytest.raises(SystemExit) as stopped:
        check_main(["--config", str(ROOT / "configs" / "grpo.yaml"), "--dry-run", "-2"])
    assert stopped.value.code == 2 and "--dry-run: the number of steps must be >= 0" in capsys.readouterr().err


def test_a_dry_run_times_its_steps_and_estimates_the_run():
    module = RLHFModule(policy="builtin:digits", reward_fns=[exact_answer], sampling=SamplingConfig(max_new_tokens=4))
    module.algorithm.group_size = 2
    data = RolloutDataModule(prompts=rows(), batch_size=2, max_prompt_length=16, val_prompts=rows(3))
    report = check(module, data, cpu_trainer(), dry_run=2)
    lines = next(s for s in report.sections if s.name == "dry run").lines
    assert lines[0].startswith("2 steps: ") and module.state.rollouts_done == 2
    estimate = next(line for line in lines if line.startswith("estimate: "))
    assert "3 rollouts x" in estimate and "held-out batches" in estimate
    assert any(line.startswith("memory: peak RSS growth") for line in lines)
