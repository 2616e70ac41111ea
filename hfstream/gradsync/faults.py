"""Bounded waits, and the reports that say what a stuck or failed step is waiting for.

A collective waits on every peer. A dead peer closes its connection and the wait fails; a
peer that is alive but stopped (SIGSTOP, a debugger, a stuck data loader) closes nothing, and
on gloo a plain ``Work.wait()`` then never returns (measured: docs/benchmarks.md, "Staying
up"). So `wait_in_order` waits with a deadline, and the error names the buckets and the
parameters that did not complete. NCCL enforces the group's timeout with its own watchdog;
there the plain wait is kept, so that the host never blocks on a poll.
"""

from __future__ import annotations

import datetime
import time
from typing import Callable, Sequence

import torch.distributed as dist


def backend_enforces_timeout(group) -> bool:
    """True where the backend ends a collective at the group's timeout by itself (NCCL)."""
    try:
        return "nccl" in str(dist.get_backend(group)).lower()
    except Exception:
        return False


def wait_in_order(states: Sequence, timeout_s: float, enforced_by_backend: bool,
                  on_complete: Callable) -> tuple[list, Exception | None]:
    """Wait for each launched bucket in order; call ``on_complete(st)`` as soon as one is reduced.

    Copying bucket k back while the later buckets are still on the wire leaves only the last
    copy after the last reduction. After the first failure the rest are not waited for.

    Returns:
        ``(failed states, first error)``; ``([], None)`` when every bucket completed.
    """
    failed, error = [], None
    deadline = None if enforced_by_backend else time.monotonic() + timeout_s
    for st in states:
        try:
            if failed:
                raise RuntimeError("not waited for: an earlier bucket failed")
            if deadline is None:
                st.work.wait()
            else:
                left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
                if st.work.wait(timeout=left) is False:
                    raise RuntimeError(f"no result within timeout={timeout_s:.0f} s")
        except Exception as exc:   # a timeout, or a peer that died (connection closed)
            failed.append(st)
            error = error or exc
            continue
        on_complete(st)
    return failed, error


def pending_report(rank: int, states: Sequence, launch_order: Sequence[int], serial: bool) -> str:
    """What the current synchronised step still waits for, on this rank ("" when nothing).

    Buckets whose gradients are not all ready (with the parameters whose hook never fired),
    and buckets launched whose reduction has not completed.
    """
    lines = []
    for st in list(states):
        if st.work is None:
            waiting = [n for n, r in zip(st.plan.names, st.ready) if not r]
            if serial:
                lines.append(f"  bucket {st.plan.index}: not launched (serial mode launches in finish())")
            else:
                lines.append(f"  bucket {st.plan.index}: never became ready; no gradient yet for {_shown(waiting, 6)}")
        elif not st.work.is_completed():
            age = time.perf_counter() - st.launch_time if st.launch_time else float("nan")
            lines.append(f"  bucket {st.plan.index}: launched {age:.1f} s ago, reduction not complete "
                         f"(a peer has not launched it, or cannot)")
    if not lines:
        return ""
    return f"GradSync rank {rank}, launched so far {list(launch_order)}:\n" + "\n".join(lines)


def failure_message(rank: int, failed: Sequence, timeout_s: float, error: Exception | None, report: str) -> str:
    """The error ``finish()`` raises when a reduction did not complete: which, why, what to do."""
    names = [n for st in failed for n in st.plan.names]
    return (
        f"GradSync.finish() on rank {rank}: the all-reduce of bucket(s) {[st.plan.index for st in failed]} "
        f"did not complete (parameters: {_shown(names, 8)}). A peer rank died, stopped, or did not launch the same "
        f"buckets in the same order within timeout={timeout_s:.0f} s: every rank must run the same "
        f"synchronised backward (outside no_sync()) and call finish(); .grad holds partial results. "
        f"Underlying error: {error}\n{report}"
    )


def _shown(names: Sequence[str], limit: int) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")
