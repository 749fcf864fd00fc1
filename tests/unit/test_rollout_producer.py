"""The asynchronous rollouts' producer thread (`lit_rlhf.rollout.producer`): jobs run one at a time in order,
results are taken by number, a job's exception reaches the taker with its type, and neither a full queue, a pause
nor a job that is still running can hang `close` or leave the thread behind."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lit_rlhf.rollout.collect import RolloutTimings
from lit_rlhf.rollout.producer import STOP_POLL_S, ProducedRollout, ProducerStopped, RolloutJob, RolloutProducer
from lit_rlhf.types import PromptBatch, Rollout


def job(index: int) -> RolloutJob:
    prompts = PromptBatch(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), [f"p{index}"], {})
    return RolloutJob(index, prompts, {}, weights_step=index, policy_version=index)


def produced(work_job: RolloutJob) -> ProducedRollout:
    n = work_job.index
    rollout = Rollout(
        prompt_ids=torch.zeros(1, 2, dtype=torch.long),
        prompt_mask=torch.ones(1, 2, dtype=torch.long),
        response_ids=torch.full((1, 1), n),
        response_mask=torch.ones(1, 1, dtype=torch.bool),
        truncated=torch.zeros(1, dtype=torch.bool),
        scores=torch.tensor([float(n)]),
    )
    return ProducedRollout(n, rollout, RolloutTimings(), work_job.weights_step, list(work_job.prompts.texts))


class Recorder:
    """A work function that logs which jobs ran and how many ran at once; `gate` holds every job until set."""

    def __init__(self, fail_at: int | None = None):
        self.order: list[int] = []
        self.running = self.most_at_once = 0
        self.gate = threading.Event()
        self.gate.set()
        self.fail_at = fail_at
        self.lock = threading.Lock()

    def __call__(self, work_job: RolloutJob) -> ProducedRollout:
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        self.gate.wait(10)
        with self.lock:
            self.running -= 1
            self.order.append(work_job.index)
        if work_job.index == self.fail_at:
            raise KeyError(f"reward column missing in rollout {work_job.index}")
        return produced(work_job)


def test_jobs_run_one_at_a_time_in_order_and_are_taken_by_number():
    work = Recorder()
    producer = RolloutProducer(work)
    for i in range(4):
        producer.submit(job(i))
    assert int(producer.take(2).rollout.scores) == 2  # out of order: waits, then the right one
    assert [int(producer.take(i).rollout.scores) for i in (0, 1, 3)] == [0, 1, 3]
    assert work.order == [0, 1, 2, 3] and work.most_at_once == 1
    with pytest.raises(RuntimeError, match="rollout 7 was never submitted"):
        producer.take(7)
    producer.close(5)
    assert not producer.alive


def test_a_job_error_is_raised_by_take_with_its_type_and_the_thread_ends():
    work = Recorder(fail_at=1)
    work.gate.clear()  # all three queued before any runs
    producer = RolloutProducer(work)
    for i in range(3):
        producer.submit(job(i))
    work.gate.set()
    assert int(producer.take(0).rollout.scores) == 0
    with pytest.raises(KeyError, match="reward column missing in rollout 1"):
        producer.take(1)
    with pytest.raises(KeyError):  # and again: the producer stays failed
        producer.take(2)
    with pytest.raises(KeyError):
        producer.submit(job(3))
    producer._thread.join(5)
    assert not producer.alive


def test_close_with_a_full_queue_and_a_running_job_returns_and_leaves_no_thread():
    work = Recorder()
    work.gate.clear()  # job 0 blocks until released
    producer = RolloutProducer(work)
    for i in range(5):
        producer.submit(job(i))
    time.sleep(0.05)
    start = time.perf_counter()
    producer.close(0.2)  # job 0 still running: close returns after its timeout, queued jobs are dropped
    assert time.perf_counter() - start < 2
    assert producer._thread.daemon  # cannot keep the process alive
    work.gate.set()
    producer._thread.join(5)
    assert not producer.alive and work.order == [0]  # none of the queued jobs ran after close
    with pytest.raises(RuntimeError, match="closed"):
        producer.submit(job(9))


def test_pause_waits_for_the_running_job_and_starts_no_other():
    work = Recorder()
    work.gate.clear()
    producer = RolloutProducer(work)
    producer.submit(job(0))
    producer.submit(job(1))
    time.sleep(0.05)
    threading.Timer(0.1, work.gate.set).start()  # job 0 finishes while `pause` waits
    producer.pause()
    assert work.order == [0]
    time.sleep(0.1)
    assert work.order == [0]  # job 1 did not start during the pause
    with pytest.raises(RuntimeError, match="behind a pause"):
        producer.take(1)  # would wait forever: refused
    producer.resume()
    assert int(producer.take(1).rollout.scores) == 1
    producer.close(5)


def test_settle_waits_for_every_job_and_keeps_the_results():
    work = Recorder()
    producer = RolloutProducer(work)
    producer.put(produced(job(5)))  # restored from a checkpoint
    for i in (6, 7):
        producer.submit(job(i))
    assert [p.index for p in producer.settle()] == [5, 6, 7]
    assert producer.known() == {5, 6, 7}
    assert int(producer.take(5).rollout.scores) == 5
    producer.close(5)


def test_a_job_that_never_returns_holds_neither_take_nor_settle_once_the_run_stops():
    """A hung job (a reward that never returns): `take` with a stop test raises `ProducerStopped` soon after the
    test turns true, and `settle` with a deadline returns the rollouts finished by then, leaving the hung one out."""
    hung = threading.Event()

    def work(work_job: RolloutJob) -> ProducedRollout:
        if work_job.index == 1:
            hung.set()
            threading.Event().wait()  # never returns
        return produced(work_job)

    producer = RolloutProducer(work)
    for index in (0, 1):
        producer.submit(job(index))
    assert hung.wait(10)
    stopping = threading.Event()
    threading.Timer(0.3, stopping.set).start()
    start = time.monotonic()
    with pytest.raises(ProducerStopped, match="rollout 1"):
        producer.take(1, stop=stopping.is_set)
    assert 0.25 < time.monotonic() - start < 0.3 + 2 * STOP_POLL_S + 0.5
    start = time.monotonic()
    finished = producer.settle(lambda: start + 0.5)
    assert [p.index for p in finished] == [0]  # the finished one kept, the hung one left out
    assert 0.5 <= time.monotonic() - start < 0.5 + 2 * STOP_POLL_S + 0.5
    producer.close(timeout_s=0.1)
    assert producer.alive  # the daemon thread is left behind; it cannot keep the process alive
