"""A sharded optimizer's own state_dict() is this rank's shard: it loads back into the same layout, and
is refused by name in another (the whole form, `sync.optimizer_state_dict()`, is what moves)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from hfstream.gradsync import GradSync


def _local_round_trip(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    sync = GradSync(model, mode="sharded", bucket_mb=0)
    opt = sync.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    try:
        for step in range(2):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step + 10 * rank))).sum().backward()
            sync.finish()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync.wait_for_params()
        mine = copy.deepcopy(opt.state_dict())   # state_dict() holds the live tensors
        before = {k: {n: v.clone() for n, v in s.items()} for k, s in mine["state"].items()}
        for s in opt.state.values():   # wipe, then load this rank's own shard back
            for v in s.values():
                if torch.is_tensor(v):
                    v.zero_()
        opt.load_state_dict(mine)
        after = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}
        theirs = [None] * world_size
        dist.all_gather_object(theirs, mine)
        try:
            opt.load_state_dict(theirs[1 - rank])
            refused = None
        except ValueError as exc:
            refused = str(exc)
        return before, after, refused
    finally:
        sync.close()


@pytest.mark.multiprocess
def test_a_ranks_shard_loads_back_into_its_layout_and_is_refused_in_another(run_distributed):
    for rank, (before, after, refused) in enumerate(run_distributed(_local_round_trip, 2, timeout=90)):
        assert before and before.keys() == after.keys()
        for k, s in before.items():
            assert s.keys() == after[k].keys()
            for n, v in s.items():
                assert torch.equal(after[k][n], v), (rank, k, n)
        assert any(v.abs().sum() > 0 for s in before.values() for v in s.values() if v.dim() > 0)
        assert refused is not None and f"one rank's shard (rank {1 - rank} of 2" in refused, refused
        assert "sync.optimizer_state_dict()" in refused


class WithScalar(nn.Module):
    """A 0-dim parameter (CLIP's logit scale): its state's ``exp_avg`` and ``step`` have the same shape."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.lin(x) * self.scale


def _scalar_state(rank, world_size):
    torch.manual_seed(0)
    model, ref = WithScalar(), WithScalar()
    ref.load_state_dict(model.state_dict())
    sync = GradSync(model, mode="sharded", bucket_mb=0)   # the scalar alone in its bucket: rank 1 holds padding
    opt = sync.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    try:
        for step in range(3):   # the same batch on every rank: the mean gradient is the local one
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            for m, o in ((model, opt), (ref, ref_opt)):
                m(x).pow(2).mean().backward()
                if m is model:
                    sync.finish()
                o.step()
                o.zero_grad(set_to_none=True)
        whole = sync.optimizer_state_dict()
        # Loaded back (a resume), each piece's own state is as torch's AdamW makes it: a 0-dim step.
        opt.load_state_dict(whole)
        steps = [tuple(state["step"].shape) for state in opt.state.values()]
        return whole, ref_opt.state_dict(), steps
    finally:
        sync.close()


@pytest.mark.multiprocess
def test_a_scalar_parameters_step_stays_a_per_parameter_count_in_the_whole_state(run_distributed):
    for whole, ref, steps in run_distributed(_scalar_state, 2, timeout=90):
        assert steps and set(steps) == {()}, steps
        assert whole["param_groups"][0]["params"] == ref["param_groups"][0]["params"]
        assert whole["state"].keys() == ref["state"].keys() and len(ref["state"]) == 3
        for pid, s in ref["state"].items():
            assert whole["state"][pid].keys() == s.keys(), pid
            for k, v in s.items():
                assert whole["state"][pid][k].shape == v.shape, (pid, k)
                torch.testing.assert_close(whole["state"][pid][k], v, rtol=1e-6, atol=1e-7, msg=f"{pid} {k}")


def _frozen_state_round_trip(rank, world_size):
    # A stock checkpoint (an optimizer over every parameter) with state for a layer frozen when the run
    # resumes: the unsharded optimizer keeps that state and writes it into its next checkpoint.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    whole = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).sum().backward()
    whole.step()
    saved = copy.deepcopy(whole.state_dict())
    model.zero_grad(set_to_none=True)
    model[0].requires_grad_(False)
    sync = GradSync(model, mode="sharded", bucket_mb=0)
    opt = sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    try:
        opt.load_state_dict(saved)
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()
        sync.finish()
        opt.step()
        sync.wait_for_params()
        return saved, sync.optimizer_state_dict(keep=True)
    finally:
        sync.close()


@pytest.mark.multiprocess
def test_the_state_of_a_parameter_frozen_at_resume_is_kept_into_the_next_checkpoint(run_distributed):
    for saved, after in run_distributed(_frozen_state_round_trip, 2, timeout=90):
        assert sorted(after["state"]) == sorted(saved["state"]) == [0, 1, 2, 3]
        for pid in (0, 1):   # the frozen layer's: as loaded
            assert torch.equal(after["state"][pid]["momentum_buffer"], saved["state"][pid]["momentum_buffer"])
        assert not torch.equal(after["state"][2]["momentum_buffer"], saved["state"][2]["momentum_buffer"])
        assert after["param_groups"][0]["params"] == saved["param_groups"][0]["params"]
