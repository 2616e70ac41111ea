"""A step watchdog: a training step that makes no progress is reported, then ended, never left hanging.

Collectives wait on every peer. When a peer dies, gloo and NCCL notice the closed connection;
when a peer is alive but stopped (SIGSTOP, a debugger, a data loader stuck on a network file
system) nothing closes, and on gloo a plain ``Work.wait()`` never returns (a stock Trainer
waits forever: docs/benchmarks.md, "Staying up"). `GradSync.finish` waits with a timeout;
this watchdog covers the rest of the step (forward, backward, a native DDP reduction) in two stages:

1. after ``report_after_s`` inside one step, log, per rank, what the step still waits for
   (`GradSync.pending_report`: buckets that never became ready and the parameters whose
   gradient never arrived, reductions launched but not complete);
2. after ``exit_after_s``, print why and end the process with exit code 124, so the launcher
   (torchrun, accelerate launch, SLURM) sees a failure instead of a job that sits forever.
   NCCL's own watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``) does the same on GPUs.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

EXIT_CODE = 124   # what `timeout(1)` returns: "ran past its limit"


class StepWatchdog:
    """Watches the time spent inside one step, from another thread.

    Args:
        report_after_s: seconds in one step before the report is logged (once per step).
        exit_after_s: seconds in one step before the process exits with `EXIT_CODE`;
            None = never exit, only report.
        describe: returns what the step waits for (called from the watchdog thread).
        rank: this process's rank, for the messages.
        poll_s: how often the thread looks.
    """

    def __init__(self, report_after_s: float, exit_after_s: float | None, describe: Callable[[], str],
                 rank: int = 0, poll_s: float = 0.5):
        if report_after_s <= 0:
            raise ValueError(f"report_after_s={report_after_s!r} must be > 0")
        if exit_after_s is not None and exit_after_s < report_after_s:
            raise ValueError(f"exit_after_s={exit_after_s!r} must be >= report_after_s={report_after_s!r}")
        self.report_after_s, self.exit_after_s = report_after_s, exit_after_s
        self.describe, self.rank, self.poll_s = describe, rank, poll_s
        self._lock = threading.Lock()
        self._step: int | None = None
        self._since = 0.0
        self._reported = False
        self._closed = threading.Event()
        self.reports: list[str] = []          # what was reported, for tests and post-mortems
        self._thread = threading.Thread(target=self._run, name="hfstream-watchdog", daemon=True)
        self._thread.start()

    def begin(self, step: int) -> None:
        with self._lock:
            self._step, self._since, self._reported = step, time.monotonic(), False

    def end(self) -> None:
        with self._lock:
            self._step = None

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2 * self.poll_s + 1)

    def _run(self) -> None:
        while not self._closed.wait(self.poll_s):
            with self._lock:
                step, since, reported = self._step, self._since, self._reported
            if step is None:
                continue
            stuck = time.monotonic() - since
            if stuck >= self.report_after_s and not reported:
                self._report(step, stuck)
            if self.exit_after_s is not None and stuck >= self.exit_after_s:
                self._exit(step, stuck)

    def _message(self, step: int, stuck: float) -> str:
        try:
            detail = self.describe() or "no gradient reduction pending on this rank"
        except Exception as exc:   # a report must never kill the thread that may have to exit
            detail = f"(could not describe the step: {exc!r})"
        return f"hfstream watchdog: rank {self.rank} has been inside step {step} for {stuck:.0f} s.\n{detail}"

    def _report(self, step: int, stuck: float) -> None:
        message = self._message(step, stuck)
        with self._lock:
            if self._step != step:
                return
            self._reported = True
        self.reports.append(message)
        logger.error(message)   # with no handler configured, logging still prints errors to stderr

    def _exit(self, step: int, stuck: float) -> None:
        message = (f"{self._message(step, stuck)}\nhfstream watchdog: no progress for more than "
                   f"{self.exit_after_s:.0f} s (ddp_timeout plus a margin): a peer rank is stopped or gone. "
                   f"Exiting with code {EXIT_CODE} so the launcher sees the failure instead of a hang.")
        print(message, file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(EXIT_CODE)   # a normal exit would join gloo threads blocked on the stopped peer
