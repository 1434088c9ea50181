"""The compute process (specdemo.app.worker): a real spawned process running generator functions of this module."""

from __future__ import annotations

import os
import time

import pytest

from specdemo.app.worker import Worker, WorkerError


def count(n: int, pause: float = 0.0):
    for i in range(n):
        if pause:
            time.sleep(pause)
        yield i, os.getpid()


def fails_after(n: int):
    yield from range(n)
    raise KeyError("no such thing")


def dies():
    yield "before"
    os._exit(3)


@pytest.fixture(scope="module")
def worker():
    w = Worker(threads=1)
    w.start()
    yield w
    w.close()


def test_items_come_back_in_order_from_another_process(worker):
    """Every item, in order, computed in the worker's process rather than this one."""
    items = list(worker.wrap(count)(25))
    assert [i for i, _ in items] == list(range(25))
    assert {pid for _, pid in items} != {os.getpid()} and len({pid for _, pid in items}) == 1


def test_an_exception_in_the_step_is_raised_here_after_its_items_and_the_worker_keeps_serving(worker):
    """The items before the error arrive, then the error itself (its type and words); the next step runs."""
    got = []
    with pytest.raises(KeyError, match="no such thing"):
        for item in worker.wrap(fails_after)(3):
            got.append(item)
    assert got == [0, 1, 2]
    assert len(list(worker.wrap(count)(2))) == 2


def test_closing_early_stops_the_step_in_the_worker(worker):
    """A consumer that stops after two items (a Stop, a cancelled client) ends the step there: the long step does not
    run to its end, and the next step starts at once with nothing left over from the old one."""
    steps = worker.wrap(count)(10_000, 0.01)
    assert [i for i, _ in (next(steps), next(steps))] == [0, 1]
    t0 = time.monotonic()
    steps.close()
    assert time.monotonic() - t0 < 5
    assert [i for i, _ in worker.wrap(count)(3)] == [0, 1, 2]


def test_a_worker_that_dies_is_an_error_and_the_next_step_starts_a_new_one():
    """The process ending mid-step (killed for memory, say) is a WorkerError naming it, not a hang; the next step
    gets a fresh process."""
    w = Worker(threads=1)
    try:
        with pytest.raises(WorkerError, match="ended unexpectedly"):
            list(w.wrap(dies)())
        assert [i for i, _ in w.wrap(count)(2)] == [0, 1]
    finally:
        w.close()
