"""Device-agnostic streams and events: one small API over CUDA, XPU, ... without a device string.

Built on ``torch.accelerator``, ``torch.Stream`` and ``torch.Event`` (PyTorch >= 2.6, the
oldest torch hfstream supports), with a fallback through ``torch.get_device_module(device)``
for any piece the installed torch or backend lacks.
The semantics are those of PyTorch's CUDA notes ("CUDA semantics: asynchronous execution,
CUDA streams"): work on one stream runs in order, work on different streams may overlap, and
an event recorded on one stream and waited on by another is the only ordering between them.

Used by ``StreamPrefetcher`` (side stream for host-to-device copies) and, later, by
``GradSync`` (communication stream) and the timeline (timing events).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Union

import torch

DeviceLike = Union[str, int, torch.device, None]

# Stream priorities in PyTorch's convention: 0 is the default, negative is more urgent.
# torch.Stream documents "0 or negative"; torch.cuda.Stream maps out-of-range values to the
# nearest valid one, so -1 asks for the backend's high-priority pool wherever one exists.
PRIORITIES = {"normal": 0, "high": -1}


def default_device() -> torch.device:
    """This rank's accelerator with its index (e.g. ``cuda:1``) if one is available, else CPU.

    The index is the current device once the script (``torch.cuda.set_device``) or Accelerate set
    one; a process left on device 0 that a launcher started with ``LOCAL_RANK`` (torchrun,
    ``accelerate launch``) gets ``LOCAL_RANK`` modulo the device count, as Accelerate's
    ``PartialState`` picks it. Without that, a script that never sets the device would put every
    rank's batches on device 0.
    """
    if not torch.accelerator.is_available():
        return torch.device("cpu")
    dev = torch.accelerator.current_accelerator()
    return torch.device(dev.type, _rank_index(dev.type))


def _rank_index(device_type: str) -> int:
    index = _current_index(device_type)
    local_rank = os.environ.get("LOCAL_RANK")
    if index != 0 or local_rank is None or not local_rank.isdigit():
        return index
    return int(local_rank) % max(1, torch.accelerator.device_count())


def _current_index(device_type: str) -> int:
    for name in ("current_device_index", "current_device_idx"):   # the second is the older name
        fn = getattr(torch.accelerator, name, None)
        if fn is not None:
            return int(fn())
    return int(torch.get_device_module(device_type).current_device())


def bind_thread(device: DeviceLike) -> None:
    """Make ``device`` this thread's current accelerator (nothing on CPU). A new thread starts on
    device 0, and a CUDA call there (an event's wait, a registration) opens a context on device 0:
    about half a GiB of another rank's GPU (torch's own pin-memory thread sets its device first)."""
    dev = torch.device(device)
    if is_accelerator(dev) and dev.index is not None:
        torch.accelerator.set_device_index(dev.index)


def is_accelerator(device: DeviceLike) -> bool:
    """True for a device with streams (CUDA, XPU, ...); False for CPU and meta."""
    return torch.device(device).type not in ("cpu", "meta")


def resolve_device(device: DeviceLike, arg: str = "device") -> torch.device:
    """Turn ``device`` into a usable ``torch.device`` with an index, or raise a clear error.

    Args:
        device: ``None`` (the current accelerator, else CPU), a string, an index or a device.
        arg: the caller's argument name, used in the error message.
    """
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"{arg}={device!r} is not a device; pass a torch.device, a string such as 'cpu' or "
            f"the accelerator's type, or None for the current accelerator"
        ) from exc
    if dev.type == "cpu":
        return dev
    available = default_device()
    if dev.type != available.type:
        raise ValueError(
            f"{arg}={device!r} is not available on this machine (the available device is "
            f"{available}); pass None to use the current accelerator (or CPU), or {str(available)!r}"
        )
    if dev.index is None:
        dev = torch.device(dev.type, _rank_index(dev.type))
    count = torch.get_device_module(dev.type).device_count()
    if dev.index >= count:
        raise ValueError(f"{arg}={device!r} does not exist: this machine has {count} {dev.type} device(s)")
    return dev


def stream_priority(priority: Union[str, int], arg: str = "priority") -> int:
    """Map ``"high"``/``"normal"`` (or a backend integer, lower = more urgent) to a stream priority."""
    if isinstance(priority, bool) or not isinstance(priority, (str, int)):
        raise TypeError(f"{arg} must be 'high', 'normal' or an int (0 or negative), got {priority!r}")
    if isinstance(priority, str):
        if priority not in PRIORITIES:
            raise ValueError(f"{arg}={priority!r} is not one of {sorted(PRIORITIES)}; pass 'high' or 'normal'")
        return PRIORITIES[priority]
    return priority


def new_stream(device: DeviceLike, priority: Union[str, int] = "normal"):
    """A new side stream on ``device`` (an accelerator) with the given priority.

    Raises:
        RuntimeError: when neither ``torch.Stream`` nor the backend's module can make one
            (e.g. Apple MPS: ``torch.mps`` has no ``Stream``); see `has_side_streams`.
    """
    dev = torch.device(device)
    prio = stream_priority(priority)
    if hasattr(torch, "Stream"):
        try:
            return torch.Stream(device=dev, priority=prio)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            pass   # backend without generic-stream support in this torch: use its own class
    try:
        return torch.get_device_module(dev.type).Stream(device=dev, priority=prio)
    except (AttributeError, RuntimeError, TypeError, NotImplementedError) as exc:
        raise RuntimeError(f"{dev.type} has no side streams in this torch ({exc})") from exc


_HAS_STREAMS: dict = {}


def has_side_streams(device: DeviceLike) -> bool:
    """Whether a side stream can be made on ``device`` (tried once per device type, then cached)."""
    dev = torch.device(device)
    if dev.type not in _HAS_STREAMS:
        try:
            new_stream(dev)
            _HAS_STREAMS[dev.type] = True
        except RuntimeError:
            _HAS_STREAMS[dev.type] = False
    return _HAS_STREAMS[dev.type]


def current_stream(device: DeviceLike):
    """The stream that work on ``device`` is issued to right now (per thread)."""
    dev = torch.device(device)
    if hasattr(torch.accelerator, "current_stream"):
        return torch.accelerator.current_stream(dev)
    return torch.get_device_module(dev.type).current_stream(dev)


@contextlib.contextmanager
def use_stream(stream) -> Iterator[None]:
    """Make ``stream`` current on its device inside the block, then restore the previous one.

    Re-entrant and per thread: nested blocks on one stream, and two threads on one shared side
    stream (the prefetchers share theirs), each restore what they replaced.
    """
    # Not ``with stream:``. torch.Stream's own context manager keeps the stream it replaced on
    # the stream object (torch up to about 2.11), so a second entry, from a nested block or
    # another thread, overwrites it and the first exit restores the wrong stream. The device
    # module's ``stream(s)`` (``torch.cuda.stream``, ``torch.xpu.stream``) builds a new context
    # each call, which holds the previous stream itself, and accepts a torch.Stream.
    context = getattr(torch.get_device_module(stream.device.type), "stream", None)
    if context is None:
        with stream:
            yield
        return
    with context(stream):
        yield


def new_event(device: DeviceLike, enable_timing: bool = False):
    """A new event on ``device``; ``enable_timing`` only where ``elapsed_time`` will be read (it costs)."""
    dev = torch.device(device)
    if hasattr(torch, "Event"):
        try:
            return torch.Event(device=dev, enable_timing=enable_timing)
        except (RuntimeError, TypeError):
            pass
    return torch.get_device_module(dev.type).Event(enable_timing=enable_timing)


def wait_event(event, stream) -> None:
    """Make ``stream`` (not the host) wait until ``event`` has completed."""
    stream.wait_event(event)


def record_stream(tensor: torch.Tensor, stream) -> None:
    """Tell the caching allocator that ``tensor`` is used on ``stream``.

    Its memory is then not reused after ``tensor`` is freed until the work queued on ``stream``
    up to that free has finished (PyTorch docs: ``Tensor.record_stream``).
    """
    tensor.record_stream(stream)
