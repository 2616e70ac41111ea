"""`gradsync.faults` on scripted works: bounded waits in order, and what a stuck or failed step reports.

The 2-rank tests (`test_gradsync.py`'s rank that skips backward, `test_watchdog.py`) show the
messages on real failures; these hold each rule: which backend ends a collective by itself, a
deadline shared by every bucket, nothing waited for after the first failure, each completed
bucket handed on at once and in order, and what each kind of pending bucket says.
"""

from __future__ import annotations

import datetime
import types

import pytest
import torch.distributed as dist

from hfstream.gradsync import faults


class _Work:
    def __init__(self, result=True, raises=None, completed=True):
        self.result, self.raises, self.completed, self.calls = result, raises, completed, []

    def wait(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.raises is not None:
            raise self.raises
        return self.result

    def is_completed(self):
        return self.completed


def _state(index, work=None, names=("w",), ready=(True,), launch_time=0.0):
    return types.SimpleNamespace(work=work, plan=types.SimpleNamespace(index=index, names=list(names)),
                                 ready=list(ready), launch_time=launch_time)


@pytest.mark.parametrize("backend, expected", [("nccl", True), ("NCCL", True), ("cpu:gloo,cuda:nccl", True),
                                               ("gloo", False), (None, False)])
def test_only_nccl_ends_a_collective_at_the_groups_timeout_by_itself(monkeypatch, backend, expected):
    def get_backend(group):
        if backend is None:
            raise RuntimeError("no process group")
        return backend
    monkeypatch.setattr(dist, "get_backend", get_backend)
    assert faults.backend_enforces_timeout(None) is expected


def test_each_bucket_is_handed_on_as_it_completes_in_order():
    states = [_state(i, _Work()) for i in range(3)]
    done = []
    assert faults.wait_in_order(states, 30.0, False, done.append) == ([], None)
    assert done == states


def test_where_the_backend_enforces_the_timeout_the_plain_wait_is_kept():
    work = _Work()
    faults.wait_in_order([_state(0, work)], 30.0, True, lambda st: None)
    assert work.calls == [((), {})]


def test_one_deadline_is_shared_by_every_bucket(monkeypatch):
    clock = iter([100.0, 100.0, 112.0, 140.0])   # the deadline's start, then one reading per wait
    monkeypatch.setattr(faults.time, "monotonic", lambda: next(clock))
    works = [_Work(), _Work(), _Work()]
    faults.wait_in_order([_state(i, w) for i, w in enumerate(works)], 30.0, False, lambda st: None)
    lefts = [w.calls[0][1]["timeout"] for w in works]
    # 30 s from the start, then 18 s left, then past the deadline: a minimal wait, never a negative one.
    assert lefts == [datetime.timedelta(seconds=30), datetime.timedelta(seconds=18),
                     datetime.timedelta(seconds=0.001)]


def test_a_wait_that_times_out_fails_its_bucket_and_nothing_after_it_is_waited_for():
    late, after = _Work(result=False), _Work()
    first = _state(0, _Work())
    done = []
    failed, error = faults.wait_in_order([first, _state(1, late), _state(2, after)], 30.0, False, done.append)
    assert [st.plan.index for st in failed] == [1, 2] and done == [first]
    assert "no result within timeout=30 s" in str(error)
    assert after.calls == []   # not waited for: the step already failed


def test_the_first_error_is_the_one_returned():
    dead = ConnectionError("peer closed the connection")
    failed, error = faults.wait_in_order([_state(0, _Work(raises=dead)), _state(1, _Work(raises=ValueError("x")))],
                                         30.0, True, lambda st: None)
    assert error is dead and len(failed) == 2


def test_nothing_pending_reports_nothing():
    assert faults.pending_report(0, [_state(0, _Work(completed=True))], [0], serial=False) == ""
    assert faults.pending_report(0, [], [], serial=False) == ""


def test_the_pending_report_names_each_kind_of_bucket(monkeypatch):
    monkeypatch.setattr(faults.time, "perf_counter", lambda: 50.0)
    names = [f"p{i}" for i in range(8)]
    states = [_state(0, None, names, [True, False] * 4),
              _state(1, _Work(completed=False), launch_time=47.5),
              _state(2, _Work(completed=True))]
    report = faults.pending_report(3, states, [1, 2], serial=False)
    assert report.splitlines() == [
        "GradSync rank 3, launched so far [1, 2]:",
        "  bucket 0: never became ready; no gradient yet for p1, p3, p5, p7",
        "  bucket 1: launched 2.5 s ago, reduction not complete (a peer has not launched it, or cannot)"]
    serial = faults.pending_report(0, [_state(4, None, ready=[False])], [], serial=True)
    assert serial.splitlines()[1] == "  bucket 4: not launched (serial mode launches in finish())"
    unknown = faults.pending_report(0, [_state(5, _Work(completed=False), launch_time=0.0)], [5], serial=False)
    assert "launched nan s ago" in unknown
    many = faults.pending_report(0, [_state(6, None, names[:7], [False] * 7)], [], serial=False)
    assert many.endswith("no gradient yet for p0, p1, p2, p3, p4, p5, ... (7 in all)")   # six names at most


def test_the_failure_names_the_buckets_the_parameters_the_timeout_and_the_cause():
    failed = [_state(2, names=[f"a{i}" for i in range(5)]), _state(4, names=[f"b{i}" for i in range(5)])]
    msg = faults.failure_message(1, failed, 600.0, RuntimeError("boom"), "REPORT")
    assert msg.startswith("GradSync.finish() on rank 1: the all-reduce of bucket(s) [2, 4] did not complete "
                          "(parameters: a0, a1, a2, a3, a4, b0, b1, b2, ... (10 in all))")
    assert "within timeout=600 s" in msg and msg.endswith("Underlying error: boom\nREPORT")


def test_a_list_is_shown_whole_up_to_its_limit():
    assert faults._shown(["a", "b"], 2) == "a, b"
    assert faults._shown(["a", "b", "c"], 2) == "a, b, ... (3 in all)"
