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
        buf = torch.empty(size)
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


def test_reduce_scatter_by_shifts_passes():
    assert _failures("10.reduce_scatter", RS_RIGHT) == []


def test_reduce_scatter_paired_by_xor_fails_at_three_ranks():
    first = _failures("10.reduce_scatter", RS_XOR)[0]
    assert first.startswith("3 ranks: rank "), first
    assert "which does not exist at N = 3" in first and "power of two" in first, first


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
