"""Lesson 00's checks play wrong learners: each diagnosed mistake is named on the first failure
without its reveal, the right answers pass, and the untouched student notebook's exercises fail
every case with a first-stage hint. 00.predict is graded on canned measurements, and once on a
real one."""

from __future__ import annotations

import textwrap

import pytest

from course import build as course_build
from course.checks import lesson00
from course.grading import LEARNER_PREAMBLE, REVEAL_AFTER, check, lesson_exercises, run_cell, stub_message


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSTREAM_COURSE_PROGRESS", str(tmp_path / "progress.json"))


def _first_failure(results, index):
    r = results[index]
    assert not r.passed, r.message
    assert r.reveal == "", f"the reveal shows on the first failure: {r.reveal}"
    return r.message


# --------------------------------------------------------------------------- 00.real_apis
RIGHT_API = """
import importlib, dataclasses
def api_exists(spec):
    if spec.startswith("torchrun "):
        from torch.distributed.run import get_args_parser
        flag = spec.split(maxsplit=1)[1]
        return any(flag in a.option_strings for a in get_args_parser()._actions)
    parts = spec.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}:
                obj = None
            else:
                return False
        return True
    return False
"""
CLAIMS = ["torch.Stream", "torch.distributed.stream", "torchrun --stream", "torchrun --nproc-per-node",
          "transformers.TrainingArguments.stream_scheduler"]


def real_apis(api_source: str, is_real: str = "{c: api_exists(c) for c in CLAIMS}"):
    # As in the notebook, a checker that crashes leaves `is_real` undefined.
    ns = run_cell(textwrap.dedent(api_source) + f"\nCLAIMS = {CLAIMS!r}\ntry:\n    is_real = {is_real}\n"
                  "except Exception:\n    pass\n")
    return check("00.real_apis", namespace=ns, quiet=True)


WHOLE_NAME_IMPORT = RIGHT_API.replace("for cut in range(len(parts), 0, -1):", "for cut in [len(parts)]:")
NO_CATCH = RIGHT_API.replace("except ImportError:\n            continue", "finally:\n            pass")
MODULE_ONLY = RIGHT_API.replace("            else:\n                return False\n", "")
HELP_SUBSTRING = RIGHT_API.replace(
    "return any(flag in a.option_strings for a in get_args_parser()._actions)",
    "return flag in get_args_parser().format_help()")
NO_TORCHRUN = RIGHT_API.replace('if spec.startswith("torchrun "):', 'if False:')
NO_FIELDS = RIGHT_API.replace("elif dataclasses.is_dataclass(obj)", "elif False and dataclasses.is_dataclass(obj)")


@pytest.mark.parametrize("source, case, words", [
    (WHOLE_NAME_IMPORT, 0, "`import_module` of the whole name fails"),
    (NO_CATCH, 0, "is an answer, False, not an error"),
    (MODULE_ONLY, 0, "every part must resolve"),
    (NO_TORCHRUN, 1, "a flag is not a Python attribute"),
    (HELP_SUBSTRING, 1, "'--nproc' is only a piece of '--nproc-per-node'"),
    (NO_FIELDS, 2, "its default is made by a factory"),
], ids=["whole-name-import", "raises", "module-only", "flags-as-names", "help-substring", "class-attrs-only"])
def test_api_checker_mistakes_are_named_without_the_code(source, case, words):
    results = real_apis(source)
    message = _first_failure(results, case)
    assert words in message, message
    assert "import_module('.'.join" not in message and "_actions" not in message
    assert not results[3].passed and "fix the case above first" in results[3].message


def test_the_course_checker_does_not_count_as_yours():
    results = real_apis("from course.checks.lesson00 import _truth as api_exists\n")
    assert "write yours" in _first_failure(results, 0)


def test_a_hand_typed_sorting_that_disagrees_with_the_packages_is_named():
    typed = "{c: not c.endswith('stream') for c in CLAIMS}"    # stream_scheduler: wrongly True
    results = real_apis(RIGHT_API, is_real=typed)
    assert all(r.passed for r in results[:3])
    assert "no stream_scheduler field" in _first_failure(results, 3)


def test_the_right_checker_passes_and_sorts_the_claims():
    results = real_apis(RIGHT_API)
    assert all(r.passed for r in results), [r.message for r in results]
    assert "2 real, 3 invented" in results[3].message


def test_the_reveal_shows_from_the_third_failure_in_a_row():
    for attempt in range(REVEAL_AFTER + 1):
        r = real_apis(NO_FIELDS)[2]
        assert bool(r.reveal) == (attempt >= REVEAL_AFTER), (attempt, r.reveal)
    assert "dataclasses.fields" in r.reveal


# --------------------------------------------------------------------------- 00.ceiling
CEILING = """
def ceiling_ms(data_wait_ms, forward_ms, backward_ms, comm_busy_ms, optimizer_ms):
    return {formula}
def efficiency(step_ms, *parts):
    return {efficiency}
"""
RIGHT_CEILING = "forward_ms + max(backward_ms, comm_busy_ms) + optimizer_ms"


def ceiling(formula=RIGHT_CEILING, efficiency="ceiling_ms(*parts) / step_ms"):
    return check("00.ceiling", namespace=run_cell(CEILING.format(formula=formula, efficiency=efficiency)),
                 quiet=True)


@pytest.mark.parametrize("formula, words", [
    ("data_wait_ms + forward_ms + max(backward_ms, comm_busy_ms) + optimizer_ms", "you added data_wait"),
    ("max(forward_ms + backward_ms, comm_busy_ms) + optimizer_ms", "cannot hide any of it"),
    ("forward_ms + backward_ms + optimizer_ms", "left communication out"),
    ("forward_ms + backward_ms + comm_busy_ms + optimizer_ms", "not their sum"),
])
def test_ceiling_mistakes_are_named_without_the_formula(formula, words):
    results = ceiling(formula)
    message = _first_failure(results, 0)
    assert words in message and lesson00.REVEAL_CEILING not in message, message
    assert "fix the case above first" in results[1].message


def test_efficiency_upside_down_is_named():
    results = ceiling(efficiency="step_ms / ceiling_ms(*parts)")
    assert results[0].passed and "you divided step by ideal" in _first_failure(results, 1)


# --------------------------------------------------------------------------- 00.predict
RIGHT_PREDICT = {"serial": "d + f + b + c + o", "prefetch": "max(d, f + b + c + o)",
                 "overlap": "d + f + max(b, c) + o", "both": "max(d, f + max(b, c) + o)"}
PREDICT = """
def predict_step_ms(schedule, data_ms, forward_ms, backward_ms, comm_ms, optimizer_ms):
    d, f, b, c, o = data_ms, forward_ms, backward_ms, comm_ms, optimizer_ms
    return {{"serial": {serial}, "prefetch": {prefetch}, "overlap": {overlap}, "both": {both}}}[schedule]
"""


def _canned_measurement(f=20.0, b=30.0, o=5.0):
    """What a perfectly quiet machine would measure: every step exactly as the course's model says."""
    scenarios = {}
    for name, (schedule, data_share, comm_share) in lesson00.SCENARIOS.items():
        d, c = data_share * (f + b + o), comm_share * b
        step = lesson00._right(schedule, d, f, b, c, o)
        steps = [{"forward_ms": f, "backward_ms": b, "optimizer_ms": o, "step_ms": step}] * 6
        scenarios[name] = {"schedule": schedule, "data_ms": d, "comm_ms": c, "steps": steps, "step_ms": step}
    return {"calibration": {"forward_ms": f, "backward_ms": b, "optimizer_ms": o}, "scenarios": scenarios}


@pytest.fixture
def canned(monkeypatch):
    measurement = _canned_measurement()
    monkeypatch.setattr(lesson00, "LAST_SCHEDULES", measurement)
    monkeypatch.setattr(lesson00, "_remeasure", lambda name: measurement["scenarios"][name])
    return measurement


def predict(**formulas):
    ns = run_cell(PREDICT.format(**{**RIGHT_PREDICT, **formulas}))
    return check("00.predict", namespace=ns, quiet=True)


# The canned machine: forward 20, backward 30, optimizer 5, data 27.5 and comm 18 ms in every schedule; the
# steps are serial 100.5, prefetch 73, overlap 82.5, both 55 ms. Cases 0-3 are the schedules, 4 the drawn ones.
@pytest.mark.parametrize("formulas, case, words", [
    ({"serial": "f + b + c + o"}, 0, "you left out the data"),
    ({"prefetch": "d + f + b + c + o"}, 1, "that adds every part"),
    ({"overlap": "d + f + b + c + o"}, 2, "that adds every part"),
    ({"both": "d + f + max(b, c) + o"}, 3, "you added data_ms"),
    ({"both": "f + max(b, c) + o"}, 3, "you left out the data"),
    ({"both": "max(d, f + b + o)"}, 3, "you left out the reduction"),
], ids=["serial-no-data", "prefetch-as-serial", "overlap-as-serial", "both-adds-data", "ceiling-only",
        "comm-never-exposed"])
def test_prediction_mistakes_are_named(canned, formulas, case, words):
    results = predict(**formulas)
    message = _first_failure(results, case)
    assert words in message, message
    if case < 4:                 # against the measurement: both numbers shown
        assert "predicted" in message and "measured" in message
    assert "max(data, forward" not in message
    assert all(r.passed for r in results[:case]), [r.message for r in results[:case]]


@pytest.mark.parametrize("formulas, words, where", [
    ({"serial": "d + f + b + c", "prefetch": "max(d, f + b + c)", "overlap": "d + f + max(b, c)",
      "both": "max(d, f + max(b, c))"}, "you left out the optimizer step", "within the tolerance"),
    ({"serial": "d + b + c + o", "prefetch": "max(d, b + c + o)", "overlap": "d + max(b, c) + o",
      "both": "max(d, max(b, c) + o)"}, "you left out the forward", "measured"),
], ids=["no-optimizer", "no-forward"])
def test_a_part_the_tolerance_would_hide_is_named_in_every_case(canned, formulas, words, where):
    # 5 ms of optimizer (or 20 of forward) sit inside 15 % + 2 ms of these steps: the measured
    # comparison alone passes them; every case must still fail and name the part left out.
    results = predict(**formulas)
    for r in results:
        assert not r.passed and words in r.message, r.message
        assert where in r.message or r.case.startswith("drawn"), r.message
        assert r.reveal == "" and "max(data, forward" not in r.message


def test_a_prediction_within_the_tolerance_passes_and_says_both_numbers(canned):
    results = predict()
    assert all(r.passed for r in results), [r.message for r in results]
    assert "predicted 55 ms, measured 55 ms" in results[3].message


def test_a_real_measurement_agrees_with_the_right_prediction():
    """One real run of the four schedules (a few seconds): the tolerance holds on this machine."""
    lesson00.measure_schedules()
    results = predict()
    assert all(r.passed for r in results), [r.message for r in results]


# --------------------------------------------------------------------------- the student notebook
def test_untouched_student_exercises_fail_every_case_with_a_first_stage_hint():
    built = course_build.build_lesson(next(p for p in course_build.lesson_sources() if p.stem.startswith("00_")))
    ns: dict = {}
    run_cell(LEARNER_PREAMBLE + "import importlib, dataclasses\nCLAIMS = ['torch.Stream']\n", ns)
    for cell in built.student.cells:
        if cell.cell_type == "code" and "is yours to write" in cell.source:
            try:
                run_cell(cell.source, ns)
            except NotImplementedError:
                pass                        # a stub at the cell's top level, as in the notebook
    for exercise in lesson_exercises("00"):
        assert stub_message(exercise.id) in "\n".join(c.source for c in built.student.cells)
        results = check(exercise.id, namespace=ns, quiet=True)
        assert len(results) == len(exercise.cases) > 0, (exercise.id, results)
        for r in results:
            assert not r.passed, f"{exercise.id}: {r.case} passes with the stub"
            assert len(r.message) > 40 and not r.reveal, (exercise.id, r.message, r.reveal)


def test_a_second_look_at_one_scenario_keeps_the_graded_measurement(monkeypatch):
    class QuietLab:                        # a machine whose every step takes what the model says
        ids = None

        def compute(self, batch, comm_ms, overlapped):
            return 20.0, 30.0, 5.0

        def run(self, schedule, data_ms, comm_ms, steps, warmup):
            step = lesson00._right(schedule, data_ms, 20.0, 30.0, comm_ms, 5.0)
            return [{"forward_ms": 20.0, "backward_ms": 30.0, "optimizer_ms": 5.0, "step_ms": step}] * steps

    monkeypatch.setattr(lesson00, "_Lab", QuietLab)
    monkeypatch.setattr(lesson00, "LAST_SCHEDULES", {})
    lesson00.measure_schedules()
    again = lesson00._remeasure("serial")
    assert again["step_ms"] == pytest.approx(27.5 + 20 + 30 + 18 + 5)
    assert list(lesson00.LAST_SCHEDULES["scenarios"]) == list(lesson00.SCENARIOS)
