"""A slow link on one CPU machine, without root: `SimulatedLink` delays each collective's completion.

On one machine, loopback moves gigabytes per second, so communication is too cheap to be worth
hiding (docs/design.md section 5). To study overlap on CPU the link must be slow: as root,
`hfstream.cli.bench.netns` rate-limits a real loopback; anywhere, `SimulatedLink` wraps the
``torch.distributed`` collectives. The real operation is launched at once; the work it returns
completes no earlier than ``latency + wire_bytes / bandwidth`` after launch, queued after the
transfers before it in the same direction (a full-duplex link: what a rank sends and what it
receives each travel one transfer at a time). Waiting happens only in ``wait()`` and the
future: a launch returns immediately, so compute is never blocked by the simulation.

Wire bytes per rank, for N ranks and a tensor of b bytes (Patarasuk and Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009):

- ``all_reduce``: 2 (N-1) / N x b each way (`ring_allreduce_bytes`);
- ``all_to_all_single`` (a reduce-scatter's transfer): (N-1) / N x b of the input each way;
- ``all_gather_single``: (N-1) / N x b of the gathered output each way;
- ``isend`` / ``irecv``: b, sent or received.

Not modelled: per-message latency inside a ring (a ring's 2 (N-1) steps each pay one; here a
collective pays ``latency_ms`` once), congestion, switches, and the CPU a real network card
would take off the host. `measure_allreduce` times an all-reduce on whatever link the ranks have.

Used by `hfstream bench` (`hfstream.cli.bench.link`) and by the course's lessons 05, 06, 09 and 10.
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
import torch.distributed.distributed_c10d as c10d

# What `SimulatedLink.installed()` routes, by torch.distributed name -> the link's method.
OPS = {"all_reduce": "all_reduce", "all_to_all_single": "all_to_all_single",
       "all_gather_single": "all_gather_single", "all_gather_into_tensor": "all_gather_single",
       "isend": "isend", "irecv": "irecv"}


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: ``2 (N-1) / N x nbytes``."""
    if world_size <= 1:
        return 0.0
    return 2.0 * (world_size - 1) / world_size * nbytes


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


def sleep_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``deadline`` (returns at once if it has)."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


class DelayedWork:
    """What the link's operations return for ``async_op=True``: the real work, finished late.

    ``wait()`` waits for the real operation, then until the simulated completion time;
    ``get_future()`` gives a future completed (by the link's timer thread) at that time, with
    the real result. GradSync uses both; DDP's comm hook uses the future.
    """

    def __init__(self, work, future: torch.futures.Future, done_at: float):
        self._work, self._future, self.done_at = work, future, done_at

    def wait(self, timeout=None) -> bool:
        ok = self._work.wait() if timeout is None else self._work.wait(timeout)
        sleep_until(self.done_at)
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
    """A full-duplex link of ``rate_mbit`` per rank with a per-transfer ``latency_ms``, in wall-clock time.

    A transfer launched at ``t`` that sends ``tx`` and receives ``rx`` wire bytes completes at
    ``max(t, end of the previous transfer in each direction it uses) + latency + max(tx, rx) / rate``,
    or when the real operation completes, whichever is later. Each process simulates its own
    link; the ranks' collectives are matched, so they see the same schedule.

    Args:
        rate_mbit: bandwidth of each rank's link in Mbit/s (10**6 bit/s), each way. May be changed
            between transfers (the course sizes it from the machine's compute as it runs).
        latency_ms: fixed cost of every transfer (one collective), in milliseconds.
        record: keep every transfer in ``events`` (kind, bytes, launch, start, done; perf_counter
            seconds) for a timeline.

    >>> link = SimulatedLink(rate_mbit=1000)                                   # doctest: +SKIP
    >>> with link.installed():          # the collectives of torch.distributed now go through it
    ...     work = dist.all_reduce(t, async_op=True); work.wait()
    """

    def __init__(self, rate_mbit: float, latency_ms: float = 0.0, record: bool = False):
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        if latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {latency_ms}")
        self.rate_mbit, self.latency_ms = float(rate_mbit), float(latency_ms)
        self._free = {"tx": 0.0, "rx": 0.0}    # perf_counter time each direction finishes its queue
        self._lock = threading.Lock()          # hooks may launch from several threads
        self._timer: _Timer | None = None
        self._real: dict[str, Callable] = {}   # the functions installed() replaced, by name
        self.transfers = 0
        self.events: list[dict] | None = [] if record else None

    # -- the model ----------------------------------------------------------------------------
    def wire_s(self, wire_bytes: float) -> float:
        """Seconds ``wire_bytes`` take at the link's rate (no latency)."""
        return wire_bytes * 8 / (self.rate_mbit * 1e6)

    def transfer_s(self, nbytes: float, world_size: int) -> float:
        """Seconds the link needs for one all-reduce of ``nbytes`` on its own."""
        if world_size <= 1:
            return 0.0
        return self.latency_ms / 1e3 + self.wire_s(ring_allreduce_bytes(nbytes, world_size))

    def book(self, kind: str, tx: float, rx: float, nbytes: float) -> float:
        """Book a transfer launched now that sends ``tx`` and receives ``rx`` wire bytes; returns its
        simulated completion (perf_counter seconds)."""
        now = time.perf_counter()
        sides = [side for side, b in (("tx", tx), ("rx", rx)) if b]
        with self._lock:
            start = max([now] + [self._free[s] for s in sides])
            done = start + (self.latency_ms / 1e3 + self.wire_s(max(tx, rx)) if sides else 0.0)
            for s in sides:
                self._free[s] = done
            self.transfers += 1
            if self.events is not None:
                self.events.append({"kind": kind, "bytes": nbytes, "launch": now, "start": start, "done": done})
        return done

    def reserve(self, nbytes: float, world_size: int) -> float:
        """Book an all-reduce of ``nbytes`` launched now; returns its simulated completion."""
        wire = ring_allreduce_bytes(nbytes, world_size)
        return self.book("all_reduce", wire, wire, nbytes)

    # -- the operations (torch.distributed's signatures) ------------------------------------------
    def _fn(self, name: str) -> Callable:
        return self._real.get(name) or getattr(dist, name)

    def _delayed(self, work, done_at: float, async_op: bool):
        if not async_op:
            work.wait()
            sleep_until(done_at)
            return None
        if self._timer is None:
            self._timer = _Timer()
        delayed: torch.futures.Future = torch.futures.Future()

        def on_real_done(fut: torch.futures.Future) -> None:
            # Runs on the backend's thread when the real operation ends; hand the result over at
            # the simulated time (or now, if that has passed) without blocking that thread.
            try:
                value = fut.value()
            except Exception as exc:
                delayed.set_exception(exc)
                return
            self._timer.call_at(done_at, lambda: delayed.set_result(value))

        try:
            work.get_future().add_done_callback(on_real_done)
        except Exception:                 # gloo's point-to-point works have no future
            self._timer.call_at(done_at, lambda: delayed.set_result(None))
        return DelayedWork(work, delayed, done_at)

    @staticmethod
    def _bytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        """``torch.distributed.all_reduce``, completed late."""
        done_at = self.reserve(self._bytes(tensor), dist.get_world_size(group))
        work = self._fn("all_reduce")(tensor, op=op, group=group, async_op=True)
        return self._delayed(work, done_at, async_op)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op: bool = False):
        """``torch.distributed.all_to_all_single``, completed late ((N-1)/N of the input each way)."""
        n = dist.get_world_size(group)
        wire = (n - 1) / n * self._bytes(input)
        done_at = self.book("all_to_all", wire, wire, self._bytes(input))
        work = self._fn("all_to_all_single")(output, input, output_split_sizes, input_split_sizes, group=group,
                                             async_op=True)
        return self._delayed(work, done_at, async_op)

    def all_gather_single(self, output, input, group=None, async_op: bool = False):
        """``torch.distributed.all_gather_single`` (``all_gather_into_tensor``), completed late
        ((N-1)/N of the output each way)."""
        n = dist.get_world_size(group)
        wire = (n - 1) / n * self._bytes(output)
        done_at = self.book("all_gather", wire, wire, self._bytes(output))
        real = self._real.get("all_gather_single") or getattr(dist, "all_gather_single", None) \
            or self._fn("all_gather_into_tensor")
        work = real(output, input, group=group, async_op=True)
        return self._delayed(work, done_at, async_op)

    def isend(self, tensor, dst=None, group=None, tag=0, **kwargs):
        """``torch.distributed.isend``: the tensor's bytes on the sending side."""
        done_at = self.book("send", self._bytes(tensor), 0.0, self._bytes(tensor))
        return self._delayed(self._fn("isend")(tensor, dst, group=group, tag=tag, **kwargs), done_at, True)

    def irecv(self, tensor, src=None, group=None, tag=0, **kwargs):
        """``torch.distributed.irecv``: the tensor's bytes on the receiving side."""
        done_at = self.book("recv", 0.0, self._bytes(tensor), self._bytes(tensor))
        return self._delayed(self._fn("irecv")(tensor, src, group=group, tag=tag, **kwargs), done_at, True)

    # -- installing ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def installed(self, *ops: str) -> Iterator["SimulatedLink"]:
        """Route the named ``torch.distributed`` functions (default: all of `OPS`) through this link
        inside the block.

        Code that calls ``dist.all_reduce`` etc. at run time (GradSync, a DDP comm hook, a learner's
        function) is then delayed, and so is hfstream's sharded all-gather, whose primitive
        `hfstream.gradsync.sharded.collectives` looks up once at import. Code that imported a function
        object before the block (``from torch.distributed import all_reduce``) and DDP's built-in
        C++ reducer are not.
        """
        from hfstream.gradsync.sharded import collectives

        names = tuple(ops) or tuple(OPS)
        unknown = [n for n in names if n not in OPS]
        if unknown:
            raise ValueError(f"SimulatedLink.installed({', '.join(map(repr, unknown))}): it simulates {sorted(OPS)}")
        if self._real:
            raise RuntimeError("this SimulatedLink is already installed")
        saved = [(mod, name, getattr(mod, name)) for mod in (dist, c10d) for name in names if hasattr(mod, name)]
        for mod, name, fn in saved:
            self._real.setdefault(name, fn)
        for mod, name, _ in saved:
            setattr(mod, name, getattr(self, OPS[name]))
        gather = collectives._all_gather
        if {"all_gather_single", "all_gather_into_tensor"} & set(names):
            collectives._all_gather = self.all_gather_single
        try:
            yield self
        finally:
            for mod, name, fn in saved:
                setattr(mod, name, fn)
            collectives._all_gather = gather
            self._real = {}

    def describe(self) -> dict[str, Any]:
        return {"kind": "simulated", "rate_mbit": self.rate_mbit, "latency_ms": self.latency_ms}


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
