"""A slow network on one CPU machine: a rate-limited loopback in a private network namespace,
or, without root, a simulated link that delays each all-reduce's completion.

On one machine, loopback moves gigabytes per second, so gradient communication is too cheap to
be worth hiding (DESIGN.md section 5). To study overlap on CPU the link must be slow:

- ``netns-tbf`` (root, Linux, ``ip`` and ``tc``): `shaped_namespace` creates a private network
  namespace, brings its loopback up and puts a token-bucket filter (``tc qdisc ... tbf``) on it;
  the ranks run inside it (`run_in_namespace`) and talk over 127.0.0.1 there. Nothing outside
  the namespace is touched, and it is deleted on the way out, exceptions and Ctrl-C included.
  All ranks share that one loopback, so a per-rank link of R Mbit/s needs a tbf of N x R.
- ``simulated`` (anywhere): `SimulatedLink` wraps ``torch.distributed.all_reduce``. The real
  asynchronous all-reduce is launched at once; the work it returns completes no earlier than
  ``latency + wire_bytes / bandwidth`` after launch, and after the previous transfer on the link
  (a link carries one transfer at a time). Waiting happens only in ``wait()`` and the future:
  the launch returns immediately, so compute is never blocked by the simulation.

Wire bytes follow the ring all-reduce: each of N ranks sends ``2 (N-1) / N x bytes``
(`ring_allreduce_bytes`; Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for
clusters of workstations", JPDC 2009).

Commands (as root)::

    python -m hfstream.tools.bench.link check                      # can this machine shape? why not?
    python -m hfstream.tools.bench.link probe --rate-mbit 1000     # all-reduce through a shaped namespace
    python -m hfstream.tools.bench.link probe --simulated --rate-mbit 1000
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

KINDS = ("netns-tbf", "simulated")
_NETNS_DIR = "/run/netns"
_counter = itertools.count()


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: ``2 (N-1) / N x nbytes``."""
    if world_size <= 1:
        return 0.0
    return 2.0 * (world_size - 1) / world_size * nbytes


# ---------------------------------------------------------------------------------------------
# netns-tbf: a private namespace whose loopback has a rate limit
# ---------------------------------------------------------------------------------------------

def _ip(*args: str, timeout_s: float = 10.0, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def namespace_exists(name: str) -> bool:
    """Whether a named network namespace (``ip netns list``) called ``name`` exists."""
    return os.path.exists(os.path.join(_NETNS_DIR, name))


_probe_cache: dict[bool, tuple[bool, str]] = {}


def can_shape(latency: bool = False) -> tuple[bool, str]:
    """Whether `shaped_namespace` can work here, and if not, why.

    Checks Linux, root, the ``ip`` and ``tc`` tools, and then really creates (and deletes) a
    namespace with a tbf on its loopback, because containers often lack the capability or the
    kernel module. The probe runs once per process.

    Args:
        latency: also require the ``netem`` qdisc, which adds delay (``--latency-ms`` > 0).

    Returns:
        ``(True, "ok")`` or ``(False, reason)`` with a reason a user can act on.
    """
    if latency in _probe_cache:
        return _probe_cache[latency]
    if not sys.platform.startswith("linux"):
        result = (False, f"network namespaces need Linux (this is {sys.platform})")
    elif os.geteuid() != 0:
        result = (False, "network namespaces need root (run as root, or use the simulated link)")
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        result = (False, "the `ip` and `tc` tools (iproute2) are not installed")
    elif latency and not can_shape(latency=False)[0]:
        result = can_shape(latency=False)
    else:
        try:
            with shaped_namespace(1000.0, latency_ms=1.0 if latency else 0.0):
                pass
            result = (True, "ok")
        except Exception as exc:   # no CAP_SYS_ADMIN / CAP_NET_ADMIN, no sch_tbf, no sch_netem
            what = "the netem qdisc that adds latency is not available" if latency else "creating a shaped namespace failed"
            result = (False, f"{what}: {exc}")
    _probe_cache[latency] = result
    return result


@contextlib.contextmanager
def shaped_namespace(
    rate_mbit: float,
    latency_ms: float = 0.0,
    burst_kb: int = 256,
    queue_ms: float = 50.0,
    timeout_s: float = 10.0,
) -> Iterator[str]:
    """A fresh network namespace whose loopback is limited to ``rate_mbit``; yields its name.

    The loopback's root qdisc is ``tbf rate RATE burst BURST latency QUEUE``; with
    ``latency_ms > 0`` a ``netem delay`` sits above it (every packet is delayed once, so a
    round trip costs twice that). The namespace is deleted on exit, whatever happens inside;
    processes started in it must be ended first (`run_in_namespace` does that).

    Args:
        rate_mbit: rate of the loopback in Mbit/s, shared by everything in the namespace.
        latency_ms: delay added to every packet (needs the ``sch_netem`` kernel module).
        burst_kb: token-bucket size in KiB. It must exceed the loopback's 64 KiB packets, or
            tbf can never send them.
        queue_ms: how long a packet may wait in the tbf queue before it is dropped.
        timeout_s: limit for each ``ip``/``tc`` command.

    >>> with shaped_namespace(1000) as name:                                    # doctest: +SKIP
    ...     run_in_namespace(name, [sys.executable, "-m", "hfstream.tools.bench.link", "probe"])
    """
    if rate_mbit <= 0:
        raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
    name = f"hfs-{os.getpid()}-{next(_counter)}"
    try:
        # Inside the try: an interrupt right after `ip netns add` must still delete it.
        _ip("netns", "add", name, timeout_s=timeout_s)
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up", timeout_s=timeout_s)
        tc = ["netns", "exec", name, "tc", "qdisc", "add", "dev", "lo"]
        tbf = ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", f"{burst_kb}kb", "latency", f"{queue_ms:g}ms"]
        if latency_ms > 0:
            _ip(*tc, "root", "handle", "1:", "netem", "delay", f"{latency_ms:g}ms", timeout_s=timeout_s)
            _ip(*tc, "parent", "1:", "handle", "2:", *tbf, timeout_s=timeout_s)
        else:
            _ip(*tc, "root", *tbf, timeout_s=timeout_s)
        yield name
    finally:
        if namespace_exists(name):
            _ip("netns", "delete", name, timeout_s=timeout_s, check=False)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)   # the child and everything it spawned (its ranks)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def run_in_namespace(
    name: str,
    cmd: Sequence[str],
    timeout_s: float,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    capture_output: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` inside namespace ``name`` (``ip netns exec NAME CMD``), with a hard timeout.

    The command runs in its own process group; on timeout or interrupt the whole group (the
    command and every process it started) is killed before this returns or raises.

    Args:
        name: a namespace from `shaped_namespace`.
        cmd: the program and its arguments.
        timeout_s: seconds before the group is killed and `subprocess.TimeoutExpired` raised.
        env: the full environment of the command (default: this process's).
        cwd: working directory.
        capture_output: capture stdout/stderr as text instead of passing them through.
    """
    pipe = subprocess.PIPE if capture_output else None
    proc = subprocess.Popen(["ip", "netns", "exec", name, *cmd], env=env, cwd=cwd, stdout=pipe, stderr=pipe,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except BaseException:   # TimeoutExpired, KeyboardInterrupt: nothing may outlive the namespace
        _kill_group(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


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


def _probe_rank(rank: int, world_size: int, nbytes: int, repeats: int, simulated: dict | None) -> dict:
    if simulated:
        with SimulatedLink(**simulated).installed():
            return measure_allreduce(nbytes, repeats)
    return measure_allreduce(nbytes, repeats)


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hfstream.tools.bench.link", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="say whether this machine can run a shaped namespace, and why not")
    probe = sub.add_parser("probe", help="time a gloo all-reduce over a shaped (or simulated) link")
    probe.add_argument("--rate-mbit", type=float, default=1000.0, help="per-rank link rate (default 1000)")
    probe.add_argument("--mb", type=float, default=4.0, help="all-reduce size in MiB (default 4)")
    probe.add_argument("--world-size", type=int, default=2)
    probe.add_argument("--repeats", type=int, default=3)
    probe.add_argument("--simulated", action="store_true", help="use the simulated link, no namespace")
    probe.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)   # already in the namespace
    ns = parser.parse_args(argv)
    if ns.cmd == "check":
        ok, reason = can_shape()
        print(json.dumps({"can_shape": ok, "reason": reason}))
        return 0 if ok else 1
    from hfstream.testing import run_on_ranks

    nbytes = int(ns.mb * 2**20)
    if ns.simulated or ns.inside:
        sim = {"rate_mbit": ns.rate_mbit} if ns.simulated else None
        res = run_on_ranks(_probe_rank, ns.world_size, nbytes, ns.repeats, sim, timeout=120,
                           env={"GLOO_SOCKET_IFNAME": "lo"})
        print(json.dumps(res[0]))
        return 0
    with shaped_namespace(ns.rate_mbit * ns.world_size) as name:   # N ranks share the loopback
        argv2 = [sys.executable, "-m", "hfstream.tools.bench.link", "probe", "--inside", "--mb", str(ns.mb),
                 "--world-size", str(ns.world_size), "--repeats", str(ns.repeats)]
        proc = run_in_namespace(name, argv2, timeout_s=150)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(_main())
