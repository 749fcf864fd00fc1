"""Asynchronous rollouts (`algorithm.max_staleness: k` > 0): rollouts n+1 .. n+k are sampled on a background
thread (`lit_rlhf.rollout.producer`) while the update of rollout n runs.

Semantics (docs/async.md):
- Training step i trains on the rollout of the prompts Lightning hands it, as the synchronous loop does. The
  producer reads the next k batches ahead from the `RolloutDataModule` (`PromptSupply.batches_after`); a step
  whose prompts differ from those read ahead (a dataloader that skipped or reordered) drops every rollout in
  flight, samples its own with the current weights and warns.
- The job for rollout m is made at step max(0, m - k) with a copy of the policy's trainable weights at that
  point, so rollout m is `min(m, k)` updates stale when it is trained on; `take` refuses one staler than k.
- The producer samples with its own copy of the policy (the update changes the live one meanwhile) and its own
  random stream, seeded per rollout number: what a rollout draws does not depend on timing.
- The behaviour policy of a stale rollout is its sampler: the engine's own log-probs, or a forward of the copy
  it was sampled with. The update clips against the policy at the start of the update and weights each token by
  min(pi_old / pi_sampler, tis_cap): the decoupled PPO objective with a truncated behaviour weight.
- A checkpoint waits for the rollouts in flight and stores them, so a resumed run trains on exactly the rollouts
  the stopped run would have used next.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lit_rlhf.algorithms.experience import frozen_forward, response_stats
from lit_rlhf.data.handoff import PromptSupply
from lit_rlhf.rollout.backends.base import RolloutBackend
from lit_rlhf.rollout.collect import Collector, RolloutTimings
from lit_rlhf.rollout.dynamic import dynamic_rollout, refill_position
from lit_rlhf.rollout.producer import ProducedRollout, RolloutJob, RolloutProducer
from lit_rlhf.rollout.scoring import thread_state
from lit_rlhf.types import PromptBatch, Rollout

CLOSE_TIMEOUT_S = 120.0
"""How long the end of fit waits for the producer's running job (a backend call has its own timeout too)."""
SHUTDOWN_WAIT_S = 10.0
"""How long a run stopping on SIGTERM, Ctrl-C or an error waits for the producer's running job, in all: for the
`last.ckpt` it saves (the rollouts finished by then are kept, the running one is sampled again on resume) and
when the producer is closed (then its daemon thread is left to end with the process)."""
SEED_STRIDE = 1_000_003
"""Rollout m of rank r draws from seed `base + r * SEED_STRIDE + m` (a prime stride keeps ranks apart)."""


@dataclass(frozen=True)
class AsyncSettings:
    """How far ahead to sample, the random stream's base seed, dynamic sampling's (group size, rounds, pad id)
    or None, and what the behaviour log-probs are computed with (temperature, shared prompt forward, length
    groups, logit chunk)."""

    max_staleness: int
    seed: int
    rank: int
    dynamic: tuple[int, int, int] | None
    temperature: float
    share_prompts: bool
    length_groups: int
    logit_chunk_tokens: int | None


def trainable_weights(policy: nn.Module) -> dict[str, Tensor]:
    """A copy of the parameters the update changes, by name (LoRA: only the adapters)."""
    with torch.no_grad():
        weights = {name: p.detach().clone() for name, p in policy.named_parameters() if p.requires_grad}
    first = next(iter(weights.values()), None)
    if first is not None and first.is_cuda:
        torch.cuda.current_stream(first.device).synchronize()  # the copies are complete before another thread reads
    return weights


@torch.no_grad()
def load_weights(model: nn.Module, weights: dict[str, Tensor]) -> None:
    """Copy `weights` into the parameters of the same names (tied parameters follow)."""
    for name, parameter in model.named_parameters():
        if name in weights:
            parameter.copy_(weights[name])


@torch.no_grad()
def behaviour_logprobs(model: nn.Module, rollout: Rollout, settings: AsyncSettings) -> Tensor:
    """The log-probs (B, T) of the sampled tokens under `model`, the copy that sampled them, computed as the
    trainer computes its own (0 after each response's end)."""
    forward = frozen_forward(model, rollout, settings.share_prompts, settings.length_groups)
    stats = response_stats(forward, rollout, settings.temperature, settings.logit_chunk_tokens, entropy=False)
    return stats.logprobs.float()


class AsyncRollouts:
    """The producer, its copy of the policy and the jobs' bookkeeping, for one fit."""

    def __init__(
        self,
        policy: nn.Module,
        make_sampler: Callable[[nn.Module, torch.Generator], tuple[RolloutBackend, Collector]],
        supply: PromptSupply,
        settings: AsyncSettings,
    ):
        self.policy, self.supply, self.settings = policy, supply, settings
        self.sampler = copy.deepcopy(policy).eval().requires_grad_(False)  # the producer's own weights
        device = next(policy.parameters()).device
        self.generator = torch.Generator(device)
        self.backend, self.collector = make_sampler(self.sampler, self.generator)
        self.synced_version = -1  # the policy version the backend last sampled with
        self.enter_thread_state = thread_state()  # autocast and CUDA device of the training thread
        self.producer = RolloutProducer(self.work)
        self.warned_restart = False
        self._shutdown_deadline: float | None = None  # set when a stopping run first waits for the producer

    # ---------------------------------------------------------------- the producer thread

    def work(self, job: RolloutJob) -> ProducedRollout:
        """Sample and score one job with the weights it carries (on the producer thread)."""
        settings = self.settings
        with self.enter_thread_state():
            if job.policy_version != self.synced_version:
                load_weights(self.sampler, job.weights)
                self.backend.sync_weights(self.sampler)  # an engine of its own (vLLM) gets the copy's weights
                self.synced_version = job.policy_version
            self.generator.manual_seed(settings.seed + settings.rank * SEED_STRIDE + job.index)
            collect = lambda batch: self.collector.collect(batch, job.policy_version)  # noqa: E731
            rollout: Rollout
            timings: RolloutTimings
            if settings.dynamic is None:
                rollout, timings = collect(job.prompts)
            else:
                group_size, rounds, pad = settings.dynamic
                refill = lambda j: job.refills[j - 1]  # noqa: E731  # extra round j, 1-based
                rollout, timings = dynamic_rollout(collect, job.prompts, refill, group_size, rounds, pad)
            if rollout.sampler_logprobs is None:  # an in-process sampler: its copy's forward is the behaviour policy
                rollout.sampler_logprobs = behaviour_logprobs(self.sampler, rollout, settings)
            if rollout.response_ids.is_cuda:
                torch.cuda.current_stream(rollout.response_ids.device).synchronize()
        return ProducedRollout(job.index, rollout, timings, job.weights_step, list(job.prompts.texts))

    # ---------------------------------------------------------------- the training thread

    def job(self, index: int, prompts: PromptBatch, weights: dict[str, Tensor], step: int, version: int) -> RolloutJob:
        """Rollout `index` of `prompts`, to be sampled with `weights`, the policy's after `step` rollouts."""
        refills: list[PromptBatch] = []
        if self.settings.dynamic is not None:  # read on this thread: the DataModule's tokenizer is not thread-safe
            rounds, size = self.settings.dynamic[1], self.supply.batch_size
            refills = [self.supply.refill_batch(refill_position(index + 1, j, rounds, size)) for j in range(1, rounds)]
        return RolloutJob(index, prompts, weights, step, version, refills)

    def take(
        self, prompts: PromptBatch, step: int, policy_version: int, stop: Callable[[], bool] | None = None
    ) -> tuple[Rollout, RolloutTimings]:
        """The rollout of training step `step` (0-based) on `prompts`, after queueing the rollouts up to
        `step + max_staleness` (their prompts read ahead) with the current weights; `ProducerStopped` once
        `stop()` is true while it waits."""
        start = time.perf_counter()
        k, known = self.settings.max_staleness, self.producer.known()
        missing = [index for index in range(step, step + k + 1) if index not in known]
        if missing:  # one copy of the current weights for every job made now
            weights = trainable_weights(self.policy)
            batches = [prompts, *self.supply.batches_after(prompts.position, k)]  # steps step .. step + k
            for index in missing:
                self.producer.submit(self.job(index, batches[index - step], weights, step, policy_version))
        produced = self.producer.take(step, stop)
        if produced.prompt_texts != list(prompts.texts):
            return self.restart(prompts, step, policy_version, stop)
        staleness = step - produced.weights_step
        if not 0 <= staleness <= k:
            raise RuntimeError(
                f"asynchronous rollouts: rollout {step} was sampled with the weights after {produced.weights_step} "
                f"rollouts, {staleness} updates old, over algorithm.max_staleness: {k}"
            )
        rollout = produced.rollout.to(prompts.input_ids.device)
        timings = produced.timings
        timings.metrics = {
            **timings.metrics,
            "async/staleness": float(staleness),
            "time/rollout_wait_s": time.perf_counter() - start,
        }
        return rollout, timings

    def restart(
        self, prompts: PromptBatch, step: int, policy_version: int, stop: Callable[[], bool] | None
    ) -> tuple[Rollout, RolloutTimings]:
        """The step's prompts are not those read ahead: drop every rollout in flight and start again from them."""
        if not self.warned_restart:
            warnings.warn(
                f"asynchronous rollouts: the prompts of training step {step} differ from those read ahead (a "
                "dataloader that skips or reorders batches, e.g. limit_train_batches); the rollouts in flight are "
                "dropped and sampled again from the current weights",
                stacklevel=2,
            )
            self.warned_restart = True
        self.producer.close()
        self.producer = RolloutProducer(self.work)
        return self.take(prompts, step, policy_version, stop)

    def evaluation_backend(self) -> RolloutBackend:
        """The sampler's backend with the live policy's weights, for held-out evaluation while the producer is
        paused; its next job loads its own weights again."""
        if not self.producer.paused:
            raise RuntimeError(
                "asynchronous rollouts: held-out evaluation during fit runs only while the producer is paused"
            )
        load_weights(self.sampler, trainable_weights(self.policy))
        self.backend.sync_weights(self.sampler)
        self.synced_version = -1
        return self.backend

    def in_flight(self, stop: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
        """Every rollout queued, running or finished and not taken, finished now, as checkpoint records; once
        `stop()` is true, those finished by the shutdown's deadline (the others are sampled again on resume)."""
        deadline = None if stop is None else lambda: self.shutdown_deadline() if stop() else None
        return [produced_record(p) for p in self.producer.settle(deadline)]

    def shutdown_deadline(self) -> float:
        """When a stopping run stops waiting for the producer: `SHUTDOWN_WAIT_S` after it first asked, one wait
        for every checkpoint and the close together."""
        if self._shutdown_deadline is None:
            self._shutdown_deadline = time.monotonic() + SHUTDOWN_WAIT_S
        return self._shutdown_deadline

    def restore(self, records: list[dict[str, Any]], step: int) -> None:
        """Put back the rollouts a checkpoint kept in flight, from training step `step` on; those the bound no
        longer allows (a smaller `max_staleness` than the stopped run's) are dropped and sampled again."""
        for record in records:
            if record["index"] >= step and record["index"] - record["weights_step"] <= self.settings.max_staleness:
                self.producer.put(produced_from_record(record))

    def close(self, stopping: bool = False) -> None:
        """End the producer (its running job finishes first, for up to `CLOSE_TIMEOUT_S`, or until the shutdown's
        deadline when `stopping`) and the backend."""
        timeout_s = max(0.0, self.shutdown_deadline() - time.monotonic()) if stopping else CLOSE_TIMEOUT_S
        self.producer.close(timeout_s)
        if self.producer.alive:
            warnings.warn(
                f"asynchronous rollouts: the producer's last job did not finish within {timeout_s} s of the "
                "end of fit; its daemon thread is left to end with the process",
                stacklevel=2,
            )
            return  # the job still uses the backend
        self.backend.close()


def produced_record(produced: ProducedRollout) -> dict[str, Any]:
    """A finished rollout as plain data (tensors, lists, numbers: weights-only loadable)."""
    rollout = {f.name: getattr(produced.rollout, f.name) for f in dataclasses.fields(produced.rollout)}
    timings = dataclasses.asdict(produced.timings)
    return {
        "index": produced.index,
        "weights_step": produced.weights_step,
        "prompt_texts": produced.prompt_texts,
        "rollout": {key: value.cpu() if isinstance(value, Tensor) else value for key, value in rollout.items()},
        "timings": {key: timings[key] for key in ("generate_s", "score_s", "metrics")},
    }


def produced_from_record(record: dict[str, Any]) -> ProducedRollout:
    timings = RolloutTimings(**record["timings"])
    rollout = Rollout(**record["rollout"])
    return ProducedRollout(record["index"], rollout, timings, record["weights_step"], record["prompt_texts"])
