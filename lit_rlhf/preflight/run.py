"""`check`: the whole preflight of a module, its data module and a Trainer, as a `Report`.

Nothing heavier than the tokenizer, the models' configs (`meta`-device builds) and the prompt rows is built,
unless `dry_run` asks for real steps (which load the models and train the module by that many steps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer

from lit_rlhf.config import ConfigError
from lit_rlhf.data.sources import prompt_value
from lit_rlhf.models.loading import load_tokenizer
from lit_rlhf.preflight.backends import check_backends
from lit_rlhf.preflight.data import check_data, training_rows
from lit_rlhf.preflight.dry_run import dry_run as run_steps
from lit_rlhf.preflight.dry_run import process_age_s
from lit_rlhf.preflight.memory import check_memory
from lit_rlhf.preflight.model import check_model, model_configs
from lit_rlhf.preflight.report import Report, Section
from lit_rlhf.preflight.rewards import check_rewards
from lit_rlhf.preflight.run_length import run_length
from lit_rlhf.preflight.settings import describe_settings


def guarded(section: Section, work: Callable[[], Any]) -> Any:
    """Run one family of checks; a `ConfigError` (or a folder that cannot be read) becomes a finding that blocks
    the run, naming the setting the message starts with."""
    try:
        return work()
    except (ConfigError, OSError) as err:
        section.refused(err)
        return None


def _chat_prompts(datamodule: Any) -> bool:
    rows = training_rows(datamodule, 16)
    return any(not isinstance(prompt_value(r, datamodule.prompt_column, datamodule.messages_column), str) for r in rows)


def check(
    module: Any,
    datamodule: Any,
    trainer: Trainer | None = None,
    *,
    device_memory_gb: float | None = None,
    dry_run: int = 0,
    title: str = "lit-rlhf check",
) -> Report:
    """Check an `RLHFModule`, its `RolloutDataModule` and the `Trainer` it will fit with (default: `Trainer()`)
    before the run; `dry_run` > 0 then loads the models and runs that many real steps (training the module)."""
    started_s = process_age_s() or 0.0
    trainer = trainer or Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    report = Report(title)
    length = run_length(module, datamodule, trainer)
    describe_settings(report.section("settings"), module, datamodule, trainer, length)
    tokenizer = (
        module.tokenizer if datamodule.tokenizer is None else load_tokenizer(datamodule.tokenizer, "data.tokenizer")
    )
    metric_fns = list(module.metric_fns.values())
    data = report.section("data")
    guarded(data, lambda: check_data(data, datamodule, tokenizer, module.reward.reward_fns, metric_fns))
    model = report.section("model")
    models = guarded(model, lambda: model_configs(module))
    if models is not None:
        guarded(model, lambda: check_model(model, module, models, _chat_prompts(datamodule)))
    rewards = report.section("rewards")
    guarded(rewards, lambda: check_rewards(rewards, module, datamodule, tokenizer))
    memory = report.section("memory")
    plan = guarded(memory, lambda: check_memory(memory, module, datamodule, trainer, device_memory_gb))
    backends = report.section("backends")
    if models is not None:
        guarded(backends, lambda: check_backends(backends, module, models["policy"]))
    if dry_run > 0:
        section = report.section("dry run")
        if report.blocked:
            section.line("not run: the findings above block the run")
        else:
            run_steps(section, module, datamodule, trainer, dry_run, length, plan, started_s)
    return report


def refused_settings(title: str, error: ValueError) -> Report:
    """The report of a config whose settings were refused before anything could be built: the `ConfigError` the
    error carries (jsonargparse wraps a nested dataclass's in a ValueError of its own), else the error itself."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, ConfigError):
        cause = cause.__cause__ or cause.__context__
    report = Report(title)
    report.section("settings").refused(cause if isinstance(cause, ConfigError) else error)
    return report
