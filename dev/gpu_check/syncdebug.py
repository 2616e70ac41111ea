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


# The tensor methods that hand a tensor's value to the host: on an accelerator each waits for the device.
HOST_READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "nonzero",
                        "equal", "allclose", "is_nonzero", "cpu"})


@contextlib.contextmanager
def host_reads(device_type: str):
    """Inside the block, count the torch calls made (``.calls``) and record every call that reads a tensor
    of ``device_type`` on the host (``.reads``: ``name at file:line``), on any thread.

    The counting twin of ``set_sync_debug_mode("error")``: it also runs on CPU (so the dry run checks
    the same step), and it names the Python line. The reads are seen by wrapping the tensor methods
    in `HOST_READS` on ``torch.Tensor`` for the block (process-wide, so the gradient hooks autograd
    runs are seen too: a ``TorchFunctionMode`` is not active inside backward's hooks); a sync inside a
    C++ op is not seen, which on a GPU the sync-debug mode covers. ``.calls`` (a ``TorchFunctionMode``
    on this thread) is what it watched: zero means it watched nothing.
    """
    import threading
    import traceback

    import torch
    from torch.overrides import TorchFunctionMode

    class Counter(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = 0
            self.reads: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    watch = Counter()

    inside = threading.local()      # the read's own dispatch (through the mode) calls the wrapper again

    def wrap(name, original):
        def reading(self, *args, **kwargs):
            if getattr(inside, "read", False):
                return original(self, *args, **kwargs)
            if self.device.type == device_type and not (name == "cpu" and device_type == "cpu"):
                where = traceback.extract_stack(limit=2)[0]
                watch.reads.append(f"{name} at {Path(where.filename).name}:{where.lineno}")
            inside.read = True
            try:
                return original(self, *args, **kwargs)
            finally:
                inside.read = False
        return reading

    saved = {name: torch.Tensor.__dict__.get(name) for name in HOST_READS if hasattr(torch.Tensor, name)}
    for name in saved:
        setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    try:
        with watch:
            yield watch
    finally:
        for name, own in saved.items():
            if own is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own)
