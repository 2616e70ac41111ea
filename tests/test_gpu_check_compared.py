"""`make gpu-check`: every part says what it compared, and fails when it compared nothing.

For each part, a case that makes it fail, run on CPU in this process (or a 2-rank gloo run):
a comparison of zero kernels, NCCL's one-rank shortcut (copies, no kernel), identical objects
compared, a collective that is a no-op at world size 1, a host read inside the step, a corrupted
batch, a run that logged nothing, a missing rank. Nothing here needs a GPU.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dev.gpu_check import multi_rank, one_process, prefetch
from dev.gpu_check.checks import Checks, compare_tensors, same_memory
from dev.gpu_check.comm_kernels import compare_comm_times, nccl_op
from dev.gpu_check.gpu_tests import pytest_part
from dev.gpu_check.syncdebug import host_reads

REPO = Path(__file__).resolve().parents[1]


def failed_names(result: dict) -> list[str]:
    return [name for name, ok, _ in result["checks"] if not ok]


@pytest.fixture
def one_rank_gloo():
    """A one-rank gloo default group in this process (as a world-size-1 run has), destroyed after."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


# -- the bookkeeping: counted comparisons ---------------------------------------------------------
def test_a_comparison_of_nothing_fails_whatever_its_verdict():
    c = Checks()
    assert c.compare("kernels match", 0, "NCCL kernels", True) is False
    r = c.result([], {})
    assert r["status"] == "fail" and r["failed"] == ["kernels match: compared nothing (NCCL kernels)"]
    assert r["compared"] == [["kernels match", 0, "NCCL kernels"]] and r["summary"][0] == "compared: 0 NCCL kernels"


def test_a_part_whose_checks_all_hold_but_compared_nothing_fails():
    c = Checks()
    c.add("steps ran", True)
    r = c.result(["ran"], {})
    assert r["status"] == "fail" and r["summary"][0] == "compared: NOTHING"
    c = Checks()
    c.compare("gradients", 12, "gradient tensors", True)
    assert c.result([], {})["status"] == "pass"


def test_identical_objects_compared_are_no_comparison():
    a = torch.arange(6.0)
    c = Checks()
    compare_tensors(c, "params", [a, a.view(2, 3).reshape(-1)], [a, a], 0.0)      # the same tensor, and a view of it
    r = c.result([], {})
    assert r["status"] == "fail" and r["compared"] == [["params", 0, "tensors"]]
    assert same_memory(a, a[:]) and not same_memory(a, a.clone()) and not same_memory(a[1:], a)
    ok = Checks()
    assert compare_tensors(ok, "params", [a + 1e-7], [a.clone()], 1e-6) <= 1e-6
    assert ok.result([], {})["status"] == "pass"
    short = Checks()
    compare_tensors(short, "params", [a], [a.clone(), a.clone()], 1e-6)       # a tensor left out is no pass
    assert short.result([], {})["status"] == "fail"


# -- the profiler: only NCCL kernels count ---------------------------------------------------------
def test_nccl_kernel_names():
    assert nccl_op("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "allreduce"
    assert nccl_op("ncclKernel_ReduceScatter_RING_LL_Sum_float") == "reducescatter"
    assert nccl_op("ncclDevKernel_AllGather_RING_LL") == "allgather"
    assert nccl_op("Memcpy DtoD (Device -> Device)") is None and nccl_op("void at::native::vectorized") is None


def test_the_one_rank_shortcut_a_copy_for_a_collective_fails_the_comparison():
    events = [("Memcpy DtoD (Device -> Device)", "copy", 0.04, 21)] * 6
    c = Checks()
    assert compare_comm_times(c, "reduce-scatter time", 0.05, events, "reducescatter", 2, 3) is None
    (name, ok, info), = c.items
    assert not ok and "compared nothing" in info and "6 device copies" in info and "one-rank shortcut" in info


def test_the_report_against_nccl_kernels_fails_when_it_differs_or_kernels_are_missing():
    kernels = [("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 1.0, 21)] * 6     # 2 a step over 3 steps
    good = Checks()
    assert compare_comm_times(good, "t", 2.1, kernels, "allreduce", 2, 3) == pytest.approx(2.0)
    assert good.items[0][1] and good.compared == [("t", 6, "NCCL allreduce kernels")]
    far = Checks()
    compare_comm_times(far, "t", 3.0, kernels, "allreduce", 2, 3)                  # 50 % off
    assert not far.items[0][1]
    few = Checks()
    compare_comm_times(few, "t", 2.0, kernels, "allreduce", 4, 3)                 # the report says 12 ran
    assert not few.items[0][1] and "fewer kernels" in few.items[0][2]
    other = Checks()
    compare_comm_times(other, "t", 2.0, kernels, "allgather", 2, 3)               # kernels of another op
    assert not other.items[0][1]


# -- host reads, counted ---------------------------------------------------------------------------
def test_the_host_read_counter_sees_an_item_in_a_gradient_hook_and_counts_what_it_watched():
    lin = torch.nn.Linear(4, 1)
    handle = lin.weight.register_post_accumulate_grad_hook(lambda p: p.grad.sum().item() and None)
    with host_reads("cpu") as watch:
        lin(torch.ones(2, 4)).sum().backward()
    handle.remove()
    assert watch.calls > 0 and len(watch.reads) == 1 and watch.reads[0].startswith("item at ")
    with host_reads("cpu") as idle:
        pass
    c = Checks()
    c.compare("no host read", idle.calls, "torch calls watched", not idle.reads)
    assert c.result([], {})["status"] == "fail"                 # watched nothing: no pass


# -- part 1: the gpu tests -------------------------------------------------------------------------
def test_part_1_on_a_gpu_with_no_test_passed_fails_and_says_it_compared_0():
    r = pytest_part(100, True, runner=lambda cmd, t, cwd=None, env=None: (0, "14 skipped in 0.4s\n", 1.0))
    assert r["status"] == "fail" and r["compared"] == [["gpu tests passed", 0, "tests"]]
    ok = pytest_part(100, True, runner=lambda cmd, t, cwd=None, env=None: (0, "3 passed in 1.0s\n", 1.0))
    assert ok["status"] == "pass" and ok["summary"][0] == "compared: 3 gpu tests passed"


# -- part 2: GradSync on 2 ranks, here at world size 1 where every collective is a no-op -----------
def test_part_2_fails_where_its_collectives_are_no_ops(one_rank_gloo):
    from dev.gpu_check.gradsync import _gradsync_rank, gradsync_sizes

    out = _gradsync_rank(0, 1, gradsync_sizes(True, True), True)
    checks = dict((n, ok) for n, ok, _ in out["checks"])
    counts = {n: k for n, k, _ in out["compared"]}
    assert checks["every bucket reduced once per step"] is False and counts["every bucket reduced once per step"] == 0
    assert checks["gradients equal the single-process mean (allclose)"]   # the math still holds: compared, not counted as run


# -- part 3: prefetch ------------------------------------------------------------------------------
def test_part_3_fails_on_a_corrupted_batch(monkeypatch):
    import hfstream

    class Corrupting(hfstream.StreamPrefetcher):
        def __iter__(self):
            for i, b in enumerate(super().__iter__()):
                yield {**b, "x": b["x"] + 1} if i == 2 else b

    monkeypatch.setattr(hfstream, "StreamPrefetcher", Corrupting)
    r = prefetch.part_prefetch(True, True, 60)
    assert r["status"] == "fail"
    assert set(failed_names(r)) == {"prefetch: every batch equals its source, in order",
                                    "prefetch_pageable: every batch equals its source, in order"}


def test_part_3_with_no_batch_consumed_compared_nothing(monkeypatch):
    monkeypatch.setattr(prefetch, "prefetch_sizes", lambda quick, on_cpu: dict(mib=1, distinct=2, steps=0, warmup=1,
                                                                               matmul=16))
    r = prefetch.part_prefetch(True, True, 60)
    assert r["status"] == "fail" and all(n == 0 for _, n, _ in r["compared"])


# -- part 4: GradSync at world size 1 --------------------------------------------------------------
def test_part_4_fails_on_a_host_read_in_the_step(monkeypatch):
    import hfstream

    class Reading(hfstream.GradSync):
        def finish(self):
            super().finish()
            next(self.model.parameters()).grad.sum().item()     # a sync on a GPU

    monkeypatch.setattr(hfstream, "GradSync", Reading)
    r = one_process.part_ws1(True, True, 60)
    assert failed_names(r) == ["no host read in a step with GradSync (counted)"]
    assert "item at" in r["failed"][0]


def test_part_4_fails_when_grad_sync_stays_active_at_world_size_1(monkeypatch, one_rank_gloo):
    import hfstream
    from dev.gpu_check.one_rank import one_rank_grad_sync

    monkeypatch.setattr(hfstream, "GradSync", one_rank_grad_sync())   # active on the one-rank default group
    r = one_process.part_ws1(True, True, 60)
    assert "GradSync at world size 1 adds no hook to the model" in failed_names(r)
    assert r["numbers"]["hooks_added"] > 0


# -- part 5: the Trainer on one rank (tests/test_gpu_check_trainer.py) ------------------------------------------


# -- part 6: one rank ------------------------------------------------------------------------------
def test_part_6_fails_with_the_plain_grad_sync_whose_one_rank_collectives_are_no_ops(monkeypatch):
    from hfstream import GradSync
    from dev.gpu_check import one_rank

    monkeypatch.setattr(one_rank, "one_rank_grad_sync", lambda: GradSync)   # the test-only switch removed
    r = one_rank.part_one_rank(True, True, 60)
    assert r["status"] == "fail"
    assert {"overlap: GradSync active on one rank (the test-only switch)",
            "overlap: every bucket's completion callback ran (one span each)"} <= set(failed_names(r))


def test_part_6_fails_when_the_bf16_wire_is_not_used(monkeypatch):
    from dev.gpu_check import one_rank

    switch = one_rank.one_rank_grad_sync

    def fp32_wire():
        class Fp32Wire(switch()):
            def __init__(self, *args, comm_dtype=None, **kwargs):
                super().__init__(*args, **kwargs)    # comm_dtype dropped: gradients travel in fp32

        return Fp32Wire

    monkeypatch.setattr(one_rank, "one_rank_grad_sync", fp32_wire)
    r = one_rank.part_one_rank(True, True, 60)
    assert failed_names(r) == ["overlap: bf16 wire: every gradient after finish() is a bf16 value"]
    assert r["numbers"]["wire_not_bf16"] > 0


# -- part 7: every GPU -----------------------------------------------------------------------------
def test_part_7_on_one_gpu_is_a_skip_that_says_it_needs_two_never_a_pass():
    r = multi_rank.part_multi_rank(True, False, 60, ranks=1)
    assert r["status"] == "skip" and r["summary"][0].startswith("needs two GPUs: 1 visible")


def _rank(checks: list, compared: list) -> dict:
    return {"checks": checks, "compared": compared, "numbers": {}}


def test_part_7_merge_fails_for_a_missing_rank_and_for_a_rank_that_compared_nothing():
    ok = _rank([["params", True, "18 parameter tensors"]], [["params", 18, "parameter tensors"]])
    merged = multi_rank.merge_ranks([ok, ok], 2, True, True, "spawn")
    assert merged["status"] == "pass"
    missing = multi_rank.merge_ranks([ok, None], 2, True, True, "spawn")
    assert missing["status"] == "fail" and "rank 1 reported" in failed_names(missing)
    crashed = multi_rank.merge_ranks([ok, {"error": "Traceback...\nRuntimeError: NCCL error"}], 2, True, True, "spawn")
    assert crashed["failed"][0] == "rank 1 reported: RuntimeError: NCCL error"
    nothing = _rank([["params", False, "compared nothing"]], [["params", 0, "parameter tensors"]])
    one_empty = multi_rank.merge_ranks([ok, nothing], 2, True, True, "spawn")
    assert one_empty["status"] == "fail" and one_empty["compared"] == [["params", 0, "parameter tensors"]]


def test_part_7_on_one_rank_compares_nothing_across_ranks_and_fails(one_rank_gloo):
    class OneProcess:                     # what accelerate gives one process: gather is the tensor itself
        device = torch.device("cpu")

        @staticmethod
        def gather(t):
            return t

    out = multi_rank.run_rank(OneProcess(), multi_rank.multi_rank_sizes(True, True), False,
                              datetime.timedelta(seconds=30))
    bad = {n for n, ok, _ in out["checks"] if not ok}
    assert {"overlap: every rank holds bitwise the same parameters",
            "overlap: every bucket all-reduced once a step, launched in backward",
            "sharded: the forward starts with the all-gathers launched and not waited for (params_pending at its "
            "first pre-hook)",
            "two groups: WORLD's gather ran while the gradient group's all-gathers were launched and not waited for "
            "(params_pending)"} <= bad


@pytest.mark.multiprocess
def test_part_7_dry_run_on_2_gloo_ranks_under_torchrun(tmp_path):
    out = tmp_path / "part.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", multi_rank.LAUNCHER_ENV: "torchrun"}
    proc = subprocess.run([sys.executable, "-m", "dev.gpu_check", "--on-cpu", "--quick", "--parts",
                           "multirank", "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (part,) = json.loads(out.read_text())["parts"]
    assert part["status"] == "pass" and part["numbers"]["launcher"] == "torchrun" and part["numbers"]["world"] == 2
    counts = {name: n for name, n, _ in part["compared"]}
    assert counts["overlap: every rank holds bitwise the same parameters"] == 1
    assert counts["sharded: the forward starts with the all-gathers launched and not waited for (params_pending "
                  "at its first pre-hook)"] >= 1
    assert counts["two groups: WORLD's gather ran while the gradient group's all-gathers were launched and not "
                  "waited for (params_pending)"] >= 1


def test_device_events_keep_the_device_side_and_tell_kernels_from_copies():
    import types

    from torch.autograd import DeviceType

    from dev.gpu_check.comm_kernels import device_events

    def ev(name, device, us, stream):
        return types.SimpleNamespace(name=name, device_type=device, device_resource_id=stream,
                                     time_range=types.SimpleNamespace(elapsed_us=lambda: us))

    prof = types.SimpleNamespace(events=lambda: [
        ev("nccl:all_reduce", DeviceType.CPU, 900.0, 1234),                # the host-side op: not a kernel
        ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", DeviceType.CUDA, 500.0, 21),
        ev("Memcpy DtoD (Device -> Device)", DeviceType.CUDA, 40.0, 21)])
    assert device_events(prof) == [("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 0.5, 21),
                                   ("Memcpy DtoD (Device -> Device)", "copy", 0.04, 21)]


def test_part_7_profiler_comparison_on_a_run_with_no_nccl_kernel_fails(one_rank_gloo):
    """The profiled steps on CPU (gloo: no device kernel at all): every comparison compared nothing."""
    from hfstream import GradSync

    size = dict(multi_rank.multi_rank_sizes(True, True), profiled=2)
    ctx = dict(rank=0, world=1, dev=torch.device("cpu"), cuda=False, size=size, group=None)
    model, _ = multi_rank._models(ctx)
    sync = GradSync(model, bucket_mb=size["bucket_mb"], mode="overlap")
    checks, numbers = Checks(), {}
    multi_rank._profile(ctx, model, sync, multi_rank._sgd(model.parameters()), 0, checks, numbers,
                        {"allreduce": ("comm_busy_ms", 2)})
    sync.close()
    (name, ok, info), = checks.items
    assert not ok and "compared nothing (NCCL allreduce kernels)" in info and numbers["kernel_allreduce_ms"] is None


def test_part_7_runs_the_torchrun_of_this_python_only(tmp_path, monkeypatch):
    bindir, other = tmp_path / "bin", tmp_path / "elsewhere"
    bindir.mkdir()
    other.mkdir()
    python = bindir / "python"
    python.write_text("")
    monkeypatch.setattr(sys, "executable", str(python))
    monkeypatch.delenv(multi_rank.LAUNCHER_ENV, raising=False)
    torchrun = other / "torchrun"
    monkeypatch.setenv("PATH", str(other))
    torchrun.write_text("#!/usr/bin/some-other-python\n")
    torchrun.chmod(0o755)                                              # shutil.which finds executables only
    assert multi_rank.launcher_command(8) is None                      # another python's torch: spawn instead
    torchrun.write_text(f"#!{python}\nimport sys\n")
    assert multi_rank.launcher_command(8) == [str(torchrun), "--standalone", "--nnodes", "1", "--nproc_per_node", "8"]
    beside = bindir / "torchrun"
    beside.write_text("")
    assert multi_rank.launcher_command(2)[0] == str(beside)
    monkeypatch.setenv(multi_rank.LAUNCHER_ENV, "spawn")
    assert multi_rank.launcher_command(2) is None
