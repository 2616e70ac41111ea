"""A watchdog over train(): a rank that makes no progress is reported, then ended, never left hanging.

Collectives wait on every peer. When a peer dies, gloo and NCCL notice the closed connection;
when a peer is alive but stopped (SIGSTOP, a debugger, a data loader stuck on a network file
system) nothing closes, and on gloo a plain ``Work.wait()`` never returns (a stock Trainer
waits forever: docs/benchmarks.md, "Staying up"). `GradSync.finish` waits with a timeout;
this watchdog covers the rest of ``train()`` -- forward, backward, a native DDP reduction, the
data loader's and the Trainer's own collectives between steps, evaluation, saving -- in two
stages, counted from the last sign of progress (`watch` marks each phase):

1. after ``report_after_s`` in one phase, log, per rank, where it is and what it waits for
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
    """Watches, from another thread, the time spent in one phase of training without progress.

    ``watch(what)`` marks progress and names the phase ("inside step 5 (...)"); ``idle()``
    stops watching (outside ``train()``); ``begin(step)``/``end()`` are the same for one step.

    Args:
        report_after_s: seconds in one phase before the report is logged (once per phase).
        exit_after_s: seconds in one phase before the process exits with `EXIT_CODE`;
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
        self._what: str | None = None
        self._since = 0.0
        self._reported = False
        self._closed = threading.Event()
        self.reports: list[str] = []          # what was reported, for tests and post-mortems
        self._thread = threading.Thread(target=self._run, name="hfstream-watchdog", daemon=True)
        self._thread.start()

    def watch(self, what: str) -> None:
        """Progress: a new phase begins (``what`` completes "rank r has been ...")."""
        with self._lock:
            self._what, self._since, self._reported = what, time.monotonic(), False

    def idle(self) -> None:
        """Nothing to watch until the next `watch` (e.g. between two ``train()`` calls)."""
        with self._lock:
            self._what = None

    def begin(self, step: int) -> None:
        self.watch(f"inside step {step}")

    def end(self) -> None:
        self.idle()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2 * self.poll_s + 1)

    def _run(self) -> None:
        while not self._closed.wait(self.poll_s):
            with self._lock:
                what, since, reported = self._what, self._since, self._reported
            if what is None:
                continue
            stuck = time.monotonic() - since
            if stuck >= self.report_after_s and not reported:
                self._report(what, since, stuck)
            if self.exit_after_s is not None and stuck >= self.exit_after_s:
                self._exit(what, stuck)

    def _message(self, what: str, stuck: float) -> str:
        try:
            detail = self.describe() or "no gradient reduction pending on this rank"
        except Exception as exc:   # a report must never kill the thread that may have to exit
            detail = f"(could not describe the step: {exc!r})"
        return f"hfstream watchdog: rank {self.rank} has been {what} for {stuck:.0f} s.\n{detail}"

    def _report(self, what: str, since: float, stuck: float) -> None:
        message = self._message(what, stuck)
        with self._lock:
            if self._what != what or self._since != since:
                return   # progress was made meanwhile
            self._reported = True
        self.reports.append(message)
        logger.error(message)   # with no handler configured, logging still prints errors to stderr

    def _exit(self, what: str, stuck: float) -> None:
        message = (f"{self._message(what, stuck)}\nhfstream watchdog: no progress for more than "
                   f"{self.exit_after_s:.0f} s (ddp_timeout plus a margin): a peer rank is stopped or gone. "
                   f"Exiting with code {EXIT_CODE} so the launcher sees the failure instead of a hang.")
        print(message, file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(EXIT_CODE)   # a normal exit would join gloo threads blocked on the stopped peer
