"""``save_async``'s snapshot keeps each storage's device in the files it writes, as the stock save does.

``torch.save`` writes every storage's location (``location_tag``: ``"cuda:0"`` for AdamW's moments on
a GPU) into the file's pickle, and loads it back there. A snapshot's storages are host copies: saved
as they are, they would be tagged ``"cpu"``, a file other than the stock Trainer's (``torch.load``
without ``map_location`` would give CPU tensors where stock's gives the GPU's). So each snapshot
buffer remembers the tag of the storage it copies (`remember`), and while a snapshot's file is
written (`writing`, on that thread only) a tagger registered with ``torch.serialization`` (the
documented ``register_package``) answers that tag for those buffers. Elsewhere it answers nothing,
and torch's own taggers decide.

Byte for byte means the same string objects too: pickle writes a string object once and refers to
it after. torch's CUDA tagger builds a new ``"cuda:0"`` for every storage, its CPU tagger returns
one constant; a remembered tag is returned the same way (`remember` asks torch twice to know which).
"""

from __future__ import annotations

import contextlib
import threading

import torch

# A snapshot buffer's storage (its data_ptr) -> (its source's location tag, a new string per call).
_TAGS: dict[int, tuple[str, bool]] = {}
_WRITING = threading.local()


def remember(host: torch.Tensor, source: torch.UntypedStorage) -> None:
    """``host`` (a snapshot buffer) now holds a copy of ``source``: files saved from it tag ``source``'s
    device. A host source forgets an earlier tag of the buffer (buffers are reused by the next save)."""
    tag = torch.serialization.location_tag(source)
    set_tag(host.untyped_storage().data_ptr(),
            None if tag == "cpu" else (tag, tag is not torch.serialization.location_tag(source)))


def tag_of(ptr: int) -> tuple[str, bool] | None:
    """The tag remembered for the buffer at ``ptr`` (sent to the writer process with the buffer's place)."""
    return _TAGS.get(ptr)


def set_tag(ptr: int, tag: tuple[str, bool] | None) -> None:
    """The buffer at ``ptr`` tagged ``tag`` (None: as its own, the host's); the writer process's side of
    `tag_of` too: the same buffer, at its address there."""
    if tag is None:
        _TAGS.pop(ptr, None)
    else:
        _TAGS[ptr] = tag


@contextlib.contextmanager
def writing():
    """While a snapshot's file is written on this thread: its buffers are tagged as their sources."""
    _WRITING.on = True
    try:
        yield
    finally:
        _WRITING.on = False


def _tagger(storage) -> str | None:
    if not getattr(_WRITING, "on", False) or storage.device.type != "cpu":
        return None
    found = _TAGS.get(storage.data_ptr())
    if found is None:
        return None
    tag, fresh = found
    return tag.encode().decode() if fresh else tag


def _never_loads(storage, location):
    return None   # loading is torch's own: the tag names a device its deserializers know


# Before torch's CPU tagger (priority 10; lower runs first), once per process (this module's import).
torch.serialization.register_package(9, _tagger, _never_loads)
