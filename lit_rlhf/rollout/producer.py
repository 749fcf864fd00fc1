"""A background thread that makes rollouts ahead of the update (asynchronous rollouts, `algorithm.max_staleness`).

The training thread submits numbered jobs (the prompts of a future training step and a copy of the weights to
sample them with) and later takes each finished rollout by its number. The producer runs the jobs one at a time,
in order; it holds no collective and touches no state of the training thread's except through the job. An
exception in a job stops the producer and is raised again, the same object with its type, by the next `take`
(or `submit`). `close` drops the queued jobs and ends the thread after the job it is running; the thread is a
daemon, so even a job that never returns cannot keep the process alive. `take` given a `stop` test stops waiting
(`ProducerStopped`) once it is true, and `settle` given a deadline returns what finished by then: a job that never
returns (a hung reward) cannot hold a shutdown.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from lit_rlhf.rollout.collect import RolloutTimings
from lit_rlhf.types import PromptBatch, Rollout

STOP_POLL_S = 0.2
"""How often a `take` with a `stop` test looks at it."""


class ProducerStopped(RuntimeError):
    """`take` stopped waiting because its `stop` test became true (a SIGTERM, say)."""


@dataclass
class RolloutJob:
    """One rollout to make: the prompts of training step `index` (0-based) and the weights to sample them with."""

    index: int
    prompts: PromptBatch
    weights: dict[str, Tensor]  # the policy's trainable weights by parameter name, copied when the job was made
    weights_step: int  # rollouts the policy had been trained on when those weights were copied
    policy_version: int  # optimizer updates in those weights
    refills: list[PromptBatch] = field(default_factory=list)  # dynamic sampling's extra rounds, in order


@dataclass
class ProducedRollout:
    """A finished job: the scored rollout, its timings, and what it was sampled from."""

    index: int
    rollout: Rollout
    timings: RolloutTimings
    weights_step: int
    prompt_texts: list[str]  # the job's prompts (one per prompt, not per sample): checked against the step's


class RolloutProducer:
    """Runs `work` over submitted jobs on one daemon thread; finished rollouts wait until taken by number."""

    def __init__(self, work: Callable[[RolloutJob], ProducedRollout], name: str = "lit_rlhf-rollout-producer"):
        self._work = work
        self._queued: deque[RolloutJob] = deque()
        self._done: dict[int, ProducedRollout] = {}
        self._running: int | None = None  # the job being worked on
        self._error: BaseException | None = None
        self._paused = self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def paused(self) -> bool:
        return self._paused

    def known(self) -> set[int]:
        """The numbers of every job queued, running or finished and not taken yet."""
        with self._changed:
            running = set() if self._running is None else {self._running}
            return {job.index for job in self._queued} | running | set(self._done)

    def submit(self, job: RolloutJob) -> None:
        with self._changed:
            self._raise_if_failed()
            if self._closed:
                raise RuntimeError("RolloutProducer.submit: the producer is closed")
            self._queued.append(job)
            self._changed.notify_all()

    def put(self, produced: ProducedRollout) -> None:
        """A rollout finished elsewhere (restored from a checkpoint), to be taken like the producer's own."""
        with self._changed:
            self._done[produced.index] = produced
            self._changed.notify_all()

    def take(self, index: int, stop: Callable[[], bool] | None = None) -> ProducedRollout:
        """Rollout `index`, waiting for it; the producer's exception when it failed; `ProducerStopped` once
        `stop()` is true (looked at every `STOP_POLL_S`)."""
        with self._changed:
            while index not in self._done:
                self._raise_if_failed()
                if index != self._running and all(job.index != index for job in self._queued):
                    raise RuntimeError(f"RolloutProducer.take: rollout {index} was never submitted")
                if self._paused and index != self._running:
                    raise RuntimeError(f"RolloutProducer.take: rollout {index} waits behind a pause; resume first")
                if stop is not None and stop():
                    raise ProducerStopped(f"RolloutProducer.take: stopped while waiting for rollout {index}")
                self._changed.wait(None if stop is None else STOP_POLL_S)
            return self._done.pop(index)

    def settle(self, deadline: Callable[[], float | None] | None = None) -> list[ProducedRollout]:
        """Wait until no job is queued or running, or until the `time.monotonic()` that `deadline()` gives (None:
        no limit yet; looked at every `STOP_POLL_S`); the finished rollouts not taken yet, by number (kept)."""
        with self._changed:
            while (self._queued and not self._paused) or self._running is not None:
                self._raise_if_failed()
                until = deadline() if deadline is not None else None
                if until is not None and time.monotonic() >= until:
                    break
                self._changed.wait(None if deadline is None else STOP_POLL_S)
            self._raise_if_failed()
            return [self._done[index] for index in sorted(self._done)]

    def pause(self) -> None:
        """Start no new job, and wait for the one running to finish (its failure is raised by `take`)."""
        with self._changed:
            self._paused = True
            while self._running is not None:
                self._changed.wait()

    def resume(self) -> None:
        with self._changed:
            self._paused = False
            self._changed.notify_all()

    def close(self, timeout_s: float | None = None) -> None:
        """Drop the queued jobs and end the thread once the running job returns (waiting up to `timeout_s`)."""
        with self._changed:
            self._closed = True
            self._queued.clear()
            self._changed.notify_all()
        self._thread.join(timeout_s)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._closed and (self._paused or not self._queued):
                    self._changed.wait()
                if self._closed:
                    return
                job = self._queued.popleft()
                self._running = job.index
            try:
                produced = self._work(job)
            except BaseException as error:  # handed to the training thread, which raises it
                with self._changed:
                    self._error, self._running = error, None
                    self._changed.notify_all()
                return
            with self._changed:
                self._done[job.index], self._running = produced, None
                self._changed.notify_all()
