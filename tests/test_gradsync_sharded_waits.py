"""Sharded mode's parameter waits: a gather a peer never joins fails within GradSync's timeout, named;
and the last bucket stays small (a short tail of reduce-scatter after backward)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import prune

from hfstream.gradsync import GradSync


def _peer_never_steps(rank, world_size, flag):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))
    sync = GradSync(model, mode="sharded", bucket_mb=0, timeout=3)
    opt = sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(4, 16)).sum().backward()
    sync.finish()
    if rank == 1:   # alive, but never steps (its slices never go out) until rank 0 is done waiting
        end = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < end:
            time.sleep(0.05)
        return None
    opt.step()
    t0 = time.monotonic()
    try:
        sync.wait_for_params()
        return "wait_for_params() returned", time.monotonic() - t0, []
    except RuntimeError as exc:
        # The gather may still write into its buffer once the peer joins: the buffer is kept alive with it.
        gathered = [st.shard.gathered for st in sync.bucket_states]
        kept = [any(buf is g for g in gathered) and work is not None for buf, work in sync._wiring.abandoned]
        return str(exc), time.monotonic() - t0, kept
    finally:
        open(flag, "w").close()


@pytest.mark.multiprocess
def test_a_gather_no_peer_joins_fails_within_the_timeout_naming_the_bucket(run_distributed, tmp_path):
    (message, waited, kept), _ = run_distributed(_peer_never_steps, 2, str(tmp_path / "done"), timeout=120,
                                                 pg_timeout_s=60)
    assert kept == [True], kept   # the one gather given up on, with the buffer it writes into
    assert "the all-gather of bucket" in message and "(parameters 0.weight" in message, message
    assert "did not complete" in message and "did not call optimizer.step()" in message, message
    # GradSync's own 3 s, not the process group's 60 s (the peer waits until this rank gave up).
    assert 2.5 < waited < 30, (message, waited)


def _bucket_bytes(rank, world_size):
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(24)])   # 24 layers of 0.25 MiB: 6 MiB
    sync = GradSync(model, mode="sharded", bucket_mb=4.0)
    try:
        return [b.nbytes for b in sync.buckets]
    finally:
        sync.close()


@pytest.mark.multiprocess
def test_the_sharded_last_bucket_is_at_most_a_mebibyte(run_distributed):
    # Buckets of 4 MiB, but the one backward fills last, whose reduce-scatter is what is left after
    # backward, holds at most 1 MiB: a short tail (DDP's small first bucket, at the other end).
    sizes, _ = run_distributed(_bucket_bytes, 2, timeout=60)
    small = [b for b in sizes if b <= 2**20 + 4096]
    assert max(sizes) > 2 * 2**20 and sizes[-1] <= 2**20 + 4096 and len(small) >= 3, sizes


def _rebuilt_by_a_pre_hook(rank, world_size):
    """torch.nn.utils.prune's pre-hook rebuilds ``weight`` from ``weight_orig``: it must read it gathered."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 1))
    prune.l1_unstructured(model[1], "weight", amount=0.5)   # registered before GradSync's hooks
    sync = GradSync(model, mode="sharded", bucket_mb=0)
    sync.keep_plan()
    opt = sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    bucket = next(st.plan.index for st in sync.bucket_states if "1.weight_orig" in st.plan.names)
    pending_when_rebuilt = []
    # Right behind prune's hook among the module's own pre-hooks (GradSync places its wait after the
    # first forward), so it sees the bucket as prune's hook saw it.
    model[1].register_forward_pre_hook(lambda *_: pending_when_rebuilt.append(bucket in sync.params_pending))
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        model(torch.randn(4, 16, generator=g)).square().mean().backward()
        sync.finish()
        opt.step()
        opt.zero_grad()
    sync.close()
    return pending_when_rebuilt


@pytest.mark.multiprocess
def test_a_weight_rebuilt_by_a_forward_pre_hook_reads_its_parameters_gathered(run_distributed):
    for rank, pending in enumerate(run_distributed(_rebuilt_by_a_pre_hook, 2, timeout=120)):
        assert len(pending) == 3 and pending[0] is False, pending   # the first forward: nothing in flight yet
        assert pending[1:] == [False, False], (
            f"rank {rank}: prune's pre-hook ran while the all-gather of weight_orig's bucket was in flight "
            f"({pending}): GradSync's wait must come first among the module's pre-hooks")


def _whole_gradients(rank, world_size, wire):
    """gather_gradients() after finish(): the whole mean gradient in .grad, views of the buckets' wire buffers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1), nn.Linear(1, 1))   # the last: unused
    sync = GradSync(model, mode="sharded", bucket_mb=0, comm_dtype=wire)
    opt = sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(rank)
    model[:3](torch.randn(4, 8, generator=g)).square().mean().backward()
    sync.finish()
    sync.reduction.gather_gradients()
    buffers = [st.buffer for st in sync.bucket_states]
    in_buffers = {n: any(p.grad.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in buffers)
                  for n, p in model.named_parameters() if p.grad is not None}
    none = sorted(n for n, p in model.named_parameters() if p.grad is None)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    sync.close()
    return in_buffers, none, grads


@pytest.mark.multiprocess
@pytest.mark.parametrize("wire", [None, "bf16"])
def test_gathered_whole_gradients_live_in_the_bucket_buffers_and_idle_ones_stay_none(run_distributed, wire):
    (views0, none0, grads0), (views1, none1, grads1) = run_distributed(_whole_gradients, 2, wire, timeout=120)
    assert none0 == none1 == ["3.bias", "3.weight"]   # no rank used it: None, as DDP leaves it
    for k in grads0:
        assert torch.equal(grads0[k], grads1[k]), k   # every rank holds the same whole mean
    # On the parameters' own dtype no new memory: .grad are views of the wire buffers; a bf16 wire's
    # buffer has another dtype, so there it is a tensor of its own.
    assert all(views0.values()) if wire is None else not any(views0.values()), views0
