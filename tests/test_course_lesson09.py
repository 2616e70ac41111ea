"""Lesson 09's checks: each diagnosed mistake gets its hint, the right answers pass, and the final
challenge grades a measured run (its diagnosis tested on canned measurements, one real lab run)."""

from __future__ import annotations

import textwrap

import pytest

from course import build as course_build
from course.checks import lesson09
from course.grading import LEARNER_PREAMBLE, check, lesson_exercises, run_cell

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSTREAM_COURSE_PROGRESS", str(tmp_path / "progress.json"))


RING = """
def ring_allreduce_ms(nbytes, world_size, link_gbs, latency_us):
    if world_size <= 1:
        return 0.0
    n = world_size
    return {bandwidth} + {latency}
"""
RIGHT_BW = "2 * (n - 1) / n * nbytes / (link_gbs * 1e9) * 1e3"
RIGHT_LAT = "2 * (n - 1) * latency_us * 1e-3"
STEP = """
def predict_step(world_size, forward_ms, backward_ms, optimizer_ms, bucket_bytes, link_gbs, latency_us):
    busy = {busy}
    return {{"comm_busy_ms": busy, "step_serial_ms": forward_ms + backward_ms + busy + optimizer_ms,
            "ideal_ms": {ideal}}}
"""
RIGHT_BUSY = "sum(ring_allreduce_ms(b, world_size, link_gbs, latency_us) for b in bucket_bytes)"
RIGHT_IDEAL = "forward_ms + max(backward_ms, busy) + optimizer_ms"


def scaling(bandwidth=RIGHT_BW, latency=RIGHT_LAT, busy=RIGHT_BUSY, ideal=RIGHT_IDEAL):
    ns = run_cell(RING.format(bandwidth=bandwidth, latency=latency) + STEP.format(busy=busy, ideal=ideal))
    return check("09.scaling", namespace=ns, quiet=True)


@pytest.mark.parametrize("bandwidth, latency, words", [
    ("nbytes / (link_gbs * 1e9) * 1e3", RIGHT_LAT, "cross the link in a reduce-scatter and again"),
    ("2 * nbytes / (link_gbs * 1e9) * 1e3", RIGHT_LAT, "only the limit for large N"),
    (RIGHT_BW, "0.0", "you left out the latency"),
    (RIGHT_BW, "latency_us * 1e-3", "once per all-reduce"),
    (RIGHT_BW, "2 * (n - 1) * latency_us", "microseconds"),
    ("2 * (n - 1) / n * nbytes / (link_gbs * 1e9 / 8) * 1e3", RIGHT_LAT, "do not divide by 8"),
])
def test_ring_allreduce_mistakes_get_their_hint(bandwidth, latency, words):
    results = scaling(bandwidth=bandwidth, latency=latency)
    assert not results[0].passed
    assert words in results[0].message, results[0].message
    assert not results[0].reveal and lesson09.REVEAL_RING not in results[0].message   # first stage only
    assert "fix the case above first" in results[1].message


def test_the_ring_formula_is_revealed_from_the_third_failure_in_a_row():
    reveals = [scaling(latency="0.0")[0].reveal for _ in range(3)]
    assert reveals[:2] == ["", ""] and reveals[2] == lesson09.REVEAL_RING


def test_one_allreduce_for_the_whole_model_is_caught():
    results = scaling(busy="ring_allreduce_ms(sum(bucket_bytes), world_size, link_gbs, latency_us)")
    assert results[0].passed and not results[1].passed
    assert "each is its own all-reduce" in results[1].message


@pytest.mark.parametrize("ideal, words", [
    ("forward_ms + backward_ms + optimizer_ms", "the link, not compute, sets the ceiling"),
    ("forward_ms + backward_ms + busy + optimizer_ms", "that is the serial step"),
])
def test_a_ceiling_that_ignores_the_link_is_caught(ideal, words):
    results = scaling(ideal=ideal)
    assert not results[1].passed and words in results[1].message, results[1].message
    assert not results[1].reveal and "max(backward" not in results[1].message


def test_the_planner_formula_passes_with_a_detail():
    results = scaling()
    assert all(r.passed for r in results), [r.message for r in results]
    assert "N=1024" in results[1].message


# --------------------------------------------------------------------------- 09.crossover
CROSS = RING.format(bandwidth=RIGHT_BW, latency=RIGHT_LAT) + """
def _busy(n, bucket_bytes, link_gbs, latency_us):
    return sum(ring_allreduce_ms(b, n, link_gbs, latency_us) for b in bucket_bytes)

def crossover_world_size(backward_ms, bucket_bytes, link_gbs, latency_us, max_world_size=2**40):
{crossover}

def min_link_gbs(world_size, backward_ms, bucket_bytes, latency_us):
{min_link}
"""
RIGHT_CROSS = """
    if _busy(max_world_size, bucket_bytes, link_gbs, latency_us) <= backward_ms:
        return None
    lo, hi = 1, max_world_size
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _busy(mid, bucket_bytes, link_gbs, latency_us) <= backward_ms else (lo, mid)
    return hi {adjust}
"""
RIGHT_MIN = """
    n = world_size
    if n <= 1:
        return 0.0
    left = backward_ms - {latency}
    if left <= 0:
        return math.inf
    return 2 * (n - 1) / n * sum(bucket_bytes) / (left / 1e3) / 1e9
"""
LAT_ALL = "2 * (n - 1) * latency_us * 1e-3 * len(bucket_bytes)"
POWERS = """
    n = 2
    while n <= max_world_size:
        if _busy(n, bucket_bytes, link_gbs, latency_us) > backward_ms:
            return n
        n *= 2
    return None
"""
NO_LATENCY = """
    if 2 * sum(bucket_bytes) / (link_gbs * 1e9) * 1e3 <= backward_ms:
        return None
""" + RIGHT_CROSS.format(adjust="")


def crossover(cross=RIGHT_CROSS.format(adjust=""), min_link=RIGHT_MIN.format(latency=LAT_ALL)):
    ns = run_cell("import math\n" + CROSS.format(crossover=textwrap.indent(textwrap.dedent(cross), "    "),
                                                   min_link=textwrap.indent(textwrap.dedent(min_link), "    ")))
    return check("09.crossover", namespace=ns, quiet=True)


@pytest.mark.parametrize("cross, words", [
    (RIGHT_CROSS.format(adjust="- 1"), "the last N where overlap is still complete"),
    (POWERS, "a power of two"),
    (NO_LATENCY, "latency terms grow without bound"),
])
def test_crossover_mistakes_get_their_hint(cross, words):
    results = crossover(cross=cross)
    assert not results[0].passed and words in results[0].message, results[0].message
    assert not results[0].reveal and "(lo + hi) // 2" not in results[0].message


@pytest.mark.parametrize("cross", [
    RIGHT_CROSS.format(adjust="").replace("<= backward_ms:\n        return None", "< backward_ms:\n        return None"),
    RIGHT_CROSS.format(adjust="").replace("<= backward_ms else", "< backward_ms else"),
], ids=["none-guard", "bisection"])
def test_a_crossover_that_counts_equal_as_exceeding_is_caught(cross):
    # Comm busy exactly equal to backward still fits: the planner's cases never land on it, the boundary case does.
    assert cross != RIGHT_CROSS.format(adjust="")
    results = crossover(cross=cross)
    assert not results[0].passed and "*exceeds* backward" in results[0].message, results[0].message


def test_min_link_with_latency_equal_to_backward_is_inf():
    strict = RIGHT_MIN.format(latency=LAT_ALL).replace("if left <= 0:", "if left < 0:")
    results = crossover(min_link=strict)
    assert results[0].passed and not results[1].passed
    assert "all of a 2 ms backward" in results[1].message, results[1].message


def test_min_link_without_latency_is_caught():
    results = crossover(min_link=RIGHT_MIN.format(latency="0.0"))
    assert results[0].passed and not results[1].passed
    assert "left out the latency" in results[1].message, results[1].message
    assert not results[1].reveal and lesson09.REVEAL_MIN_LINK not in results[1].message


def test_min_link_without_the_inf_guard_is_caught():
    # Without `if left <= 0: return math.inf` the bandwidth comes out negative once the latency
    # terms alone outlast backward (llama-8b's 194 buckets at N = 4096).
    unguarded = RIGHT_MIN.format(latency=LAT_ALL).replace("    if left <= 0:\n        return math.inf\n", "")
    assert "math.inf" not in unguarded
    results = crossover(min_link=unguarded)
    assert results[0].passed and not results[1].passed
    assert "N=4096" in results[1].message and "negative bandwidth" in results[1].message, results[1].message
    assert not results[1].reveal and lesson09.REVEAL_MIN_LINK not in results[1].message


def test_the_right_crossover_and_bandwidth_pass():
    results = crossover()
    assert all(r.passed for r in results), [r.message for r in results]
    assert "687" in results[0].message and "None" in results[0].message


# --------------------------------------------------------------------------- 09.final_challenge
SCHEDULE = RING.format(bandwidth=RIGHT_BW, latency=RIGHT_LAT) + """
def overlap_step_ms(buckets, forward_ms, backward_ms, optimizer_ms, world_size, link_gbs, latency_us):
    times = [ring_allreduce_ms(b, world_size, link_gbs, latency_us) for b, _ in buckets]
{body}
"""
RIGHT_SCHEDULE = """
    end = 0.0
    for t, (_, ready) in zip(times, buckets):
        end = max(ready * backward_ms, end) + t
    return forward_ms + max(backward_ms, end) + optimizer_ms
"""


def challenge(config_source: str, schedule: str = RIGHT_SCHEDULE):
    ns = run_cell(SCHEDULE.format(body=textwrap.indent(textwrap.dedent(schedule), "    "))
                  + f"\ndef final_run_config():\n    return {config_source}\n")
    return check("09.final_challenge", namespace=ns, quiet=True)


GOOD_CONFIG = '{"grad_sync": "overlap", "bucket_mb": 0.125, "prefetch_depth": 2}'


@pytest.mark.parametrize("schedule, words", [
    ("return forward_ms + backward_ms + sum(times) + optimizer_ms", "that is the serial step"),
    ("return forward_ms + max(backward_ms, sum(times)) + optimizer_ms", "that is the ceiling"),
    ("end = max([r * backward_ms + t for t, (_, r) in zip(times, buckets)] + [0.0])\n"
     "return forward_ms + max(backward_ms, end) + optimizer_ms", "the link reduces one bucket at a time"),
], ids=["serial", "ceiling", "no-queue-on-the-link"])
def test_planner_schedule_mistakes_are_named_without_the_code(schedule, words, monkeypatch):
    monkeypatch.setattr(lesson09, "run_lab", lambda *a, **k: _canned(0.8, dict(eval(GOOD_CONFIG))))
    results = challenge(GOOD_CONFIG, schedule=schedule)
    assert not results[0].passed and words in results[0].message, results[0].message
    assert not results[0].reveal and "max(ready * backward_ms" not in results[0].message
    assert results[1].passed
    # The graded run depends on the planner that chose its cap: a wrong schedule fails it too.
    assert not results[2].passed and "fix the case above first (\"your overlapped step matches the planner" \
        in results[2].message, results[2].message


def test_the_right_schedule_passes_as_the_planner():
    results = challenge("None", schedule=RIGHT_SCHEDULE)
    assert results[0].passed, results[0].message
    assert not results[1].passed and "fix the case above first" in results[2].message


@pytest.mark.parametrize("config, words", [
    ('{"grad_sync": "overlap", "bucket_mb": "auto", "prefetch_depth": 2}', "choose the cap yourself"),
    ('{"grad_sync": "overlap", "bucket_mb": 0.125}', "missing: ['prefetch_depth']"),
    ('{"grad_sync": "native", "bucket_mb": 0.125, "prefetch_depth": 2}', "'serial' and 'overlap'"),
])
def test_a_config_the_lab_cannot_run_is_refused_before_measuring(config, words, monkeypatch):
    monkeypatch.setattr(lesson09, "run_lab", lambda *a, **k: pytest.fail("measured an invalid config"))
    results = challenge(config)
    assert not results[1].passed and words in results[1].message, results[1].message


def _canned(efficiency, config, buckets=4, data=0.0, busy=52.0, backward=40.0, exposed=10.0, link=48.0):
    run = {"efficiency": efficiency, "efficiency_all": [efficiency] * 7, "config": config, "buckets": buckets,
           "data_wait_ms": data, "step_ms": 100.0, "ceiling_ms": 100.0 * efficiency, "comm_busy_ms": busy,
           "backward_ms": backward, "exposed_comm_ms": exposed, "link_ms": link}
    return {"grad_bytes": 2**19, "runs": {"yours": run}}


@pytest.mark.parametrize("config, canned, words", [
    ({"grad_sync": "serial", "bucket_mb": 25.0, "prefetch_depth": 0}, {"efficiency": 0.46, "data": 40.0},
     "prefetch_depth >= 1"),
    ({"grad_sync": "serial", "bucket_mb": 25.0, "prefetch_depth": 2}, {"efficiency": 0.6, "buckets": 1},
     "grad_sync='serial'"),
    ({"grad_sync": "overlap", "bucket_mb": 25.0, "prefetch_depth": 2}, {"efficiency": 0.55, "buckets": 1},
     "one bucket"),
    ({"grad_sync": "overlap", "bucket_mb": 0.0, "prefetch_depth": 2}, {"efficiency": 0.6, "buckets": 16, "busy": 80.0},
     "Fewer, larger buckets"),
    ({"grad_sync": "overlap", "bucket_mb": 0.25, "prefetch_depth": 2}, {"efficiency": 0.62, "buckets": 2},
     f"below {lesson09.THRESHOLD:.2f}"),
])
def test_a_slow_run_is_told_what_its_breakdown_shows(config, canned, words, monkeypatch):
    calls = []

    def fake(configs, **kwargs):
        calls.append(kwargs)
        return _canned(config=configs["yours"], **canned)

    monkeypatch.setattr(lesson09, "run_lab", fake)
    results = challenge(repr(config))
    assert results[1].passed
    assert not results[2].passed and words in results[2].message, results[2].message
    assert f"ceiling / step = {canned['efficiency']:.2f}" in results[2].message
    assert not results[2].reveal and "min(caps" not in results[2].message
    assert len(calls) == 1              # far below the line: no second measurement


def test_a_run_just_below_the_line_is_measured_again_with_the_steps_pooled(monkeypatch):
    config = {"grad_sync": "overlap", "bucket_mb": 0.125, "prefetch_depth": 2}
    effs = iter([lesson09.THRESHOLD - 0.03, lesson09.THRESHOLD + 0.05])   # pooled: 7 steps each
    monkeypatch.setattr(lesson09, "run_lab", lambda configs, **k: _canned(next(effs), configs["yours"]))
    results = challenge(repr(config))
    assert results[2].passed, results[2].message
    assert "two runs" in results[2].message


def test_a_serial_run_just_below_the_line_stays_below_after_the_second_measurement(monkeypatch):
    config = {"grad_sync": "serial", "bucket_mb": 25.0, "prefetch_depth": 2}
    effs = iter([lesson09.THRESHOLD - 0.05, lesson09.THRESHOLD - 0.02])
    monkeypatch.setattr(lesson09, "run_lab", lambda configs, **k: _canned(next(effs), configs["yours"], buckets=1))
    results = challenge(repr(config))
    assert not results[2].passed and "grad_sync='serial'" in results[2].message
    assert "two runs" in results[2].message


def test_the_naive_setting_fails_a_real_lab_run_with_the_prefetch_hint(monkeypatch):
    """One real measurement: 2 gloo ranks, 8 measured steps. The naive setting sits far below the line."""
    monkeypatch.setitem(lesson09.LAB, "steps", 8)
    results = challenge('{"grad_sync": "serial", "bucket_mb": 25.0, "prefetch_depth": 0}')
    assert results[1].passed
    assert not results[2].passed
    assert "prefetch_depth >= 1" in results[2].message, results[2].message
    run = lesson09.LAST_CHALLENGE
    assert run["data_wait_ms"] > 0 and 0 < run["efficiency"] < lesson09.THRESHOLD


# --------------------------------------------------------------------------- the student notebook
def test_untouched_student_exercises_fail_every_case_with_a_first_stage_hint(monkeypatch):
    monkeypatch.setattr(lesson09, "run_lab", lambda *a, **k: pytest.fail("measured a stub"))
    built = course_build.build_lesson(next(p for p in course_build.lesson_sources() if p.stem.startswith("09_")))
    ns: dict = {}
    run_cell(LEARNER_PREAMBLE, ns)
    for cell in built.student.cells:
        if cell.cell_type == "code" and "is yours to write" in cell.source:
            run_cell(cell.source.replace("from course.checks.lesson09 import THRESHOLD", "THRESHOLD = 0"), ns)
    exercises = lesson_exercises("09")
    assert [e.id for e in exercises] == ["09.scaling", "09.crossover", "09.final_challenge"]
    for exercise in exercises:
        results = check(exercise.id, namespace=ns, quiet=True)
        assert len(results) == len(exercise.cases) > 0, (exercise.id, results)
        for r in results:
            assert not r.passed, f"{exercise.id}: {r.case} passes with the stub"
            assert len(r.message) > 40 and not r.reveal, (exercise.id, r.message, r.reveal)
