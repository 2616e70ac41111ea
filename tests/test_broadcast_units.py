"""`gradsync/broadcast.py` on 2 gloo ranks: every rank starts from rank 0's parameters and buffers.

The ranks build different models on purpose (a different seed, a different buffer); after the
broadcast each holds rank 0's values exactly, in every chunk (a small chunk size makes several,
so every offset is used), and ``buffers_only`` leaves the parameters as they were.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 3)
        self.register_buffer("stat", torch.zeros(4))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))


def _model(rank: int) -> Net:
    torch.manual_seed(rank)
    model = Net()
    model.stat.fill_(float(rank + 1))
    model.count.fill_(10 * (rank + 1))
    return model


def broadcast_and_report(rank, world_size, buffers_only, chunk_mb):
    from hfstream.gradsync import broadcast

    broadcast.BROADCAST_CHUNK_MB = chunk_mb
    model = _model(rank)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pending = broadcast.launch_from_rank0(model, dist.group.WORLD, buffers_only=buffers_only)
    chunks = len(pending.chunks)
    broadcast.land(pending)
    return chunks, before, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("chunk_mb", [64.0, 1e-5])     # one chunk per dtype; one per tensor
def test_every_rank_ends_with_rank_0s_parameters_and_buffers(run_distributed, chunk_mb):
    (c0, before0, after0), (c1, before1, after1) = run_distributed(broadcast_and_report, 2, False, chunk_mb,
                                                                    timeout=60)
    assert set(after0) == set(after1) == set(before0) and len(after0) == 6
    for k in after0:
        assert torch.equal(after0[k], before0[k]), k        # rank 0 keeps its own
        assert torch.equal(after1[k], before0[k]), k        # rank 1 gets rank 0's
        assert not torch.equal(before1[k], before0[k]), k   # and they did differ
    assert c0 == c1
    assert c0 == (2 if chunk_mb == 64.0 else 6)      # float32 and int64 apart; or each tensor alone


def test_buffers_only_leaves_the_parameters_as_they_were(run_distributed):
    (_, before0, after0), (chunks, before1, after1) = run_distributed(broadcast_and_report, 2, True, 64.0,
                                                                       timeout=60)
    assert chunks == 2          # float32 "stat" and int64 "count", one chunk each
    for k in ("stat", "count"):
        assert torch.equal(after1[k], before0[k]), k
    for k in ("a.weight", "a.bias", "b.weight", "b.bias"):
        assert torch.equal(after1[k], before1[k]), k
        assert not torch.equal(after1[k], after0[k]), k


def broadcast_nothing(rank, world_size):
    from hfstream.gradsync import broadcast

    pending = broadcast.launch_from_rank0(torch.nn.ReLU(), dist.group.WORLD)
    broadcast.land(pending)
    return len(pending.works)


def test_a_model_without_tensors_broadcasts_nothing(run_distributed):
    assert run_distributed(broadcast_nothing, 2, timeout=60) == [0, 0]
