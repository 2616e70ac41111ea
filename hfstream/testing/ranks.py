"""Run a function on N gloo processes on this machine: the harness behind every multi-process
test, benchmark worker and course check.

Each rank is a fresh ``spawn``-ed process with one compute thread, the usual launcher
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and,
unless told otherwise, an initialised gloo process group. A hard timeout turns a hang into a
failure that names the ranks still running, and every child is killed before this returns.

    >>> from hfstream.testing import run_on_ranks
    >>> run_on_ranks(my_module.check_allreduce, world_size=2)   # doctest: +SKIP
    [result_of_rank0, result_of_rank1]

The function must be importable by name (defined at module level): spawn pickles it by
reference, which is also why notebooks write the code under test to a file first.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable


class RankFailure(RuntimeError):
    """One or more ranks raised, died or timed out; the message carries their tracebacks."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, local_rank: int | None = None) -> dict[str, str]:
    """The environment `torchrun`/`accelerate launch` would give this rank."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }


def _worker(fn, rank, world_size, port, args, kwargs, init_process_group, pg_timeout_s, extra_env, results):
    os.environ.update(rank_env(rank, world_size, port))
    os.environ.update(extra_env)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if init_process_group:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout_s),
            )
        out = fn(rank, world_size, *args, **kwargs)
        # Plain pickle, not the queue's: torch would share tensors through file descriptors
        # that vanish when this process exits before the parent reads them.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report everything, including SystemExit from a launcher
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 120.0,
    init_process_group: bool = True,
    pg_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo processes.

    Args:
        fn: a module-level function; its return value must be picklable.
        world_size: number of processes (>= 1).
        timeout: seconds for the whole run; past it every rank is killed and
            `RankFailure` names the ranks that had not finished.
        init_process_group: initialise gloo before calling ``fn``. Pass False when ``fn``
            lets Accelerate/Trainer do it from the environment.
        pg_timeout_s: the process group's own timeout, so a collective that never completes
            raises inside the rank instead of waiting forever.
        env: extra environment variables for every rank.

    Returns:
        The per-rank return values, in rank order.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, port, args, kwargs, init_process_group, pg_timeout_s, env or {}, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [r for r in range(world_size) if r not in outputs and r not in errors]
                errors.update({r: f"timed out after {timeout:.0f} s (hung?)" for r in missing})
                break
            try:
                rank, status, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                # A rank that died without reporting (segfault, os._exit, OOM kill).
                for r, p in enumerate(procs):
                    if r not in outputs and r not in errors and p.exitcode not in (None, 0):
                        errors[r] = f"process exited with code {p.exitcode} without reporting"
                continue
            if status == "ok":
                outputs[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
            if status != "ok":
                # Give the peers a moment to fail on their own (their messages help), then stop.
                deadline = min(deadline, time.monotonic() + 5.0)
    finally:
        for p in procs:
            p.join(timeout=2.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    if errors:
        body = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items()))
        raise RankFailure(f"{len(errors)} of {world_size} ranks failed:\n{body}")
    return [outputs[r] for r in range(world_size)]


# --------------------------------------------------------------------------- launcher-level runs
class NodeRun:
    """One launcher invocation ("node") started by `launch_nodes`: its exit code, output and time."""

    def __init__(self, index: int, proc, log_path: str):
        self.index, self.proc, self.log_path = index, proc, log_path
        self.returncode: int | None = None
        self.seconds: float | None = None

    @property
    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def launch_nodes(node_commands: list[list[str]], log_dir: str, env: dict[str, str] | None = None,
                 cwd: str | None = None) -> list[NodeRun]:
    """Start one launcher command per "node" (torchrun/accelerate launch), each in its own session.

    Each node's stdout and stderr go to ``log_dir/node{i}.log``. Call `wait_nodes` to collect
    them and `stop_nodes` to kill whatever is left (the whole session: launcher and workers).
    """
    import subprocess

    os.makedirs(log_dir, exist_ok=True)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    nodes = []
    for i, cmd in enumerate(node_commands):
        log_path = os.path.join(log_dir, f"node{i}.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
                                    start_new_session=True)
        nodes.append(NodeRun(i, proc, log_path))
    for node in nodes:
        node._start = time.monotonic()
    return nodes


def wait_nodes(nodes: list[NodeRun], which: list[int] | None = None, timeout: float = 300.0) -> None:
    """Wait until the nodes in ``which`` (default: all) exit, recording exit code and seconds.

    Raises `RankFailure` (after stopping every node) when they do not exit within ``timeout``.
    """
    which = list(range(len(nodes))) if which is None else which
    deadline = time.monotonic() + timeout
    for i in which:
        node = nodes[i]
        try:
            node.returncode = node.proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            node.seconds = time.monotonic() - node._start
        except Exception:
            stop_nodes(nodes)
            raise RankFailure(f"node {i} did not exit within {timeout:.0f} s (hung?); its log:\n{node.output[-3000:]}")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc); launchers may put workers in groups of their own."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_nodes(nodes: list[NodeRun]) -> None:
    """Kill every process of every node: its session and all descendants (stopped ones too)."""
    import signal

    for node in nodes:
        pids = _descendants(node.proc.pid)
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(node.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            node.proc.wait(timeout=10)
        except Exception:
            pass


def processes_mentioning(marker: str) -> list[int]:
    """PIDs whose command line contains ``marker`` (Linux /proc): finds orphans of a run."""
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            pids.append(int(entry))
    return pids
