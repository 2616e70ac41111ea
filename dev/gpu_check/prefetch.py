"""Part 3: StreamPrefetcher on copy-heavy batches.

Against a plain pinned ``.to(non_blocking=True)`` loop and a plain synchronous copy, with a matmul
per step as long as the copy; batches intact; the consume loop under ``set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import math
import time

from dev.gpu_check.checks import Checks, part_device, same_memory, synchronize
from dev.gpu_check.syncdebug import sync_debug


def prefetch_sizes(quick: bool, on_cpu: bool) -> dict:
    if on_cpu:
        return dict(mib=4, distinct=2, steps=6, warmup=2, matmul=128)
    if quick:
        return dict(mib=16, distinct=3, steps=16, warmup=3, matmul=2048)
    return dict(mib=64, distinct=4, steps=40, warmup=4, matmul=2048)


def part_prefetch(quick: bool, on_cpu: bool, timeout_s: float) -> dict:
    import torch

    from hfstream import StreamPrefetcher

    size = prefetch_sizes(quick, on_cpu)
    cuda = not on_cpu
    dev = part_device(on_cpu)
    checks = Checks()
    k_distinct, n = size["distinct"], size["steps"]
    nbytes = size["mib"] << 20
    nx = nbytes // 4 * 3 // 4
    ny = nbytes // 4 - nx
    g = torch.Generator().manual_seed(0)
    pageable = [{"x": torch.randn(nx, generator=g), "y": torch.randn(ny, generator=g), "k": k} for k in range(k_distinct)]
    pinned = [{"x": b["x"].pin_memory(), "y": b["y"].pin_memory(), "k": b["k"]} for b in pageable] if cuda else pageable
    # Copies of their own: on CPU ``.to(dev)`` is the source tensor itself, and a batch compared with itself
    # would compare nothing (counted in ``aliased``).
    ref = [{"x": b["x"].clone().to(dev), "y": b["y"].clone().to(dev)} for b in pageable]
    aliased = [0]

    # Calibrate: the copy alone, and a matmul; the step computes about as long as its batch copies.
    def timed(fn, reps: int) -> float:
        if not cuda:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t0) * 1e3 / reps
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    copy_ms = timed(lambda: [pinned[0][k].to(dev, non_blocking=True) for k in ("x", "y")], 5)
    a = torch.randn(size["matmul"], size["matmul"], device=dev)
    c = torch.empty_like(a)
    mm_ms = timed(lambda: torch.matmul(a, a, out=c), 10)
    reps = max(1, round(copy_ms / max(mm_ms, 1e-6)))
    compute_ms = timed(lambda: [torch.matmul(a, a, out=c) for _ in range(reps)], 5)
    bad = torch.zeros((), dtype=torch.int64, device=dev)

    def step(b) -> None:
        for _ in range(reps):
            torch.matmul(a, a, out=c)
        r = ref[b["k"]]
        aliased[0] += same_memory(b["x"], r["x"]) or same_memory(b["y"], r["y"])
        bad.add_((b["x"] != r["x"]).sum())                # checked on the device: no host sync per step
        bad.add_((b["y"] != r["y"]).sum())

    def plain(source, non_blocking: bool, count: int):
        for i in range(count):
            b = source[i % k_distinct]
            yield {"x": b["x"].to(dev, non_blocking=non_blocking), "y": b["y"].to(dev, non_blocking=non_blocking),
                   "k": b["k"]}

    def prefetched(source, count: int):
        return StreamPrefetcher([source[i % k_distinct] for i in range(count)], device=dev, depth=2, time_copies=True)

    variants = {
        "sync_copy": (lambda count: plain(pageable, False, count), False),   # stock: pageable, blocking .to(device)
        "pinned_to": (lambda count: plain(pinned, True, count), False),      # pinned .to(non_blocking) on the compute stream
        "prefetch": (lambda count: prefetched(pinned, count), True),       # StreamPrefetcher, pinned source
        "prefetch_pageable": (lambda count: prefetched(pageable, count), True),   # it pins them itself
    }
    rows: dict[str, dict] = {}
    for name, (make, under_error) in variants.items():
        for _ in make(size["warmup"]):                      # warm-up: allocator, pinned blocks, kernels
            pass
        synchronize(cuda)
        bad.zero_()
        aliased[0] = 0
        order, waits, error = [], [], None
        source = make(n)
        t0 = time.perf_counter()
        with sync_debug("error" if under_error else 0, cuda):
            try:
                it = iter(source)
                for _ in range(n):
                    tw = time.perf_counter()
                    b = next(it)
                    waits.append(time.perf_counter() - tw)
                    step(b)
                    order.append(b["k"])
            except RuntimeError as exc:
                error = str(exc).splitlines()[0]
        synchronize(cuda)
        row = dict(step_ms=(time.perf_counter() - t0) * 1e3 / max(len(order), 1),
                   data_wait_ms=1e3 * sum(waits) / max(len(waits), 1), mismatches=int(bad),
                   order_ok=order == [i % k_distinct for i in range(n)], error=error, steps=len(order))
        if isinstance(source, StreamPrefetcher):
            s = source.stats
            row.update(copies_timed=s.copies_timed, prefetch_data_wait_ms=s.mean_data_wait_ms,
                       copy_gbps=(nbytes / (s.copy_ms_total / s.copies_timed * 1e-3) / 1e9) if s.copies_timed else None)
            source.close()
        rows[name] = row
        row["aliased"] = aliased[0]
        checks.compare(f"{name}: every batch equals its source, in order", len(order) - aliased[0],
                       "batches (elementwise, on the device)", row["mismatches"] == 0 and row["order_ok"] and not aliased[0],
                       f"{row['mismatches']} elements differ, order {'ok' if row['order_ok'] else 'wrong'}, error {error}")
        if under_error and cuda:
            checks.add(f"{name}: consume loop does not sync under set_sync_debug_mode('error')", error is None, error or "")
        if under_error and cuda:
            checks.add(f"{name}: copies timed (device events around each copy)", row.get("copies_timed", 0) > 0)
    if cuda:
        timed = min(rows["prefetch"]["steps"], rows["pinned_to"]["steps"])
        checks.compare("prefetch is not slower than the plain pinned loop", timed, "timed steps each",
                       rows["prefetch"]["step_ms"] <= 1.10 * rows["pinned_to"]["step_ms"],
                       f"{rows['prefetch']['step_ms']:.2f} vs {rows['pinned_to']['step_ms']:.2f} ms per step")

    ideal = max(copy_ms, compute_ms)
    saved = rows["pinned_to"]["step_ms"] - rows["prefetch"]["step_ms"]
    hidden = saved / min(copy_ms, compute_ms) if min(copy_ms, compute_ms) > 0 else math.nan
    gbps = rows["prefetch"].get("copy_gbps")
    summary = [
        f"{size['mib']} MiB/batch, {n} steps: "
        + (f"copy alone {copy_ms:.2f} ms ({nbytes / (copy_ms * 1e-3) / 1e9:.1f} GB/s), " if cuda else "no device copy on CPU, ")
        + f"compute {compute_ms:.2f} ms/step ({reps} matmul{'s' if reps > 1 else ''} {size['matmul']}^2)"
        + (f"; ceiling {ideal:.2f} ms" if cuda else ""),
        "step ms: " + ", ".join(f"{k} {v['step_ms']:.2f}" for k, v in rows.items()),
        "data wait ms/step: " + ", ".join(f"{k} {v['data_wait_ms']:.3f}" for k, v in rows.items()),
        ((f"prefetch copy {gbps:.1f} GB/s on the side stream; " if gbps else "")
         + f"copy hidden {100 * hidden:.0f} % vs pinned loop; batches intact; no host sync under 'error'")
        if cuda else "batches intact (CPU: no copy, no sync checks)",
    ]
    numbers = dict(size, copy_ms=copy_ms, compute_ms=compute_ms, matmuls_per_step=reps, hidden_fraction=hidden,
                   variants=rows)
    return checks.result(summary, numbers)
