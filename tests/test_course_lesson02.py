"""Lesson 02: the simulated device behaves like PyTorch's streams, events and caching allocator,
and the checks give the hint that names each realistic mistake; right answers pass."""

from __future__ import annotations

import textwrap

import pytest

from course.checks.lesson02 import SimDevice, SimHost
from course.grading import check, run_cell


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSTREAM_COURSE_PROGRESS", str(tmp_path / "progress.json"))


def _failed_with(results, text):
    messages = " | ".join(r.message for r in results if not r.passed)
    assert text in messages, messages
    return messages


# --------------------------------------------------------------------------- the simulator
def test_a_wait_orders_the_read_and_its_absence_is_a_race_whatever_the_timing():
    for wait, races in ((False, 1), (True, 0)):
        sim = SimDevice({"copy": 0.1, "step": 10.0})    # a copy far shorter than anything: still a race
        side = sim.Stream("copy")
        with side:
            x = sim.copy_in(SimHost("b", pinned=True))
        if wait:
            sim.current_stream().wait_stream(side)
        sim.compute("step", x)
        assert len(sim.races) == races, sim.races


def test_an_event_marks_its_point_and_wait_stream_everything_so_far():
    sim = SimDevice()
    compute, side = sim.current_stream(), sim.Stream("copy")
    with side:
        a = sim.copy_in(SimHost("a", pinned=True))
    ev = sim.Event()
    ev.record(side)
    with side:
        sim.copy_in(SimHost("b", pinned=True))
    ev.wait(compute)
    step_a = sim.kernel("step", reads=[a])
    assert step_a.start == 2.0 and not sim.races          # after copy a, not after copy b
    compute.wait_stream(side)
    assert sim.kernel("step", reads=[a]).start == 5.0     # now after copy b too (ends at 4, step a at 5)


def test_an_unrecorded_event_is_complete_and_a_self_wait_orders_nothing():
    sim = SimDevice()
    side = sim.Stream("copy")
    sim.Event().wait(sim.current_stream())                # like torch: no-op
    with side:
        x = sim.copy_in(SimHost("x", pinned=True))
        sim.Event().record()
        side.wait_stream(side)
    sim.compute("step", x)
    assert len(sim.races) == 1


def test_allocator_reuses_a_block_at_once_unless_record_stream_holds_it():
    for record, reused in ((False, True), (True, False)):
        sim = SimDevice()
        compute, comm = sim.current_stream(), sim.Stream("comm")
        b = sim.compute("pack")
        comm.wait_stream(compute)
        with comm:
            sim.kernel("all-reduce", reads=[b], writes=[b])
        if record:
            b.record_stream(comm)
        block = b.block
        b.free()
        c = sim.compute("pack")
        assert (c.block == block) is reused
        assert bool(sim.races) is reused
        # once the host has waited for comm, the held block comes back
        sim.synchronize()
        d = sim.compute("pack")
        assert record is False or d.block == block


def test_pageable_copies_hold_the_host():
    times = {}
    for pinned in (True, False):
        sim = SimDevice()
        side = sim.Stream("copy")
        with side:
            sim.copy_in(SimHost("a", pinned=pinned))
        times[pinned] = sim.kernel("step").start
    assert times[True] == 0.0 and times[False] == 2.0


def test_a_freed_tensor_cannot_be_used():
    sim = SimDevice()
    x = sim.compute("step")
    x.free()
    with pytest.raises(RuntimeError, match="after free"):
        sim.compute("step", x)


# --------------------------------------------------------------------------- 02.order
LOOP = """
from course.checks.lesson02 import SimHost

def prefetch_loop(sim, host_batches, start=None, use=None):
    start, use = start or start_copy, use or consume
    compute = sim.current_stream()
    side = sim.Stream("copy")
    outs, nxt = [], start(sim, side, host_batches[0])
    for i in range(len(host_batches)):
        cur = nxt
        if i + 1 < len(host_batches):
            nxt = start(sim, side, host_batches[i + 1])
        outs.append(use(sim, compute, *cur))
    return outs
"""

ORDER_RIGHT = """
def start_copy(sim, side, host):
    with side:
        x = sim.copy_in(host)
    ready = sim.Event()
    ready.record(side)
    return x, ready

def consume(sim, compute, x, ready):
    ready.wait(compute)
    return sim.compute("step", x)
"""


def _order(source):
    return check("02.order", namespace=run_cell(textwrap.dedent(source) + LOOP), quiet=True)


def test_order_right_answer_passes():
    assert all(r.passed for r in _order(ORDER_RIGHT))


def test_order_without_a_wait():
    _failed_with(_order(ORDER_RIGHT.replace("    ready.wait(compute)\n", "")), "nobody waits on it")


def test_order_with_wait_stream_overwaits():
    wrong = ORDER_RIGHT.replace("    ready.wait(compute)\n", "    compute.wait_stream(sim._streams[1])\n")
    _failed_with(_order(wrong), "waits for everything queued on the side stream so far")


def test_order_with_the_event_recorded_on_the_compute_stream():
    wrong = ORDER_RIGHT.replace("ready.record(side)", "ready.record()")
    _failed_with(_order(wrong), "You recorded the event on the compute stream")


def test_order_with_the_event_recorded_before_the_copy():
    wrong = """
def start_copy(sim, side, host):
    ready = sim.Event()
    ready.record(side)
    with side:
        x = sim.copy_in(host)
    return x, ready

def consume(sim, compute, x, ready):
    ready.wait(compute)
    return sim.compute("step", x)
"""
    _failed_with(_order(wrong), "recorded before the copy was queued")


def test_order_with_a_host_wait():
    wrong = ORDER_RIGHT.replace("ready.wait(compute)", "ready.synchronize()")
    _failed_with(_order(wrong), "the host waited")


# --------------------------------------------------------------------------- 02.lifetime
LIFETIME_RIGHT = """
def reduce_buckets(sim, comm, grads):
    compute = sim.current_stream()
    for g in grads:
        bucket = sim.compute("pack", g)
        comm.wait_stream(compute)
        with comm:
            sim.kernel("all-reduce", reads=[bucket], writes=[bucket])
            sim.kernel("unpack", reads=[bucket], writes=[g])
        bucket.record_stream(comm)
        bucket.free()
    done = sim.Event()
    done.record(comm)
    return done
"""


def _lifetime(source):
    return check("02.lifetime", namespace=run_cell(textwrap.dedent(source)), quiet=True)


def test_lifetime_right_answer_passes():
    assert all(r.passed for r in _lifetime(LIFETIME_RIGHT))


def test_lifetime_without_record_stream():
    _failed_with(_lifetime(LIFETIME_RIGHT.replace("        bucket.record_stream(comm)\n", "")),
                 "nothing told the allocator that the comm stream uses it")


def test_lifetime_recording_the_allocating_stream():
    _failed_with(_lifetime(LIFETIME_RIGHT.replace("bucket.record_stream(comm)", "bucket.record_stream(compute)")),
                 "record_stream(compute) changes nothing")


def test_lifetime_without_the_comm_wait():
    _failed_with(_lifetime(LIFETIME_RIGHT.replace("        comm.wait_stream(compute)\n", "")),
                 "nothing made the comm stream wait")


def test_lifetime_with_the_event_recorded_too_early():
    wrong = LIFETIME_RIGHT.replace("    done = sim.Event()\n    done.record(comm)\n", "").replace(
        "    compute = sim.current_stream()\n", "    compute = sim.current_stream()\n    done = sim.Event()\n").replace(
        '            sim.kernel("unpack"', '            done.record(comm)\n            sim.kernel("unpack"')
    _failed_with(_lifetime(wrong), "recorded on comm *after* the last unpack")


def test_lifetime_with_the_compute_stream_waiting_for_comm():
    wrong = LIFETIME_RIGHT.replace("bucket.record_stream(comm)", "compute.wait_stream(comm)")
    _failed_with(_lifetime(wrong), "must not wait for comm inside the loop")
