"""A snapshot's ``torch.save`` files tag each storage with its source's device, as the stock save's do.

On a GPU the stock ``optimizer.pt`` says ``"cuda:0"`` for AdamW's moments; the snapshot's host
copies would say ``"cpu"``. CPU-only here, a device is played by a tagger registered the way torch
registers its own (``torch.serialization.register_package``) that tags chosen CPU storages as a
device does: ``"cuda:" + str(index)``, a new string each call, as torch's CUDA tagger, or a constant,
as its MPS tagger. The stock save of those tensors is then compared with the snapshot's file,
written by a thread of this process and by the writer process.
"""

from __future__ import annotations

import zipfile

import pytest
import torch

from hfstream.trainer import save_tags
from hfstream.trainer.save_async import SnapshotBuffers, Write


def _records(path) -> dict[str, bytes]:
    """The file's records by name (data.pkl: every storage's key, location and size; data/N: its bytes),
    the archive's own folder name left out."""
    with zipfile.ZipFile(path) as z:
        return {n.split("/", 1)[1]: z.read(n) for n in z.namelist() if "/data" in n}


def _locations(path) -> list[str]:
    seen = []
    torch.load(path, map_location=lambda storage, location: seen.append(location) or storage, weights_only=True)
    return seen


@pytest.fixture
def on_device(monkeypatch):
    """``on_device(tensors, fresh)``: torch tags these tensors' storages as a device's from now on."""
    storages: set[int] = set()
    kind = {}

    def tagger(storage):
        if storage.device.type == "cpu" and storage.data_ptr() in storages:
            return "cuda:" + str(0) if kind["fresh"] else "mps"

    registry = sorted(torch.serialization._package_registry + [(1, tagger, lambda s, loc: None)],
                      key=lambda entry: entry[0])
    monkeypatch.setattr(torch.serialization, "_package_registry", registry)

    def mark(tensors, fresh):
        kind["fresh"] = fresh
        storages.update(t.untyped_storage().data_ptr() for t in tensors)
    return mark


def _snapshot(buffers: SnapshotBuffers, state: dict) -> dict:
    """Host copies of ``state``'s tensors, each buffer remembering its source's tag (as `host_copy` does)."""
    out, memo = {}, {}
    for k, t in state.items():
        host = memo.get(t.untyped_storage().data_ptr())
        if host is None:
            host = memo[t.untyped_storage().data_ptr()] = buffers.take(t.untyped_storage().nbytes())
            host.copy_(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()))
            save_tags.remember(host, t.untyped_storage())
        out[k] = torch.empty(0, dtype=t.dtype).set_(host.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    return out


@pytest.mark.parametrize("fresh", [True, False], ids=["cuda-like", "mps-like"])
@pytest.mark.parametrize("by", ["thread", "writer process"])
def test_a_snapshots_file_is_the_stock_save_of_its_device_sources(tmp_path, on_device, by, fresh):
    moments = {"exp_avg": torch.randn(3, 4), "exp_avg_sq": torch.rand(5)}
    moments["tied"] = moments["exp_avg"][1:]   # another tensor on the same storage: tagged again
    step = torch.tensor(2.0)   # Adam's step stays on the host
    on_device(moments.values(), fresh)
    torch.save({"state": {0: moments}, "step": step}, tmp_path / "stock.pt")
    buffers = SnapshotBuffers(shared=by == "writer process")
    snapshot = {"state": {0: _snapshot(buffers, moments)}, "step": _snapshot(buffers, {"s": step})["s"]}
    path = str(tmp_path / "optimizer.pt")
    write = Write(torch.save, path, (snapshot, path), {})
    if by == "thread":
        write.run()
    else:
        assert buffers.unshared is None, buffers.unshared
        failure, _ = buffers.writer.write(buffers.writer.encode([write]))
        assert failure is None
    device = "cuda:0" if fresh else "mps"
    assert _locations(path) == _locations(tmp_path / "stock.pt") == [device, device, "cpu"]   # one per storage
    assert _records(path) == _records(tmp_path / "stock.pt")   # the strings too: each anew, or one shared


def test_outside_a_snapshots_write_the_same_buffer_saves_as_cpu(tmp_path, on_device):
    # A user's torch.save of anything, on any thread, is torch's own, even of a remembered buffer.
    source = torch.randn(4)
    on_device([source], fresh=False)
    (host,) = _snapshot(SnapshotBuffers(), {"w": source}).values()
    torch.save(host, tmp_path / "user.pt")
    assert _locations(tmp_path / "user.pt") == ["cpu"]
    with save_tags.writing():
        torch.save(host, tmp_path / "snapshot.pt")
    assert _locations(tmp_path / "snapshot.pt") == ["mps"]


def test_a_buffer_reused_for_a_host_source_forgets_its_device():
    buffers = SnapshotBuffers()
    host = buffers.take(16)
    save_tags.remember(host, torch.empty(4, device="meta").untyped_storage())
    assert save_tags.tag_of(host.data_ptr()) == ("meta", False)
    save_tags.remember(host, torch.empty(4).untyped_storage())
    assert save_tags.tag_of(host.data_ptr()) is None
