"""Lesson 08's checks tell the likely mistakes apart: a half-done migration and a misread report
each get the hint that names the mistake, and the right answers pass."""

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
    assert "6 steps" in results[-1].message


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
