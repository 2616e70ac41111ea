"""Where the mean lands after the all-reduce (`AllReduce._write_back`), for a parameter unused on one rank.

The mean arrives in the bucket's buffer. A parameter used here whose ``.grad`` is that buffer's
view already holds it; one unused here (``.grad`` None) gets the view itself where the wire has
its dtype (the gradient held once), or a tensor of its own dtype where the wire is compressed;
one with a ``.grad`` of its own (a compressed wire) gets the mean copied into that same tensor.
"""

from __future__ import annotations

import pytest
import torch

from hfstream.gradsync import GradSync
from test_gradsync_host_reads import TwoSideBranches


def _write_back(rank, world_size, comm_dtype):
    torch.manual_seed(0)
    model = TwoSideBranches()
    sync = GradSync(model, bucket_mb=0, comm_dtype=comm_dtype)
    out = []
    try:
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x, use_sides=rank == 1).backward()
            own = model.a.weight.grad      # used on every rank
            sync.finish()
            views = {v.data_ptr() for st in sync._states for v in st.views}
            side = model.side_a.weight.grad
            out.append({"side": side.clone(), "side_dtype": side.dtype, "side_is_view": side.data_ptr() in views,
                        "own_kept": model.a.weight.grad is own, "own": model.a.weight.grad.clone()})
            model.zero_grad(set_to_none=True)
    finally:
        sync.close()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("comm_dtype", [None, "bf16"])
def test_a_parameter_unused_here_gets_the_mean_in_its_own_dtype_and_used_ones_keep_their_grad(
        run_distributed, comm_dtype):
    r0, r1 = run_distributed(_write_back, 2, comm_dtype, timeout=120)
    assert len(r0) == len(r1) == 3
    for mine, theirs in zip(r0[1:], r1[1:]):   # after the first step's re-plan
        assert mine["side_dtype"] == torch.float32
        assert mine["side"].abs().sum() > 0 and torch.equal(mine["side"], theirs["side"])
        assert torch.equal(mine["own"], theirs["own"])
        if comm_dtype is None:
            # The wire has the gradient's dtype: the unused-here parameter's .grad is the bucket's view.
            assert mine["side_is_view"]
        else:
            # A bf16 wire: .grad stays the tensor backward made, the mean cast back into it.
            assert mine["own_kept"] and not mine["side_is_view"]
