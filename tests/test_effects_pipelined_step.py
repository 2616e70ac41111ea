"""Effect: mode="sharded" launches each bucket's all-gather inside the step, bucket by bucket.

Read from inside the optimizer's own per-bucket steps (a recording SGD): when the last bucket's
pieces are stepped, the buckets stepped before it already have their all-gathers in flight
(``params_pending``). With the step run in one call and the gathers launched after it (the
closure path, or a pre-hook that misreads its arguments) the record has one call and nothing
pending, while the parameters come out equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hfstream.gradsync import GradSync
from hfstream.testing import run_on_ranks


class RecordingSGD(torch.optim.SGD):
    """SGD that records, per call of its step, how many pieces it steps and which gathers are in flight."""

    sync = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.record = []

    def step(self, closure=None):
        n = sum(len(g["params"]) for g in self.param_groups)
        self.record.append((n, sorted(self.sync.params_pending)))
        raw = torch.optim.SGD.step
        if getattr(raw, "hooked", False):   # patched by torch: the step without the hooks
            raw = raw.__wrapped__
        return raw(self, closure)


def pipelined(rank, world_size, closure, root_waits=False):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    sync = GradSync(model, mode="sharded", bucket_mb=0)   # one bucket per parameter
    opt = RecordingSGD(model.parameters(), lr=0.1)
    opt.sync = sync
    opt = sync.shard_optimizer(opt)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    sync.finish()
    opt.record.clear()
    if closure:
        opt.step(lambda: None)
    else:
        opt.step()
    record = list(opt.record)
    after = sorted(sync.params_pending)
    # The next forward waits layer by layer: when the first layer runs (this hook is registered
    # after GradSync's wait), only its own buckets have been waited for.
    per_layer = []
    handles = [layer.register_forward_pre_hook(lambda m, a, i=i: per_layer.append(len(sync.params_pending)))
               for i, layer in enumerate(model)]
    if root_waits:   # the hand-made mutant: wait for every gather at the root
        handles.append(model.register_forward_pre_hook(lambda m, a: sync.wait_for_params(), prepend=True))
    out = model(x)
    for handle in handles:
        handle.remove()
    sync.wait_for_params()
    return {"record": record, "after": after, "num_buckets": len(sync.buckets), "per_layer": per_layer,
            "params": [p.detach().clone() for p in model.parameters()], "out": out.detach()}


def both(rank, world_size):
    return (pipelined(rank, world_size, False), pipelined(rank, world_size, True),
            pipelined(rank, world_size, False, root_waits=True))


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(both, 2, timeout=90)


def test_gathers_are_launched_inside_the_step_bucket_by_bucket(runs):
    for piecewise, whole, _ in runs:
        n = piecewise["num_buckets"]
        assert n > 1
        stepped = [(k, pending) for k, pending in piecewise["record"] if k]
        assert len(stepped) == n, f"one step call per bucket, got {piecewise['record']}"
        # before each bucket's pieces are stepped, every bucket stepped before it is gathering
        assert [len(pending) for _, pending in stepped] == list(range(n))
        assert stepped[-1][1], "the first buckets' gathers in flight while the last bucket is stepped"
        assert piecewise["after"] == whole["after"] and len(piecewise["after"]) == n
        # the one-call path (a closure) really is the other path: one call, nothing in flight yet
        assert [(k, p) for k, p in whole["record"] if k] == [(whole["record"][0][0], [])]
        for a, b in zip(piecewise["params"], whole["params"], strict=True):
            assert torch.equal(a, b)


def test_the_next_forward_waits_bucket_by_bucket_later_buckets_still_in_flight(runs):
    for piecewise, _, root in runs:
        n = piecewise["num_buckets"]
        per_layer = piecewise["per_layer"]   # one Linear = two buckets (weight, bias)
        assert per_layer == [n - 2 * (i + 1) for i in range(4)], per_layer
        assert root["per_layer"] == [0, 0, 0, 0]   # the mutant: everything waited at the root
        assert torch.equal(piecewise["out"], root["out"])
