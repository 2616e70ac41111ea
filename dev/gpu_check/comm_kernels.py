"""The profiler's view of the collectives: which device events are NCCL kernels, which are copies,
on which stream each ran, and the step report's communication time against the kernels' time.

On one rank NCCL takes a shortcut: a collective is a device copy (or nothing at all for an in-place
all-reduce), no NCCL kernel runs. A comparison against "the NCCL op's device time" would then time a
memcpy. Here only kernels whose name is NCCL's count, and a comparison that found none fails,
naming the copies it saw instead.
"""

from __future__ import annotations

PROFILE_TOLERANCE = 0.20       # the report's comm time vs the kernels' time, relative ...
PROFILE_FLOOR_MS = 0.10        # ... or absolute, per step, whichever is larger
OPS = ("allreduce", "reducescatter", "allgather", "broadcast", "sendrecv", "reduce")


def nccl_op(name: str) -> str | None:
    """The collective an NCCL kernel's name says it runs (``ncclDevKernel_AllReduce_Sum_f32_RING_LL``:
    ``"allreduce"``), ``"other"`` for another NCCL kernel, None for a kernel that is not NCCL's."""
    flat = name.lower().replace("_", "")
    if not flat.startswith("nccl"):
        return None
    return next((op for op in OPS if op in flat), "other")


def device_events(prof) -> list[tuple[str, str, float, int]]:
    """``(name, "kernel" | "copy", ms, stream)`` for each device-side event a ``torch.profiler.profile``
    recorded (``stream``: the profiler's ``device_resource_id``, the CUDA stream it ran on)."""
    out = []
    for ev in prof.events():
        if str(ev.device_type).rsplit(".", 1)[-1] == "CPU":   # DeviceType.CPU: a host-side op
            continue
        lowered = ev.name.lower()
        kind = "copy" if lowered.startswith(("memcpy", "memset")) else "kernel"
        out.append((ev.name, kind, ev.time_range.elapsed_us() / 1e3, int(getattr(ev, "device_resource_id", -1))))
    return out


def side_stream_kernels(events) -> tuple[int, int, int]:
    """``(compute stream, kernels off it that are not NCCL's, kernels on it)``.

    The compute stream is the one that ran the most kernels (forward and backward); NCCL runs
    its kernels on streams of its own, so what else ran elsewhere was packed on a side stream.
    """
    counts: dict[int, int] = {}
    for name, kind, _, stream in events:
        if kind == "kernel" and nccl_op(name) is None:
            counts[stream] = counts.get(stream, 0) + 1
    if not counts:
        return -1, 0, 0
    compute = max(counts, key=counts.__getitem__)
    return compute, sum(n for s, n in counts.items() if s != compute), counts[compute]


def compare_comm_times(checks, name: str, report_ms: float, events: list[tuple[str, str, float, int]], op: str,
                       collectives_per_step: int, steps: int) -> float | None:
    """Check the report's per-step comm time of ``op`` against the profiler's NCCL ``op`` kernels.

    Counts the kernels compared: none (only copies: NCCL's one-rank shortcut, or no collective ran)
    fails, and so do fewer kernels than the collectives the report says ran. Returns the kernels' ms
    per step (None when there were none).
    """
    kernels = [ms for n, kind, ms, _ in events if kind == "kernel" and nccl_op(n) == op]
    copies = sum(1 for _, kind, _, _ in events if kind == "copy")
    need = collectives_per_step * steps
    if not kernels:
        checks.compare(name, 0, f"NCCL {op} kernels", False,
                       f"the profiler saw no NCCL {op} kernel in {steps} steps ({copies} device copies: NCCL's "
                       f"one-rank shortcut, or no collective ran); the report said {report_ms:.3f} ms a step")
        return None
    per_step = sum(kernels) / max(steps, 1)
    close = abs(report_ms - per_step) <= max(PROFILE_TOLERANCE * per_step, PROFILE_FLOOR_MS)
    enough = len(kernels) >= need
    checks.compare(name, len(kernels), f"NCCL {op} kernels", close and enough,
                   f"report {report_ms:.3f} ms vs kernels {per_step:.3f} ms a step over {steps} steps"
                   + ("" if enough else f"; fewer kernels than the {need} collectives the report counted"))
    return per_step
