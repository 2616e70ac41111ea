"""The grader's own set of wrong learners: plausible wrong answers (not operator mutants) that an
earlier grader accepted, each a small change to the solution a learner could write. Each test runs the
course's check on the wrong answer and asserts that it fails with a first message naming the mistake,
and that the solution the answer was made from passes (issue 46).

Every wrong answer here was shown wrong on an input the old checks never drew: a world of 3 ranks,
a frozen parameter, gradients that arrive out of the launch order, the rank that skips a parameter,
a report whose first advice is not the fastest. In-process checks only (thread ranks or a stand-in
all-reduce), so the file runs in seconds."""

from __future__ import annotations

import textwrap

import pytest

from course.grading import LEARNER_PREAMBLE, check, run_cell


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSTREAM_COURSE_PROGRESS", str(tmp_path / "progress.json"))


def _failures(exercise: str, source: str, cases: str | None = None) -> list[str]:
    """The failure messages of ``exercise``'s cases (those whose title contains ``cases``) on ``source``."""
    results = check(exercise, namespace=run_cell(LEARNER_PREAMBLE + textwrap.dedent(source)), quiet=True)
    return [r.message for r in results if not r.passed and (cases is None or cases in r.title)]


def _changed(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old
    return source.replace(old, new)


# --------------------------------------------------------------------------- 10.reduce_scatter
RS_RIGHT = """
def reduce_scatter_mean(flat):
    n, rank = dist.get_world_size(), dist.get_rank()
    size = flat.numel() // n
    chunks = flat.view(n, size)
    total = chunks[rank].clone()
    for step in range(1, n):
        peer = (rank + step) % n            # send to the rank `step` ahead, receive from the one behind
        src = (rank - step) % n
        send = dist.isend(chunks[peer].contiguous(), peer)
        buf = torch.empty(size, dtype=flat.dtype)
        dist.irecv(buf, src).wait()
        send.wait()
        total += buf
    return total / n
"""
# Pairing by XOR: rank ^ step is a perfect matching at N = 2 and 4, a rank that does not exist at N = 3.
RS_XOR = _changed(RS_RIGHT, """        peer = (rank + step) % n            # send to the rank `step` ahead, receive from the one behind
        src = (rank - step) % n
""", """        peer = src = rank ^ step
""")
# The same pairing, made not to crash: the ranks beyond N are skipped, so their contributions never arrive.
RS_XOR_GUARDED = _changed(RS_XOR, "        peer = src = rank ^ step\n",
                          "        peer = src = rank ^ step\n        if peer >= n:\n            continue\n")


# The receive buffer made without dtype=: float32 whatever the input; right on the old check's float32 inputs.
RS_FLOAT32_BUFFER = _changed(RS_RIGHT, "buf = torch.empty(size, dtype=flat.dtype)", "buf = torch.empty(size)")


def test_reduce_scatter_by_shifts_passes():
    assert _failures("10.reduce_scatter", RS_RIGHT) == []


def test_reduce_scatter_paired_by_xor_fails_at_three_ranks():
    first = _failures("10.reduce_scatter", RS_XOR)[0]
    assert first.startswith("3 ranks: rank "), first
    assert "which does not exist at N = 3" in first and "power of two" in first, first


def test_reduce_scatter_with_a_float32_buffer_is_named_on_a_float64_input():
    first = _failures("10.reduce_scatter", RS_FLOAT32_BUFFER)[0]
    assert "float32" in first and "float64" in first and "dtype=" in first, first


def test_reduce_scatter_paired_by_xor_skipping_missing_peers_names_the_lost_contribution():
    first = _failures("10.reduce_scatter", RS_XOR_GUARDED)[0]
    assert first.startswith("3 ranks, rank "), first
    assert "never arrived" in first and "power of two" in first, first


# --------------------------------------------------------------------------- 08.check_advice
ADVICE_RIGHT = """
def check_advice(report, rerun):
    advice = report["advice"][0]
    applied = {advice["setting"]: advice["value"]}
    after = rerun(**applied)
    wait = report["mean"]["data_wait_ms"]
    rest = report["mean"]["step_ms"] - wait
    measured = after["mean"]["step_ms"]
    return {"applied": applied, "mine_ms": max(rest, wait), "predicted_ms": advice["predicted_step_ms"],
            "measured_ms": measured, "error": (advice["predicted_step_ms"] - measured) / measured}
"""
# "The advice that promises the fastest step": right whenever the first advice is also the fastest.
ADVICE_LOWEST = _changed(ADVICE_RIGHT, 'advice = report["advice"][0]',
                         'advice = min(report["advice"], key=lambda a: a["predicted_step_ms"])')
# "My prediction" read off the run after the change: right whenever the rerun measures exactly max(rest, wait).
ADVICE_MEASURED_AS_MINE = _changed(ADVICE_RIGHT, '"mine_ms": max(rest, wait)', '"mine_ms": measured')


def test_check_advice_solution_passes_on_the_drawn_reports():
    from course.checks.lesson08 import advice_draws

    draws = advice_draws()
    assert len(draws) >= 4
    for report, after in draws:        # the property's premise: the first advice is not the fastest
        first = report["advice"][0]["predicted_step_ms"]
        assert min(a["predicted_step_ms"] for a in report["advice"][1:]) < first
        assert after not in (first, max(report["mean"]["step_ms"] - report["mean"]["data_wait_ms"],
                                        report["mean"]["data_wait_ms"]))
    assert _failures("08.check_advice", ADVICE_RIGHT) == []


def test_applying_the_fastest_advice_instead_of_the_first_is_named():
    first = _failures("08.check_advice", ADVICE_LOWEST)[0]
    assert first.startswith("you applied the advice that promised the fastest step, not the first"), first


def test_the_measured_step_reported_as_my_prediction_is_named():
    first = _failures("08.check_advice", ADVICE_MEASURED_AS_MINE)[0]
    assert first.startswith("your prediction is the step measured after the change"), first


# --------------------------------------------------------------------------- 05 and 06: drawn models on thread ranks
def _case(exercise: str, title: str, source: str):
    """One case of ``exercise`` run on ``source`` (its ``after=`` ignored): the in-process part of a check."""
    from course.grading import Learner, get_exercise, run_case

    ex = get_exercise(exercise)
    case = next(c for c in ex.cases if c.title == title)
    return run_case(ex, case, Learner(run_cell(LEARNER_PREAMBLE + textwrap.dedent(source)), ex))


def _drawn_part(exercise: str, helper: str, source: str) -> str | None:
    """The drawn-model part of a case that runs gloo ranks first: its message, or None when it passes."""
    import course.checks.lesson05 as l05
    import course.checks.lesson06 as l06
    from course.grading import Learner, Wrong, get_exercise

    fn = getattr(l05 if exercise.startswith("05") else l06, helper)
    ex = get_exercise(exercise)
    try:
        fn(Learner(run_cell(LEARNER_PREAMBLE + textwrap.dedent(source)), ex))
    except Wrong as exc:
        return str(exc)
    return None


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
# A hook on every parameter, frozen ones included: right on a model with nothing frozen.
OVERLAP_HOOKS_FROZEN = _changed(OVERLAP_RIGHT, "for p in model.parameters() if p.requires_grad]",
                                "for p in model.parameters()]")

ORDERED_RIGHT = """
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
# `if` where the rule needs `while`: at most one launch per hook; right while gradients arrive in the order.
ORDERED_IF = _changed(ORDERED_RIGHT, "        while self.next < len(self.order) and self.ready[self.next]:",
                      "        if self.next < len(self.order) and self.ready[self.next]:")

BUCKETED_RIGHT = """
class BucketedSync:
    def __init__(self, model, buckets):
        self.world_size = dist.get_world_size()
        params = dict(model.named_parameters())
        self.buckets = [[params[name] for name in names] for names in buckets]
        self.bucket_of = {p: b for b, members in enumerate(self.buckets) for p in members}
        self.pending = [len(m) for m in self.buckets]
        self.next = 0
        self.inflight = []
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                        for members in self.buckets for p in members]

    def _launch(self, b):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[b]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.inflight.append((b, flat, dist.all_reduce(flat, async_op=True)))

    def _on_grad_ready(self, param):
        self.pending[self.bucket_of[param]] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self._launch(self.next)
            self.next += 1

    def finish(self):
        while self.next < len(self.buckets):
            self._launch(self.next)
            self.next += 1
        for b, flat, work in self.inflight:
            work.wait()
            flat.div_(self.world_size)
            offset = 0
            for p in self.buckets[b]:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.inflight, self.next = [], 0
        self.pending = [len(m) for m in self.buckets]
"""
# Launch, then count down: the bucket a hook completes leaves with the next hook (the last one in finish()).
BUCKETED_ONE_HOOK_LATE = _changed(BUCKETED_RIGHT, """        self.pending[self.bucket_of[param]] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self._launch(self.next)
            self.next += 1
""", """        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self._launch(self.next)
            self.next += 1
        self.pending[self.bucket_of[param]] -= 1
""")
# A parameter this rank did not use gets zeros, not its slice of the mean: right on the rank that used it.
BUCKETED_ZEROS_FOR_UNUSED = _changed(BUCKETED_RIGHT, """                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
""", """                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
""")


def test_the_drawn_models_cover_what_the_holes_need():
    from course.checks.drawn import draw_cases

    draws = draw_cases(6, 6, frozen_every=2)
    assert {d.world_size for d in draws} == {2, 3, 4}
    assert {r for d in draws for r in d.skipped} - {1}, "the rank that skips is drawn, not always rank 1"
    assert any(d.frozen for d in draws) and all(d.frozen for d in draw_cases(5, 4, frozen_every=1, skip=False))
    assert all(len(b) > 1 for b in [d.buckets for d in draw_cases(7, 6, frozen_every=2, buckets=True)])


def test_ordered_launch_with_if_instead_of_while_is_named():
    from course.checks.lesson05 import ORDER_CASE

    assert _case("05.finish", ORDER_CASE, ORDERED_RIGHT).passed
    result = _case("05.finish", ORDER_CASE, ORDERED_IF)
    assert not result.passed and result.message.startswith(
        "a hook launched fewer parameters than it made ready: rank "), result.message
    assert _drawn_part("05.finish", "_check_drawn_finish_means", ORDERED_RIGHT) is None


def test_a_hook_on_a_frozen_parameter_is_named():
    assert _drawn_part("05.overlap_hook", "_check_drawn_overlap_launches", OVERLAP_RIGHT) is None
    assert _drawn_part("05.overlap_hook", "_check_drawn_overlap_means", OVERLAP_RIGHT) is None
    message = _drawn_part("05.overlap_hook", "_check_drawn_overlap_launches", OVERLAP_HOOKS_FROZEN)
    assert message and message.startswith("a frozen parameter got a hook: rank 0 raised RuntimeError"), message


def test_a_bucket_launched_one_hook_late_is_named():
    assert _drawn_part("06.bucketed_sync", "_check_drawn_on_time", BUCKETED_RIGHT) is None
    message = _drawn_part("06.bucketed_sync", "_check_drawn_on_time", BUCKETED_ONE_HOOK_LATE)
    assert message and message.startswith("a bucket left a hook late: rank "), message


def test_zeros_for_the_skipping_ranks_parameter_are_named_on_that_rank():
    from course.checks.lesson06 import UNUSED_CASE

    assert _drawn_part("06.bucketed_sync", "_check_drawn_means", BUCKETED_RIGHT) is None
    result = _case("06.bucketed_sync", UNUSED_CASE, BUCKETED_ZEROS_FOR_UNUSED)      # fails before any gloo rank
    assert not result.passed and ", which did not use p" in result.message, result.message
    assert "holds zeros" in result.message.split("(")[0] and result.seconds < 10, result


@pytest.mark.slow
@pytest.mark.parametrize("exercise, source, first", [
    ("05.overlap_hook", OVERLAP_HOOKS_FROZEN, "a frozen parameter got a hook"),
    ("05.finish", ORDERED_IF, "a hook launched fewer parameters than it made ready"),
    ("06.bucketed_sync", BUCKETED_ONE_HOOK_LATE, "a bucket left a hook late"),
    ("06.bucketed_sync", BUCKETED_ZEROS_FOR_UNUSED, "rank "),
], ids=["frozen_hooked", "if_not_while", "bucket_one_hook_late", "zeros_for_unused"])
def test_the_whole_check_fails_the_wrong_learner_first_with_its_mistake(exercise, source, first):
    # Every case, the 2-process gloo ones included (tens of seconds): the first failure is the named mistake.
    messages = _failures(exercise, source)
    assert messages and messages[0].startswith(first), messages
    if source is BUCKETED_ZEROS_FOR_UNUSED:
        assert "holds zeros" in messages[0], messages
