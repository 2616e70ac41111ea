"""``save_async``: the stock Trainer's checkpoint, written behind training.

The save is a stream: a snapshot into host memory on the training thread, then the files written
by the writer process while the next steps run, then a rename that makes them ``checkpoint-N``.

    snapshot      `DeferredWrites`: the stock ``Trainer._save_checkpoint`` runs as it is, on the
                  training thread, into a staging folder; every ``torch.save`` and safetensors
                  ``save_file`` it makes keeps a host copy of what it was given instead of writing
                  (the small JSON files are written at once); its rotation is held back. Whatever
                  the save gathers (the sharded optimizer state) is gathered here, in step order.
    write         `AsyncSave`: the writer process (`save_writer`) calls the same functions with the
                  host copies, so the files are the stock Trainer's, byte for byte.
    commit        the trainer, at a point every rank reaches (a step boundary, the next save, the
                  end of training): the ranks agree that every rank's files are complete (one small
                  all-reduce), then the saving rank renames the staging folder to ``checkpoint-N`` and
                  rotates. A crash before that leaves no ``checkpoint-N``: `get_last_checkpoint`
                  never sees a partial one.

The writes are made by a process of their own (`save_writer`: why, measured), reading the snapshot
from shared memory; where it cannot serve, by a thread of this process, said once.

The host copies go into `SnapshotBuffers`, reused by the next save: a fresh copy pays a page fault
per page it first writes (this host, 2026-12-06: 0.59 GB cloned in 0.24 s, copied into buffers
already written once in 0.04 s), and pinned memory is slower still to allocate; the first save's
buffers are allocated (each page written once) on a thread after the first optimizer step
(`SnapshotBuffers.prepare`), so no save pays for them. On an accelerator
the buffers are pinned and the copies run on a side stream of their own, each after what the
training stream queued before it (so it copies the values of the save's step), so the next
forward and backward need not wait for them; the trainer makes the training stream wait for the
copies' event (the device waits, not the host) before anything can change what they read: the
next optimizer step, and the next forward where the model has buffers (BatchNorm's running
statistics change in the forward, and a user's training_step may move weights). Training on CPU,
a thread of their own makes the copies the same way (`HostCopies`). The save's thread waits on the
same event before it hands the bytes to the writer. On an accelerator the shared arenas are pinned
in place (``cudaHostRegister``, as torch.distributed.checkpoint pins its shared staging memory).
This path has not run on a GPU yet (`make gpu-check` runs it where one is lent). While a save is
in flight every step boundary costs one small all-reduce of the ranks' "written" flags, over a
gloo group (no device wait).

Sources: torch.distributed.checkpoint.async_save (snapshot to host, then write in the
background; its process-based executor and shared, pinned staging memory), torchtitan's async
checkpointing, Lightning's ``AsyncCheckpointIO``.
"""

from __future__ import annotations

import copy
import os
import threading
import time
import uuid
import weakref
from typing import Any, Callable, NamedTuple

import torch

from .. import streams
from . import save_tags

STAGING_DIR = ".hfstream-saving"   # under the run's output_dir: no ``checkpoint-N`` name until complete


def snapshot_bytes(model: torch.nn.Module, optimizer, optimizer_scale: int = 1) -> int:
    """Host bytes a snapshot takes: the model's state and the optimizer's (``optimizer_scale`` times this
    rank's, where each rank holds 1/N of it and the checkpoint holds all of it)."""
    moments = sum(_storage_sizes(_optimizer_tensors(optimizer)))
    return sum(_storage_sizes(model.state_dict().values())) + optimizer_scale * moments


def snapshot_sizes(model: torch.nn.Module, optimizer=None) -> list[int]:
    """The bytes of each host buffer a snapshot of ``model`` and ``optimizer`` takes, one per storage.

    Pass no optimizer where its checkpoint is assembled at the save (sharded: gathered from every
    rank's slices, in storages that exist only then)."""
    return _storage_sizes(model.state_dict().values()) + _storage_sizes(_optimizer_tensors(optimizer))


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    state = getattr(getattr(optimizer, "optimizer", optimizer), "state", {}) if optimizer is not None else {}
    return [v for st in state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _storage_sizes(tensors) -> list[int]:
    seen, sizes = set(), []
    for t in tensors:
        s = t.untyped_storage()
        if (t.device, s.data_ptr()) not in seen:
            seen.add((t.device, s.data_ptr()))
            sizes.append(s.nbytes())
    return sizes


def available_host_bytes() -> int | None:
    """The host memory the kernel says is available (MemAvailable), or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Write(NamedTuple):
    """One deferred file write: the original function, the path, and its arguments with host copies."""

    fn: Callable[..., Any]
    path: str
    args: tuple
    kwargs: dict

    def run(self) -> None:
        """Make the file (its folder first), by whichever thread or process writes it."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with save_tags.writing():   # a storage copied from a device is tagged with it, as stock's file
            self.fn(*self.args, **self.kwargs)


class SnapshotBuffers:
    """The host buffers snapshots copy into, one per storage, reused by the next save.

    A save's buffers come back when its files are written (`give_back`); the next snapshot takes
    those of the sizes it needs (a model's storages keep their sizes from save to save) and frees the
    rest (`drop_rest`), so between saves the run holds one snapshot's worth of host memory.

    Buffers are carved from arenas, one per `prepare` (or per buffer `take` had to allocate): with
    ``shared``, a file in /dev/shm that the writer process (`save_writer`) maps too, so each save
    sends it only where its tensors lie; without (or where /dev/shm has no room, said in
    ``unshared``), ordinary memory a thread of this process writes from.

    Args:
        device: where training runs; on an accelerator the buffers are pinned (the copies from it then
            do not make the host wait), allocated and registered by threads bound to it.
        stream: on an accelerator, the side stream the copies run on (None: the current stream).
        shared: in shared memory, for the writer process.
    """

    def __init__(self, device: torch.device | None = None, stream=None, shared: bool = False):
        self.device = torch.device(device or "cpu")
        self.pin = streams.is_accelerator(self.device)
        self.unpinned: str | None = None                 # why the buffers could not be pinned (the copies then wait)
        self.stream = stream
        self.copies: HostCopies | None = None            # on CPU, where the snapshot's copies wait for their thread
        self.writer = None                               # the `WriterProcess` the arenas are shared with
        self.unshared: str | None = None if shared else "save_async's writer process is off"
        self.taken: list[torch.Tensor] = []              # the buffers of the snapshot being taken
        self.new_bytes = 0                               # bytes `take` allocated (no free buffer fitted)
        self._free: dict[int, list[torch.Tensor]] = {}   # bytes -> buffers written by a finished save
        self._preparing: threading.Thread | None = None

    def prepare(self, sizes: list[int]) -> None:
        """Allocate buffers of ``sizes`` and write every page once, on a thread of their own, so that
        the first snapshot copies into memory the kernel has already mapped (a fresh copy pays a page
        fault per page, on the training thread). Sizes no snapshot takes are freed by its `drop_rest`."""
        def allocate(free=self._free):
            streams.bind_thread(self.device)
            for buffer in self._allocate(sizes, touch=True):
                free.setdefault(buffer.numel(), []).append(buffer)

        self._preparing = threading.Thread(target=allocate, name="hfstream-snapshot-buffers", daemon=True)
        self._preparing.start()

    def _prepared(self) -> dict[int, list[torch.Tensor]]:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        return self._free

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of ``nbytes``: a free one of that size, else a new one."""
        free = self._prepared().get(nbytes)
        if free:
            buffer = free.pop()
        else:
            (buffer,) = self._allocate([nbytes], touch=False)
            self.new_bytes += nbytes
        self.taken.append(buffer)
        return buffer

    def drop_rest(self) -> list[torch.Tensor]:
        """A snapshot is complete: the free buffers it did not take are freed; returns the ones it took."""
        self._prepared().clear()
        taken, self.taken = self.taken, []
        return taken

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        """The files of the save that took ``buffers`` are written: the next snapshot may reuse them."""
        free = self._prepared()
        for buffer in buffers:
            free.setdefault(buffer.numel(), []).append(buffer)

    @property
    def held_bytes(self) -> int:
        """Bytes held for the next snapshot."""
        return sum(b.numel() for free in self._prepared().values() for b in free)

    def _allocate(self, sizes: list[int], touch: bool) -> list[torch.Tensor]:
        """Buffers of ``sizes`` carved from one new arena, each a storage of its own (``torch.save`` writes
        whole storages); ``touch``: every page written once now."""
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // 64) * 64   # 64-byte aligned
        if total == 0:
            return [torch.empty(0, dtype=torch.uint8) for _ in sizes]
        flat, path = self._arena(total)
        if touch:
            flat.fill(0)
        # Each buffer holds ``flat`` (and through it the arena's memory) until it is freed: what is done
        # when the arena goes is tied to ``flat``.
        buffers = [torch.frombuffer(flat, dtype=torch.uint8, count=n, offset=o) if n else torch.empty(0, dtype=torch.uint8)
                   for n, o in zip(sizes, offsets)]
        if path is not None:
            from .save_writer import WriterGone

            carved = [(b, o) for b, o in zip(buffers, offsets) if b.numel()]
            try:
                arena_id = self.writer.add_arena(path, total, carved)
            except WriterGone as exc:   # this memory serves a thread instead, as every later buffer does
                self.unshared, self.writer = str(exc), None
            else:
                weakref.finalize(flat, self.writer.forget, arena_id, [b.data_ptr() for b, _ in carved])
        return buffers

    def _arena(self, nbytes: int):
        """``nbytes`` of host memory as a numpy array: in /dev/shm for the writer process where it can be
        (and its path), else ordinary memory (and None)."""
        from . import save_writer

        if self.unshared is None and self.writer is not None and not self.writer.alive:
            self.unshared, self.writer = self.writer.ended, None
        if self.unshared is None:
            free = save_writer.shm_free_bytes()
            if free is None or nbytes > free - SHM_HEADROOM:
                self.unshared = (f"/dev/shm has {free} bytes free, the snapshot needs {nbytes} more"
                                 if free is not None else "this system has no /dev/shm")
            else:
                try:
                    self.writer = self.writer or save_writer.writer()
                except OSError as exc:
                    self.unshared = f"the writer process did not start ({exc})"
        if self.unshared is not None:
            return self._ordinary(nbytes), None
        path = os.path.join(save_writer.SHM_DIR, f"hfstream-snapshot-{os.getpid()}-{uuid.uuid4().hex}")
        flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).numpy()
        weakref.finalize(flat, save_writer.unlink, path)   # the writer unlinks it once mapped; this, if it never did
        if self.pin:
            self._register(flat)
        return flat, path

    def _ordinary(self, nbytes: int):
        """``nbytes`` of this process's memory, pinned by torch's allocator on an accelerator where it can."""
        if self.pin and self.unpinned is None:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
            except RuntimeError as exc:   # a backend without pinned host memory (MPS), or none left
                self.unpinned = f"pinned memory: {exc}"
        return torch.empty(nbytes, dtype=torch.uint8).numpy()

    def _register(self, flat) -> None:
        """The shared arena ``flat`` pinned in place with CUDA (as torch.distributed.checkpoint pins its shared
        staging memory), on a thread of its own bound to the device: a failed registration leaves its
        error as that thread's last CUDA error, which the next kernel launch of the thread would raise,
        and the thread ends with it. Other accelerators: the arena stays unpinned, said in ``unpinned``."""
        if self.device.type != "cuda":
            self.unpinned = f"{self.device.type}: shared memory is pinned for CUDA only"
            return
        cudart, pointer, result = torch.cuda.cudart(), flat.ctypes.data, []

        def register():
            streams.bind_thread(self.device)
            result.append(int(cudart.cudaHostRegister(pointer, flat.nbytes, 1)))   # 1: cudaHostRegisterPortable

        thread = threading.Thread(target=register, name="hfstream-pin", daemon=True)
        thread.start()
        thread.join()
        if result != [0]:
            self.unpinned = f"cudaHostRegister returned {result[0] if result else 'nothing'}"
            return
        done = weakref.finalize(flat, cudart.cudaHostUnregister, pointer)
        done.atexit = False   # not after CUDA's own teardown at exit (torch's checkpoint stager does the same)


class HostCopies:
    """Training on CPU: the snapshot's copies made by a thread of their own, beside the next forward and
    backward, as a side stream makes them on an accelerator.

    What they read (parameters, buffers, the optimizer's state; each source is held until copied) only
    the next optimizer step changes, and before it a forward (a BatchNorm's statistics) or a user's
    ``training_step`` (FGM, SAM): the trainer waits (`synchronize`, a CUDA event's name for it) before
    those. A copy releases the GIL: with a core
    free it costs the training thread nothing but that wait.
    """

    def __init__(self):
        self.jobs: list[tuple[torch.Tensor, torch.Tensor]] = []   # (host buffer, source), in the save's order
        self._thread: threading.Thread | None = None

    def add(self, host: torch.Tensor, source: torch.Tensor) -> None:
        self.jobs.append((host, source))

    def start(self) -> "HostCopies":
        jobs, self.jobs = self.jobs, []

        def copy_all():
            for host, source in jobs:
                host.copy_(source)

        self._thread = threading.Thread(target=copy_all, name="hfstream-snapshot-copies", daemon=True)
        self._thread.start()
        return self

    def synchronize(self) -> None:
        """Until every copy has landed."""
        if self._thread is not None:
            self._thread.join()


SHM_HEADROOM = 64 << 20   # left free in /dev/shm: a full tmpfs ends a process that writes into it (SIGBUS)


def host_copy(obj: Any, memo: dict, buffers: SnapshotBuffers) -> Any:
    """``obj`` with every tensor copied to host memory, storages shared as they were (so files are the same).

    ``memo`` maps a storage to its host copy; keep one per call, while the tensors of ``obj`` are alive
    (a storage is known by its address). The copies go into buffers taken from ``buffers``.

    Containers are rebuilt; other leaves are deep-copied (a later change in training must not reach
    the snapshot). A tensor keeps its whole storage, offset and strides: ``torch.save`` writes
    storages, and a view saved alone would change the file.
    """
    if isinstance(obj, torch.Tensor):
        return _host_tensor(obj, memo, buffers)
    if type(obj) in (dict, list, tuple) or isinstance(obj, dict):
        if isinstance(obj, dict):
            out = copy.copy(obj)   # keeps OrderedDict and the like
            for k, v in obj.items():
                out[k] = host_copy(v, memo, buffers)
            return out
        return type(obj)(host_copy(v, memo, buffers) for v in obj)
    return copy.deepcopy(obj)


def _host_tensor(t: torch.Tensor, memo: dict, buffers: SnapshotBuffers) -> torch.Tensor:
    storage = t.untyped_storage()
    key = (t.device, storage.data_ptr(), storage.nbytes())
    host = memo.get(key) if storage.nbytes() else None
    if host is None:
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        host = buffers.take(whole.numel())
        if buffers.copies is not None and t.device.type == "cpu":   # training on CPU: copied beside the next step
            buffers.copies.add(host, whole)
        elif buffers.stream is None or t.device != buffers.stream.device:
            # A host tensor (an RNG state), or one on another device than the copy stream's (a model spread
            # over devices: the stream's event would not cover its copy): copied now.
            host.copy_(whole)
        else:
            # On the side stream, after what the training stream queued before (the save's own copies
            # included), into pinned memory without making the host wait; the writer waits on the
            # side stream's event (`AsyncSave._run`). A temporary of the save (a gathered optimizer
            # piece) is kept for that stream: freed now, its memory is not reused before the copy ran.
            buffers.stream.wait_stream(streams.current_stream(t.device))
            with streams.use_stream(buffers.stream):
                host.copy_(whole, non_blocking=True)
            streams.record_stream(whole, buffers.stream)
        save_tags.remember(host, storage)
        memo[key] = host
    out = torch.empty(0, dtype=t.dtype).set_(host.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    if isinstance(t, torch.nn.Parameter):
        out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out


class DeferredWrites:
    """Inside it, on the thread that entered: the big writes keep host copies, rotation waits.

    ``torch.save``, ``safetensors.torch.save_file`` (and transformers' own name for it) record a
    `Write` whose arguments are host copies; ``transformers.trainer.rotate_checkpoints`` records
    its arguments. Other threads (a prefetcher, the previous save's writer) call the originals.
    A ``torch.save`` into a file object (not a path) is written at once: it cannot wait.

    >>> with DeferredWrites() as deferred:               # doctest: +SKIP
    ...     trainer._save_checkpoint(model, None)
    >>> deferred.writes[0].path                          # doctest: +SKIP
    'out/.hfstream-saving/checkpoint-4/model.safetensors'
    """

    def __init__(self, buffers: SnapshotBuffers | None = None):
        self.writes: list[Write] = []        # in the order the stock save made them
        self.rotations: list[dict] = []      # rotate_checkpoints' keyword arguments, held back
        self.buffers = buffers or SnapshotBuffers()   # where the host copies go
        self._owner = None                   # the training thread
        self._undo: list[tuple[object, str, object]] = []   # (module, name, original) to put back

    def __enter__(self) -> "DeferredWrites":
        import safetensors.torch
        import transformers.modeling_utils
        import transformers.trainer

        self._owner = threading.get_ident()
        self._patch(torch, "save", lambda orig: self._deferred(orig, path_at=1))
        self._patch(safetensors.torch, "save_file", lambda orig: self._deferred(orig, path_at=1))
        self._patch(transformers.modeling_utils, "safe_save_file", lambda orig: self._deferred(orig, path_at=1))
        self._patch(transformers.trainer, "rotate_checkpoints", self._held_rotation)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in reversed(self._undo):
            setattr(module, name, original)
        self._undo.clear()

    def _patch(self, module, name: str, make: Callable) -> None:
        original = getattr(module, name)   # AttributeError: this transformers/safetensors moved it
        self._undo.append((module, name, original))
        setattr(module, name, make(original))

    def _deferred(self, original: Callable, path_at: int) -> Callable:
        def call(*args, **kwargs):
            path = args[path_at] if len(args) > path_at else kwargs.get("f", kwargs.get("filename"))
            if threading.get_ident() != self._owner or not isinstance(path, (str, os.PathLike)):
                return original(*args, **kwargs)
            # One memo per file: storages shared within a file stay shared; across files an address may
            # be a freed temporary's reused by another tensor, so a save-wide memo would copy the wrong one.
            memo: dict = {}
            self.writes.append(Write(original, os.fspath(path), host_copy(args, memo, self.buffers),
                                     host_copy(kwargs, memo, self.buffers)))
        return call

    def _held_rotation(self, original: Callable) -> Callable:
        def call(*args, **kwargs):
            if threading.get_ident() != self._owner:
                return original(*args, **kwargs)
            self.rotations.append(kwargs)
        return call


class AsyncSave:
    """One checkpoint in flight: its writes sent to the writer process (or made by a thread of this one,
    where they cannot be), waited for on a background thread; then its rename to ``final_dir``.

    Args:
        writes: the `Write` list of a `DeferredWrites`.
        staging_dir: where the stock save wrote (``<output_dir>/.hfstream-saving/checkpoint-N``).
        final_dir: its name once every rank is done (``<output_dir>/checkpoint-N``).
        state: the Trainer's state at the save (for the ``on_save`` callbacks, run at the commit).
        rotations: ``rotate_checkpoints`` keyword arguments, for the commit (after the rename).
        event: what ends the host copies (a CUDA event on an accelerator, `HostCopies` on CPU); waited on
            before the writer reads them.
        buffers: the host buffers the snapshot took (`SnapshotBuffers.drop_rest`), free again once written.
        writer: the `save_writer.WriterProcess` the buffers are shared with (None: a thread writes).
        device: where training runs: the thread that waits for ``event`` is bound to it.
    """

    def __init__(self, writes: list[Write], staging_dir: str, final_dir: str, state: Any = None,
                 rotations: list[dict] | None = None, event=None, buffers: list[torch.Tensor] | None = None,
                 writer=None, device: torch.device | None = None):
        self.device = torch.device(device or "cpu")
        self.staging_dir = staging_dir
        self.final_dir = final_dir
        self.state = state
        self.rotations = rotations or []
        self.writes = writes
        self.buffers = buffers or []
        self.writer = writer
        self.by_thread: str | None = None                # why this process's thread wrote it, not the writer
        self.error: tuple[str, str] | None = None        # (the path it failed on, why)
        self.write_s = 0.0                               # seconds the writer took
        self._event = event
        self._thread = threading.Thread(target=self._run, name=f"hfstream-save-{os.path.basename(final_dir)}",
                                        daemon=True)

    def start(self) -> "AsyncSave":
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> float:
        """Wait for this rank's writes; returns the seconds waited."""
        t0 = time.perf_counter()
        self._thread.join()
        return time.perf_counter() - t0

    def _run(self) -> None:
        t0 = time.perf_counter()
        path = self.staging_dir
        try:
            streams.bind_thread(self.device)
            if self._event is not None:
                self._event.synchronize()   # the host copies have landed
            message, sent, kept = self._split()
            for write in kept:              # this thread's share first: a failure is said as soon as it can be
                path = write.path
                write.run()
            if message is not None and not self._by_writer(message):
                for write in sent:          # the writer ended: the snapshot is still here
                    path = write.path
                    write.run()
        except BaseException as exc:   # said on the training thread, at the next step
            self.error = (path, f"{type(exc).__name__}: {exc}")
        finally:
            self.writes = []
            self.write_s = self.write_s or time.perf_counter() - t0

    def _split(self) -> tuple[bytes | None, list[Write], list[Write]]:
        """(the message for the writer process or None, the writes in it, the writes this thread makes),
        with why in ``by_thread`` where this thread makes any."""
        if self.writer is None:
            return None, [], self.writes
        if not self.writer.alive:   # ended between saves
            self.by_thread = self.writer.ended
            return None, [], self.writes
        try:
            return self.writer.encode(self.writes), self.writes, []
        except Exception:   # a tensor outside the shared buffers, a function or class pickle cannot name
            pass
        sent, kept, why = [], [], None
        for write in self.writes:
            try:
                self.writer.encode([write])
                sent.append(write)
            except Exception as exc:
                kept.append(write)
                why = why or f"{type(exc).__name__}: {exc}"
        self.by_thread = (why if not sent else
                          f"{', '.join(os.path.basename(w.path) for w in kept)}: {why}")
        return (self.writer.encode(sent) if sent else None), sent, kept

    def _by_writer(self, message: bytes) -> bool:
        """The writes of ``message`` sent to the writer process and waited for; False, with why in
        ``by_thread``, where it ended (killed mid-save, or never started)."""
        from .save_writer import WriterGone

        try:
            self.error, self.write_s = self.writer.write(message)
        except WriterGone as exc:
            self.by_thread = str(exc)
            return False
        return True

    def failure(self) -> str:
        path, why = self.error
        return (f"save_async: writing {path!r} failed ({why}); {self.final_dir!r} was not "
                f"made and the previous checkpoint is whole. Free space or fix the permissions of output_dir, "
                f"or set save_async=False to save in the training loop")

    def commit(self) -> None:
        """The staging folder becomes ``final_dir`` (the saving rank only, once every rank is done)."""
        if os.path.isdir(self.final_dir):   # the stock Trainer overwrites a checkpoint of the same step
            import shutil

            shutil.rmtree(self.final_dir)
        os.replace(self.staging_dir, self.final_dir)
        try:
            os.rmdir(os.path.dirname(self.staging_dir))   # an empty staging folder is not left in output_dir
        except OSError:
            pass
