"""A rate-limited loopback in a private network namespace (root, Linux, ``ip`` and ``tc``).

`shaped_namespace` creates a network namespace, brings its loopback up and puts a token-bucket
filter (``tc qdisc ... tbf``) on it; the ranks run inside it (`run_in_namespace`) and talk over
127.0.0.1 there. Nothing outside the namespace is touched, and it is deleted on the way out,
exceptions and Ctrl-C included. All ranks share that one loopback, so a per-rank link of
R Mbit/s needs a tbf of N x R. Without root, `hfstream.cli.bench.link.SimulatedLink` stands in.

Commands (as root)::

    python -m hfstream.cli.bench.netns check                      # can this machine shape? why not?
    python -m hfstream.cli.bench.netns probe --rate-mbit 1000     # all-reduce through a shaped namespace
    python -m hfstream.cli.bench.netns probe --simulated --rate-mbit 1000
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from typing import Iterator, Sequence

_NETNS_DIR = "/run/netns"
_counter = itertools.count()


def gloo_loopback_env(inside_namespace: bool) -> dict[str, str]:
    """Environment that makes gloo's ranks talk over the loopback, ``lo``.

    Without ``GLOO_SOCKET_IFNAME`` gloo uses the address the hostname resolves to, which has no
    route inside a fresh namespace (its only interface is ``lo``, and there is no DNS) and may be
    unreachable in a container. ``lo`` is Linux's name, though: outside a namespace it is set
    only when this machine has it, and otherwise gloo is left to choose.
    """
    if inside_namespace:
        return {"GLOO_SOCKET_IFNAME": "lo"}
    try:
        names = {name for _, name in socket.if_nameindex()}
    except (AttributeError, OSError):   # no if_nameindex on this platform
        names = set()
    return {"GLOO_SOCKET_IFNAME": "lo"} if "lo" in names else {}


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
    ...     run_in_namespace(name, [sys.executable, "-m", "hfstream.cli.bench.netns", "probe"])
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


def _probe_rank(rank: int, world_size: int, nbytes: int, repeats: int, simulated: dict | None) -> dict:
    from .link import SimulatedLink, measure_allreduce

    if simulated:
        with SimulatedLink(**simulated).installed():
            return measure_allreduce(nbytes, repeats)
    return measure_allreduce(nbytes, repeats)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hfstream.cli.bench.netns", description=__doc__.split("\n\n")[0])
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
                           env=gloo_loopback_env(inside_namespace=ns.inside))
        print(json.dumps(res[0]))
        return 0
    with shaped_namespace(ns.rate_mbit * ns.world_size) as name:   # N ranks share the loopback
        argv2 = [sys.executable, "-m", "hfstream.cli.bench.netns", "probe", "--inside", "--mb", str(ns.mb),
                 "--world-size", str(ns.world_size), "--repeats", str(ns.repeats)]
        proc = run_in_namespace(name, argv2, timeout_s=150)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
