"""Lesson 03 (prefetching): each exercise's likely mistakes get the hint that names them, and the
right answer passes. The wrong prefetchers start daemon threads, as a learner's would, so a thread
they leave blocked cannot keep pytest from exiting."""

from __future__ import annotations

import textwrap

import pytest

from course.grading import check, run_cell

PRELUDE = "import math, queue, threading, time\n"


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSTREAM_COURSE_PROGRESS", str(tmp_path / "progress.json"))


def _results(exercise_id, source):
    results = check(exercise_id, namespace=run_cell(PRELUDE + textwrap.dedent(source)), quiet=True)
    return {r.case: r for r in results}


def _failed_with(results, *needles):
    messages = " | ".join(r.message for r in results.values() if not r.passed)
    for needle in needles:
        assert needle in messages, messages


# --------------------------------------------------------------------------- 03.data_wait
RIGHT_DATA_WAIT = """
def timed_epoch(batches, step, max_steps=None):
    waits, steps = [], []
    it = iter(batches)
    while max_steps is None or len(steps) < max_steps:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        step(batch)
        t2 = time.perf_counter()
        waits.append((t1 - t0) * 1e3)
        steps.append((t2 - t0) * 1e3)
    return {"data_wait_ms": waits, "step_ms": steps}

def expected_step_ms(collate_ms, compute_ms, depth):
    return collate_ms + compute_ms if depth == 0 else max(collate_ms, compute_ms)
"""


def test_data_wait_timed_inside_a_for_loop_gets_the_next_hint_and_max_at_depth_0_too():
    wrong = """
    def timed_epoch(batches, step, max_steps=None):
        waits, steps = [], []
        for batch in batches:
            if max_steps is not None and len(steps) >= max_steps:
                break
            t0 = time.perf_counter()
            t1 = time.perf_counter()
            step(batch)
            waits.append((t1 - t0) * 1e3)
            steps.append((time.perf_counter() - t0) * 1e3)
        return {"data_wait_ms": waits, "step_ms": steps}

    def expected_step_ms(collate_ms, compute_ms, depth):
        return max(collate_ms, compute_ms)
    """
    results = _results("03.data_wait", wrong)
    _failed_with(results, "a `for` loop calls next() before your timer starts", "nothing overlaps")


def test_data_wait_right_answer_passes():
    assert all(r.passed for r in _results("03.data_wait", RIGHT_DATA_WAIT).values())


# --------------------------------------------------------------------------- 03.prefetcher
RIGHT_PREFETCH = """
def prefetch(iterable, depth=2):
    q = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item):
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def produce():
        try:
            for item in iterable:
                if not put(("batch", item)):
                    return
        except BaseException as exc:
            put(("error", exc))
            return
        put(("end", None))

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        while True:
            kind, payload = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise payload
            yield payload
    finally:
        stop.set()
        thread.join()
"""


def test_prefetch_right_answer_passes():
    results = _results("03.prefetcher", RIGHT_PREFETCH)
    assert all(r.passed for r in results.values()), [r.message for r in results.values() if not r.passed]


def test_prefetch_with_an_unbounded_queue_is_told_to_bound_it():
    results = _results("03.prefetcher", RIGHT_PREFETCH.replace("queue.Queue(maxsize=depth)", "queue.Queue()"))
    _failed_with(results, "Bound the queue")


def test_prefetch_without_a_thread_is_told_nothing_runs_ahead():
    wrong = """
    def prefetch(iterable, depth=2):
        for item in iterable:
            yield item
    """
    _failed_with(_results("03.prefetcher", wrong), "read by the training loop's own thread")


NAIVE_PREFETCH = """
def prefetch(iterable, depth=2):
    q = queue.Queue(maxsize=depth)
    END = object()

    def produce():
        for item in iterable:
            q.put(item)
        q.put(END)

    threading.Thread(target=produce, daemon=True).start()
    while True:
        item = q.get()
        if item is END:
            return
        yield item
"""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_prefetch_whose_thread_dies_on_an_error_and_leaks_on_break_gets_both_hints():
    results = _results("03.prefetcher", NAIVE_PREFETCH)
    _failed_with(results, "an exception ends the thread silently", "is still alive")
    assert results["yields the same batches, in order, read by a background thread"].passed
    assert results["runs ahead of the loop by at most depth batches"].passed


def test_prefetch_that_swallows_the_error_or_raises_it_early_is_told_where_it_belongs():
    swallowed = RIGHT_PREFETCH.replace("                raise payload", "                return")
    _failed_with(_results("03.prefetcher", swallowed), "the error was swallowed")
    early = """
    def prefetch(iterable, depth=2):
        q = queue.Queue(maxsize=depth)
        stop = threading.Event()
        failure = []

        def produce():
            try:
                for item in iterable:
                    while not stop.is_set():
                        try:
                            q.put(item, timeout=0.05)
                            break
                        except queue.Full:
                            pass
            except Exception as exc:
                failure.append(exc)
            q.put(None)

        thread = threading.Thread(target=produce, daemon=True)
        thread.start()
        try:
            while True:
                time.sleep(0.01)
                if failure:
                    raise failure[0]
                item = q.get()
                if item is None:
                    return
                yield item
        finally:
            stop.set()
    """
    _failed_with(_results("03.prefetcher", early), "surfaced at step")


# --------------------------------------------------------------------------- 03.depth
def test_depth_that_forgets_the_batch_in_hand_gets_the_hint_and_the_right_answer_passes():
    wrong = """
    def longest_wait_ms(worst_collate_ms, compute_ms, depth):
        if depth == 0:
            return worst_collate_ms
        return max(0.0, worst_collate_ms - depth * compute_ms)

    def depth_needed(worst_collate_ms, compute_ms):
        return math.ceil(worst_collate_ms / compute_ms)
    """
    _failed_with(_results("03.depth", wrong), "the batch in the thread's hand", "one too deep")
    right = """
    def longest_wait_ms(worst_collate_ms, compute_ms, depth):
        if depth == 0:
            return worst_collate_ms
        return max(0.0, worst_collate_ms - (depth + 1) * compute_ms)

    def depth_needed(worst_collate_ms, compute_ms):
        return max(1, math.ceil(worst_collate_ms / compute_ms) - 1)
    """
    assert all(r.passed for r in _results("03.depth", right).values())
