"""StreamPrefetcher on CPU: same batches in the same order and structure, errors at the right
step, no leaked thread, bounded look-ahead, clear argument errors.

Two paths run here. "thread" is the real CPU path (background thread, bounded queue). "staged"
is the accelerator path (side stream, one event per batch, record_stream) driven through fake
streams and events onto the meta device, so its ordering logic is tested without a GPU; the
real device semantics are in test_prefetch_gpu.py.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import threading
import time
import traceback
from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import BatchEncoding

from hfstream import streams
from hfstream.prefetch import prefetcher as prefetch
from hfstream.prefetch.prefetcher import THREAD_PREFIX, StreamPrefetcher

Point = namedtuple("Point", ["x", "y"])


def make_batch(i: int):
    """Batch i of a source that cycles through every container kind the prefetcher handles."""
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3) + i
    kinds = [
        {"input_ids": t.long(), "labels": t, "i": i},
        BatchEncoding({"input_ids": t.long(), "attention_mask": torch.ones(2, 3), "i": i}, n_sequences=1),
        [t, i, "text"],
        (t, i),
        Point(t, i),
        {"nested": [Point(t, {"deep": (t, None)}), {"i": i}], "meta": {"name": f"b{i}", "ids": [1, 2]}},
        OrderedDict(a=t, i=i),
        defaultdict(list, {"a": t, "i": i}),
        t,
    ]
    return kinds[i % len(kinds)]


def assert_same(got, exp, device: torch.device, skip=()):
    """Same types and structure; tensors on `device` with equal values (shape and dtype on meta)."""
    assert type(got) is type(exp), (type(got), type(exp))
    if isinstance(exp, torch.Tensor):
        assert got.device.type == device.type and got.dtype == exp.dtype and got.shape == exp.shape
        if device.type != "meta":
            assert torch.equal(got.cpu(), exp.cpu())
    elif isinstance(exp, (dict, BatchEncoding)):
        assert list(got.keys()) == list(exp.keys())
        for k in exp.keys():
            if k in skip:
                assert got[k] is exp[k]          # skipped: the very same host object
            else:
                assert_same(got[k], exp[k], device, skip)
        if isinstance(exp, BatchEncoding):
            assert got.n_sequences == exp.n_sequences
        if isinstance(exp, defaultdict):
            assert got.default_factory is exp.default_factory
    elif isinstance(exp, (list, tuple)):
        assert len(got) == len(exp)
        for g, e in zip(got, exp):
            assert_same(g, e, device, skip)
    else:
        assert got == exp


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def assert_no_prefetch_thread():
    gc.collect()
    assert wait_until(lambda: not prefetch_threads(), timeout=3.0), prefetch_threads()


# -- the two paths ---------------------------------------------------------------------------

class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(("wait", event.id, self.name))

    def synchronize(self):
        raise AssertionError("the prefetcher must never synchronize the host")


class FakeEvent:
    ids = itertools.count()

    def __init__(self, log, timing):
        self.id, self.log, self.timing = next(self.ids), log, timing

    def record(self, stream):
        self.log.append(("record", self.id, stream.name))

    def query(self):
        return True

    def elapsed_time(self, end):
        return 2.0

    def synchronize(self):
        raise AssertionError("the prefetcher must never synchronize the host")


@pytest.fixture
def fake_accelerator(monkeypatch):
    """Route the accelerator path through fake streams onto the meta device; returns the log."""
    log: list = []
    consumer = FakeStream("consumer", log)
    state = {"current": consumer}

    @contextlib.contextmanager
    def use_stream(stream):
        prev, state["current"] = state["current"], stream
        try:
            yield
        finally:
            state["current"] = prev

    real_resolve = streams.resolve_device
    monkeypatch.setattr(streams, "resolve_device",
                        lambda d, arg="device": torch.device("meta") if d == "meta" else real_resolve(d, arg))
    monkeypatch.setattr(streams, "is_accelerator", lambda d: torch.device(d).type == "meta")
    monkeypatch.setattr(streams, "new_stream", lambda device, priority="normal": FakeStream("side", log))
    monkeypatch.setattr(streams, "current_stream", lambda device: state["current"])
    monkeypatch.setattr(streams, "use_stream", use_stream)
    monkeypatch.setattr(streams, "new_event", lambda device, enable_timing=False: FakeEvent(log, enable_timing))
    monkeypatch.setattr(streams, "record_stream",
                        lambda t, s: log.append(("record_stream", t.data_ptr(), t.shape, s.name)))
    monkeypatch.setattr(prefetch, "_SIDE_STREAMS", {})
    return log


@pytest.fixture(params=["thread", "staged"])
def path(request):
    """(device, make): the CPU thread path, or the staged accelerator path on fakes."""
    if request.param == "thread":
        return torch.device("cpu"), lambda src, **kw: StreamPrefetcher(src, device="cpu", **kw)
    request.getfixturevalue("fake_accelerator")
    return torch.device("meta"), lambda src, **kw: StreamPrefetcher(src, device="meta", **kw)


# -- same batches, same order, same structure ------------------------------------------------

@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_batches_match_plain_iteration(path, depth):
    device, make = path
    source = [make_batch(i) for i in range(20)]
    got = list(make(source, depth=depth))
    assert len(got) == len(source)
    for g, e in zip(got, source):
        assert_same(g, e, device)
    assert_no_prefetch_thread()


def test_non_tensor_leaves_and_skip_keys_are_untouched(path):
    device, make = path
    host_ids = torch.arange(4)
    names = ["a", "b"]
    opaque = object()
    batch = {"x": torch.ones(2), "ids": host_ids, "names": names, "opaque": opaque, "cfg": {"ids": torch.zeros(1), "y": torch.ones(1)}}
    (got,) = list(make([batch], depth=2, skip_keys=("ids",)))
    assert got["ids"] is host_ids and got["cfg"]["ids"] is batch["cfg"]["ids"]   # stays on the host
    assert got["opaque"] is opaque and got["names"] == names   # containers rebuilt, leaves kept
    assert got["names"][0] is names[0]
    assert got["x"].device.type == device.type and got["cfg"]["y"].device.type == device.type
    assert_same(got, batch, device, skip=("ids",))
    (got,) = list(make([batch], depth=1, skip_keys="ids"))    # a single key is accepted too
    assert got["ids"] is host_ids


@pytest.mark.parametrize("depth", [0, 1, 2, 4])
@pytest.mark.parametrize("n", [0, 1, 3])
def test_source_shorter_than_depth_or_empty(path, depth, n):
    device, make = path
    source = [make_batch(i) for i in range(n)]
    it = iter(make(source, depth=depth))
    got = list(it)
    assert len(got) == n
    for g, e in zip(got, source):
        assert_same(g, e, device)
    with pytest.raises(StopIteration):
        next(it)


def test_reiteration_starts_a_fresh_epoch(path):
    _, make = path
    source = [{"i": i, "x": torch.tensor([i])} for i in range(7)]
    p = make(source, depth=2)
    assert [b["i"] for b in p] == list(range(7))
    for b in p:             # stop early: the next epoch still starts from the beginning
        if b["i"] == 2:
            break
    assert [b["i"] for b in p] == list(range(7))
    assert_no_prefetch_thread()


def test_len_follows_the_source():
    assert len(StreamPrefetcher([1, 2, 3], device="cpu")) == 3
    with pytest.raises(TypeError, match="no len"):
        len(StreamPrefetcher((i for i in range(3)), device="cpu"))


# -- errors surface at their step ------------------------------------------------------------

def failing_source(n_good):
    for i in range(n_good):
        yield {"i": i, "x": torch.tensor([i])}
    raise KeyError("broken batch")


@pytest.mark.parametrize("depth", [0, 1, 2, 4])
@pytest.mark.parametrize("n_good", [0, 1, 5])
def test_source_exception_surfaces_at_its_step(path, depth, n_good):
    _, make = path
    it = iter(make(failing_source(n_good), depth=depth))
    got = []
    with pytest.raises(KeyError, match="broken batch") as excinfo:
        for b in it:
            got.append(b["i"])
    assert got == list(range(n_good))          # every good batch first, then the error
    frames = [f.name for f in traceback.extract_tb(excinfo.value.__traceback__)]
    assert "failing_source" in frames          # the original traceback is kept
    with pytest.raises(StopIteration):
        next(it)
    assert_no_prefetch_thread()


# -- lifecycle: nothing left running ---------------------------------------------------------

def endless(sleep_s=0.0):
    for i in itertools.count():
        if sleep_s:
            time.sleep(sleep_s)
        yield {"i": i, "x": torch.full((1000,), float(i))}


@pytest.mark.parametrize("depth", [1, 2, 4])
@pytest.mark.parametrize("sleep_s", [0.0, 0.2])
def test_break_leaves_no_thread(depth, sleep_s):
    p = StreamPrefetcher(endless(sleep_s), device="cpu", depth=depth)
    for b in p:
        assert prefetch_threads()
        if b["i"] == 2:
            break
    assert_no_prefetch_thread()


def test_garbage_collected_iterator_stops_its_thread():
    it = iter(StreamPrefetcher(endless(), device="cpu", depth=2))
    next(it)
    assert prefetch_threads()
    del it
    assert_no_prefetch_thread()


def test_close_and_context_manager_stop_the_thread():
    p = StreamPrefetcher(endless(), device="cpu", depth=2)
    it = iter(p)
    next(it)
    p.close()
    assert not prefetch_threads()             # close() joins: gone without waiting
    with pytest.raises(StopIteration):
        next(it)
    with StreamPrefetcher(endless(), device="cpu", depth=3) as p:
        it = iter(p)          # held: an epoch nobody holds is closed by the garbage collector
        next(it)
        assert prefetch_threads()
    assert not prefetch_threads()


def test_thread_prepares_ahead_and_stays_bounded():
    produced = []

    def source():
        for i in range(20):
            produced.append(i)
            yield {"i": i}

    depth = 2
    it = iter(StreamPrefetcher(source(), device="cpu", depth=depth))
    # Before anything is asked for, the thread fills the queue and holds one more batch...
    assert wait_until(lambda: len(produced) >= depth + 1)
    time.sleep(0.2)
    assert len(produced) == depth + 1         # ...and no more: the queue is bounded
    assert next(it)["i"] == 0
    assert wait_until(lambda: len(produced) >= depth + 2)
    time.sleep(0.2)
    assert len(produced) == depth + 2
    it.close()
    assert_no_prefetch_thread()


@pytest.mark.usefixtures("fake_accelerator")
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_staged_copies_run_depth_batches_ahead(depth):
    pulled = []

    def source():
        for i in range(10):
            pulled.append(i)
            yield {"x": torch.ones(3), "i": i}

    it = iter(StreamPrefetcher(source(), device="meta", depth=depth))
    assert len(pulled) == depth               # copies start at iter(), like DataLoader workers
    for k, b in enumerate(it):
        assert b["i"] == k
        assert len(pulled) == min(k + 1 + depth, 10)   # batch k is in use, k+1..k+depth copying


@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_staged_consumer_waits_on_each_batch_event(fake_accelerator, depth):
    log = fake_accelerator
    source = [{"x": torch.ones(3), "y": (torch.zeros(2, 2),), "i": i} for i in range(6)]
    p = StreamPrefetcher(source, device="meta", depth=depth, time_copies=True)
    for b in p:
        if depth == 0:
            continue
        # The last "done" event recorded on the side stream for this batch was waited on by the
        # consumer stream, and both of its copied tensors were recorded on the consumer stream.
        waits = [e for e in log if e[0] == "wait"]
        assert waits and waits[-1][2] == "consumer"
        done_id = waits[-1][1]
        assert ("record", done_id, "side") in log
        rec = [e for e in log if e[0] == "record_stream"]
        assert [r[2] for r in rec[-2:]] == [b["x"].shape, b["y"][0].shape]
        assert all(r[3] == "consumer" for r in rec)
    n_waits = sum(e[0] == "wait" for e in log)
    assert n_waits == (0 if depth == 0 else len(source))     # exactly one wait per batch
    stats = p.stats
    assert stats.batches == len(source)
    assert stats.bytes_copied == len(source) * (3 + 4) * 4
    if depth:
        assert stats.copy_ms == 2.0 and stats.copies_timed == len(source)
        assert stats.copy_gbps == pytest.approx(28 / 2e-3 / 1e9)


# -- DataLoader ------------------------------------------------------------------------------

class Squares(Dataset):
    def __len__(self):
        return 23

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i)] * 3), "y": i * i}


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_dataloader(workers, persistent):
    loader = DataLoader(Squares(), batch_size=4, num_workers=workers, persistent_workers=persistent)
    expected = list(loader)
    p = StreamPrefetcher(loader, device="cpu", depth=2)
    assert len(p) == len(loader)
    for _ in range(2):
        got = list(p)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert_same(g, e, torch.device("cpu"))
    for b in p:               # break mid-epoch, then a full epoch: same workers reused safely
        break
    got = list(p)
    assert len(got) == len(expected) and torch.equal(got[-1]["y"], expected[-1]["y"])
    p.close()
    assert_no_prefetch_thread()


# -- stats -----------------------------------------------------------------------------------

def test_stats_count_batches_and_wait():
    def slow():
        for i in range(3):
            time.sleep(0.05)
            yield {"i": i}

    p = StreamPrefetcher(slow(), device="cpu", depth=0)
    for _ in p:
        assert p.stats.data_wait_ms >= 50.0   # depth 0: the consumer waits for the source itself
    s = p.stats
    assert s.batches == 3 and s.data_wait_ms_total >= 150.0
    assert s.mean_data_wait_ms == pytest.approx(s.data_wait_ms_total / 3)
    assert s.copy_ms is None and s.bytes_copied == 0      # nothing to copy on CPU


# -- arguments -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(iterable=5), TypeError, "iterable"),
    (dict(depth=-1), ValueError, "depth"),
    (dict(depth=1.5), TypeError, "depth"),
    (dict(depth=True), TypeError, "depth"),
    (dict(device="bogus"), ValueError, "device"),
    (dict(device="meta"), ValueError, "not available"),
    (dict(stream_priority="urgent"), ValueError, "stream_priority"),
    (dict(stream_priority=0.5), TypeError, "stream_priority"),
    (dict(skip_keys=5), TypeError, "skip_keys"),
    (dict(non_blocking="yes"), TypeError, "non_blocking"),
    (dict(pin_memory="auto"), TypeError, "pin_memory"),
])
def test_bad_arguments_say_what_to_pass(kwargs, exc, match):
    kwargs = {"iterable": [1, 2], **kwargs}
    with pytest.raises(exc, match=match):
        StreamPrefetcher(**kwargs)


def test_default_device_is_the_accelerator_or_cpu():
    p = StreamPrefetcher([1], depth=0)
    if torch.accelerator.is_available():
        assert p.device.type == torch.accelerator.current_accelerator().type
        assert p.device.index is not None
    else:
        assert p.device == torch.device("cpu")


def test_stream_priority_names_map_to_backend_numbers():
    assert streams.stream_priority("normal") == 0
    assert streams.stream_priority("high") < 0          # lower number = more urgent
    assert streams.stream_priority(-3) == -3
    with pytest.raises(ValueError, match="'high' or 'normal'"):
        streams.stream_priority("low")


def test_a_device_without_side_streams_copies_on_the_current_stream(monkeypatch, caplog):
    """Apple MPS in current torch: no torch.mps.Stream. The prefetcher must not crash; it says so once."""
    import logging

    from hfstream.prefetch import prefetcher as prefetch_module

    monkeypatch.setattr(streams, "is_accelerator", lambda device: True)
    monkeypatch.setattr(streams, "has_side_streams", lambda device: False)
    prefetch_module._SAID.clear()
    batches = [{"x": torch.full((2,), float(i))} for i in range(5)]
    with caplog.at_level(logging.WARNING, logger="hfstream"):
        got = [b["x"][0].item() for b in StreamPrefetcher(batches, device="cpu", depth=2)]
        got += [b["x"][0].item() for b in StreamPrefetcher(batches, device="cpu", depth=2)]
    assert got == [0.0, 1.0, 2.0, 3.0, 4.0] * 2
    said = [r.getMessage() for r in caplog.records if "no side streams" in r.getMessage()]
    assert len(said) == 1, said


def test_has_side_streams_is_false_where_neither_torch_stream_nor_the_backend_makes_one(monkeypatch):
    import types

    def no_generic_stream(*a, **k):
        raise RuntimeError("generic streams are not supported on this backend")

    monkeypatch.setattr(torch, "Stream", no_generic_stream)
    monkeypatch.setattr(torch, "get_device_module", lambda kind: types.SimpleNamespace())   # e.g. torch.mps
    monkeypatch.setattr(streams, "_HAS_STREAMS", {})
    assert streams.has_side_streams("meta") is False
    with pytest.raises(RuntimeError, match="no side streams"):
        streams.new_stream("meta")


def test_a_source_that_communicates_is_read_on_the_consumers_thread():
    """Accelerate's DataLoaderDispatcher broadcasts each batch: it must never be read from another thread."""
    import threading

    readers = []

    def source():
        for i in range(6):
            readers.append(threading.current_thread().name)
            yield torch.tensor([i])

    got = [int(b) for b in StreamPrefetcher(list(source()), depth=2)]   # a list: read before
    readers.clear()
    got = [int(b) for b in StreamPrefetcher(_Regen(source), depth=2, source_issues_collectives=True)]
    assert got == list(range(6))
    assert set(readers) == {threading.current_thread().name}, readers
    readers.clear()
    list(StreamPrefetcher(_Regen(source), depth=2))
    assert set(readers) != {threading.current_thread().name}   # without the flag a thread reads it (CPU)


class _Regen:
    def __init__(self, fn):
        self.fn = fn

    def __iter__(self):
        return self.fn()


def test_source_issues_collectives_must_be_a_bool():
    with pytest.raises(TypeError, match="source_issues_collectives must be True or False"):
        StreamPrefetcher([1], source_issues_collectives="yes")
