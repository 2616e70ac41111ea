"""Child processes: each in its own session, killed whole (ranks included) at its time box."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_child(cmd: list[str], timeout_s: float, cwd: str | os.PathLike | None = None,
              env: dict | None = None) -> tuple[int | None, str, float]:
    """Run ``cmd`` in its own session; past ``timeout_s`` kill the whole session.

    Returns ``(exit code or None on timeout, stdout+stderr, seconds)``.
    """
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd, env=env, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        # Also after a normal exit: what the child started (rank processes) goes with it.
        _kill_session(proc.pid)
        if rc is None:
            proc.wait()
        log.seek(0)
        text = log.read().decode(errors="replace")
    return rc, text, time.monotonic() - t0


def _kill_session(pid: int) -> None:
    if not hasattr(os, "killpg"):
        return
    try:
        os.killpg(pid, signal.SIGKILL)   # the child was started with start_new_session: pgid == pid
    except (ProcessLookupError, PermissionError):
        pass


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    return env
