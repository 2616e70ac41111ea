"""Part 6: GradSync on a one-rank NCCL group (gloo with ``--on-cpu``), kept active by a test-only switch.

At world size 1 GradSync does nothing (there is nothing to average), so one GPU never runs its
collectives. `one_rank_grad_sync` is the test-only switch: a GradSync subclass that stays active
on a one-rank process group and shards the optimizer into its single slice, so that a real NCCL
collective runs on one device, on the gradient group's high-priority stream. It is defined here,
in the check, and nowhere in the training path (part 5 runs the Trainer on it). Checks:

    overlap   buckets all-reduced from the hooks with the bf16 wire: every gradient is its own
              value rounded to bf16 (not the fp32 original: the control), every bucket's callback
              ran (one span each), launched in backward; on a GPU: every pack on a stream other
              than the compute stream (the stream current inside the pack, and the profiler's
              stream ids), ``finish()`` orders the compute stream after the collectives without
              holding the host (a sleep on the side stream), no host sync in the whole step under
              ``set_sync_debug_mode("error")`` and the host a whole step ahead of a device sleep
    sharded   reduce-scatter in backward, all-gather after the step: parameters equal plain SGD's;
              on a GPU the host reaches the next forward with the gathers still running on the
              device (their works not complete, behind a sleep queued before the step)
    soak      sharded steps (100; 20 with --quick): parameters still equal plain SGD's

What one rank cannot show, and this part therefore does not claim: NCCL on one rank takes a
shortcut (a collective is a device copy, an in-place all-reduce launches nothing), so the mean is
the identity and there is no NCCL kernel to time the report against: the profiler's device events
are classified (`comm_kernels`) and the part says how many copies and NCCL kernels it saw; where
NCCL did run a kernel the report is compared with it, never with a copy. NCCL marks a
collective's future complete when it is queued, so "the future completed" says nothing there:
the device order is checked instead (`device_order`). A default-group collective beside the
gradient group on one rank is a no-op, so two communicators under load are part 7's (two GPUs and
up), as is the report against real NCCL kernels. The high-priority option of the gradient group is
recorded, not checked: reading it back returns what `one_rank_group` set.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
from typing import Any

from dev.gpu_check.checks import Checks, compare_tensors, mlp, mse, part_device, synchronize
from dev.gpu_check.syncdebug import calibrate_sleep, device_sleep, sync_debug

SLEEP_MS = 200.0   # the device sleeps the host must get past (a step of these models takes a few ms)


def one_rank_sizes(quick: bool, on_cpu: bool) -> dict:
    if on_cpu:
        return dict(width=64, layers=3, batch=8, steps=3, soak=10, bucket_mb=0.02, profiled=0)
    if quick:
        return dict(width=2048, layers=4, batch=64, steps=3, soak=20, bucket_mb=16.0, profiled=3)
    return dict(width=4096, layers=6, batch=64, steps=5, soak=100, bucket_mb=32.0, profiled=5)


def one_rank_grad_sync():
    """The test-only GradSync class that stays active on a one-rank process group (see the module docstring)."""
    from hfstream import GradSync
    from hfstream.gradsync.sharded import optim as shard_optim, state as shard_state

    class OneRankGradSync(GradSync):
        """Test-only: GradSync active at world size 1, so its collectives run on one device."""

        @property
        def _active(self) -> bool:
            return self.__dict__.get("_one_rank_active", False)

        @_active.setter
        def _active(self, value: bool) -> None:
            # GradSync.__init__ sets it once, from world_size > 1 (False here): on a group it stays
            # on. Every later assignment (close()) is honoured.
            first = "_one_rank_active" not in self.__dict__
            self.__dict__["_one_rank_active"] = bool(value) or (first and self.process_group is not None)

        def shard_optimizer(self, optimizer):
            # shard_optim leaves the optimizer whole at world size 1; cut it into its one slice instead.
            group_of = shard_optim.check_optimizer(self.hooked_parameters, self.model, optimizer)
            shard_optim._SHARDED[optimizer] = self.reduction
            shard_state.remember_groups(optimizer)
            self.reduction.attach(optimizer, group_of)
            return optimizer

    return OneRankGradSync


@contextlib.contextmanager
def one_rank_world(on_cpu: bool, timeout_s: float):
    """A one-rank default group (NCCL on cuda:0, gloo on CPU) for the block; yields ``(device, timeout)``."""
    import torch
    import torch.distributed as dist

    dev = part_device(on_cpu)
    if not on_cpu:
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=max(30, int(timeout_s)))
    extra = {"device_id": dev} if not on_cpu else {}
    dist.init_process_group("gloo" if on_cpu else "nccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timeout, **extra)
    try:
        yield dev, timeout
    finally:
        # NCCL's is left to the part's child, which writes its result and ends with os._exit: a teardown
        # that hung there would turn a finished part into "timed out". gloo's (tests run parts in-process).
        if on_cpu:
            dist.destroy_process_group()


def one_rank_group(cuda: bool, timeout):
    """The Trainer's gradient group on one rank (`hfstream.trainer.data_parallel.gradient_group` makes none there)."""
    import torch.distributed as dist

    if not cuda:
        return dist.new_group(backend="gloo", timeout=timeout)
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    options._timeout = timeout        # as data_parallel does: new_group warns when the two differ
    return dist.new_group(backend="nccl", pg_options=options, timeout=timeout)


def part_one_rank(quick: bool, on_cpu: bool, timeout_s: float) -> dict:
    with one_rank_world(on_cpu, timeout_s) as (dev, timeout):
        return _run(quick, on_cpu, dev, timeout)


def _run(quick: bool, on_cpu: bool, dev, timeout) -> dict:
    cuda = not on_cpu
    size = one_rank_sizes(quick, on_cpu)
    group = one_rank_group(cuda, timeout)
    checks = Checks()
    numbers: dict[str, Any] = {"size": size, "sleep_ms": SLEEP_MS}
    if cuda:
        try:
            high = bool(group._get_backend(dev).options.is_high_priority_stream)   # private accessor, as comm_streams
        except Exception as exc:   # noqa: BLE001 - recorded, not fatal
            high = f"unreadable ({exc})"
        # Recorded, not checked: this reads back the options set in one_rank_group, not the
        # priority of the stream NCCL created (ProcessGroupNCCL does not expose that stream), so
        # as a check it could not fail.
        numbers["nccl_high_priority_option"] = high
    _overlap(size, dev, group, checks, numbers, cuda)
    _sharded(size, dev, group, checks, numbers, cuda)
    _soak(size, dev, group, checks, numbers, cuda)
    n = numbers
    summary = [
        f"overlap: {n['overlap_collectives']} all-reduces a step on a 1-rank {'NCCL' if cuda else 'gloo'} group, "
        f"{n['overlap_launched_in_backward']} launched in backward; bf16 wire: {n['wire_elements']} gradient "
        f"elements, {n['wire_not_bf16']} not bf16 values, max |diff| to the reference's rounded "
        f"{n['wire_diff']:.1e} (the fp32 reference has {n['wire_control_not_bf16']} that are not)",
        f"sharded: parameters = plain SGD's after {size['steps']} steps (max |diff| {n['sharded_param_diff']:.1e}); "
        f"{n['sharded_collectives']} reduce-scatters and {n['sharded_gathers']} all-gathers a step",
        f"soak: {n['soak_steps']} sharded steps, {n['soak_s']:.1f} s, max |diff| to plain SGD {n['soak_param_diff']:.1e}",
    ]
    if cuda:
        fo = n["finish_order"]
        summary.append(
            f"device order: packs off the compute stream {n['overlap_packs_off_compute']}/{n['overlap_packs']}; "
            f"behind a {SLEEP_MS:.0f} ms side-stream sleep finish() took {fo['finish_ms']:.1f} ms and the compute "
            f"stream after it waited: {'yes' if fo['ordered'] else 'NO'}; at the next forward "
            f"{n['gathers_running']} of {n['gathers_pending']} pending all-gathers still running on the device")
        summary.append(
            f"step under set_sync_debug_mode('error'): overlap {n['overlap_sync_error'] or 'clean'}, sharded "
            f"{n['sharded_sync_error'] or 'clean'}; host a whole step ahead of a {SLEEP_MS:.0f} ms device sleep: "
            f"overlap {'yes' if n['overlap_host_ahead'] else 'NO'}, sharded {'yes' if n['sharded_host_ahead'] else 'NO'}")
        summary.append(f"gradient group's high-priority option: {n['nccl_high_priority_option']} (recorded, not "
                       "checked: reading it back returns what was set)")
        summary.append("profiler, one rank: " + "; ".join(
            f"{op}: {n[f'{op}_nccl_kernels']} NCCL kernels, {n[f'{op}_copies']} copies"
            + (" (NCCL's one-rank shortcut: no kernel to time the report against; part 7 does)"
               if not n[f"{op}_nccl_kernels"] else "") for op in ("allreduce", "reducescatter"))
            + f"; {n['side_stream_kernels']} kernels off the compute stream that are not NCCL's (the packs)")
    else:
        summary.append("device order, sync-debug, device sleep and profiler checks: n/a on CPU")
    return checks.result(summary, numbers)


def _data(step: int, size: dict, dev):
    import torch

    g = torch.Generator().manual_seed(104729 + step)
    x = torch.randn(size["batch"], size["width"], generator=g)
    return x.to(dev), torch.randn(size["batch"], size["width"], generator=g).to(dev)


def _model(size: dict, dev):
    import torch

    torch.manual_seed(0)
    return mlp(size["width"], size["layers"]).to(dev)


def _step(model, sync, opt, x, y) -> None:
    mse(model, x, y).backward()
    sync.finish()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _callbacks_ran(stats) -> bool:
    spans = stats.bucket_spans
    return (len(spans) == stats.num_collectives > 0
            and all(math.isfinite(a) and math.isfinite(b) and b >= a for _, a, b in spans))


def _host_ahead(step, dev, size_ms: float) -> bool:
    """Whether the host gets through ``step()`` while a device sleep queued before it still runs."""
    import torch

    cycles = calibrate_sleep(dev)
    torch.cuda.synchronize()
    slept = device_sleep(size_ms, cycles)
    step()
    ahead = not slept.query()
    torch.cuda.synchronize()
    return ahead


def _no_sync_error(step, cuda: bool) -> str | None:
    with sync_debug("error", cuda):
        try:
            step()
        except RuntimeError as exc:
            return str(exc).splitlines()[0][:200]
    return None


def _host_sync_checks(mode: str, model, sync, opt, size: dict, dev, checks: Checks, numbers: dict) -> None:
    """No host sync in a whole step under ``set_sync_debug_mode("error")``, and the host a step ahead of a device sleep."""
    x, y = _data(999, size, dev)
    error = _no_sync_error(lambda: _step(model, sync, opt, x, y), True)
    numbers[f"{mode}_sync_error"] = error
    checks.add(f"{mode}: no host sync in the whole step under set_sync_debug_mode('error')", error is None, error or "")
    ahead = _host_ahead(lambda: _step(model, sync, opt, x, y), dev, SLEEP_MS)
    numbers[f"{mode}_host_ahead"] = ahead
    checks.add(f"{mode}: the host got through a whole step while the device still slept", ahead)


def _one_rank_profile(model, sync, opt, size: dict, dev, seed: int, op: str, checks: Checks, numbers: dict) -> None:
    """Profile ``size["profiled"]`` steps; count the NCCL kernels and the copies of ``op``. Only NCCL kernels
    are compared with the report (`comm_kernels`); the one-rank shortcut's copies are counted and said.
    Under overlap, the kernels that ran off the compute stream and are not NCCL's (the packs) are counted too."""
    from torch.profiler import ProfilerActivity, profile

    from dev.gpu_check.comm_kernels import compare_comm_times, device_events, nccl_op, side_stream_kernels

    busy = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for k in range(size["profiled"]):
            _step(model, sync, opt, *_data(seed + k, size, dev))
            busy.append(sync.stats.comm_busy_ms)
        synchronize(True)
    events = device_events(prof)
    kernels = sum(1 for name, kind, _, _ in events if kind == "kernel" and nccl_op(name) == op)
    numbers[f"{op}_nccl_kernels"] = kernels
    numbers[f"{op}_copies"] = sum(1 for _, kind, _, _ in events if kind == "copy")
    numbers[f"report_{op}_ms"] = sum(busy) / max(1, len(busy))
    if kernels:   # this NCCL runs a kernel on one rank: then the report must match it
        compare_comm_times(checks, f"one rank: the report's {op} time is the profiler's NCCL kernel time",
                           numbers[f"report_{op}_ms"], events, op, len(sync.buckets), size["profiled"])
    if op == "allreduce":
        compute, off, on = side_stream_kernels(events)
        numbers.update(side_stream_kernels=off, compute_stream_kernels=on, compute_stream_id=compute)
        need = len(sync.buckets) * size["profiled"]
        checks.compare("overlap: the packs ran off the compute stream (profiler stream ids, NCCL's own excluded)",
                       off, "kernels off the compute stream", off >= need,
                       f"at least one a bucket a step: {need}; {on} on the compute stream {compute}")


def _wire_checks(grads, reference, checks: Checks, numbers: dict) -> None:
    """The bf16 wire on one rank: each gradient is its fp32 value rounded to bf16 (the sum over one rank is the
    identity), so every value is a bf16 value; the fp32 reference's are not (the control: else nothing told them apart)."""

    def not_bf16(ts):
        return sum(int((t != t.bfloat16().float()).sum()) for t in ts)

    rounded = [r.bfloat16().float() for r in reference]
    elements = sum(g.numel() for g in grads)
    numbers.update(wire_elements=elements, wire_not_bf16=not_bf16(grads), wire_control_not_bf16=not_bf16(reference))
    checks.compare("overlap: bf16 wire: every gradient after finish() is a bf16 value", elements, "gradient elements",
                   numbers["wire_not_bf16"] == 0 and numbers["wire_control_not_bf16"] > 0,
                   f"{numbers['wire_not_bf16']} are not; of the fp32 reference's, {numbers['wire_control_not_bf16']} "
                   f"are not (the control)")
    # Within one bf16 step of the reference's own rounding: the two backwards may differ in a last fp32 bit,
    # which can move a rounding by one bf16 step, never more.
    worst = max([0.0] + [float(((g - r).abs() - r.abs() * 2.0 ** -7).max()) for g, r in zip(grads, rounded)])
    numbers["wire_diff"] = max([0.0] + [float((g - r).abs().max()) for g, r in zip(grads, rounded)])
    checks.compare("overlap: bf16 wire: gradients equal the reference's rounded to bf16 (within one bf16 step)",
                   len(grads), "gradient tensors", len(grads) == len(reference) and worst <= 0.0,
                   f"max |diff| {numbers['wire_diff']:.1e}")


def _overlap(size, dev, group, checks: Checks, numbers: dict, cuda: bool) -> None:
    import torch

    from hfstream import streams
    from dev.gpu_check.device_order import (check_finish_orders, check_pack_streams, finish_orders,
                                            pack_streams, stream_key)

    model, ref = _model(size, dev), _model(size, dev)
    sync = one_rank_grad_sync()(model, bucket_mb=size["bucket_mb"], mode="overlap", process_group=group, timeout=60,
                                comm_dtype="bf16")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stats, grads, reference = None, [], []
    compute = streams.current_stream(dev) if cuda else None
    for step in range(size["steps"]):
        x, y = _data(step, size, dev)
        with pack_streams(sync, dev) if (cuda and step == size["steps"] - 1) else contextlib.nullcontext([]) as packs:
            mse(model, x, y).backward()
            sync.finish()
        mse(ref, x, y).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]          # the last step's
        reference = [r.grad.detach().clone() for r in ref.parameters()]
        stats = sync.stats
        opt.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    numbers.update(overlap_collectives=stats.num_collectives, overlap_buckets=len(sync.buckets),
                   overlap_launched_in_backward=stats.launched_in_backward, overlap_callbacks=_callbacks_ran(stats))
    checks.compare("overlap: GradSync active on one rank (the test-only switch)", stats.num_collectives,
                   "all-reduces a step", bool(sync.bucket_states), f"{len(sync.bucket_states)} buckets at run time")
    _wire_checks(grads, reference, checks, numbers)
    checks.compare("overlap: every bucket's completion callback ran (one span each)", len(stats.bucket_spans),
                   "bucket spans", _callbacks_ran(stats), f"{stats.num_collectives} collectives")
    checks.add("overlap: buckets launched from the hooks in backward", stats.launched_in_backward >= 1,
               f"{stats.launched_in_backward} of {stats.num_collectives}")
    if cuda:
        numbers.update(overlap_packs=len(packs), overlap_packs_off_compute=sum(1 for s in packs
                                                                         if stream_key(s) != stream_key(compute)))
        check_pack_streams(checks, "overlap: every bucket packed on a stream other than the compute stream "
                           "(the current stream inside the pack)", packs, compute)
        x, y = _data(998, size, dev)
        order = finish_orders(sync, lambda: mse(model, x, y).backward(), dev, SLEEP_MS, calibrate_sleep(dev))
        opt.zero_grad(set_to_none=True)
        numbers["finish_order"] = order
        check_finish_orders(checks, "overlap", order, SLEEP_MS)
        _host_sync_checks("overlap", model, sync, opt, size, dev, checks, numbers)
        numbers["profile_steps"] = size["profiled"]
        _one_rank_profile(model, sync, opt, size, dev, 2000, "allreduce", checks, numbers)
    sync.close()


def _sharded_pair(size, dev, group):
    import torch

    model, ref = _model(size, dev), _model(size, dev)
    sync = one_rank_grad_sync()(model, bucket_mb=size["bucket_mb"], mode="sharded", process_group=group, timeout=60)
    opt = sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    return model, ref, sync, opt, torch.optim.SGD(ref.parameters(), lr=0.01)


def _gathers_at_forward(model, sync, opt, size, dev, checks: Checks, numbers: dict) -> None:
    """The host reaches the next forward with the step's all-gathers still running on the device.

    A sleep queued on the compute stream before the step holds the step's kernels and the gathers
    behind it (NCCL's stream waits for the compute stream when a collective is queued): a host
    that waits for the gathers anywhere between the step and the forward finds none running.
    """
    import torch

    from dev.gpu_check.device_order import check_gathers_running, gathers_running

    cycles = calibrate_sleep(dev)
    x, y = _data(4000, size, dev)
    mse(model, x, y).backward()
    sync.finish()
    torch.cuda.synchronize()
    seen = []
    # Runs before every other pre-hook (GradSync's waits included): what is in flight as the forward begins.
    handle = model.register_forward_pre_hook(lambda _m, _a: seen.append(gathers_running(sync)), prepend=True)
    try:
        device_sleep(SLEEP_MS, cycles)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _step(model, sync, opt, *_data(4001, size, dev))
    finally:
        handle.remove()
    torch.cuda.synchronize()
    numbers.update(gathers_pending=seen[0][0] if seen else 0, gathers_running=len(seen[0][1]) if seen else 0)
    check_gathers_running(checks, "sharded: the host reaches the next forward with the all-gathers still running on "
                          "the device (their works not complete)", seen, len(sync.buckets))


def _sharded(size, dev, group, checks: Checks, numbers: dict, cuda: bool) -> None:
    model, ref, sync, opt, ref_opt = _sharded_pair(size, dev, group)
    stats = None
    for step in range(size["steps"]):
        x, y = _data(step, size, dev)
        _step(model, sync, opt, x, y)
        _step(ref, _NoSync(), ref_opt, x, y)
        stats = sync.stats
    sync.wait_for_params()
    diff = compare_tensors(checks, "sharded: parameters equal plain SGD's (reduce-scatter, slice step, all-gather)",
                           list(model.parameters()), list(ref.parameters()), 1e-5, "parameter tensors")
    numbers.update(sharded_param_diff=diff, sharded_collectives=stats.num_collectives, sharded_gathers=stats.num_all_gathers)
    checks.compare("sharded: every reduce-scatter left a span (its completion callback) and every bucket's "
                   "all-gather was launched after the step",
                   stats.num_collectives, "reduce-scatters",
                   _callbacks_ran(stats) and stats.num_all_gathers == len(sync.buckets),
                   f"{len(stats.bucket_spans)} spans, {stats.num_collectives} reduce-scatters, "
                   f"{stats.num_all_gathers} all-gathers, {len(sync.buckets)} buckets")
    if cuda:
        _gathers_at_forward(model, sync, opt, size, dev, checks, numbers)
        _host_sync_checks("sharded", model, sync, opt, size, dev, checks, numbers)
        _one_rank_profile(model, sync, opt, size, dev, 3000, "reducescatter", checks, numbers)
    sync.close()


class _NoSync:
    """The reference's stand-in for a GradSync: nothing to finish."""

    def finish(self) -> None:
        pass


def _soak(size, dev, group, checks: Checks, numbers: dict, cuda: bool) -> None:
    model, ref, sync, opt, ref_opt = _sharded_pair(size, dev, group)
    t0 = time.perf_counter()
    errors: list[str] = []
    done = 0
    for step in range(size["soak"]):
        x, y = _data(10_000 + step, size, dev)
        try:
            _step(model, sync, opt, x, y)
        except Exception as exc:   # noqa: BLE001 - the table says where it broke
            errors.append(f"step {step}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            break
        _step(ref, _NoSync(), ref_opt, x, y)
        done += 1
    synchronize(cuda)
    numbers.update(soak_steps=done, soak_s=time.perf_counter() - t0, soak_errors=errors)
    checks.add(f"soak: {size['soak']} sharded steps, no error or hang", done == size["soak"] and not errors,
               "; ".join(errors))
    if not errors:
        sync.wait_for_params()
        numbers["soak_param_diff"] = compare_tensors(checks, "soak: parameters still equal plain SGD's",
                                                     list(model.parameters()), list(ref.parameters()), 1e-4,
                                                     "parameter tensors")
    else:
        numbers["soak_param_diff"] = math.nan
    sync.close()
