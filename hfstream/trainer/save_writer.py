"""``save_async``'s writer: a process of its own that writes the snapshots, reading them from shared memory.

    arena         `SnapshotBuffers` (save_async.py) allocates the host buffers a snapshot copies into
                  as a few files in /dev/shm, each mapped by both processes: the training process
                  copies into them, the writer reads them. Sent once, reused by every later save.
    write         per save, only the `Write` list crosses, pickled with each tensor named by where it
                  lies (arena, offset, bytes): no tensor data is copied or sent again.
    lifetime      one writer per training process, started at its first save (`writer`); it ends
                  when that process closes its end of the pipe, whether it exits or is killed.

Why a process and not a thread (docs/benchmarks.md, "Thread or process for the writer"): the stock
writes (safetensors' ``save_file`` and ``torch.save``) run Python that takes the training thread's
GIL in short bursts (pickling, a bytes copy per tensor); a step that starts beside a thread writing
one snapshot ran 6-18 % longer on this 2-core host, beside this process 0 % (a forked one: +106 %,
the fork and the copies of every page the optimizer writes after it). A subprocess started with
``python -c`` (not ``multiprocessing``): nothing of the user's script runs again in it, whether or
not it guards its ``__main__``, and its end of the pipe closes when the training process dies.

Where the writer cannot be used (no /dev/shm, not enough free there, a write function that cannot
be pickled, a writer that would not start), the snapshot is written by a thread of the training
process, as before, and the trainer says so once.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
import types
from typing import Any

import torch

from . import save_tags

SHM_DIR = "/dev/shm"
_HEADER = struct.Struct("<Q")   # each message: its length, then a pickle


class NotShared(Exception):
    """A tensor of the snapshot lies outside the shared arenas: this save is written by a thread."""


class WriterGone(Exception):
    """The writer process ended (killed, crashed, or never started)."""


def shm_free_bytes() -> int | None:
    """Bytes free in /dev/shm, or None where there is none (macOS, Windows)."""
    try:
        st = os.statvfs(SHM_DIR)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def unlink(path: str) -> None:
    """Remove an arena's name, if either process has not already."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _send(stream, obj: Any) -> None:
    data = obj if isinstance(obj, bytes) else pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream) -> bytes | None:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    data = stream.read(n)
    return data if len(data) == n else None


# The writer's command line: Ctrl-C is the training process's to handle (the writer ends when that
# process closes the pipe); its results go to a copy of stdout taken first, whatever it prints to
# stderr; it imports what unpickling a save needs (transformers: training_args.bin) while training begins.
START = ("import os, signal; signal.signal(signal.SIGINT, signal.SIG_IGN); results = os.dup(1); os.dup2(2, 1); "
         "from hfstream.trainer.save_writer import serve; serve(results, preload=True)")

_STR, _TENSOR = 0, 1   # the kinds of persistent id (not strings: pickle would ask for their ids too)


def _interned(s: str) -> bool:
    """Whether ``s`` is the interpreter's interned string of its value (asked with a copy: interning
    ``s`` itself would make it so)."""
    return sys.intern(s.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass")) is s


class _RefPickler(pickle.Pickler):
    """Pickles a tensor that lies in an arena as its place there (`persistent_id`), any other object as pickle does."""

    def __init__(self, file, places):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.places = places   # data_ptr of a buffer's storage -> (arena id, offset, bytes)

    def persistent_id(self, obj):
        if type(obj) is str:
            # The file pickles equal strings once where they are one object (a dict key "cpu" and
            # torch.save's own location "cpu", both interned): an interned string stays interned.
            return (_STR, obj.encode("utf-8", "surrogatepass")) if len(obj) > 1 and _interned(obj) else None
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            # The writer's __main__ is not the script's: it could not find this by name.
            raise NotShared(f"{obj.__qualname__} is defined in the script (__main__), which the writer process "
                            f"does not import")
        if not isinstance(obj, torch.Tensor):
            return None
        storage = obj.untyped_storage()
        if storage.nbytes() == 0:
            return None
        place = self.places.get(storage.data_ptr())
        if place is None:
            raise NotShared(f"a tensor of {storage.nbytes()} bytes outside the shared buffers")
        return (_TENSOR, *place, obj.dtype, obj.storage_offset(), tuple(obj.size()), obj.stride(),
                isinstance(obj, torch.nn.Parameter), obj.requires_grad, save_tags.tag_of(storage.data_ptr()))


class _RefUnpickler(pickle.Unpickler):
    """The writer's side: a tensor's place becomes a tensor on the arena's memory, one storage per buffer."""

    def __init__(self, file, arenas):
        super().__init__(file)
        self.arenas = arenas
        self.storages: dict[tuple[int, int], torch.UntypedStorage] = {}   # one per buffer: files share as stock's do

    def persistent_load(self, pid):
        if pid[0] == _STR:
            return sys.intern(pid[1].decode("utf-8", "surrogatepass"))
        _, arena, offset, nbytes, dtype, storage_offset, size, stride, parameter, requires_grad, tag = pid
        storage = self.storages.get((arena, offset))
        if storage is None:
            buffer = torch.frombuffer(self.arenas[arena], dtype=torch.uint8, count=nbytes, offset=offset)
            storage = self.storages[(arena, offset)] = buffer.untyped_storage()
            save_tags.set_tag(storage.data_ptr(), tag)
        t = torch.empty(0, dtype=dtype).set_(storage, storage_offset, size, stride)
        return torch.nn.Parameter(t, requires_grad=requires_grad) if parameter else t


class WriterProcess:
    """The writer process, seen from the training process. Use `writer` (one per training process).

    ``add_arena`` tells it of a new shared arena, ``encode`` turns a save's `Write` list into a
    message, ``write`` sends one and waits for its result (from the save's own thread, never the
    training thread).
    """

    def __init__(self):
        # It imports what this process imports (the same path, absolute), on one thread.
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(os.path.abspath(p or ".") for p in sys.path))
        self.proc = subprocess.Popen([sys.executable, "-c", START], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env)
        self.pid = os.getpid()      # the training process that started it
        self._lock = threading.Lock()   # arenas are announced from the snapshot's and the preparing thread
        self.places: dict[int, tuple[int, int, int]] = {}   # a buffer's data_ptr -> (arena id, offset, bytes)
        self._arenas = 0
        self._forgotten: list[int] = []   # arenas freed here, said to the writer before the next message

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def ended(self) -> str:
        """Why it cannot write (it ended), for a message."""
        return f"the writer process (pid {self.proc.pid}) ended, exit code {self.proc.poll()}"

    def add_arena(self, path: str, nbytes: int, buffers: list[tuple[torch.Tensor, int]]) -> int:
        """Tell the writer of the arena at ``path`` (it maps the file, then removes its name);
        ``buffers`` are the buffers carved from it, with their offsets."""
        with self._lock:
            arena, self._arenas = self._arenas, self._arenas + 1
            for buffer, offset in buffers:
                self.places[buffer.data_ptr()] = (arena, offset, buffer.numel())
            self._send(("arena", arena, path, nbytes))
        return arena

    def forget(self, arena: int, pointers: list[int]) -> None:
        """The training process freed this arena: the writer unmaps it at the next message. (A finalizer
        calls it, on whatever thread drops the last buffer, perhaps in the middle of a send.)"""
        for p in pointers:
            self.places.pop(p, None)
        self._forgotten.append(arena)

    def release(self) -> None:
        """Tell the writer now of the arenas freed (the end of training: no save may follow)."""
        if self._forgotten and self.alive:
            with self._lock:
                try:
                    self._send(None)
                except WriterGone:
                    pass

    def encode(self, writes: list) -> bytes:
        """The `Write` list as the writer reads it; raises `NotShared`, or what pickle raises for a
        function it cannot name (a closure put in place of ``torch.save``)."""
        out = io.BytesIO()
        _RefPickler(out, self.places).dump(("write", writes))
        return out.getvalue()

    def write(self, message: bytes) -> tuple[tuple[str, str] | None, float]:
        """Send one save's writes, wait for them: (None or (path, why it failed), seconds the writer took)."""
        with self._lock:
            self._send(message)
        data = _receive(self.proc.stdout)   # one result per write; nothing else comes back
        if data is None:
            self.proc.wait()
            raise WriterGone(self.ended)
        _, failure, seconds = pickle.loads(data)
        return failure, seconds

    def _send(self, obj) -> None:
        """``obj`` (None: nothing) after the arenas forgotten since the last message; under ``_lock``."""
        try:
            while self._forgotten:
                _send(self.proc.stdin, ("forget", self._forgotten.pop()))
            if obj is not None:
                _send(self.proc.stdin, obj)
        except (BrokenPipeError, ValueError) as exc:   # its end of the pipe closed: it is ending
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            raise WriterGone(self.ended) from exc


IN_WRITER = False   # True inside the writer process

_WRITER: WriterProcess | None = None
_WRITER_LOCK = threading.Lock()


def writer() -> WriterProcess:
    """This training process's writer, started at first use (again if the last one ended)."""
    global _WRITER
    with _WRITER_LOCK:
        if _WRITER is None or _WRITER.pid != os.getpid() or not _WRITER.alive:
            _WRITER = WriterProcess()
        return _WRITER


def serve(results_fd: int, preload: bool = False) -> None:
    """The writer process: messages on stdin, results on ``results_fd``, until stdin closes."""
    global IN_WRITER
    IN_WRITER = True
    torch.set_num_threads(1)
    if preload:
        import safetensors.torch  # noqa: F401
        import transformers.training_args  # noqa: F401
    requests, results = sys.stdin.buffer, os.fdopen(results_fd, "wb")
    parent = os.getppid()
    arenas: dict[int, Any] = {}
    while True:
        data = _receive(requests)
        if data is None:   # the training process closed its end (it finished, or it died)
            return
        try:
            message = _RefUnpickler(io.BytesIO(data), arenas).load()
        except Exception as exc:   # a write it cannot read: that save fails, the writer goes on
            _send(results, ("written", ("", f"the writer process could not read the save ({type(exc).__name__}: "
                                            f"{exc})"), 0.0))
            continue
        kind = message[0]
        if kind == "arena":
            _, arena, path, nbytes = message
            arenas[arena] = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).numpy()
            unlink(path)   # both processes have it mapped: the memory lives while either holds it
        elif kind == "forget":
            arenas.pop(message[1], None)
        elif kind == "write":
            t0, path, failure = time.perf_counter(), "", None
            try:
                for w in message[1]:
                    if os.getppid() != parent:   # the training process died: nobody will rename this save
                        return
                    path = w.path
                    w.run()
            except BaseException as exc:   # said by the trainer, at its next step
                failure = (path, f"{type(exc).__name__}: {exc}")
            _send(results, ("written", failure, time.perf_counter() - t0))
