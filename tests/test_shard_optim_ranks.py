"""`shard_optim` on 2 gloo ranks: the clip's norm across ranks, and a second `shard_optimizer` of one optimizer.

The clip is held against ``torch.nn.utils.clip_grad_norm_`` on all ranks' pieces together, with
the largest gradient on one rank only (the max norm must come from the other rank too), and its
``error_if_nonfinite`` both ways. A second ``shard_optimizer`` (the Trainer's second ``train()``)
keeps only the new pieces' state, and frees the old layout's before the whole state is loaded
into the new pieces (else this rank's optimizer state is held twice at that peak).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

pytestmark = pytest.mark.multiprocess


def _pieces(rank):
    # Rank 0 holds parameters 0 and 1 whole; rank 1 holds parameter 2 whole. The largest gradient is on rank 1.
    g = torch.Generator().manual_seed(rank)
    sizes = [(4,), (3,)] if rank == 0 else [(5,)]
    tensors = []
    for size in sizes:
        t = torch.zeros(size, requires_grad=True)
        t.grad = torch.randn(size, generator=g) * (10.0 if rank == 1 else 1.0)
        tensors.append(t)
    owners = [(0, True), (1, True)] if rank == 0 else [(2, True)]
    return tensors, owners


def clip_across_ranks(rank, world_size):
    from hfstream.gradsync.sharded.optim import clip_grad_norm_

    out = {}
    for norm_type in (2.0, math.inf):
        tensors, owners = _pieces(rank)
        before = [t.grad.clone() for t in tensors]
        total = clip_grad_norm_(tensors, owners, 3, dist.group.WORLD, 1.0, norm_type)
        everyone = [None] * world_size
        dist.all_gather_object(everyone, before)
        out[norm_type] = (total, [t.grad.clone() for t in tensors], [g for per in everyone for g in per])
    tensors, owners = _pieces(rank)
    clip_grad_norm_(tensors, owners, 3, dist.group.WORLD, 1.0, 2.0, error_if_nonfinite=True)   # finite: no error
    tensors, owners = _pieces(rank)
    if rank == 1:
        tensors[0].grad[0] = float("inf")
    out["nonfinite"] = clip_grad_norm_(tensors, owners, 3, dist.group.WORLD, 1.0, 2.0)   # scaled anyway, as stock
    tensors, owners = _pieces(rank)
    if rank == 1:
        tensors[0].grad[0] = float("nan")
    try:
        clip_grad_norm_(tensors, owners, 3, dist.group.WORLD, 1.0, 2.0, error_if_nonfinite=True)
        out["raised"] = None
    except RuntimeError as exc:
        out["raised"] = str(exc)
    return out


def test_the_clip_takes_every_ranks_gradients_as_stock_takes_them_all(run_distributed):
    ranks = run_distributed(clip_across_ranks, 2, timeout=60)
    for rank, out in enumerate(ranks):
        for norm_type in (2.0, math.inf):
            total, clipped, everything = out[norm_type]
            ref = [torch.zeros_like(g, requires_grad=True) for g in everything]
            for t, g in zip(ref, everything):
                t.grad = g.clone()
            want = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type)
            assert torch.equal(total, want), (rank, norm_type, total, want)
            mine = ref[:2] if rank == 0 else ref[2:]
            for got, t in zip(clipped, mine):
                torch.testing.assert_close(got, t.grad, rtol=0, atol=0)
        assert math.isinf(out["nonfinite"]) and out["raised"].startswith("The total norm of order 2.0")


def clip_as_a_parameter_thaws(rank, world_size):
    """Parameter 2 (rank 1's, the largest gradient) has none in step 0 and one in step 1."""
    from hfstream.gradsync.sharded.optim import clip_grad_norm_

    out = []
    for frozen in (True, False):
        tensors, owners = _pieces(rank)
        if rank == 1 and frozen:
            tensors[0].grad = None
        everyone = [None] * world_size
        dist.all_gather_object(everyone, [t.grad for t in tensors])
        ref = [torch.zeros_like(g, requires_grad=True) for per in everyone for g in per if g is not None]
        for t, g in zip(ref, (g for per in everyone for g in per if g is not None)):
            t.grad = g.clone()
        ours = clip_grad_norm_(tensors, owners, 3, dist.group.WORLD, 1.0)
        out.append((ours, torch.nn.utils.clip_grad_norm_(ref, 1.0)))
    return out


def test_a_parameter_that_thaws_on_another_rank_counts_in_the_norm_at_once(run_distributed):
    # Rank 0 holds no piece of parameter 2: its pieces are the same in both steps, and only the reduced
    # table tells it that parameter 2 has a gradient again. Rank 1 sees it in its own pieces.
    ranks = run_distributed(clip_as_a_parameter_thaws, 2, timeout=60)
    for rank, ((frozen, want_frozen), (thawed, want_thawed)) in enumerate(ranks):
        assert torch.equal(frozen, want_frozen), (rank, frozen, want_frozen)
        assert thawed > 3 * frozen   # rank 1's gradients are ten times the others'
        torch.testing.assert_close(thawed, want_thawed, rtol=1e-6, atol=0)
    assert torch.equal(ranks[1][1][0], ranks[1][1][1])   # the rank that saw it in its pieces: stock's bits


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def second_shard(rank, world_size):
    from hfstream.gradsync import GradSync

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out, at_load = {}, []
    # What the optimizer still holds when the whole state is loaded into the new pieces: the old
    # layout's state must be freed first, or the peak holds this rank's state twice over.
    optimizer.register_load_state_dict_pre_hook(lambda opt, sd: at_load.append(len(opt.state)))
    for run in range(2):
        sync = GradSync(model, mode="sharded", bucket_mb=0.0001)
        sync.shard_optimizer(optimizer)
        for step in range(2):
            g = torch.Generator().manual_seed(10 * step + rank)
            model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
            sync.finish()
            optimizer.step()
            optimizer.zero_grad()
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        out[run] = (len(optimizer.state), sum(id(k) in held for k in optimizer.state))
        sync.close()
    out["at_load"] = at_load
    return out


def test_a_second_shard_of_one_optimizer_keeps_only_the_new_pieces_state(run_distributed):
    for out in run_distributed(second_shard, 2, timeout=60):
        for run in (0, 1):
            entries, of_current_pieces = out[run]
            assert entries > 0 and entries == of_current_pieces, (run, out[run])
        assert out["at_load"] == [0], out["at_load"]   # the second shard loads the whole state, with nothing left
