"""Lesson 05's checks name the learner's mistake: reducing after backward, a blocking all-reduce
in the hook, a sum instead of a mean, launch orders that differ between ranks, unused
parameters never reduced; the code of a fix only from the third failure (staged hints), never in
an untouched stub's hint; and the right answers pass. The profiler trace the GPU cell draws is
read here from a CPU (gloo) trace."""

from __future__ import annotations

import textwrap

import pytest

from course.grading import LEARNER_PREAMBLE, check, get_exercise, run_cell


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSTREAM_COURSE_PROGRESS", str(tmp_path / "progress.json"))


def _ns(source: str) -> dict:
    return run_cell(LEARNER_PREAMBLE + textwrap.dedent(source))


def _failures(exercise: str, source: str):
    return [r for r in check(exercise, namespace=_ns(source), quiet=True) if not r.passed]


def _messages(exercise: str, source: str) -> list[str]:
    return [r.message for r in _failures(exercise, source)]


OVERLAP_RIGHT = """
class OverlapSync:
    def __init__(self, model):
        self.world_size = dist.get_world_size()
        self.works = []
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                        for p in model.parameters() if p.requires_grad]

    def _on_grad_ready(self, param):
        self.works.append((param, dist.all_reduce(param.grad, async_op=True)))

    def finish(self):
        for param, work in self.works:
            work.wait()
            param.grad.div_(self.world_size)
        self.works = []
"""


def test_overlap_hook_right_answer_passes():
    assert _messages("05.overlap_hook", OVERLAP_RIGHT) == []


def test_reducing_after_backward_is_named():
    wrong = """
    class OverlapSync:
        def __init__(self, model):
            self.world_size = dist.get_world_size()
            self.params = list(model.parameters())

        def finish(self):
            for p in self.params:
                dist.all_reduce(p.grad, async_op=True).wait()
                p.grad.div_(self.world_size)
    """
    messages = _messages("05.overlap_hook", wrong)
    assert "you reduced after backward" in messages[0], messages
    assert "register a hook per parameter" in messages[0].lower(), messages


def test_blocking_all_reduce_in_the_hook_is_named():
    wrong = OVERLAP_RIGHT.replace("dist.all_reduce(param.grad, async_op=True)", "dist.all_reduce(param.grad)")
    failed = _failures("05.overlap_hook", wrong)
    assert "blocking" in failed[0].message and "returns None, not a Work" in failed[0].message, failed
    assert "async_op=True" not in failed[0].message and failed[0].reveal == "", failed   # first try: no code
    assert "fix the case above first" in failed[1].message, failed


def test_a_sum_instead_of_a_mean_is_named():
    wrong = OVERLAP_RIGHT.replace("param.grad.div_(self.world_size)", "pass")
    messages = _messages("05.overlap_hook", wrong)
    assert len(messages) == 1 and "sum over ranks, not the mean" in messages[0], messages


ORDERED_HEAD = """
import functools

class OrderedOverlapSync:
    def __init__(self, model):
        self.world_size = dist.get_world_size()
        self.order = [p for p in model.parameters() if p.requires_grad][::-1]
        self.ready = [False] * len(self.order)
        self.next = 0
        self.works = []
        self.handles = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, i))
                        for i, p in enumerate(self.order)]

    def _launch(self, i):
        p = self.order[i]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        self.works.append((p, dist.all_reduce(p.grad, async_op=True)))
"""

ORDERED_RIGHT = ORDERED_HEAD + """
    def _on_grad_ready(self, i, param):
        self.ready[i] = True
        while self.next < len(self.order) and self.ready[self.next]:
            self._launch(self.next)
            self.next += 1

    def finish(self):
        while self.next < len(self.order):
            self._launch(self.next)
            self.next += 1
        for p, work in self.works:
            work.wait()
            p.grad.div_(self.world_size)
        self.works, self.next = [], 0
        self.ready = [False] * len(self.order)
"""


def test_ordered_right_answer_passes():
    assert _messages("05.finish", ORDERED_RIGHT) == []


def test_launching_in_hook_order_then_the_rest_is_a_different_order_per_rank():
    # Launch each parameter from its own hook, the unused ones in finish(): rank 1 (which skips
    # `expert`) sends it last, rank 0 during backward -> mismatched collectives.
    wrong = ORDERED_HEAD + """
    def _on_grad_ready(self, i, param):
        self.ready[i] = True
        self._launch(i)

    def finish(self):
        for i in range(len(self.order)):
            if not self.ready[i]:
                self._launch(i)
        for p, work in self.works:
            work.wait()
            p.grad.div_(self.world_size)
        self.works = []
        self.ready = [False] * len(self.order)
"""
    failures = [_failures("05.finish", wrong) for _ in range(3)]     # in-process: no rank is started
    first, third = failures[0], failures[2]
    assert len(first) == 2, first
    assert "different orders" in first[0].message and "expert" in first[0].message, first
    assert "fix the case above first" in first[1].message, first     # the real ranks are not started
    assert first[0].reveal == "" and "self.ready[self.next]" not in first[0].message, first
    assert "self.ready[self.next]" in third[0].reveal and third[0].failures == 3, third   # the code, third time
    assert third[1].reveal == "", third    # a case that did not run is not a try


def test_never_reducing_unused_parameters_is_named():
    wrong = ORDERED_HEAD + """
    def _on_grad_ready(self, i, param):
        self.ready[i] = True
        while self.next < len(self.order) and self.ready[self.next]:
            self._launch(self.next)
            self.next += 1

    def finish(self):
        for p, work in self.works:
            work.wait()
            p.grad.div_(self.world_size)
        self.works, self.next = [], 0
        self.ready = [False] * len(self.order)
"""
    messages = _messages("05.finish", wrong)
    assert "was never reduced" in messages[0] and "waits forever" in messages[0], messages


def test_forgetting_to_reset_between_steps_is_named():
    wrong = ORDERED_RIGHT.replace("        self.works, self.next = [], 0\n        self.ready = [False] * len(self.order)\n",
                                  "        self.works = []\n")
    messages = _messages("05.finish", wrong)
    assert "step 2 launched nothing" in messages[0], messages


def test_not_clearing_the_works_between_steps_is_named():
    wrong = OVERLAP_RIGHT.replace("            param.grad.div_(self.world_size)\n        self.works = []\n",
                                  "            param.grad.div_(self.world_size)\n")
    assert wrong != OVERLAP_RIGHT
    messages = _messages("05.overlap_hook", wrong)
    assert any("clear the list" in m for m in messages), messages


def test_untouched_stubs_get_a_first_stage_hint_without_code():
    from course import build

    built = build.build_lesson(next(p for p in build.lesson_sources() if p.stem.startswith("05")))
    cells = "\n\n".join(c.source for c in built.student.cells
                         if c.cell_type == "code" and "class " in c.source and "raise NotImplementedError" in c.source)
    ns = _ns(cells)
    for exercise in ("05.overlap_hook", "05.finish"):
        results = check(exercise, namespace=ns, quiet=True)
        assert len(results) == len(get_exercise(exercise).cases) > 0, (exercise, results)
        for r in results:
            assert not r.passed and "still raises NotImplementedError" in r.message, r
            assert not any(code in r.message for code in ("async_op=True", "(self._on_grad_ready)", "div_(", "while ")), r
            assert r.reveal == "", r


def test_the_profiler_trace_shows_each_all_reduce_and_backward(tmp_path):
    import torch

    from course.checks.lesson05 import trace_figure, trace_overlap_step

    found = trace_overlap_step(torch.device("cpu"), tmp_path / "trace.json", dim=32, hidden=64, layers=3, batch=64)
    assert found["backend"] == "gloo" and found["buckets"] == 6, found
    assert len(found["host_launches"]) == 6, found["host_launches"]           # one c10d::allreduce_ per hook
    start, end = found["host_backward"]
    assert start == 0 and all(start <= a <= end for a, _ in found["host_launches"]), found
    assert found["comm"] and found["device_backward"] is None                  # gloo's threads; no device here
    assert trace_figure(found, tmp_path / "trace.png", "t").stat().st_size > 0
