"""Host reads in the overlap path: a parameter unused on a rank costs one read a step, not one per bucket.

Issue 29: `AllReduce.reduced` read each bucket's used flags to the host with ``.tolist()``, a
device-to-host sync per bucket with a parameter unused here (MoE experts, unused heads), every step.
DDP reads its used map once per step; so does GradSync now (`AllReduce.all_reduced`). On CPU the
read is no sync, so the test counts the reads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hfstream.gradsync import GradSync


class TwoSideBranches(nn.Module):
    """Two side branches used on rank 1 only; at ``bucket_mb=0`` each parameter is its own bucket."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.side_a, self.side_b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, use_sides):
        h = self.a(x) + (self.side_a(x) if use_sides else 0)
        h = self.b(h) + (self.side_b(x) if use_sides else 0)
        return self.c(h).sum()


def _reads_per_step(rank, world_size, steps=5):
    torch.manual_seed(0)
    model = TwoSideBranches()
    sync = GradSync(model, bucket_mb=0)
    reads, counting = [0], [False]
    tolist = torch.Tensor.tolist

    def counted(t):
        if counting[0]:
            reads[0] += 1
        return tolist(t)

    torch.Tensor.tolist = counted
    try:
        per_step, side = [], []
        for step in range(steps):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank)),
                  use_sides=rank == 1).backward()
            flagged = sum(1 for st in sync._states if not all(st.used))   # with a parameter unused here
            reads[0], counting[0] = 0, True
            sync.finish()
            counting[0] = False
            per_step.append(reads[0])
            side.append([model.side_a.weight.grad.clone(), model.side_b.weight.grad.clone()])
            model.zero_grad(set_to_none=True)
    finally:
        torch.Tensor.tolist = tolist
        sync.close()
    return {"reads": per_step, "side": side, "flagged": flagged, "buckets": len(sync.buckets)}


@pytest.mark.multiprocess
def test_unused_parameters_in_two_buckets_cost_one_host_read_a_step(run_distributed):
    r0, r1 = run_distributed(_reads_per_step, 2, timeout=120)
    # Ten parameters, ten buckets; the side branches' four (weights, biases) unused on rank 0.
    assert r0["buckets"] == 10 and r0["flagged"] == 4, r0
    assert r1["flagged"] == 0
    # After the first steps (the arrival order is read once), one read a step where four buckets need
    # their flags, none where every parameter was used.
    assert r0["reads"][2:] == [1, 1, 1], r0["reads"]
    assert r1["reads"][2:] == [0, 0, 0], r1["reads"]
    # And the flags were read right: rank 0 holds rank 1's gradient of the branches it never ran.
    assert len(r0["side"]) == len(r1["side"]) == 5
    for mine, theirs in zip(r0["side"], r1["side"]):
        for g0, g1 in zip(mine, theirs):
            assert g0.abs().sum() > 0 and torch.equal(g0, g1)


def _old_gradient_kept(rank, world_size):
    """Step 0 runs the side branches on every rank; step 1 on none, with no zero_grad between."""
    torch.manual_seed(0)
    model = TwoSideBranches()
    sync = GradSync(model, bucket_mb=0)
    try:
        seen = []
        for step, sides in enumerate((True, True, False)):
            if step == 2:
                before = model.side_a.weight.grad.clone()
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x, use_sides=sides).backward()
            sync.finish()
            seen.append(model.side_a.weight.grad.clone())
            if step == 0:
                model.zero_grad(set_to_none=True)   # step 1 starts fresh; step 2 keeps step 1's gradients
        return {"before": before, "after": seen[2], "a": model.a.weight.grad.clone()}
    finally:
        sync.close()


@pytest.mark.multiprocess
def test_a_parameter_no_rank_used_keeps_its_old_gradient_as_ddp_leaves_it(run_distributed):
    # Step 1's mean sits in the bucket's buffer as side_a's .grad (a view); in step 2 no rank runs
    # side_a, so DDP leaves its .grad as it was. Packing must not divide that view in place, nor write
    # the all-reduced sum of the old gradients over it. Three ranks: on two, old / 2 + old / 2 is old
    # exactly, and so a pack that divided the view in place would still read right.
    for r in run_distributed(_old_gradient_kept, 3, timeout=120):
        assert r["before"].abs().sum() > 0
        assert torch.equal(r["after"], r["before"]), (r["after"] - r["before"]).abs().max()
        assert r["a"].abs().sum() > 0
