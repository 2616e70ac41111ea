"""`gradsync/overlap_check.py`: a run that lost its overlap is told once, with the reason, and only then.

Nothing breaks when reductions cannot overlap backward, so this is the only thing between such a
run and a silent slowdown. Host times are scripted here (the module's clock is replaced), so each
rule is held exactly: the pattern must hold `SUSPECT_STEPS` synchronised steps in a row, one
bucket is never a loss, the launch time is not counted as spread, and the note is said once.
"""

from __future__ import annotations

import sys
import types

import pytest

from hfstream.gradsync import overlap_check
from hfstream.gradsync.overlap_check import NO_SPREAD, SUSPECT_STEPS, OverlapCheck


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(overlap_check.time, "perf_counter", c)
    monkeypatch.setattr(overlap_check, "anything_compiled", lambda: False)
    return c


def buckets(n=3):
    names = [("h.0.w", "h.0.b", "h.1.w", "h.1.b", "h.2.w"), ("wte",), ("ln_f",)]
    return [types.SimpleNamespace(names=names[i % 3]) for i in range(n)]


def one_step(check, clock, hooks_at, launched=2, launching_s=0.0, step_s=1.0, step=1, forward=True, bks=None):
    """One synchronised step: the forward at 0, hooks at ``hooks_at`` (s), finish() at ``step_s``."""
    check.reset()
    start = clock.now
    if forward:
        check.forward_time = start
    for t in hooks_at:
        clock.now = start + t
        check.hook()
    check.launching_s = launching_s
    clock.now = start + step_s
    note = check.step_done(step, buckets() if bks is None else bks, launched, clock.now)
    clock.now += 1.0
    return note


def test_hook_is_true_for_the_first_of_a_step_only(clock):
    check = OverlapCheck()
    assert check.hook() is True
    clock.now += 0.1
    assert check.hook() is False
    assert (check.first_hook, check.last_hook) == (100.0, 100.1)
    check.reset()
    assert check.first_hook is check.last_hook is check.forward_time is None and check.launching_s == 0.0
    assert check.hook() is True


def test_no_launch_in_backward_is_said_on_the_third_step_in_a_row_once(clock):
    check = OverlapCheck("sharded")
    notes = [one_step(check, clock, [0.2, 0.8], launched=0, step=s) for s in range(1, SUSPECT_STEPS + 3)]
    assert notes[:SUSPECT_STEPS - 1] == [None] * (SUSPECT_STEPS - 1)
    said = notes[SUSPECT_STEPS - 1]
    assert said.startswith(f"GradSync(mode='sharded'): overlap lost in synchronised steps 1-{SUSPECT_STEPS}: ")
    assert "no bucket was launched while backward ran: all 3 waited for finish()" in said
    assert "(the first bucket, h.0.w, h.0.b, h.1.w, h.1.b, never completed" in said   # four names at most
    assert notes[SUSPECT_STEPS:] == [None, None] and check.said


def test_a_good_step_between_suspect_ones_starts_the_count_again(clock):
    check = OverlapCheck()
    pattern = [0, 0, 2, 0, 0]   # buckets launched in backward, per step
    notes = [one_step(check, clock, [0.2, 0.8], launched=n, step=s + 1) for s, n in enumerate(pattern)]
    assert notes == [None] * 5 and not check.said
    assert "steps 4-6" in one_step(check, clock, [0.2, 0.8], launched=0, step=6)


def test_one_bucket_is_never_a_loss_and_two_are(clock):
    check = OverlapCheck()
    for s in range(1, 6):
        assert one_step(check, clock, [0.999, 0.9995], launched=0, step=s, bks=buckets(1)) is None
    assert not check.said
    notes = [one_step(check, clock, [0.999, 0.9995], launched=0, step=s, bks=buckets(2)) for s in range(6, 9)]
    assert notes[-1] is not None and "all 2 waited for finish()" in notes[-1]


def test_gradients_arriving_at_once_are_said_with_the_eager_reason(clock):
    check = OverlapCheck()
    at_once = [0.9, 0.9 + NO_SPREAD * 0.5]   # half the allowed spread, in a 1 s step
    notes = [one_step(check, clock, at_once, launching_s=0.0015, step=s) for s in range(1, SUSPECT_STEPS + 1)]
    said = notes[-1]
    assert notes[:-1] == [None] * (SUSPECT_STEPS - 1) and said is not None
    assert "every gradient arrived at once, at the end of backward (8.50 ms apart in a 1000.0 ms step" in said
    assert "nothing is compiled" in said and "(1.50 ms of it went to launching 3 buckets)" in said


def test_spread_above_the_threshold_is_overlap(clock):
    check = OverlapCheck()
    spread = [0.5, 0.5 + NO_SPREAD * 1.5]
    assert all(one_step(check, clock, spread, step=s) is None for s in range(1, 6))


def test_the_launch_time_is_not_counted_as_spread(clock):
    check = OverlapCheck()
    # 30 ms between the first and last hook, 25 of them launching: 5 ms of real spread in 1 s.
    notes = [one_step(check, clock, [0.5, 0.53], launching_s=0.025, step=s) for s in range(1, SUSPECT_STEPS + 1)]
    assert notes[-1] is not None and "5.00 ms apart" in notes[-1]
    assert "(25.00 ms of it went to launching 3 buckets)" in notes[-1]


def test_the_step_is_measured_from_the_forward_and_without_one_nothing_is_judged_at_once(clock):
    check = OverlapCheck()
    # 15 ms spread: at once in a 1 s step, not in a 0.5 s one (the limit is 2 % of the step).
    assert [one_step(check, clock, [0.48, 0.495], step_s=0.5, step=s) for s in range(1, 5)] == [None] * 4
    assert all(one_step(check, clock, [0.2, 0.9], forward=False, launched=2, step=s) is None for s in range(5, 10))
    assert [one_step(check, clock, [0.98, 0.995], step=s) for s in range(10, 13)][-1] is not None


def test_a_compiled_backward_names_torch_compile_and_native(clock, monkeypatch):
    monkeypatch.setattr(overlap_check, "anything_compiled", lambda: True)
    check = OverlapCheck()
    said = [one_step(check, clock, [0.99, 0.991], step=s) for s in range(1, SUSPECT_STEPS + 1)][-1]
    assert "a compiled model (torch.compile)" in said and "grad_sync='native'" in said
    assert "nothing is compiled" not in said


def test_anything_compiled_reads_dynamos_frame_counter(monkeypatch):
    frames = {"ok": 0}
    fake = types.SimpleNamespace(utils=types.SimpleNamespace(counters={"frames": frames}))
    monkeypatch.setitem(sys.modules, "torch._dynamo", fake)
    assert overlap_check.anything_compiled() is False
    frames["ok"] = 1
    assert overlap_check.anything_compiled() is True
    monkeypatch.setitem(sys.modules, "torch._dynamo", types.SimpleNamespace())   # renamed internals
    assert overlap_check.anything_compiled() is False
    monkeypatch.delitem(sys.modules, "torch._dynamo")
    assert overlap_check.anything_compiled() is False
