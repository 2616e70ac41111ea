"""Lesson 08's checks tell the likely mistakes apart: a half-done migration and a misread report
each get the hint that names the mistake, and so does a misapplied or mispredicted piece of advice;
the right answers pass."""

from __future__ import annotations

import textwrap

import pytest

from course.checks.lesson08 import RECORDED, report_truth
from course.grading import Learner, check, get_exercise, run_case, run_cell

PREAMBLE = ("import torch\nfrom transformers import Trainer, TrainingArguments\n"
            "from hfstream import StreamTrainer, StreamTrainingArguments\n")

STOCK_KW = ('output_dir=output_dir, max_steps=6, per_device_train_batch_size=4, gradient_accumulation_steps=2, '
            'learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=3, seed=0, ddp_bucket_cap_mb=1, '
            'report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True')


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSTREAM_COURSE_PROGRESS", str(tmp_path / "progress.json"))


def migration(args_cls="StreamTrainingArguments", trainer_cls="StreamTrainer", kwargs=STOCK_KW,
              extra='prefetch_depth=2, grad_sync="overlap"') -> dict:
    ns = run_cell(PREAMBLE)
    return run_cell(textwrap.dedent(f"""
        def stream_trainer(model, train_dataset, output_dir):
            args = {args_cls}({kwargs}{", " + extra if extra else ""})
            return {trainer_cls}(model=model, args=args, train_dataset=train_dataset)
    """), ns)


def one_case(exercise_id: str, index: int, ns: dict) -> tuple[bool, str]:
    ex = get_exercise(exercise_id)
    r = run_case(ex, ex.cases[index], Learner(ns, ex))
    return r.passed, r.message


# --------------------------------------------------------------------------- 08.migrate
def test_migration_right_answer_passes_and_trains():
    results = check("08.migrate", namespace=migration(), quiet=True)
    assert all(r.passed for r in results), [(r.case, r.message) for r in results]
    assert "6 steps" in results[-2].message and "run equal to the stock Trainer" in results[-1].message


def test_the_grad_bucket_mb_route_passes_too():
    ns = migration(kwargs=STOCK_KW.replace("ddp_bucket_cap_mb=1", "grad_bucket_mb=1"))
    assert one_case("08.migrate", 2, ns)[0]


@pytest.mark.parametrize("kwargs, needle", [
    ({"trainer_cls": "Trainer", "args_cls": "TrainingArguments", "extra": ""}, "still Trainer"),
    ({"args_cls": "TrainingArguments", "extra": ""}, "refused plain TrainingArguments"),
])
def test_half_migrations_are_named(kwargs, needle):
    passed, message = one_case("08.migrate", 0, migration(**kwargs))
    assert not passed and needle in message, message


def test_a_dropped_stock_setting_is_named():
    ns = migration(kwargs=STOCK_KW.replace(" gradient_accumulation_steps=2,", ""))
    passed, message = one_case("08.migrate", 1, ns)
    assert not passed and "gradient_accumulation_steps is 1" in message and "no_sync" in message


@pytest.mark.parametrize("kwargs, extra, needle", [
    (STOCK_KW, 'grad_sync="overlap"', "prefetch_depth is 2"),            # the default, so this one passes
    (STOCK_KW, 'prefetch_depth=0, grad_sync="overlap"', "prefetch_depth is 0"),
    (STOCK_KW, "prefetch_depth=2", "grad_sync is 'auto'"),
    (STOCK_KW.replace(" ddp_bucket_cap_mb=1,", ""), 'prefetch_depth=2, grad_sync="overlap"', "1 MiB"),
])
def test_hfstream_settings_are_named(kwargs, extra, needle):
    passed, message = one_case("08.migrate", 2, migration(kwargs=kwargs, extra=extra))
    if needle == "prefetch_depth is 2":
        assert passed, message
    else:
        assert not passed and needle in message, message


# --------------------------------------------------------------------------- 08.read_report
RIGHT = """
def read_report(report):
    m = report["mean"]
    other = m["step_ms"] - sum(m[k] for k in ("data_wait_ms", "forward_ms", "backward_ms", "exposed_comm_ms",
                                              "optimizer_ms"))
    costs = {"data_wait_ms": m["data_wait_ms"], "exposed_comm_ms": m["exposed_comm_ms"], "other": other}
    steps = [r["step_ms"] for r in report["per_rank"]]
    return {"efficiency": m["ideal_ms"] / m["step_ms"], "headroom_ms": m["step_ms"] - m["ideal_ms"],
            "biggest": max(costs, key=costs.get), "slowest_rank": steps.index(max(steps))}
"""


def test_recorded_reports_have_different_answers_per_rank_and_part():
    a = RECORDED["one machine, 2 processes"]
    assert report_truth(a)["biggest"] == "exposed_comm_ms"
    assert report_truth(a)["slowest_rank"] == 0
    assert a["per_rank"][1]["efficiency"] < a["per_rank"][0]["efficiency"]   # least efficient != slowest


def test_read_report_right_answer_passes_with_a_live_report():
    ns = run_cell(RIGHT)
    ns["report"] = RECORDED["two nodes, 1 process each"]
    results = check("08.read_report", namespace=ns, quiet=True)
    assert all(r.passed for r in results), [(r.case, r.message) for r in results]
    assert "7 reports" in results[0].message


@pytest.mark.parametrize("old, new, index, needle", [
    ('m["ideal_ms"] / m["step_ms"], "headroom', 'm["step_ms"] / m["ideal_ms"], "headroom', 0, "divided step by ceiling"),
    ('m = report["mean"]', 'm = report["per_rank"][0]', 0, "rank 0's row"),
    ('"exposed_comm_ms": m["exposed_comm_ms"], "other"', '"exposed_comm_ms": m["comm_busy_ms"], "other"', 1,
     "only exposed_comm_ms costs step time"),
    ('"exposed_comm_ms": m["exposed_comm_ms"], "other"', '"comm_busy_ms": m["comm_busy_ms"], "other"', 1,
     "only exposed_comm_ms costs step time"),
    ('costs = {', 'costs = {"backward_ms": m["backward_ms"], ', 1, "the work itself"),
    ('steps = [r["step_ms"]', 'steps = [-r["efficiency"]', 2, "least efficient rank"),
])
def test_misreadings_are_named(old, new, index, needle):
    assert old in RIGHT
    passed, message = one_case("08.read_report", index, run_cell(RIGHT.replace(old, new)))
    assert not passed and needle in message, message


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


def _advice_results(source: str):
    return check("08.check_advice", namespace=run_cell(textwrap.dedent(source)), quiet=True)


def test_check_advice_right_answer_passes():
    assert [r.message for r in _advice_results(ADVICE_RIGHT) if not r.passed] == []


@pytest.mark.parametrize("old, new, index, needle", [
    ('advice = report["advice"][0]', 'advice = report["advice"][-1]', 0, "you applied the last piece of advice"),
    ("after = rerun(**applied)", "after = rerun(setting=advice['setting'], value=advice['value'])", 0,
     "rerun takes the changed settings by name"),
    ("after = rerun(**applied)", "after = report", 0, "never called rerun"),
    ('measured = after["mean"]["step_ms"]', 'measured = report["mean"]["step_ms"]', 0,
     "measured_ms is the step before the change"),
    ('"error": (advice["predicted_step_ms"] - measured) / measured',
     '"error": (measured - advice["predicted_step_ms"]) / measured', 1, "so the error is negative"),
    ('"error": (advice["predicted_step_ms"] - measured) / measured',
     '"error": (advice["predicted_step_ms"] - measured) / advice["predicted_step_ms"]', 1,
     "a fraction of the prediction"),
    ('"error": (advice["predicted_step_ms"] - measured) / measured',
     '"error": advice["predicted_step_ms"] - measured', 1, "error is in milliseconds"),
    ('"mine_ms": max(rest, wait)', '"mine_ms": rest', 2, "as if the wait disappeared entirely"),
    ('"mine_ms": max(rest, wait)', '"mine_ms": report["mean"]["step_ms"]', 2, "the step as it was"),
    ('"mine_ms": max(rest, wait)', '"mine_ms": min(rest, wait)', 2, "you predicted the shorter of the data wait and the rest"),
    ('"mine_ms": max(rest, wait)', '"mine_ms": advice["predicted_step_ms"]', 2, "the advice's own number"),
], ids=["last_advice", "setting_value_kwargs", "no_rerun", "old_step", "sign", "over_predicted", "ms",
        "wait_vanishes", "no_change", "shorter", "copied_advice"])
def test_advice_mistakes_are_named(old, new, index, needle):
    assert old in ADVICE_RIGHT
    results = _advice_results(ADVICE_RIGHT.replace(old, new))
    failed = [r for r in results if not r.passed]
    assert not results[index].passed and needle in results[index].message, [r.message for r in results]
    assert all(r.reveal == "" for r in failed), "a first failure shows no code"
    assert sum(not r.passed for r in results) == 1 + (index == 0), [r.message for r in results]


def test_check_advice_third_failure_reveals_the_formula():
    source = ADVICE_RIGHT.replace('"mine_ms": max(rest, wait)', '"mine_ms": rest')
    for attempt in (1, 2, 3):
        mine = _advice_results(source)[2]
        assert "disappeared entirely" in mine.message and mine.failures == attempt
    assert "max(rest, wait)" in mine.reveal


def test_advice_sentences_follow_the_numbers():
    from course.checks.lesson08 import advice_sentences

    before = {"mean": {"step_ms": 60.0, "data_wait_ms": 41.0},
              "advice": [{"setting": "prefetch_depth", "value": 2, "predicted_step_ms": 41.2}]}
    over = {"applied": {"prefetch_depth": 2}, "mine_ms": 41.0, "predicted_ms": 41.2, "measured_ms": 60.0,
            "error": (41.2 - 60.0) / 60.0}
    text = " ".join(advice_sentences(before, over))
    assert "-31.3%" in text and "promised a faster step" in text and "outside the 25 %" in text, text
    near = dict(over, measured_ms=40.0, error=(41.2 - 40.0) / 40.0)
    text = " ".join(advice_sentences(before, near, {"mean": {"data_wait_ms": 26.0}, "advice": []}))
    assert "+3.0%" in text and "faster than the advice promised" in text and "within the 25 %" in text, text
    assert "1.50 x faster" in text and "no advice worth 5 %" in text, text
