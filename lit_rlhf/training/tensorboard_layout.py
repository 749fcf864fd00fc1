"""TensorBoard's first screen: a custom-scalars layout of the charts that say whether a run learns."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger

# category -> chart title -> ["Multiline", tag regexes]: the format of SummaryWriter.add_custom_scalars
FIRST_SCREEN: dict[str, dict[str, list[Any]]] = {
    "lit_rlhf": {
        "training reward": ["Multiline", ["rollout/reward_mean", "rollout/score_mean"]],
        # every held-out metric function's value and the held-out reward; their lengths and cut-offs have other scales
        "held-out metrics (greedy)": ["Multiline", [r"val/(?!response_len_mean$|frac_truncated$).*"]],
        "KL to the reference": ["Multiline", ["objective/kl", "policy/kl_loss"]],
        "policy entropy": ["Multiline", ["objective/entropy"]],
        "step time (s)": ["Multiline", ["time/rollout_s", "time/update_s", "time/generate_s"]],
    }
}


def write_first_screen(loggers: Iterable[Any]) -> int:
    """Write `FIRST_SCREEN` to every TensorBoard logger among `loggers`; the number written to.

    Lightning's loggers write on rank 0 only (elsewhere `experiment` is a no-op), so every rank may call this.
    """
    tensorboards = [logger for logger in loggers if isinstance(logger, TensorBoardLogger)]
    for logger in tensorboards:
        logger.experiment.add_custom_scalars(FIRST_SCREEN)
    return len(tensorboards)
