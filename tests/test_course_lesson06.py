"""Lesson 06's checks name the learner's mistake: a plan in forward order, `>` for `>=`, closing a
bucket before it would overflow, elements for bytes; a bucketed sync that reduces per parameter,
forgets to copy the mean back, launches buckets in completion order, never resets (one diagnosis,
the dependent cases say "fix the case above first"), or trips on a parameter without .grad; the
code of a fix only from the third failure; and the right answers pass."""

from __future__ import annotations

import textwrap

import pytest

from course.grading import LEARNER_PREAMBLE, check, get_exercise, run_cell


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSTREAM_COURSE_PROGRESS", str(tmp_path / "progress.json"))


def _failures(exercise: str, source: str):
    ns = run_cell(LEARNER_PREAMBLE + textwrap.dedent(source))
    return [r for r in check(exercise, namespace=ns, quiet=True) if not r.passed]


def _messages(exercise: str, source: str) -> list[str]:
    return [r.message for r in _failures(exercise, source)]


PLAN_RIGHT = """
def plan_buckets(named_params, bucket_mb):
    cap = bucket_mb * 2**20
    buckets, current, size = [], [], 0
    for name, p in reversed(list(named_params)):
        current.append(name)
        size += p.numel() * p.element_size()
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
"""


def test_plan_right_answer_passes():
    assert _messages("06.plan_buckets", PLAN_RIGHT) == []


@pytest.mark.parametrize("change, expected", [
    (("reversed(list(named_params))", "list(named_params)"), "reverse* registration order"),
    (("if size >= cap:", "if size > cap:"), "once it *reaches* the cap"),
    (("size += p.numel() * p.element_size()", "size += p.numel()"), "counted elements, not bytes"),
    (("cap = bucket_mb * 2**20", "cap = bucket_mb * 1e6"), "MiB (2**20 bytes"),
    (("    if current:\n        buckets.append(current)\n", ""), "last bucket"),
])
def test_plan_mistakes_are_named(change, expected):
    old, new = change
    assert old in PLAN_RIGHT
    messages = _messages("06.plan_buckets", PLAN_RIGHT.replace(old, new))
    assert messages and any(expected in m for m in messages), messages


def test_closing_before_overflow_is_named():
    wrong = """
    def plan_buckets(named_params, bucket_mb):
        cap = bucket_mb * 2**20
        buckets, current, size = [], [], 0
        for name, p in reversed(list(named_params)):
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > cap:
                buckets.append(current)
                current, size = [], 0
            current.append(name)
            size += nbytes
        if current:
            buckets.append(current)
        return buckets
    """
    messages = _messages("06.plan_buckets", wrong)
    # The first message names the mistake; a later case that needs the rule only says it waits for it.
    assert messages and "before it would overflow" in messages[0], messages
    assert all("depends on it" in m for m in messages[1:]), messages


SYNC_HEAD = """
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
"""

LAUNCH = """
    def _launch(self, b):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[b]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.inflight.append((b, flat, dist.all_reduce(flat, async_op=True)))
"""

ON_READY = """
    def _on_grad_ready(self, param):
        self.pending[self.bucket_of[param]] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self._launch(self.next)
            self.next += 1
"""

FINISH = """
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


def test_bucketed_right_answer_passes():
    assert _messages("06.bucketed_sync", SYNC_HEAD + LAUNCH + ON_READY + FINISH) == []


def test_one_all_reduce_per_parameter_is_named():
    per_param = """
    def _launch(self, b):
        for p in self.buckets[b]:
            self.inflight.append((p, dist.all_reduce(p.grad, async_op=True)))

    def finish(self):
        while self.next < len(self.buckets):
            self._launch(self.next)
            self.next += 1
        for p, work in self.inflight:
            work.wait()
            p.grad.div_(self.world_size)
        self.inflight, self.next = [], 0
        self.pending = [len(m) for m in self.buckets]
"""
    messages = _messages("06.bucketed_sync", SYNC_HEAD + textwrap.indent(textwrap.dedent(per_param), "    ") + ON_READY)
    assert "one per parameter, not per bucket" in messages[0], messages


def test_forgetting_to_unflatten_is_named():
    no_copy = FINISH.replace("                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))\n", "")
    failed = _failures("06.bucketed_sync", SYNC_HEAD + LAUNCH + ON_READY + no_copy)
    assert len(failed) == 2 and "nothing wrote it back" in failed[0].message, failed
    assert "view_as" not in failed[0].message and failed[0].reveal == "", failed    # first try: no code
    assert "fix the case above first" in failed[1].message, failed


def test_launching_in_completion_order_is_named():
    completion = """
    def _on_grad_ready(self, param):
        b = self.bucket_of[param]
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self._launch(b)
            self.launched.add(b)

    def finish(self):
        for b in range(len(self.buckets)):
            if b not in self.launched:
                self._launch(b)
        self.launched = set()
        for b, flat, work in self.inflight:
            work.wait()
            flat.div_(self.world_size)
            offset = 0
            for p in self.buckets[b]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.inflight = []
        self.pending = [len(m) for m in self.buckets]
"""
    head = SYNC_HEAD.replace("        self.inflight = []\n", "        self.inflight = []\n        self.launched = set()\n")
    messages = _messages("06.bucketed_sync", head + LAUNCH + textwrap.indent(textwrap.dedent(completion), "    "))
    assert "not in plan order" in messages[0], messages


def test_not_resetting_is_named_once_and_the_dependent_cases_wait():
    no_reset = FINISH.replace("        self.inflight, self.next = [], 0\n        self.pending = [len(m) for m in self.buckets]\n",
                              "        self.inflight = []\n")
    assert no_reset != FINISH
    failed = _failures("06.bucketed_sync", SYNC_HEAD + LAUNCH + ON_READY + no_reset)
    assert len(failed) == 3 and "step 2 launched nothing" in failed[0].message, failed
    assert all("fix the case above first" in r.message for r in failed[1:]), failed
    assert not any("copy" in r.message for r in failed), failed       # no second, wrong diagnosis


def test_packing_a_missing_grad_is_named():
    no_zeros = LAUNCH.replace("grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[b]]",
                              "grads = [p.grad for p in self.buckets[b]]")
    assert no_zeros != LAUNCH
    failed = _failures("06.bucketed_sync", SYNC_HEAD + no_zeros + ON_READY + FINISH)
    assert len(failed) == 1 and failed[0].case.startswith("a parameter without .grad"), failed
    assert "no .grad" in failed[0].message and "as zeros" in failed[0].message, failed
    assert failed[0].reveal == "", failed


PACK_ALL = "grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[b]]"
GIVE_GRAD = "                if p.grad is None:\n                    p.grad = torch.empty_like(p)\n"


@pytest.mark.parametrize("launch, finish, expected", [
    # unpacking skips a parameter without .grad: rank 1's expert.weight stays None
    (LAUNCH, FINISH.replace(GIVE_GRAD + "                p.grad.copy_(",
                            "                if p.grad is not None:\n                    p.grad.copy_("),
     "expert.weight has no .grad on rank 1"),
    # unpacking assumes every parameter has a .grad
    (LAUNCH, FINISH.replace(GIVE_GRAD, ""), "finish() crashed"),
    # packing leaves a parameter without .grad out of the flat tensor
    (LAUNCH.replace(PACK_ALL, "grads = [p.grad for p in self.buckets[b] if p.grad is not None]"), FINISH,
     "was left out of its bucket's flat tensor"),
])
def test_a_parameter_without_grad_is_named_before_any_rank_starts(launch, finish, expected):
    # Only the unused-parameter case: its in-process rehearsal finds these before any rank starts.
    from course.grading import Learner, get_exercise, run_case

    assert launch != LAUNCH or finish != FINISH
    ex = get_exercise("06.bucketed_sync")
    case = next(c for c in ex.cases if c.title.startswith("a parameter without .grad"))
    result = run_case(ex, case, Learner(run_cell(LEARNER_PREAMBLE + SYNC_HEAD + launch + ON_READY + finish), ex))
    assert not result.passed and expected in result.message, result
    assert result.reveal == "" and result.seconds < 5, result


def test_untouched_stubs_get_a_first_stage_hint_without_code():
    from course import build

    built = build.build_lesson(next(p for p in build.lesson_sources() if p.stem.startswith("06")))
    cells = "\n\n".join(c.source for c in built.student.cells
                         if c.cell_type == "code" and "raise NotImplementedError" in c.source)
    ns = run_cell(LEARNER_PREAMBLE + cells)
    for exercise in ("06.plan_buckets", "06.bucketed_sync"):
        results = check(exercise, namespace=ns, quiet=True)
        assert len(results) == len(get_exercise(exercise).cases) > 0, (exercise, results)
        for r in results:
            assert not r.passed and "still raises NotImplementedError" in r.message, r
            assert not any(code in r.message for code in ("torch.cat", "view_as", "async_op", "2**20", ">=")), r
            assert r.reveal == "", r


def test_the_code_of_the_plan_shows_only_from_the_third_failure():
    wrong = PLAN_RIGHT.replace("reversed(list(named_params))", "list(named_params)")
    first, second, third = (_failures("06.plan_buckets", wrong) for _ in range(3))
    assert "reverse* registration order" in first[0].message and first[0].reveal == "", first
    assert second[0].reveal == "" and "2**20" in third[0].reveal and third[0].failures == 3, (second, third)
