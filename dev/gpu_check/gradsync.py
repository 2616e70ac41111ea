"""Part 2: GradSync on 2 ranks over gloo, both on cuda:0.

Gradients equal the single-process mean, buckets are launched from the hooks and packed on a
stream other than the compute stream (the stream current inside the pack, `device_order`), and
the host never waits for the device while forward, backward and the launches run.

What synchronises in a GradSync step (read from ``gradsync/sync.py`` and torch's gloo backend):
the gradient hooks and ``_launch`` only enqueue work (pack on the side stream, events,
``all_reduce(async_op=True)``); the "used" flags go to the device from pinned memory without
blocking (``reduction.write_used_flags``) and come back with one ``.tolist()`` a step in
``all_reduced``, only where a bucket has a parameter unused on this rank (none here); ``finish()`` waits on the host for each bucket's
``Work`` (by design); reading ``GradSync.stats`` waits for its timing events (by design: the
Trainer reads them a step later). On CUDA tensors gloo's ``run()``, on its own worker thread,
calls ``cudaStreamSynchronize`` on its device-to-host copy before reducing on the host.
``set_sync_debug_mode`` is one process-wide switch, so ``"error"`` would fail that worker's
collective; the synchronised step is therefore checked with ``"warn"`` (every sync a Python
thread makes, the autograd thread's hooks included, is recorded with its phase and source line;
gloo's C++ worker only logs) and with a sleep kernel queued ahead of it (the host must get
through forward, backward and every launch while the device still sleeps). ``"error"`` itself
covers what has no collective in flight: a ``no_sync()`` micro-step (here), the prefetcher loop
(part 3), the world-size-1 step (part 4). Each detector is first shown a deliberate ``.item()``
it must catch.

The communication times here are host-side, not the collective's: gloo's future has no CUDA
devices, so the completion callback that records a bucket's end event runs on gloo's thread and
records it on that thread's default stream, which is not ordered after gloo's copy back to the
device. "comm busy/exposed" in this part are labelled so; part 7 measures them on NCCL against
the profiler.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

from dev.gpu_check.checks import Checks, compare_tensors, mlp, mse, part_device, synchronize
from dev.gpu_check.device_order import check_pack_streams, pack_streams
from dev.gpu_check.syncdebug import SyncRecorder, calibrate_sleep, device_sleep, sync_debug


def gradsync_sizes(quick: bool, on_cpu: bool) -> dict:
    if on_cpu:
        return dict(width=128, layers=4, batch=16, steps=3, bucket_mb=0.06)
    if quick:
        return dict(width=512, layers=4, batch=64, steps=3, bucket_mb=1.0)
    return dict(width=1024, layers=6, batch=64, steps=5, bucket_mb=4.0)   # one 4 MiB layer per bucket


def part_gradsync(quick: bool, on_cpu: bool, timeout_s: float) -> dict:
    from hfstream.testing import run_on_ranks

    size = gradsync_sizes(quick, on_cpu)
    ranks = run_on_ranks(_gradsync_rank, 2, size, on_cpu, timeout=max(timeout_s - 10, 20), pg_timeout_s=60)
    checks = Checks()
    for rank, out in enumerate(ranks):
        for name, ok, info in out["checks"]:
            checks.add(f"rank {rank}: {name}", ok, info)
        checks.compared += [(f"rank {rank}: {name}", n, kind) for name, n, kind in out["compared"]]
    sums = [out["param_sum"] for out in ranks]
    checks.compare("both ranks hold the same parameters after the steps", len(sums) - 1, "other rank's parameter sum",
                   math.isclose(sums[0], sums[1], rel_tol=1e-9), f"parameter sums {sums[0]!r} vs {sums[1]!r}")
    n0 = ranks[0]["numbers"]
    summary = [
        f"grads = single-process mean over {n0['steps']} steps (max |diff| {max(o['numbers']['max_grad_diff'] for o in ranks):.1e}, "
        f"MLP {size['layers']}x{size['width']}, {n0['buckets']} buckets of {size['bucket_mb']:g} MiB)",
        f"{n0['launched_in_backward']}/{n0['num_collectives']} buckets launched in backward"
        + (", on the side stream" if n0.get("side_stream") else ("" if on_cpu else ", NOT on a side stream"))
        + f"; comm busy {n0['comm_busy_ms']:.2f} ms, exposed {n0['exposed_comm_ms']:.2f} ms"
        + ("" if on_cpu else " (host-side: gloo's end event is not ordered after its copy back; NCCL in part 7)"),
    ]
    if on_cpu:
        summary.append("sync checks: n/a on CPU")
    else:
        syncs = n0["syncs"]
        summary.append(
            f"no host sync in forward/backward/launch: host ahead of a {n0['sleep_ms']:.0f} ms device sleep after "
            f"{n0['window_ms']:.1f} ms: {'yes' if n0['host_ahead'] else 'NO'}; "
            + "; ".join(f"{p} {len(v)} sync" + ("s" if len(v) != 1 else "") + (f" ({', '.join(sorted(set(v)))})" if v else "")
                        for p, v in syncs.items()))
        summary.append(f"finish() held the host {n0['finish_ms']:.1f} ms (waits for the reductions, by design; gloo's "
                       f"worker waits for its device-to-host copy); no_sync micro-step under 'error': "
                       f"{'clean' if n0['no_sync_error'] is None else 'RAISED'}")
    summary.append(f"sharded: bucket-by-bucket step = the single-process mean's AdamW step with clipping (max |diff| "
                   f"{n0['sharded_ref_diff']:.1e}) and = the one-call step, over {n0['sharded_buckets']} buckets"
                   + ("" if on_cpu else f"; syncs inside the pipelined step: {len(n0['sharded_step_syncs'])}"))
    return checks.result(summary, {f"rank{r}": o["numbers"] for r, o in enumerate(ranks)})


def _gradsync_rank(rank: int, world_size: int, size: dict, on_cpu: bool) -> dict:
    import torch
    import torch.distributed as dist

    from hfstream import GradSync, streams

    cuda = not on_cpu
    dev = part_device(on_cpu)
    if cuda:
        torch.cuda.set_device(dev)
    checks = Checks()
    numbers: dict[str, Any] = {}
    width, batch = size["width"], size["batch"]

    torch.manual_seed(0)
    model = mlp(width, size["layers"]).to(dev)
    ref = mlp(width, size["layers"]).to(dev)
    sync = GradSync(model, bucket_mb=size["bucket_mb"], mode="overlap", timeout=60)
    ref.load_state_dict(model.state_dict())          # rank 0's weights, as GradSync broadcast them
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def data(step: int, r: int):
        g = torch.Generator().manual_seed(7919 * step + r)
        return torch.randn(batch, width, generator=g).to(dev), torch.randn(batch, width, generator=g).to(dev)

    # -- gradients against the single-process mean, stats of each step
    worst, bad, windows = 0.0, [], []
    compared = 0
    stats = None
    compute = streams.current_stream(dev) if cuda else None   # the stream backward writes the gradients on
    packs: list = []
    for step in range(size["steps"]):
        x, y = data(step, rank)
        synchronize(cuda)
        t0 = time.perf_counter()
        with pack_streams(sync, dev) if cuda else contextlib.nullcontext([]) as seen:
            mse(model, x, y).backward()
            windows.append((time.perf_counter() - t0) * 1e3)
            sync.finish()
        packs += seen
        ref.zero_grad(set_to_none=True)
        for r in range(world_size):                     # one process, every rank's batch: the mean to expect
            mse(ref, *data(step, r)).backward()
        for (name, p), rp in zip(model.named_parameters(), ref.parameters()):
            want = rp.grad / world_size
            worst = max(worst, (p.grad - want).abs().max().item())
            compared += 1
            if not torch.allclose(p.grad, want, rtol=1e-4, atol=1e-6):
                bad.append(f"step {step} {name}")
        stats = sync.stats
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.load_state_dict(model.state_dict())
    checks.compare("gradients equal the single-process mean (allclose)", compared, "gradient tensors", not bad,
                   ", ".join(bad[:4]))
    numbers.update(steps=size["steps"], max_grad_diff=worst, buckets=len(sync.buckets),
                   comm_times="host" if not cuda else "host-side (gloo on CUDA: see the module docstring)",
                   num_collectives=stats.num_collectives, launched_in_backward=stats.launched_in_backward,
                   comm_busy_ms=stats.comm_busy_ms, exposed_comm_ms=stats.exposed_comm_ms,
                   bucket_spans=[[i, b - a] for i, a, b in stats.bucket_spans])
    checks.compare("every bucket reduced once per step", stats.num_collectives, "all-reduces",
                   stats.num_collectives == len(sync.buckets) >= 2
               and len(stats.bucket_spans) == stats.num_collectives,
               f"{stats.num_collectives} collectives, {len(stats.bucket_spans)} spans, {len(sync.buckets)} buckets")
    checks.add("buckets launched by the hooks while backward ran", stats.launched_in_backward >= 1,
               f"{stats.launched_in_backward} of {stats.num_collectives}")
    checks.compare("bucket spans are well formed (end after start)", len(stats.bucket_spans), "bucket spans",
                   all(b >= a for _, a, b in stats.bucket_spans))
    if cuda:
        numbers["side_stream"] = check_pack_streams(
            checks, "buckets packed on a stream other than the compute stream (the current stream inside the pack)",
            packs, compute)

    if cuda:
        _gradsync_sync_checks(rank, model, sync, opt, data, dev, windows, checks, numbers)

    numbers["notes"] = list(sync.notes)
    param_sum = float(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().sum())
    sync.close()
    dist.barrier()
    _sharded_pipelined(rank, size, dev, cuda, checks, numbers)
    return {"checks": checks.items, "compared": checks.compared, "numbers": numbers, "param_sum": param_sum}


CLIP = 0.01     # max_norm of the sharded comparison: below the gradients' norm, so that clipping acts


def _sharded_pipelined(rank: int, size: dict, dev, cuda: bool, checks: Checks, numbers: dict) -> None:
    """Sharded mode's bucket-by-bucket step (each gather launched as its slice is stepped): the
    parameters of one process stepping the mean gradient with the unsharded optimizer (the truth),
    the same as the one-call step (a closure makes it one call: another code path, so equal to the
    bit), no host sync in the step, and its schedule: when the optimizer steps the last bucket's
    pieces, the buckets stepped before have their all-gathers launched and not yet waited for
    (``params_pending``, GradSync's own count: a claim about the order of launches, which the
    device's view, part 6, does not replace), where the one-call step has one call and none."""
    import torch
    import torch.distributed as dist

    from hfstream import GradSync

    class RecordingAdamW(torch.optim.AdamW):
        """AdamW that notes, per call of its step, how many all-gathers are launched and not waited for."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.sync, self.calls = None, []

        def step(self, closure=None):
            self.calls.append(len(self.sync.params_pending))
            raw = torch.optim.AdamW.step
            if getattr(raw, "hooked", False):   # patched by torch: the step without its hooks
                raw = raw.__wrapped__
            return raw(self, closure)

    def batch(step: int, r: int):
        g = torch.Generator().manual_seed(7919 * step + r)
        return [torch.randn(size["batch"], size["width"], generator=g).to(dev) for _ in range(2)]

    norms: list[float] = []

    def reference():
        torch.manual_seed(0)
        model = mlp(size["width"], size["layers"]).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        for step in range(size["steps"]):
            for r in range(dist.get_world_size()):
                mse(model, *batch(step, r)).backward()
            for p in model.parameters():
                p.grad.div_(dist.get_world_size())
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()]

    def run(one_call: bool, record: bool):
        torch.manual_seed(0)
        model = mlp(size["width"], size["layers"]).to(dev)
        sync = GradSync(model, bucket_mb=size["bucket_mb"], mode="sharded", timeout=60)
        inner = RecordingAdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        inner.sync = sync
        opt = sync.shard_optimizer(inner)
        syncs, calls = [], []
        for step in range(size["steps"]):
            mse(model, *batch(step, rank)).backward()
            sync.finish()
            sync.clip_grad_norm_(CLIP)
            inner.calls = []
            if record and step == size["steps"] - 1 and cuda:
                with SyncRecorder() as rec:
                    rec.phase("step")
                    opt.step()
                syncs = rec.syncs()["step"]
            elif one_call:
                opt.step(lambda: None)   # with a closure the step runs in one call, the gathers after it
            else:
                opt.step()
            calls.append(inner.calls)
            opt.zero_grad(set_to_none=True)
        sync.wait_for_params()
        params = [p.detach().clone() for p in model.parameters()]
        buckets = len(sync.buckets)
        sync.close()
        return params, buckets, syncs, calls

    piecewise, buckets, syncs, calls = run(one_call=False, record=True)
    whole, _, _, whole_calls = run(one_call=True, record=False)
    # After the first step (its re-plan in the arrival order), the step in several calls (bucket by
    # bucket), the last with the gathers of the buckets before it launched; the one-call step: one
    # call, nothing launched yet.
    later = calls[1:]
    checks.compare("sharded: the buckets stepped before the last have their all-gathers launched (pipelined step)",
                   len(later), "steps",
                   bool(later) and all(len(c) >= 2 and c[-1] >= 1 for c in later),
                   f"gathers launched, not waited for, at each per-bucket step call: {later}")
    checks.add("control: the one-call step (a closure) steps in one call, no gather launched yet",
               all(c == [0] for c in whole_calls[1:]) and len(whole_calls) > 1, f"{whole_calls}")
    truth = reference()
    ref_diff = compare_tensors(checks, "sharded: the bucket-by-bucket step's parameters equal the single-process "
                               "mean's (AdamW, clipping)", piecewise, truth, 1e-6, "parameter tensors")
    compare_tensors(checks, "sharded: the bucket-by-bucket step gives exactly the one-call step's parameters",
                    piecewise, whole, 0.0, "parameter tensors")
    checks.add("sharded: more than one bucket (else bucket by bucket is one call)", buckets >= 2, f"{buckets} buckets")
    checks.add("sharded: clipping acted in every step (the mean gradient's norm above max_norm)",
               bool(norms) and min(norms) > CLIP, f"norms {[round(n, 4) for n in norms]}, max_norm {CLIP}")
    numbers.update(sharded_buckets=buckets, sharded_step_syncs=syncs, sharded_ref_diff=ref_diff)
    if cuda:
        checks.add("sharded: no host sync inside the pipelined step (sync-debug 'warn')", not syncs, f"{syncs}")


def _gradsync_sync_checks(rank, model, sync, opt, data, dev, windows, checks: Checks, numbers: dict) -> None:
    """What synchronises the host in a GradSync step on CUDA (see the module docstring)."""
    import torch

    # The detectors must be able to fail: a deliberate .item() on the main thread and in a grad hook.
    with sync_debug("error", True):
        try:
            torch.ones((), device=dev).item()
            raised = False
        except RuntimeError:
            raised = True
    checks.add("control: set_sync_debug_mode('error') catches a deliberate .item()", raised)
    probe = torch.nn.Linear(4, 1).to(dev)

    def syncing_hook(param) -> None:     # a hook must return None
        param.grad.sum().item()

    handle = probe.weight.register_post_accumulate_grad_hook(syncing_hook)
    with SyncRecorder() as rec:
        rec.phase("main")
        torch.ones((), device=dev).item()
        rec.phase("hook")
        probe(torch.ones(2, 4, device=dev)).sum().backward()
    handle.remove()
    seen = rec.syncs()
    checks.add("control: the 'warn' recorder sees a deliberate .item() on the main thread and in a grad hook",
               len(seen["main"]) >= 1 and len(seen["hook"]) >= 1, f"{seen}")

    # "error" where no collective is in flight: a no_sync() micro-step (hooks only note the gradients).
    x, y = data(1000, rank)
    torch.cuda.synchronize()
    error = None
    with sync_debug("error", True):
        try:
            with sync.no_sync():
                mse(model, x, y).backward()
        except RuntimeError as exc:
            error = str(exc).splitlines()[0]
    numbers["no_sync_error"] = error
    checks.add("no_sync() micro-step (forward, backward, hooks) does not sync under 'error'", error is None, error or "")

    # The synchronised step: recorded per phase, behind a device sleep the host must not wait for.
    cycles_per_ms = calibrate_sleep(dev)
    sleep_ms = min(max(200.0, 20 * max(windows[1:] or windows)), 2000.0)
    x, y = data(1001, rank)
    torch.cuda.synchronize()
    with SyncRecorder() as rec:
        slept = device_sleep(sleep_ms, cycles_per_ms)
        t0 = time.perf_counter()
        rec.phase("forward")
        loss = mse(model, x, y)
        rec.phase("backward+launch")
        loss.backward()
        host_ahead = not slept.query()
        window_ms = (time.perf_counter() - t0) * 1e3
        rec.phase("finish")
        t1 = time.perf_counter()
        sync.finish()
        finish_ms = (time.perf_counter() - t1) * 1e3
        rec.phase("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec.phase("stats read")
        stats = sync.stats
    syncs = rec.syncs()
    numbers.update(sleep_ms=sleep_ms, window_ms=window_ms, host_ahead=host_ahead, finish_ms=finish_ms, syncs=syncs,
                   window_launched_in_backward=stats.launched_in_backward)
    checks.add("forward and backward (with every launch) do not sync the host (sync-debug 'warn')",
               not syncs["forward"] and not syncs["backward+launch"],
               f"forward {syncs['forward']}, backward {syncs['backward+launch']}")
    checks.add("the host got through forward/backward/launch while the device still slept", host_ahead,
               f"{window_ms:.1f} ms of host work behind a {sleep_ms:.0f} ms sleep")
    checks.add("buckets still launched in backward with the device behind", stats.launched_in_backward >= 1,
               f"{stats.launched_in_backward} of {stats.num_collectives}")
