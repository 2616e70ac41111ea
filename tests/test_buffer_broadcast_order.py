"""``broadcast_buffers=True`` under sharded: the buffer broadcast travels beside the step's all-gathers.

Collectives on one process group run in the order they are issued (NCCL: one stream per
communicator and device; gloo: one work queue). A buffer broadcast issued in the next forward's
pre-hook, behind the step's all-gathers on their group, would make that forward wait for all of
them, so none would hide behind it. It is issued where DDP issues it (at the forward, with rank 0's
buffers as they are then: a probe forward between the step and the next one counts, as under
DDP), on a group of its own (`broadcast.buffer_group`). The launches are recorded on CPU by
wrapping the two collectives (``dist.broadcast`` and the all-gather `collectives` launches) on two
gloo ranks; the buffers still end as rank 0's, as DDP's ``broadcast_buffers`` gives.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from hfstream.gradsync import GradSync
from hfstream.gradsync.sharded import collectives
from hfstream.testing import run_on_ranks

STEPS = 3


class NormedMLP(nn.Module):
    """Running statistics (buffers that each rank's batches move) and a few buckets' worth of parameters."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.norm(self.fc1(x))))))


def _name(group) -> str:
    """A group as the events keep it (a ProcessGroup does not pickle back to the test)."""
    return (group or dist.group.WORLD).group_name


def launch_order(rank, world_size):
    events: list[str] = []
    broadcast, gather = dist.broadcast, collectives._all_gather

    def recording_broadcast(*args, **kwargs):
        events.append(("broadcast", _name(kwargs.get("group"))))
        return broadcast(*args, **kwargs)

    def recording_gather(*args, **kwargs):
        events.append(("gather", _name(args[2] if len(args) > 2 else kwargs.get("group"))))
        return gather(*args, **kwargs)

    dist.broadcast, collectives._all_gather = recording_broadcast, recording_gather
    torch.manual_seed(0)
    model = NormedMLP()
    sync = GradSync(model, bucket_mb=0.0, mode="sharded", broadcast_buffers=True)
    sync.keep_plan()
    opt = sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        events.append(f"forward {step}")
        model(torch.randn(8, 8, generator=g)).square().mean().backward()
        sync.finish()
        events.append(f"step {step}")
        opt.step()
        opt.zero_grad()
    events.append(f"forward {STEPS}")
    model(torch.zeros(8, 8))   # starts from rank 0's statistics, moved by the same batch on every rank
    sync.close()
    return events, model.norm.running_mean.clone(), model.norm.running_var.clone()


@pytest.fixture(scope="module")
def recorded():
    return run_on_ranks(launch_order, 2, timeout=120)


def _between_step_and_next_forward(events: list, step: int) -> list:
    """The broadcasts and gathers launched from ``step``'s optimizer step through the next forward and backward."""
    begin = events.index(f"step {step}")
    end = events.index(f"step {step + 1}") if f"step {step + 1}" in events else len(events)
    return [e for e in events[begin + 1:end] if isinstance(e, tuple)]


@pytest.mark.multiprocess
def test_buffer_broadcast_goes_out_at_the_forward_on_a_group_beside_the_all_gathers(recorded):
    for rank, (events, _, _) in enumerate(recorded):
        for step in range(STEPS):
            launched = _between_step_and_next_forward(events, step)
            kinds = [kind for kind, _ in launched]
            assert "broadcast" in kinds and kinds.count("gather") >= 2, (
                f"precondition: step {step} launched several gathers and a buffer broadcast: {kinds}")
            begin, forward = events.index(f"step {step}"), events.index(f"forward {step + 1}")
            assert not any(e[0] == "broadcast" for e in events[begin:forward] if isinstance(e, tuple)), (
                f"rank {rank}: the buffer broadcast after step {step} went out before the next forward, with "
                f"rank 0's buffers as they were at the step, where DDP sends them as they are at the forward")
            gather_groups = {group for kind, group in launched if kind == "gather"}
            broadcast_groups = {group for kind, group in launched if kind == "broadcast"}
            assert not gather_groups & broadcast_groups, (
                f"rank {rank}: after step {step} the buffer broadcast was issued on the all-gathers' group, "
                f"behind them: collectives of one group run in issue order, so the forward waits for all of them")


@pytest.mark.multiprocess
def test_buffers_still_end_as_rank0s(recorded):
    (_, mean0, var0), (_, mean1, var1) = recorded
    torch.testing.assert_close(mean1, mean0, rtol=0, atol=0)
    torch.testing.assert_close(var1, var0, rtol=0, atol=0)
