"""GradSync under what user training steps do (2 gloo ranks, in seconds): DDP's rules held by effect.

- buffers are broadcast before a forward that follows a synchronised one (DDP's
  ``require_forward_param_sync``): under accumulation, before each step's first micro-batch only;
- ``after_backward`` runs at the end of every synchronised backward (the autograd engine's final
  callback, as DDP's ``finalize_backward``), so code between two backwards of one step reads the
  mean gradient, and a second backward adds its mean to it (FGM), in overlap and sharded mode.

The Trainer-level scenarios against stock DDP are in test_trainer_user_steps.py (slow).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hfstream import GradSync
from hfstream.gradsync import sync as sync_module
from test_gradsync_order import WithRunningStats

pytestmark = pytest.mark.multiprocess


def _x(step, rank):
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def broadcasts_per_forward(rank, world_size, broadcast=True):
    torch.manual_seed(0)
    model = WithRunningStats()
    sync = GradSync(model, bucket_mb=1.0, broadcast_buffers=broadcast)
    calls = []
    real = sync_module.broadcast_from_rank0
    sync_module.broadcast_from_rank0 = lambda *a, **k: (calls.append(len(seen)), real(*a, **k))[1]
    seen = []
    for step in range(3):
        for micro in range(2):
            seen.append((step, micro))
            if micro == 0:
                with sync.no_sync():
                    model(_x(step, rank)).pow(2).mean().backward()
            else:
                model(_x(step, rank)).pow(2).mean().backward()
                sync.finish()
    sync_module.broadcast_from_rank0 = real
    return [seen[i - 1] for i in calls]


def test_buffers_are_broadcast_before_the_first_micro_batch_of_each_step_only(run_distributed):
    for got in run_distributed(broadcasts_per_forward, 2, timeout=90):
        assert got == [(0, 0), (1, 0), (2, 0)], got


def sharded_broadcasts(rank, world_size, broadcast):
    from hfstream.gradsync import broadcast as broadcast_module

    torch.manual_seed(0)
    model = WithRunningStats()
    sync = GradSync(model, bucket_mb=1.0, mode="sharded", broadcast_buffers=broadcast)
    opt = sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    real = broadcast_module.launch_from_rank0
    broadcast_module.launch_from_rank0 = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        for step in range(3):
            model(_x(step, rank)).pow(2).mean().backward()
            sync.finish()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync.wait_for_params()
    finally:
        broadcast_module.launch_from_rank0 = real
        sync.close()
    return len(calls)


@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_are_broadcast_only_when_asked(run_distributed, broadcast):
    for got in run_distributed(broadcasts_per_forward, 2, broadcast, timeout=90):
        assert got == ([(0, 0), (1, 0), (2, 0)] if broadcast else []), got
    # Sharded, if asked to: one before each of the 3 training forwards, as DDP (round 5: at the
    # forward, on a group beside the gathers, not sent ahead by the step); none after the last step
    # (no forward follows it, and DDP leaves each rank its own buffers there); if not, none.
    for sent in run_distributed(sharded_broadcasts, 2, broadcast, timeout=90):
        assert sent == (3 if broadcast else 0), sent


def _mean_grads(model, xs, world_size):
    """Reference: each rank's gradient of its own batch, averaged by hand with all_reduce."""
    model.zero_grad()
    model(xs).pow(2).mean().backward()
    out = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        out[n] = g / world_size
    model.zero_grad()
    return out


def _model_and_means(rank, world_size):
    """A small MLP, and the mean gradients of batches 1 and 2 on a copy of it (the references)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    ref.load_state_dict(model.state_dict())
    return model, _mean_grads(ref, _x(1, rank), world_size), _mean_grads(ref, _x(2, rank), world_size)


def two_backwards(rank, world_size, mode):
    model, mean1, mean2 = _model_and_means(rank, world_size)

    sync = GradSync(model, bucket_mb=0.0002, mode=mode)
    optimizer = sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.0)) if mode == "sharded" else None
    ended, seen = [], {}

    def after_backward():
        sync.finish()
        ended.append(len(ended))
        if mode == "sharded":
            sync.reduction.gather_gradients()   # what the Trainer does for a step that reads .grad
        seen[len(ended)] = {n: p.grad.clone() for n, p in model.named_parameters()}

    sync.after_backward = after_backward
    model(_x(1, rank)).pow(2).mean().backward()
    first = seen.get(1)
    model(_x(2, rank)).pow(2).mean().backward()
    if optimizer is not None:
        sync.reduction.scatter_gradients()
    return ended, first, seen.get(2), mean1, mean2


@pytest.mark.parametrize("mode", ["overlap", "sharded"])
def test_each_backward_ends_with_the_mean_gradient_and_a_second_adds_its_mean(run_distributed, mode):
    for ended, first, second, mean1, mean2 in run_distributed(two_backwards, 2, mode, timeout=90):
        assert ended == [0, 1]                 # called once at the end of each backward
        assert first is not None and sorted(first) == sorted(mean1)
        for n in mean1:
            torch.testing.assert_close(first[n], mean1[n], rtol=1e-5, atol=1e-6, msg=n)
            torch.testing.assert_close(second[n], mean1[n] + mean2[n], rtol=1e-5, atol=1e-6, msg=n)


def sharded_slices_accumulate(rank, world_size):
    model, mean1, mean2 = _model_and_means(rank, world_size)
    sync = GradSync(model, bucket_mb=0.0002, mode="sharded")
    sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))

    def after_backward():
        sync.finish()
        sync.reduction.accumulate = True   # a further backward of this step adds to the slices

    sync.after_backward = after_backward
    model(_x(1, rank)).pow(2).mean().backward()
    model(_x(2, rank)).pow(2).mean().backward()
    sync.reduction.gather_gradients()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, mean1, mean2


def test_under_sharded_a_second_backward_adds_its_mean_to_the_slices(run_distributed):
    for got, mean1, mean2 in run_distributed(sharded_slices_accumulate, 2, timeout=90):
        assert sorted(got) == sorted(mean1)
        for n in mean1:
            torch.testing.assert_close(got[n], mean1[n] + mean2[n], rtol=1e-5, atol=1e-6, msg=n)


class TwoExperts(nn.Module):
    """A router-free stand-in for MoE: rank 1's batches reach expert ``a`` only (``b`` gets no gradient there)."""

    def __init__(self, reentrant_head: bool = False):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.reentrant_head = reentrant_head

    def forward(self, x, use_b=True):
        h = self.a(x) + (self.b(x) if use_b else 0)
        if self.reentrant_head:   # the first gradients arrive in a nested graph task
            return torch.utils.checkpoint.checkpoint(self.head, h, use_reentrant=True)
        return self.head(h)


def backward_end_with_an_unused_expert(rank, world_size, mode, reentrant_head):
    torch.manual_seed(0)
    model = TwoExperts(reentrant_head)
    sync = GradSync(model, bucket_mb=0.0002, mode=mode)
    if mode == "sharded":
        sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    ended = []

    def after_backward():
        sync.finish()
        if mode == "sharded":
            sync.reduction.gather_gradients()
        ended.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})

    sync.after_backward = after_backward
    x = _x(1, rank).requires_grad_(reentrant_head)   # reentrant checkpointing needs an input that requires grad
    model(x, use_b=rank == 0).pow(2).mean().backward()
    calls_in_backward = len(ended)
    sync.after_backward = None
    # The reference: each rank's own gradient (zeros for b on rank 1), then their mean.
    ref = TwoExperts()
    ref.load_state_dict(model.state_dict())
    ref(_x(1, rank), use_b=rank == 0).pow(2).mean().backward()
    mean = {}
    for n, p in ref.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        mean[n] = g / world_size
    return calls_in_backward, ended[0] if ended else None, mean


@pytest.mark.parametrize("mode,reentrant_head", [("overlap", False), ("sharded", False), ("overlap", True)])
def test_a_backward_where_a_parameter_got_no_gradient_still_ends_with_the_mean(run_distributed, mode, reentrant_head):
    # [Note: a backward's end]: code after backward() reads the mean on every rank, also on the rank
    # whose batch reached no token to expert b (seed 145 of the generated setups read its own there),
    # and once only where the first gradients arrive in a nested (reentrant checkpoint) graph task.
    for rank, (calls, grads, mean) in enumerate(run_distributed(backward_end_with_an_unused_expert, 2, mode,
                                                                reentrant_head, timeout=90)):
        assert calls == 1, f"rank {rank}: after_backward ran {calls} times inside backward()"
        for n in mean:
            torch.testing.assert_close(grads[n], mean[n], rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {n}")


def sharded_second_backward_without_an_expert(rank, world_size):
    torch.manual_seed(0)
    model = TwoExperts()
    ref = TwoExperts()
    ref.load_state_dict(model.state_dict())
    sync = GradSync(model, bucket_mb=0.0002, mode="sharded")
    sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))

    def after_backward():
        sync.finish()
        sync.reduction.accumulate = True   # a further backward of this step adds to the slices

    sync.after_backward = after_backward
    model(_x(1, rank)).pow(2).mean().backward()                # every parameter used
    model(_x(2, rank), use_b=False).pow(2).mean().backward()   # expert b used by no rank
    sync.reduction.gather_gradients()
    got = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    ref(_x(1, rank)).pow(2).mean().backward()
    ref(_x(2, rank), use_b=False).pow(2).mean().backward()
    mean = {}
    for n, p in ref.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        mean[n] = g / world_size
    return got, mean


def test_under_sharded_a_parameter_the_second_backward_left_unused_keeps_the_first_backwards_mean(run_distributed):
    # The used flags of a further backward are OR-ed with the step's earlier ones (`_used_before`):
    # expert b, used by the first backward only, is still stepped with that backward's mean.
    for rank, (got, mean) in enumerate(run_distributed(sharded_second_backward_without_an_expert, 2, timeout=90)):
        for n in mean:
            assert got[n] is not None, f"rank {rank}: {n} lost the first backward's gradient"
            torch.testing.assert_close(got[n], mean[n], rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {n}")
