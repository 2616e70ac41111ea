"""How a part sees the host wait for the device.

``set_sync_debug_mode("error")`` where no collective is in flight; ``"warn"`` recorded per phase
(:class:`SyncRecorder`) where one is; and a sleep kernel queued ahead of the work, which the host
must get past while the device still sleeps. Each is imported lazily: torch only when used.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

SYNC_WARNING = "synchronizing CUDA operation"    # torch's sync-debug message


def sync_debug(mode, cuda: bool):
    """``torch.cuda.set_sync_debug_mode(mode)`` inside the block (nothing on CPU), restored after."""
    if not cuda:
        return contextlib.nullcontext()
    return _sync_debug(mode)


@contextlib.contextmanager
def _sync_debug(mode):
    import torch

    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class SyncRecorder:
    """``set_sync_debug_mode("warn")``, every warning a Python thread gets recorded, tagged by phase.

    torch turns a sync-debug warning raised inside an op called from Python (the main thread, or a
    gradient hook on the autograd thread) into a Python warning attributed to the calling line.
    A C++ thread of its own (gloo's worker) only logs it: it is not the training thread.
    """

    def __init__(self):
        self.records: list = []
        self.marks: list[tuple[str, int]] = []

    def __enter__(self) -> "SyncRecorder":
        import torch

        self._catch = warnings.catch_warnings(record=True)
        self.records = self._catch.__enter__()
        warnings.simplefilter("always")
        self._previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def phase(self, name: str) -> None:
        self.marks.append((name, len(self.records)))

    def __exit__(self, *exc) -> None:
        import torch

        torch.cuda.set_sync_debug_mode(self._previous)
        self._end = len(self.records)
        self._catch.__exit__(*exc)

    def syncs(self) -> dict[str, list[str]]:
        """Per phase, where each sync happened (``file.py:line``)."""
        out = {}
        bounds = [m[1] for m in self.marks[1:]] + [self._end]
        for (name, a), b in zip(self.marks, bounds):
            out[name] = [f"{Path(r.filename).name}:{r.lineno}" for r in self.records[a:b]
                         if SYNC_WARNING in str(r.message)]
        return out


def calibrate_sleep(dev) -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on this GPU."""
    import torch

    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / max(start.elapsed_time(end), 1e-3)


def device_sleep(ms: float, cycles_per_ms: float):
    """Keep the current stream busy for ``ms``; returns an event recorded after it."""
    import torch

    torch.cuda._sleep(int(ms * cycles_per_ms))
    done = torch.cuda.Event()
    done.record()
    return done
