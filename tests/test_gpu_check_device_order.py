"""`make gpu-check`'s device-side observations fail when what they observe is broken, on CPU with
stand-ins for the device: a pack on the compute stream, gathers the host waited for before the
forward (or whose works never complete), a finish() that held the host or left the compute stream
unordered, side-stream kernels that all ran on the compute stream, memory that grows or a re-plan
that holds two layouts. What the device itself does (streams, events, NCCL's end events) runs in
`make gpu-check`.
"""

from __future__ import annotations

import types

import pytest
import torch

from hfstream import streams
from dev.gpu_check import device_order
from dev.gpu_check.checks import Checks
from dev.gpu_check.comm_kernels import side_stream_kernels
from dev.gpu_check.memory import MemoryLog, StepMemory, memory_checks


def verdicts(checks: Checks) -> dict[str, bool]:
    return {name: ok for name, ok, _ in checks.items}


# -- a bucket's pack: on which stream ------------------------------------------------------------
def _stream(n: int):
    return types.SimpleNamespace(device="cuda:0", stream_id=n)


COMPUTE, SIDE = _stream(0), _stream(3)


class _Reduction:
    def __init__(self):
        self.packed = []

    def pack(self, st, stream):
        self.packed.append(st)


def _packs(monkeypatch, current) -> list:
    """Two buckets packed while ``current`` is the current stream; what `pack_streams` saw."""
    monkeypatch.setattr(streams, "current_stream", lambda device: current)
    sync = types.SimpleNamespace(reduction=_Reduction())
    with device_order.pack_streams(sync, "cuda:0") as seen:
        sync.reduction.pack("b0", SIDE)
        sync.reduction.pack("b1", SIDE)
    assert sync.reduction.packed == ["b0", "b1"] and "pack" not in vars(sync.reduction)   # the method is back
    return seen


def test_packs_on_the_side_stream_pass_and_packs_on_the_compute_stream_fail(monkeypatch):
    good = Checks()
    assert device_order.check_pack_streams(good, "packs", _packs(monkeypatch, _stream(3)), COMPUTE)
    assert good.compared == [("packs", 2, "bucket packs")]
    on_compute = Checks()                                  # GradSync without a side stream packs where backward ran
    assert not device_order.check_pack_streams(on_compute, "packs", _packs(monkeypatch, _stream(0)), COMPUTE)
    assert "2 on the compute stream" in on_compute.items[0][2]
    nothing = Checks()
    assert not device_order.check_pack_streams(nothing, "packs", [], COMPUTE)


def test_a_stream_is_known_by_its_device_and_id_whatever_its_wrapper():
    s = torch.Stream(device="cpu")
    twin = types.SimpleNamespace(device=s.device, stream_id=s.stream_id)   # torch.cuda.Stream never == torch.Stream
    assert device_order.stream_key(s) == device_order.stream_key(twin)
    assert device_order.stream_key(_stream(3)) != device_order.stream_key(_stream(0))


# -- finish(): the host not held, the compute stream ordered --------------------------------------
@pytest.mark.parametrize("result,failing", [
    (dict(host_free=True, ordered=True, control=True, finish_ms=0.3), set()),
    (dict(host_free=False, ordered=True, control=True, finish_ms=200.0), {"host"}),   # finish() waited on the host
    (dict(host_free=True, ordered=False, control=True, finish_ms=0.3), {"order"}),    # no stream wait for the comm
    (dict(host_free=True, ordered=True, control=False, finish_ms=0.3), {"order"}),    # an event that never completes
])
def test_finish_order_fails_when_the_host_is_held_or_the_compute_stream_does_not_wait(result, failing):
    c = Checks()
    device_order.check_finish_orders(c, "overlap", result, 200.0)
    (host, host_ok), (order, order_ok) = verdicts(c).items()
    assert "host not held" in host and "waits for every bucket's collective" in order
    assert {k for k, ok in (("host", host_ok), ("order", order_ok)) if not ok} == failing


# -- the all-gathers when the forward starts --------------------------------------------------------
class _Work:
    def __init__(self, done: bool):
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def _sharded_sync(pending: list[int], works: dict[int, _Work]):
    states = [types.SimpleNamespace(plan=types.SimpleNamespace(index=i),
                                    shard=types.SimpleNamespace(gather=works.get(i))) for i in range(3)]
    return types.SimpleNamespace(params_pending=pending, reduction=types.SimpleNamespace(states=states))


def test_gathers_running_counts_the_pending_works_the_device_has_not_finished():
    works = {0: _Work(False), 1: _Work(True), 2: _Work(False)}
    pending, running = device_order.gathers_running(_sharded_sync([0, 1], works))
    assert pending == 2 and running == [works[0]]


def test_gathers_at_the_forward_fail_when_the_host_waited_for_them_or_their_works_never_complete():
    def verdict(seen):
        c = Checks()
        device_order.check_gathers_running(c, "gathers", seen, 3)
        return c.items[0][1]

    running = _Work(False)
    seen = [(2, [running])]
    running.done = True                                   # the device finished them later
    assert verdict(seen)
    assert not verdict([(0, [])])                         # the host waited before the forward: nothing pending
    assert not verdict([(2, [])])                         # pending by GradSync's count, finished on the device
    assert not verdict([(2, [_Work(False)])])             # a query that never says complete proves nothing
    assert not verdict([])


# -- the profiler's streams -----------------------------------------------------------------------
def test_side_stream_kernels_are_the_non_nccl_kernels_off_the_compute_stream():
    compute = [("ampere_sgemm", "kernel", 0.1, 7)] * 20 + [("tanh_kernel", "kernel", 0.01, 7)] * 10
    packs = [("vectorized_elementwise_kernel<DivFunctor>", "kernel", 0.01, 13)] * 6
    nccl = [("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 0.2, 21), ("Memcpy DtoD", "copy", 0.01, 21)]
    assert side_stream_kernels(compute + packs + nccl) == (7, 6, 30)
    # GradSync packing on the compute stream: nothing off it but NCCL's own, which does not count.
    on_compute = [(n, k, ms, 7) for n, k, ms, _ in packs]
    assert side_stream_kernels(compute + on_compute + nccl) == (7, 0, 36)
    assert side_stream_kernels([]) == (-1, 0, 0)


# -- memory over a run ----------------------------------------------------------------------------
MiB = 2 ** 20


def _run(steps=12, replans=(1, 3, 6), grow_per_step=0, replan_extra=0, bucket=2 * MiB):
    out = {}
    for s in range(1, steps + 1):
        peak = 100 * MiB + (replan_extra if s in replans else 0)
        out[s] = StepMemory(allocated=60 * MiB + grow_per_step * s, peak=peak + grow_per_step * s, bucket_bytes=bucket)
    return out, list(replans)


def test_memory_that_stays_flat_passes_and_says_what_it_compared():
    c = Checks()
    numbers = memory_checks(c, "memory", *_run())
    assert all(verdicts(c).values()) and c.result([], {})["status"] == "pass"
    assert numbers["steady_step"] == 8 and numbers["last_step"] == 12 and numbers["growth_mib"] == 0
    assert ("memory: every re-plan step's peak within one bucket of steady state's", 3, "re-plan steps") in c.compared


def test_memory_that_grows_a_buffer_a_step_fails():
    c = Checks()
    memory_checks(c, "memory", *_run(grow_per_step=MiB))     # 4 steps after steady state: 4 MiB > a 2 MiB bucket
    failed = {n for n, ok in verdicts(c).items() if not ok}
    assert failed == {"memory: no growth from steady state to the last step (allocated, within one bucket)",
                      "memory: the last step's peak within one bucket of steady state's"}


def test_a_re_plan_that_holds_two_layouts_at_once_fails():
    c = Checks()
    memory_checks(c, "memory", *_run(replan_extra=40 * MiB))   # the old layout alive beside the new one
    failed = {n for n, ok in verdicts(c).items() if not ok}
    assert failed == {"memory: every re-plan step's peak within one bucket of steady state's",
                      "memory: step 1's peak within one bucket of steady state's"}


def test_memory_without_a_steady_state_before_the_last_step_fails():
    c = Checks()
    assert memory_checks(c, "memory", *_run(replans=(1, 11))) == {}
    assert c.result([], {})["status"] == "fail"
    empty = Checks()
    memory_checks(empty, "memory", {}, [])
    assert empty.result([], {})["status"] == "fail"


def test_memory_log_on_cpu_records_nothing():
    log = MemoryLog(torch.device("cpu"))
    log.step_ended(1, 1024)
    assert log.steps == {}
