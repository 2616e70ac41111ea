"""Staged hints: the first failure of a case names the mistake, the formula or code comes only from
its third failure in a row (counted in the progress file), a pass resets the count, a case that
depends on a failed one says "fix the case above first" and which mistake that was, and the CLI's progress and multi-lesson
grade. Fast: temporary exercises, no notebook is executed."""

from __future__ import annotations

import json
import textwrap

import pytest

from course import runner
from course.grading import (Exercise, Wrong, case_failures, check, load_progress, run_cell,
                            stub_message)


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSTREAM_COURSE_PROGRESS", str(tmp_path / "progress.json"))


def _scale_exercise(exercise_id: str) -> Exercise:
    """`scale(x)` must return 2 * x; a learner who returns x + 2 gets a diagnosed Wrong."""
    ex = Exercise(exercise_id, uses=["scale"])

    @ex.case("scale doubles", hint="return twice the input", reveal="return 2 * x")
    def _(learner):
        got = learner.scale(5)
        if got == 7:
            raise Wrong("you added 2 instead of doubling", reveal="def scale(x): return 2 * x")
        assert got == 10, f"scale(5) returned {got}"

    @ex.case("scale of a tensor", hint="the same rule for a tensor", after="scale doubles")
    def _(learner):
        import torch

        assert torch.equal(learner.scale(torch.ones(2)), torch.full((2,), 2.0))

    return ex


ADDS = "def scale(x):\n    return x + 2\n"
CRASHES = "def scale(x):\n    return x.missing\n"
RIGHT = "def scale(x):\n    return 2 * x\n"


def _first(exercise_id, source, capsys):
    results = check(exercise_id, namespace=run_cell(source))
    return results[0], capsys.readouterr().out


def test_first_failure_names_the_mistake_the_third_shows_the_code_and_a_pass_resets(capsys):
    _scale_exercise("99.hint_wrong")
    for attempt in (1, 2):
        r, out = _first("99.hint_wrong", ADDS, capsys)
        assert not r.passed and "you added 2 instead of doubling" in r.message
        assert r.reveal == "" and "more, after" not in out and "2 * x" not in out, (attempt, out)
        assert r.failures == attempt
    r, out = _first("99.hint_wrong", ADDS, capsys)
    assert r.reveal == "def scale(x): return 2 * x"
    assert "\n         more, after 3 tries: def scale(x): return 2 * x" in out
    assert case_failures("99.hint_wrong") == {"scale doubles": 3}

    r, _ = _first("99.hint_wrong", RIGHT, capsys)
    assert r.passed and case_failures("99.hint_wrong") == {}
    r, out = _first("99.hint_wrong", ADDS, capsys)      # the count starts again after a pass
    assert r.failures == 1 and r.reveal == "" and "more, after" not in out


def test_the_generic_hint_has_its_own_second_stage(capsys):
    _scale_exercise("99.hint_generic")
    outs = [_first("99.hint_generic", CRASHES, capsys) for _ in range(3)]
    for r, out in outs[:2]:
        assert "Hint: return twice the input" in r.message and "more, after" not in out
    r, out = outs[2]
    assert r.reveal == "return 2 * x" and "more, after 3 tries: return 2 * x" in out


def test_a_case_that_depends_on_a_failed_case_is_not_run_and_says_so(capsys):
    ex = _scale_exercise("99.hint_after")
    ran = []
    ex.case("would run", hint="never shown", after=["scale doubles"])(lambda learner: ran.append(1))
    results = check("99.hint_after", namespace=run_cell(ADDS), quiet=True)
    assert [r.passed for r in results] == [False, False, False]
    for r in results[1:]:
        # it names the mistake to fix first, as the case above diagnosed it (never its reveal)
        assert r.message == ("fix the case above first ('scale doubles'): this case depends on it. "
                             "The mistake to fix first: you added 2 instead of doubling"), r.message
        assert not r.counted and r.failures == 0
    assert not ran
    assert case_failures("99.hint_after") == {"scale doubles": 1}   # the skipped cases are not tries
    results = check("99.hint_after", namespace=run_cell(RIGHT), quiet=True)
    assert all(r.passed for r in results) and ran == [1]


def test_after_must_name_an_earlier_case():
    ex = Exercise("99.hint_bad_after", uses=[])
    with pytest.raises(ValueError, match="after='nope'.*earlier case"):
        ex.case("second", hint="h", after="nope")
    with pytest.raises(TypeError, match="reveal"):
        Wrong("message", reveal=3)


def test_an_untouched_stub_never_reveals_and_is_not_counted(capsys):
    _scale_exercise("99.hint_stub")
    stub = f"def scale(x):\n    raise NotImplementedError({stub_message('99.hint_stub')!r})\n"
    for _ in range(4):
        r, out = _first("99.hint_stub", stub, capsys)
        assert "still raises NotImplementedError" in r.message and "Hint: return twice the input" in r.message
        assert r.reveal == "" and "more, after" not in out and not r.counted
    # the case that depends on it names the stub too, not "fix the case above first"
    second = check("99.hint_stub", namespace=run_cell(stub), quiet=True)[1]
    assert "still raises NotImplementedError" in second.message and "Hint: the same rule" in second.message
    assert case_failures("99.hint_stub") == {}
    r, _ = _first("99.hint_stub", ADDS, capsys)          # the first real try is a first failure
    assert r.failures == 1 and r.reveal == ""


def test_an_old_progress_file_without_counts_still_works(tmp_path, capsys):
    old = {"99.hint_old": {"passed": False, "cases_passed": 0, "cases": 2, "when": "2026-11-30T10:00:00+00:00"},
           "00.ceiling": {"passed": True, "cases_passed": 3, "cases": 3, "when": "2026-11-30T09:00:00+00:00"}}
    (tmp_path / "progress.json").write_text(json.dumps(old))
    _scale_exercise("99.hint_old")
    r, out = _first("99.hint_old", ADDS, capsys)
    assert r.failures == 1 and "more, after" not in out
    progress = load_progress()
    assert progress["00.ceiling"] == old["00.ceiling"]
    assert progress["99.hint_old"]["failures"] == {"scale doubles": 1}


CEILING_RIGHT = """
def ceiling_ms(data_wait_ms, forward_ms, backward_ms, comm_busy_ms, optimizer_ms):
    return forward_ms + max(backward_ms, comm_busy_ms) + optimizer_ms
def efficiency(step_ms, *parts):
    return ceiling_ms(*parts) / step_ms
"""


def test_progress_shows_an_exercise_passed_before_and_failing_now(capsys):
    assert all(r.passed for r in check("00.ceiling", namespace=run_cell(textwrap.dedent(CEILING_RIGHT)), quiet=True))
    wrong = CEILING_RIGHT.replace("max(backward_ms, comm_busy_ms)", "backward_ms + comm_busy_ms")
    for _ in range(2):           # the pass is remembered through several failures
        assert not all(r.passed for r in check("00.ceiling", namespace=run_cell(wrong), quiet=True))
    capsys.readouterr()
    assert runner.main(["progress"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "00.ceiling" in ln)
    assert "passed before (failing now" in line and "not tried" not in line
    assert "1 of them passed before and fail now" in out


def test_progress_shows_when_an_exercise_first_passed_not_the_latest(tmp_path, capsys):
    first = "2026-11-30T09:00:00+00:00"
    old = {"00.ceiling": {"passed": True, "cases_passed": 3, "cases": 3, "when": first}}
    (tmp_path / "progress.json").write_text(json.dumps(old))
    assert all(r.passed for r in check("00.ceiling", namespace=run_cell(textwrap.dedent(CEILING_RIGHT)), quiet=True))
    assert load_progress()["00.ceiling"]["first_passed"] == first        # a later pass keeps the first
    wrong = CEILING_RIGHT.replace("max(backward_ms, comm_busy_ms)", "backward_ms + comm_busy_ms")
    assert not all(r.passed for r in check("00.ceiling", namespace=run_cell(wrong), quiet=True))
    assert load_progress()["00.ceiling"]["passed_before"] == first       # and so does a failure
    assert all(r.passed for r in check("00.ceiling", namespace=run_cell(textwrap.dedent(CEILING_RIGHT)), quiet=True))
    capsys.readouterr()
    assert runner.main(["progress"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "00.ceiling" in ln)
    assert f"first passed {first}" in line and "last checked" in line, line


def test_grade_takes_several_lessons_or_all(monkeypatch, capsys):
    graded = []

    def fake_grade(lesson, which, cell_timeout, save_dir):
        graded.append((lesson, which))
        return runner.LessonGrade(lesson, f"course/solutions/{lesson}.ipynb",
                                  [runner.ExerciseGrade(f"{lesson}.x", True, 1, 1)], [], 1, 0.0)

    monkeypatch.setattr(runner, "grade_lesson", fake_grade)
    monkeypatch.setattr(runner, "notebook_for", lambda lesson, which: runner.ROOT / "course" / f"{lesson}.ipynb")
    assert runner.main(["grade", "4", "05", "06", "05", "--which", "solution"]) == 0
    assert graded == [("04", "solution"), ("05", "solution"), ("06", "solution")]
    assert "score: 3/3 exercises (100%)" in capsys.readouterr().out
    graded.clear()
    assert runner.main(["grade", "--all", "--quiet"]) == 0
    assert [g[0] for g in graded] == runner.lessons()
    graded.clear()
    assert runner.main(["grade"]) == 0 and [g[0] for g in graded] == runner.lessons()
    with pytest.raises(SystemExit, match="no lesson '42'"):
        runner.main(["grade", "04", "42"])
    with pytest.raises(SystemExit, match="or --all, not both"):
        runner.main(["grade", "04", "--all"])


def test_the_headless_grade_keeps_the_second_stage_with_its_case(monkeypatch):
    ex = _scale_exercise("99.hint_grade")
    rows = [{"exercise": "99.hint_grade", "case": "scale doubles", "passed": False, "message": "you added 2",
             "reveal": "def scale(x): return 2 * x", "failures": 3},
            {"exercise": "99.hint_grade", "case": "scale of a tensor", "passed": False,
             "message": "fix the case above first ('scale doubles'): this case depends on it"}]
    monkeypatch.setattr(runner, "notebook_for", lambda lesson, which: runner.ROOT / "course" / "x.ipynb")
    monkeypatch.setattr(runner, "execute", lambda path, timeout, save_to: (rows, [], 0, 0.1))
    monkeypatch.setattr(runner, "lesson_exercises", lambda lesson: [ex])
    grade = runner.grade_lesson("99", "solution")
    assert grade.exercises[0].messages == [
        "scale doubles: you added 2 (more, after 3 tries: def scale(x): return 2 * x)",
        "scale of a tensor: fix the case above first ('scale doubles'): this case depends on it"]
