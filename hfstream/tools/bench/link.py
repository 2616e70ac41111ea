"""A slow link on one CPU machine, without root: `SimulatedLink` delays each all-reduce's completion.

On one machine, loopback moves gigabytes per second, so gradient communication is too cheap to
be worth hiding (docs/design.md section 5). To study overlap on CPU the link must be slow: as
root, `hfstream.tools.bench.netns` rate-limits a real loopback; anywhere, `SimulatedLink` wraps
``torch.distributed.all_reduce``. The real asynchronous all-reduce is launched at once; the
work it returns completes no earlier than ``latency + wire_bytes / bandwidth`` after launch, and
after the previous transfer on the link (a link carries one transfer at a time). Waiting
happens only in ``wait()`` and the future: the launch returns immediately, so compute is never
blocked by the simulation.

Wire bytes follow the ring all-reduce: each of N ranks sends ``2 (N-1) / N x bytes``
(`ring_allreduce_bytes`; Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for
clusters of workstations", JPDC 2009). `measure_allreduce` times an all-reduce on whatever link
the ranks have.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: ``2 (N-1) / N x nbytes``."""
    if world_size <= 1:
        return 0.0
    return 2.0 * (world_size - 1) / world_size * nbytes


# ---------------------------------------------------------------------------------------------
# simulated: completion of each all-reduce delayed to what the link would allow
# ---------------------------------------------------------------------------------------------

class _Timer:
    """One daemon thread that runs callbacks at given ``time.perf_counter()`` deadlines."""

    def __init__(self):
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="hfstream-simulated-link", daemon=True)
        self._thread.start()

    def call_at(self, deadline: float, fn: Callable[[], None]) -> None:
        with self._cv:
            heapq.heappush(self._heap, (deadline, next(self._seq), fn))
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.perf_counter():
                    timeout = None if not self._heap else self._heap[0][0] - time.perf_counter()
                    self._cv.wait(timeout)
                _, _, fn = heapq.heappop(self._heap)
            fn()   # outside the lock: completing a future runs its callbacks


def _sleep_until(deadline: float) -> None:
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


class _DelayedWork:
    """What `SimulatedLink.all_reduce` returns for ``async_op=True``: the real work, finished late.

    ``wait()`` waits for the real reduction, then until the simulated completion time;
    ``get_future()`` gives a future completed (by the link's timer thread) at that time, with
    the real result. GradSync uses both; DDP's comm hook uses the future.
    """

    def __init__(self, work, future: torch.futures.Future, done_at: float):
        self._work, self._future, self.done_at = work, future, done_at

    def wait(self, timeout=None) -> bool:
        ok = self._work.wait() if timeout is None else self._work.wait(timeout)
        _sleep_until(self.done_at)
        return ok

    def is_completed(self) -> bool:
        return self._work.is_completed() and time.perf_counter() >= self.done_at

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def get_future(self) -> torch.futures.Future:
        return self._future


class SimulatedLink:
    """A link of ``rate_mbit`` per rank with a per-transfer ``latency_ms``, in wall-clock time.

    A reduction of ``nbytes`` launched at ``t`` completes at
    ``max(t, end of the previous transfer) + latency + ring_allreduce_bytes(nbytes, N) / rate``,
    or when the real reduction completes, whichever is later. Each process simulates its own
    link; the ranks' collectives are matched, so they see the same schedule.

    Args:
        rate_mbit: bandwidth of each rank's link in Mbit/s (10**6 bit/s).
        latency_ms: fixed cost of every transfer (one collective), in milliseconds.

    >>> link = SimulatedLink(rate_mbit=1000)                                   # doctest: +SKIP
    >>> with link.installed():          # torch.distributed.all_reduce now goes through the link
    ...     work = dist.all_reduce(t, async_op=True); work.wait()
    """

    def __init__(self, rate_mbit: float, latency_ms: float = 0.0):
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        if latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {latency_ms}")
        self.rate_mbit, self.latency_ms = float(rate_mbit), float(latency_ms)
        self._free_at = 0.0                    # perf_counter time the link finishes its queue
        self._lock = threading.Lock()          # hooks may launch from several threads
        self._timer: _Timer | None = None
        self._original: Callable | None = None
        self.transfers = 0

    def transfer_s(self, nbytes: float, world_size: int) -> float:
        """Seconds the link needs for one all-reduce of ``nbytes`` on its own."""
        if world_size <= 1:
            return 0.0
        return self.latency_ms / 1e3 + ring_allreduce_bytes(nbytes, world_size) * 8 / (self.rate_mbit * 1e6)

    def reserve(self, nbytes: float, world_size: int) -> float:
        """Book a transfer launched now; returns its simulated completion (perf_counter s)."""
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + self.transfer_s(nbytes, world_size)
            self.transfers += 1
            return self._free_at

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        """Same signature and result as ``torch.distributed.all_reduce``, completed late."""
        real = self._original or dist.all_reduce
        world_size = dist.get_world_size(group)
        done_at = self.reserve(tensor.numel() * tensor.element_size(), world_size)
        work = real(tensor, op=op, group=group, async_op=True)
        if not async_op:
            work.wait()
            _sleep_until(done_at)
            return None
        if self._timer is None:
            self._timer = _Timer()
        delayed: torch.futures.Future = torch.futures.Future()

        def on_real_done(fut: torch.futures.Future) -> None:
            # Runs on the backend's thread when the real reduction ends; hand the result over
            # at the simulated time (or now, if that has passed) without blocking that thread.
            try:
                value = fut.value()
            except Exception as exc:
                delayed.set_exception(exc)
                return
            self._timer.call_at(done_at, lambda: delayed.set_result(value))

        work.get_future().add_done_callback(on_real_done)
        return _DelayedWork(work, delayed, done_at)

    @contextlib.contextmanager
    def installed(self) -> Iterator["SimulatedLink"]:
        """Route ``torch.distributed.all_reduce`` through this link inside the block.

        Code that calls ``dist.all_reduce`` (GradSync, a DDP comm hook) is then delayed; code
        that imported the function object before the block (``from torch.distributed import
        all_reduce``) and DDP's built-in C++ reducer are not.
        """
        if self._original is not None:
            raise RuntimeError("this SimulatedLink is already installed")
        self._original = dist.all_reduce
        dist.all_reduce = self.all_reduce
        try:
            yield self
        finally:
            dist.all_reduce = self._original
            self._original = None

    def describe(self) -> dict[str, Any]:
        return {"kind": "simulated", "rate_mbit": self.rate_mbit, "latency_ms": self.latency_ms}


# ---------------------------------------------------------------------------------------------
# measuring a link: what an all-reduce of a known size costs on it
# ---------------------------------------------------------------------------------------------

def measure_allreduce(nbytes: int, repeats: int = 3) -> dict[str, float]:
    """Time ``repeats`` all-reduces of ``nbytes`` (float32) on the default group, after one
    warm-up; returns the median seconds and the per-rank rate it implies (ring wire bytes)."""
    world_size = dist.get_world_size()
    t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    dist.all_reduce(t)   # warm-up: connections, buffers
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    med = sorted(times)[len(times) // 2]
    wire = ring_allreduce_bytes(t.numel() * 4, world_size)
    return {"bytes": t.numel() * 4, "seconds": med, "effective_rate_mbit": wire * 8 / med / 1e6 if med > 0 else 0.0}
