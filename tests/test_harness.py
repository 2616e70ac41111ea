"""The multi-process harness itself: results come back in rank order, a failure names its rank,
and a hang becomes a failure instead of stalling the run."""

import time

import pytest
import torch
import torch.distributed as dist

from hfstream.testing import RankFailure

pytestmark = pytest.mark.multiprocess


def _allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return (rank, torch.get_num_threads(), t.item())


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise KeyError("boom on one")
    return rank


def _hang_on_rank0(rank, world_size):
    if rank == 0:
        time.sleep(600)
    return rank


def test_results_in_rank_order_one_thread(run_distributed):
    out = run_distributed(_allreduce_rank, 2)
    assert out == [(0, 1, 3.0), (1, 1, 3.0)]


def test_failure_names_rank_and_error(run_distributed):
    with pytest.raises(RankFailure, match=r"(?s)rank 1.*KeyError: 'boom on one'"):
        run_distributed(_raise_on_rank1, 2)


def test_hang_times_out(run_distributed):
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 0 ---\ntimed out"):
        run_distributed(_hang_on_rank0, 2, timeout=8)
    assert time.monotonic() - t0 < 30


def test_bad_world_size(run_distributed):
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_allreduce_rank, 0)
