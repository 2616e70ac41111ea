"""Lesson 01's checks: realistic wrong answers get the hint that names their mistake; right ones pass."""

from __future__ import annotations

import textwrap

import pytest

from course.grading import check, run_cell

PRELUDE = "import contextlib, math, time\nimport torch\n"


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSTREAM_COURSE_PROGRESS", str(tmp_path / "progress.json"))


def _results(exercise, source):
    return check(exercise, namespace=run_cell(PRELUDE + textwrap.dedent(source)), quiet=True)


def _failed_with(results, text):
    messages = " | ".join(r.message for r in results if not r.passed)
    assert text in messages, messages
    return messages


SPANS_HEAD = """
class Spans:
    def __init__(self, rank=0, clock=time.perf_counter):
        self.rank = rank
        self.clock = clock
        self.spans = []

    @contextlib.contextmanager
    def span(self, lane, name):
"""

SPANS_RIGHT = SPANS_HEAD + """
        start = self.clock()
        try:
            yield
        finally:
            self.spans.append((self.rank, lane, name, start, self.clock()))
"""


def test_spans_right_answer_passes():
    assert all(r.passed for r in _results("01.spans", SPANS_RIGHT))


def test_spans_without_finally_loses_the_failing_phase():
    results = _results("01.spans", SPANS_HEAD + """
        start = self.clock()
        yield
        self.spans.append((self.rank, lane, name, start, self.clock()))
""")
    _failed_with(results, "`finally:`")


def test_spans_that_ignore_the_injected_clock():
    results = _results("01.spans", SPANS_HEAD + """
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append((self.rank, lane, name, start, time.perf_counter()))
""")
    _failed_with(results, "never called self.clock()")


def test_spans_without_the_rank():
    results = _results("01.spans", SPANS_HEAD + """
        start = self.clock()
        try:
            yield
        finally:
            self.spans.append((lane, name, start, self.clock()))
""")
    _failed_with(results, "starts with the rank")


def test_spans_in_milliseconds():
    results = _results("01.spans", SPANS_HEAD + """
        start = self.clock()
        try:
            yield
        finally:
            self.spans.append((self.rank, lane, name, start * 1e3, self.clock() * 1e3))
""")
    _failed_with(results, "keep its value as is (seconds)")


LOOP_RIGHT = """
def train_loop(model, batches, optimizer, spans, steps):
    it = iter(batches)
    losses = []
    for _ in range(steps):
        with spans.span("data", "data wait"):
            batch = next(it)
        with spans.span("compute", "forward"):
            loss = model(**batch).loss
        with spans.span("compute", "backward"):
            loss.backward()
        with spans.span("compute", "optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses
"""


def test_phases_right_answer_passes():
    assert all(r.passed for r in _results("01.phases", LOOP_RIGHT))


def test_phases_with_the_fetch_in_the_loop_header():
    results = _results("01.phases", """
def train_loop(model, batches, optimizer, spans, steps):
    losses = []
    for step, batch in enumerate(batches):
        if step == steps:
            break
        with spans.span("compute", "forward"):
            loss = model(**batch).loss
        with spans.span("compute", "backward"):
            loss.backward()
        with spans.span("compute", "optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses
""")
    _failed_with(results, "fetches in its header, outside any span")


def test_phases_with_backward_inside_the_forward_span():
    results = _results("01.phases", """
def train_loop(model, batches, optimizer, spans, steps):
    it = iter(batches)
    losses = []
    for _ in range(steps):
        with spans.span("data", "data wait"):
            batch = next(it)
        with spans.span("compute", "forward"):
            loss = model(**batch).loss
            with spans.span("compute", "backward"):
                loss.backward()
        with spans.span("compute", "optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses
""")
    _failed_with(results, "the backward also ran inside your 'forward' span")


def test_phases_with_invented_names():
    results = _results("01.phases", LOOP_RIGHT.replace('"forward"', '"fwd"'))
    _failed_with(results, "missing span name(s) ['forward']")


BREAKDOWN_RIGHT = """
def breakdown(spans, warmup=1):
    steps = []
    for s in sorted(spans, key=lambda s: s[3]):
        if s[2] == "data wait" or not steps:
            steps.append([])
        steps[-1].append(s)
    kept = steps[warmup:] or steps
    out = {}
    for name, key in (("data wait", "data_wait_ms"), ("forward", "forward_ms"),
                      ("backward", "backward_ms"), ("optimizer", "optimizer_ms")):
        out[key] = sum((s[4] - s[3]) * 1e3 for step in kept for s in step if s[2] == name) / len(kept)
    out["step_ms"] = sum((max(s[4] for s in step) - step[0][3]) * 1e3 for step in kept) / len(kept)
    return out
"""


def test_breakdown_right_answer_passes():
    assert all(r.passed for r in _results("01.breakdown", BREAKDOWN_RIGHT))


def test_breakdown_in_seconds():
    results = _results("01.breakdown", BREAKDOWN_RIGHT.replace("* 1e3", ""))
    _failed_with(results, "the values are in seconds")


def test_breakdown_without_warmup():
    results = _results("01.breakdown", BREAKDOWN_RIGHT.replace("steps[warmup:] or steps", "steps"))
    _failed_with(results, "Skip the first `warmup` steps")


def test_breakdown_with_the_step_as_the_sum_of_its_parts():
    wrong = BREAKDOWN_RIGHT.replace(
        'out["step_ms"] = sum((max(s[4] for s in step) - step[0][3]) * 1e3 for step in kept) / len(kept)',
        'out["step_ms"] = sum(out.values())')
    _failed_with(_results("01.breakdown", wrong), "gaps between phases")


def test_breakdown_without_sorting():
    results = _results("01.breakdown", BREAKDOWN_RIGHT.replace("sorted(spans, key=lambda s: s[3])", "spans"))
    _failed_with(results, "sort by start time first")


def test_breakdown_averaging_over_spans_not_steps():
    wrong = BREAKDOWN_RIGHT.replace(
        'out[key] = sum((s[4] - s[3]) * 1e3 for step in kept for s in step if s[2] == name) / len(kept)',
        'xs = [(s[4] - s[3]) * 1e3 for step in kept for s in step if s[2] == name]\n'
        '        out[key] = sum(xs) / len(xs)')
    _failed_with(_results("01.breakdown", wrong), "sum of its forward spans")
