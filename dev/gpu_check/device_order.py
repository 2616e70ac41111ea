"""What the device shows about where GradSync's work ran and what waits for what.

Each observes the effect, not GradSync's own bookkeeping (a stream kept in a dict, a future
that NCCL marks complete when the collective is queued, a bucket's phase):

    pack_streams      the stream current while each bucket is packed (the runtime's current stream
                      on the hook's thread, the one the pack's kernels go to), against the compute
                      stream the gradients were written on
    finish_orders     a sleep queued on GradSync's side stream before backward delays every
                      bucket's pack and collective: ``finish()`` must return while it still runs
                      (the host is not held) and an event recorded on the compute stream after
                      ``finish()`` must not be complete (the compute stream waits for every
                      collective); once the device is idle the event completes (the control)
    gathers_running   at the forward's first pre-hook, the all-gathers GradSync has pending and, of
                      those, the ones the device has not finished (``Work.is_completed()``: NCCL
                      queries its end event; gloo: its thread finished)

Each takes its device operations as arguments where a test on CPU needs to stand them in.
"""

from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def pack_streams(sync, device):
    """Inside the block, the stream current at each bucket's pack is appended to the list it yields."""
    from hfstream import streams

    seen: list = []
    reduction = sync.reduction
    pack = reduction.pack

    def watched(st, stream):
        seen.append(streams.current_stream(device))
        return pack(st, stream)

    reduction.pack = watched          # an instance attribute: shadows the strategy's method
    try:
        yield seen
    finally:
        del reduction.pack


def stream_key(stream) -> tuple:
    """What identifies a stream across its Python wrappers (``torch.Stream``, ``torch.cuda.Stream``):
    a ``torch.cuda.Stream`` never compares equal to a ``torch.Stream`` of the same stream."""
    return str(getattr(stream, "device", "")), getattr(stream, "stream_id", id(stream))


def check_pack_streams(checks, name: str, seen: list, compute) -> bool:
    """Every pack ran on a stream that is not ``compute`` (counted: no pack seen fails)."""
    on_compute = sum(1 for s in seen if stream_key(s) == stream_key(compute))
    return checks.compare(name, len(seen), "bucket packs", on_compute == 0,
                          f"{on_compute} on the compute stream" + (f" ({compute})" if on_compute else ""))


def finish_orders(sync, backward, device, sleep_ms: float, cycles_per_ms: float) -> dict:
    """Run ``backward()`` and ``sync.finish()`` behind a sleep on GradSync's side stream (see the module docstring).

    Returns ``host_free`` (the sleep still ran when ``finish()`` returned), ``ordered`` (an event
    on the compute stream after ``finish()`` was not complete then), ``control`` (it was once
    the device was idle) and ``finish_ms`` (the host's time in ``finish()``).
    """
    import torch

    from hfstream import streams
    from dev.gpu_check.syncdebug import device_sleep

    side = sync._comm_streams.get(device)          # GradSync's side stream on this device (comm_streams)
    if side is None:
        return dict(host_free=False, ordered=False, control=False, finish_ms=float("nan"),
                    why=f"GradSync has no side stream on {device}")
    torch.cuda.synchronize(device)
    with streams.use_stream(side):
        slept = device_sleep(sleep_ms, cycles_per_ms)
    backward()
    # The gradients exist once backward's own kernels have run; the side stream still sleeps.
    torch.cuda.current_stream(device).synchronize()
    t0 = time.perf_counter()
    sync.finish()
    finish_ms = (time.perf_counter() - t0) * 1e3
    after = torch.cuda.Event()
    after.record(torch.cuda.current_stream(device))
    result = dict(host_free=not slept.query(), ordered=not after.query(), finish_ms=finish_ms, why="")
    torch.cuda.synchronize(device)
    result["control"] = after.query()
    return result


def check_finish_orders(checks, mode: str, r: dict, sleep_ms: float) -> None:
    checks.add(f"{mode}: finish() returns while the collectives still wait behind a side-stream sleep (host not held)",
               r["host_free"], f"finish() took {r['finish_ms']:.1f} ms of a {sleep_ms:.0f} ms sleep" + (
                   f"; {r['why']}" if r.get("why") else ""))
    checks.add(f"{mode}: the compute stream after finish() waits for every bucket's collective (device event)",
               r["ordered"] and r["control"],
               f"event after finish(): {'pending' if r['ordered'] else 'COMPLETE'} while the side stream slept, "
               f"{'complete' if r['control'] else 'NOT complete'} once the device was idle")


def gathers_running(sync) -> tuple[int, list]:
    """``(buckets GradSync has pending, the works of those not finished on the device)``; never waits."""
    pending = set(sync.params_pending)
    works = [st.shard.gather for st in sync.reduction.states
             if st.plan.index in pending and st.shard is not None and st.shard.gather is not None]
    return len(pending), [w for w in works if not w.is_completed()]


def check_gathers_running(checks, name: str, seen: list[tuple[int, list]], buckets: int) -> None:
    """``seen``: `gathers_running` at each forward's first pre-hook. Holds when at every one some
    gather was pending and still running on the device, and each of those works completed later
    (the query can say so: the control)."""
    running = [len(r) for _, r in seen]
    later = all(w.is_completed() for _, r in seen for w in r)
    checks.compare(name, len(seen), "forwards after a step", bool(seen) and min(running, default=0) >= 1 and later,
                   f"pending {[p for p, _ in seen]}, running on the device {running} of {buckets} buckets; "
                   f"every one complete once the device was idle: {'yes' if later else 'NO'}")
