"""Effect: the prefetcher stays ``depth`` batches ahead, ``batches_per_step`` under accumulation.

The source records how many batches it has handed out. While the consumer holds batch k, the
background thread must have taken batches up to k + look-ahead from the source, and never more.
No timing: the test waits on the source's own counter (a generous guard only against a hang).
A prefetcher that ignores its depth (or the accumulation) takes fewer and the wait fails.
"""

from __future__ import annotations

import threading

import pytest
import torch

from hfstream.prefetch.prefetcher import StreamPrefetcher

N = 10
GUARD_S = 30.0   # a hang guard, not a speed threshold


class Counting:
    def __init__(self):
        self.taken = 0
        self.cond = threading.Condition()

    def __iter__(self):
        for i in range(N):
            with self.cond:
                self.taken += 1
                self.cond.notify_all()
            yield {"x": torch.full((2,), float(i))}

    def __len__(self):
        return N

    def wait_for(self, n):
        with self.cond:
            return self.cond.wait_for(lambda: self.taken >= n, timeout=GUARD_S)


@pytest.mark.parametrize("depth, per_step, ahead", [(2, 1, 2), (2, 4, 4)])
def test_the_thread_stays_its_look_ahead_in_front_and_no_further(depth, per_step, ahead):
    source = Counting()
    got = []
    with StreamPrefetcher(source, device="cpu", depth=depth, batches_per_step=per_step) as pre:
        for k, batch in enumerate(pre):
            want = min(N, k + 1 + ahead)
            assert source.wait_for(want), f"batch {k}: only {source.taken} taken, look-ahead {ahead}"
            assert source.taken <= want + 1 if k + 1 + ahead < N else source.taken == N   # not unbounded
            got.append(int(batch["x"][0]))
    assert got == list(range(N))
