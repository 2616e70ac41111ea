"""`StreamPrefetcher`'s settings and its close(), as documented: what the mutation run found untested.

- ``depth`` defaults to 2; under accumulation it is raised to ``batches_per_step``, and says so
  once, only when it was raised; ``batches_per_step`` must be an int >= 1;
- ``close()`` after an epoch that the garbage collector closed (a ``break``) still waits for its
  thread, which may be inside ``next(source)``: nobody may call ``iter(iterable)`` again before.
"""

from __future__ import annotations

import threading

import pytest
import torch

import hfstream.prefetch.prefetcher as prefetch
from hfstream.prefetch.prefetcher import THREAD_PREFIX, StreamPrefetcher

GUARD_S = 30.0   # a hang guard, not a speed threshold


def test_depth_defaults_to_two():
    assert StreamPrefetcher([{"x": torch.zeros(1)}], device="cpu").depth == 2


@pytest.mark.parametrize("depth, per_step, want, said", [(2, 4, 4, True), (4, 4, 4, False), (6, 4, 6, False),
                                                          (0, 4, 0, False)])
def test_depth_is_raised_to_a_steps_batches_and_the_raise_is_said(monkeypatch, depth, per_step, want, said):
    messages = []
    monkeypatch.setattr(prefetch, "_say_once", lambda message, *a: messages.append(message))
    pre = StreamPrefetcher([{"x": torch.zeros(1)}], device="cpu", depth=depth, batches_per_step=per_step)
    assert pre.depth == want
    assert [m for m in messages if "raised to" in m] == (
        [f"StreamPrefetcher: depth {depth} raised to {want}, the batches a step pulls at once "
         f"(gradient accumulation): with fewer in flight the step's first forward would wait for "
         f"the copies of its last micro-batches, issued at that pull"] if said else [])


@pytest.mark.parametrize("per_step", [0, -1, True, 1.5, "2"])
def test_batches_per_step_must_be_a_positive_int(per_step):
    with pytest.raises(ValueError, match="batches_per_step"):
        StreamPrefetcher([], device="cpu", batches_per_step=per_step)


def test_close_waits_for_the_thread_of_an_epoch_the_garbage_collector_closed():
    inside, release = threading.Event(), threading.Event()

    def source():
        yield {"x": torch.zeros(1)}
        inside.set()
        release.wait(GUARD_S)        # still inside next(source) when the epoch is dropped
        yield {"x": torch.ones(1)}

    pre = StreamPrefetcher(source(), device="cpu", depth=1)
    for _ in pre:
        break                        # the epoch is collected: closed without a join
    assert inside.wait(GUARD_S)
    timer = threading.Timer(0.2, release.set)   # the source returns a little later
    timer.start()
    pre.close()                      # must wait for it
    alive = [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]
    timer.join()
    assert release.is_set() and not alive, alive
