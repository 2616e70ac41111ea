"""Lesson 07's checks tell the likely mistakes apart: each wrong answer a learner would plausibly
write gets the hint that names its mistake, and the right answers pass (on 2 gloo processes)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from course.grading import Learner, check, get_exercise, run_case, run_cell

SRC = Path(__file__).resolve().parents[1] / "course" / "src" / "07_hard_cases.py"


def _minisync_cell() -> str:
    """The lesson's provided MiniSync cell, as the learner's notebook has it."""
    cells = re.split(r"^# %%.*$", SRC.read_text(), flags=re.M)
    return next(c for c in cells if "class MiniSync" in c).strip() + "\n"


def learner(code: str) -> dict:
    """A notebook namespace: the standard imports, MiniSync's cell, then the learner's cell."""
    ns = run_cell("import contextlib, math, torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
                  "import torch.distributed as dist\nfrom course.lib import *\n")
    run_cell(_minisync_cell(), ns)
    return run_cell(textwrap.dedent(code), ns)


def messages(exercise_id: str, ns: dict) -> list[tuple[bool, str]]:
    return [(r.passed, r.message) for r in check(exercise_id, namespace=ns, quiet=True)]


def one_case(exercise_id: str, index: int, ns: dict) -> tuple[bool, str]:
    """Run a single case (the in-process ones, without paying for the two-process ones)."""
    ex = get_exercise(exercise_id)
    r = run_case(ex, ex.cases[index], Learner(ns, ex))
    return r.passed, r.message


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSTREAM_COURSE_PROGRESS", str(tmp_path / "progress.json"))


NO_SYNC_OK = """
    @contextlib.contextmanager
    def no_sync(self):
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous
"""

HOOK_OK = """
    def _on_grad_ready(self, i, p):
        if not self.require_backward_grad_sync:
            return
        super()._on_grad_ready(i, p)
"""

STEP_OK = """
def accumulation_step(model, sync, optimizer, micro_batches, loss_fn):
    n = len(micro_batches)
    for k, batch in enumerate(micro_batches):
        with sync.no_sync() if k < n - 1 else contextlib.nullcontext():
            (loss_fn(model, batch) / n).backward()
    sync.finish()
    optimizer.step()
    optimizer.zero_grad()
"""


def accum_source(hook=HOOK_OK, no_sync=NO_SYNC_OK, step=STEP_OK) -> str:
    return "class AccumSync(MiniSync):\n" + textwrap.indent(textwrap.dedent(hook), "    ") + \
        textwrap.indent(textwrap.dedent(no_sync), "    ") + "\n" + textwrap.dedent(step)


# --------------------------------------------------------------------------- 07.accumulation
def test_accumulation_right_answer_passes():
    results = messages("07.accumulation", learner(accum_source()))
    assert all(ok for ok, _ in results), results


def test_syncing_every_micro_step_is_named():
    every = """
        def accumulation_step(model, sync, optimizer, micro_batches, loss_fn):
            for batch in micro_batches:
                (loss_fn(model, batch) / len(micro_batches)).backward()
                sync.finish()
            optimizer.step()
            optimizer.zero_grad()
    """
    results = messages("07.accumulation", learner(accum_source(step=every)))
    assert results[0][0]                                   # the context manager itself is right
    assert not results[1][0] and "communicated on every micro-step" in results[1][1]
    assert results[2][0]                                   # ... and the result is still correct


def test_forgetting_the_loss_scale_is_named():
    unscaled = STEP_OK.replace("(loss_fn(model, batch) / n)", "loss_fn(model, batch)")
    results = messages("07.accumulation", learner(accum_source(step=unscaled)))
    assert results[1][0]                                   # one all-reduce per parameter: right
    assert not results[2][0] and "divide each micro-batch loss by 4" in results[2][1]


def test_syncing_the_first_micro_step_instead_of_the_last_is_named():
    first = STEP_OK.replace("if k < n - 1 else", "if k > 0 else")
    assert first != STEP_OK
    results = messages("07.accumulation", learner(accum_source(step=first)))
    assert results[1][0]                                   # still one all-reduce per parameter
    passed, message = results[2]
    assert not passed and "during micro-step 1's backward, not the last one's (4)" in message, message
    assert "how much each micro-batch contributes" not in message
    assert "nullcontext" not in message and "k < n - 1" not in message   # no code in the first stage


def test_a_hook_that_ignores_the_flag_is_named():
    results = messages("07.accumulation", learner(accum_source(hook="""
        def _on_grad_ready(self, i, p):
            super()._on_grad_ready(i, p)
    """)))
    assert not results[1][0] and "return without communicating" in results[1][1]


def test_no_sync_without_finally_is_named():
    passed, message = one_case("07.accumulation", 0, learner(accum_source(no_sync="""
        @contextlib.contextmanager
        def no_sync(self):
            self.require_backward_grad_sync = False
            yield
            self.require_backward_grad_sync = True
    """)))
    assert not passed and "finally" in message


# --------------------------------------------------------------------------- 07.unused_and_tied
FINISH_OK = """
    def finish(self):
        while self.next < len(self.params):
            p = self.params[self.next]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._launch(self.next)
        for p, work in zip(self.params, self.works):
            work.wait()
            p.grad.div_(self.world_size)
        self._reset()
"""


def robust_source(hooked: str, finish: str = FINISH_OK) -> str:
    return ("class RobustSync(MiniSync):\n    def hooked_parameters(self, model):\n        return " + hooked + "\n"
            + textwrap.indent(textwrap.dedent(finish), "    "))


GOOD_LIST = "[p for p in reversed(list(model.parameters())) if p.requires_grad]"


@pytest.mark.parametrize("hooked, needle", [
    ("list(reversed([p for m in model.modules() for p in m.parameters(recurse=False)]))", "frozen"),
    ("list(reversed([p for m in model.modules() for p in m.parameters(recurse=False) if p.requires_grad]))",
     "tied"),
    ("[p for p in model.parameters() if p.requires_grad]", "reverse it"),
])
def test_wrong_parameter_lists_are_named(hooked, needle):
    passed, message = one_case("07.unused_and_tied", 0, learner(robust_source(hooked)))
    assert not passed and needle in message, message


def test_a_finish_that_waits_for_unlaunched_reductions_is_named_and_does_not_hang():
    # MiniSync's own finish(): the branch unused on one rank stalls the in-order launcher.
    results = messages("07.unused_and_tied", learner(
        "class RobustSync(MiniSync):\n    def hooked_parameters(self, model):\n        return " + GOOD_LIST + "\n"))
    assert results[0][0]
    assert not results[1][0] and "Launch the rest from finish()" in results[1][1], results[1]


def test_unused_and_tied_right_answer_passes():
    results = messages("07.unused_and_tied", learner(robust_source(GOOD_LIST)))
    assert all(ok for ok, _ in results), results


# --------------------------------------------------------------------------- 07.clip_after_sync
def test_clipping_before_the_sync_is_named():
    ns = learner("""
        def synced_clip_step(sync, model, optimizer, max_norm):
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            sync.finish()
            optimizer.step()
            optimizer.zero_grad()
            return float(norm)
    """)
    results = messages("07.clip_after_sync", ns)
    assert not results[0][0] and "clipped before finish()" in results[0][1]


def test_returning_the_clipped_norm_is_named_and_the_right_answer_passes():
    wrong = learner("""
        def synced_clip_step(sync, model, optimizer, max_norm):
            sync.finish()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            optimizer.step()
            optimizer.zero_grad()
            return float(norm)
    """)
    assert "norm after clipping" in messages("07.clip_after_sync", wrong)[0][1]
    right = learner("""
        def synced_clip_step(sync, model, optimizer, max_norm):
            sync.finish()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad()
            return float(norm)
    """)
    assert all(ok for ok, _ in messages("07.clip_after_sync", right))


def test_a_clip_that_scales_a_small_gradient_up_is_named():
    # Always scaling by max_norm / norm is right only while the gradient is above max_norm.
    ns = learner("""
        def synced_clip_step(sync, model, optimizer, max_norm):
            sync.finish()
            params = list(model.parameters())
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
            for p in params:
                p.grad.mul_(max_norm / (norm + 1e-6))
            optimizer.step()
            optimizer.zero_grad()
            return float(norm)
    """)
    results = messages("07.clip_after_sync", ns)
    assert not results[0][0] and "clipping only ever shrinks a gradient" in results[0][1], results
