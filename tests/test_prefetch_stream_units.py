"""`StagedEpoch`'s parts, one at a time, on the fake streams of `test_prefetch.py` (meta device).

What `test_prefetch.py` checks through `StreamPrefetcher` (order, one wait per batch, depth
ahead) is not repeated; these hold the rest: every copied tensor recorded on the consumer's
stream, pinning (and giving up on it only when asked to), the timings folded oldest first and
only once completed, the note for batches already on the device, a staging failure delivered
after the batches before it, and `close()` dropping what was staged.
"""

from __future__ import annotations

import collections

import pytest
import torch

from hfstream.prefetch.epoch import PrefetchStats
from hfstream.prefetch.stream import StagedEpoch, read_timings
from test_prefetch import FakeStream, fake_accelerator  # noqa: F401 - the fixture is used by name

META = torch.device("meta")


def staged(log, source, depth=2, pin=False, auto_pin=False, timings=None, notes=None, skip=frozenset()):
    return StagedEpoch(iter(source), META, skip, depth, PrefetchStats(), side=FakeStream("side", log),
                       non_blocking=True, pin=pin, auto_pin=auto_pin, timings=timings,
                       note=(notes.append if notes is not None else (lambda msg: None)))


def batches(n, shapes=((3,), (2, 2))):
    return [{"a": torch.ones(shapes[0]), "b": torch.zeros(shapes[1]), "i": i} for i in range(n)]


def test_every_copied_tensor_is_recorded_on_the_consumers_stream(fake_accelerator):
    log = fake_accelerator
    out = list(staged(log, batches(4, shapes=((3,), (5,)))))
    assert len(out) == 4
    recorded = [e for e in log if e[0] == "record_stream"]
    assert [r[2] for r in recorded] == [torch.Size([3]), torch.Size([5])] * 4
    assert {r[3] for r in recorded} == {"consumer"}


class Pins:
    """Stands in for ``Tensor.pin_memory``: counts the calls, fails or hands back a marked copy."""

    def __init__(self, fails: bool):
        self.calls, self.fails, self.made = 0, fails, set()

    def __call__(self, t):
        self.calls += 1
        if self.fails:
            raise RuntimeError("Cannot access accelerator device when none is available.")
        c = t.clone()
        self.made.add(id(c))
        return c


def test_host_tensors_are_pinned_before_their_copy_but_not_skipped_ones(fake_accelerator, monkeypatch):
    pins = Pins(fails=False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a, **k: pins(t))
    src = batches(3)
    out = list(staged(fake_accelerator, src, pin=True, skip=frozenset({"b"})))
    assert len(out) == 3
    assert pins.calls == 3        # one "a" a batch; "b" is skipped, "i" is not a tensor
    assert all(b["b"] is s["b"] for b, s in zip(out, src, strict=True))


def test_auto_pin_stops_trying_after_the_first_refusal_and_still_copies(fake_accelerator, monkeypatch):
    pins = Pins(fails=True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a, **k: pins(t))
    out = list(staged(fake_accelerator, batches(5), pin=True, auto_pin=True))
    assert [b["i"] for b in out] == list(range(5))
    assert all(b["a"].device == META for b in out)
    assert pins.calls == 1        # not once per tensor: the backend cannot pin, so it stops asking


def test_pin_memory_true_where_the_backend_cannot_pin_raises_at_the_first_step(fake_accelerator, monkeypatch):
    pins = Pins(fails=True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a, **k: pins(t))
    it = staged(fake_accelerator, batches(3), pin=True, auto_pin=False)
    with pytest.raises(RuntimeError, match="accelerator"):
        next(it)


def test_a_staging_failure_is_delivered_after_the_batches_staged_before_it(fake_accelerator, monkeypatch):
    calls = [0]

    def pin_third(t, *a, **k):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("out of pinned memory")
        return t.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_third)
    it = staged(fake_accelerator, batches(6), depth=4, pin=True, skip=frozenset({"b"}))
    assert [next(it)["i"], next(it)["i"]] == [0, 1]
    with pytest.raises(RuntimeError, match="out of pinned memory"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_batches_already_on_the_device_are_said_once_per_batch_to_the_note(fake_accelerator):
    notes: list = []
    src = [{"x": torch.ones(2, device=META)} for _ in range(2)]
    out = list(staged(fake_accelerator, src, notes=notes))
    assert [b["x"] is s["x"] for b, s in zip(out, src, strict=True)] == [True, True]
    assert len(notes) == 2 and "already on meta" in notes[0]      # the prefetcher's note says it once
    notes.clear()
    list(staged(fake_accelerator, batches(2), notes=notes))
    assert notes == []            # batches it copies are not noted
    list(staged(fake_accelerator, [{"i": 1}, {"i": 2}], notes=notes))
    assert notes == []            # nor batches without tensors


def test_close_drops_the_staged_batches_and_ends_the_epoch(fake_accelerator):
    it = staged(fake_accelerator, batches(8), depth=3)
    next(it)
    assert len(it._staged) == 3
    it.close()
    assert len(it._staged) == 0
    assert it._source is None     # a DataLoader iterator is let go of, so its workers can stop
    with pytest.raises(StopIteration):
        next(it)


class Ev:
    def __init__(self, t_ms, ready=True):
        self.t_ms, self.ready = t_ms, ready

    def query(self):
        return self.ready

    def elapsed_time(self, end):
        assert end.ready, "elapsed_time read on an event still pending"
        return end.t_ms - self.t_ms


def test_read_timings_folds_the_completed_copies_oldest_first_and_stops_at_a_pending_one():
    stats = PrefetchStats()
    q = collections.deque([(Ev(0), Ev(2), 4_000_000), (Ev(10), Ev(14), 4_000_000),
                           (Ev(20), Ev(21, ready=False), 8), (Ev(30), Ev(31), 8)])
    read_timings(q, stats)
    assert stats.copies_timed == 2 and len(q) == 2
    assert stats.copy_ms == 4 and stats.copy_ms_total == 6     # the newest of the completed
    assert stats.copy_gbps == pytest.approx(1.0, rel=1e-12)    # 4 MB in 4 ms: 1 GB/s
    q[0][1].ready = True
    read_timings(q, stats)
    assert stats.copies_timed == 4 and not q
    assert stats.copy_ms == 1 and stats.copy_ms_total == 8
    assert stats.copy_gbps == pytest.approx(8e-6, rel=1e-12)   # 8 bytes in 1 ms


def test_a_zero_length_copy_has_no_rate():
    stats = PrefetchStats()
    read_timings(collections.deque([(Ev(5), Ev(5), 100)]), stats)
    assert stats.copy_ms == 0 and stats.copy_gbps is None and stats.copies_timed == 1


def test_timed_copies_record_a_start_event_and_untimed_ones_none(fake_accelerator):
    log = fake_accelerator
    timings: collections.deque = collections.deque()
    it = staged(log, batches(3), depth=1, timings=timings)
    for _ in it:
        pass
    assert it._stats.copies_timed == 3 and it._stats.copy_ms == 2.0   # FakeEvent.elapsed_time
    assert sum(e[0] == "record" for e in log) == 6                   # start and done per batch
    log.clear()
    it = staged(log, batches(3), depth=1, timings=None)
    for _ in it:
        pass
    assert it._stats.copies_timed == 0 and it._stats.copy_ms is None
    assert sum(e[0] == "record" for e in log) == 3                   # done only
