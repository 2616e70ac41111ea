"""`gradsync/collectives.py`: which primitive each half of the all-reduce uses, and the local sum that finishes gloo's.

On gloo the reduce-scatter is an all-to-all plus `sum_received` (half the cost of gloo's own
reduce-scatter, docs/design.md section 7); elsewhere the backend reduces. The collectives are
scripted here (what is called, with what); `sum_received` is checked on real tensors, in
the parameters' dtype where the wire is narrower. The 2-rank tests of sharded mode run them for
real.
"""

from __future__ import annotations

import pytest
import torch

from hfstream.gradsync.sharded import collectives


@pytest.mark.parametrize("backend, local", [("gloo", True), ("GLOO", True), ("nccl", False), ("mpi", False)])
def test_only_gloo_reduces_locally(monkeypatch, backend, local):
    monkeypatch.setattr(collectives.dist, "get_backend", lambda g: backend)
    assert collectives.reduces_locally(object()) is local


def test_each_path_calls_its_primitive_async(monkeypatch):
    calls = []
    monkeypatch.setattr(collectives.dist, "all_to_all_single",
                        lambda out, inp, group, async_op: calls.append(("all_to_all", out, inp, group, async_op)) or "w1")
    monkeypatch.setattr(collectives, "_reduce_scatter",
                        lambda out, inp, op, group, async_op: calls.append(("reduce_scatter", out, inp, op, group, async_op)) or "w2")
    monkeypatch.setattr(collectives, "_all_gather",
                        lambda out, inp, group, async_op: calls.append(("all_gather", out, inp, group, async_op)) or "w3")
    flat, out, g = torch.zeros(4), torch.zeros(4), object()
    assert collectives.launch_reduce_scatter(flat, out, g, local_sum=True) == "w1"
    assert collectives.launch_reduce_scatter(flat, out[:2], g, local_sum=False) == "w2"
    assert collectives.launch_all_gather(out, flat[:2], g) == "w3"
    kinds = [c[0] for c in calls]
    assert kinds == ["all_to_all", "reduce_scatter", "all_gather"]
    assert calls[0][1] is out and calls[0][2] is flat and calls[0][3:] == (g, True)
    assert calls[1][3] == collectives.dist.ReduceOp.SUM and calls[1][4:] == (g, True)
    assert calls[2][1] is out and calls[2][3:] == (g, True)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sum_received_adds_every_chunk(world):
    received = torch.arange(world * 3, dtype=torch.float32)
    out = torch.full((3,), -7.0)
    collectives.sum_received(received, out, world)
    assert torch.equal(out, received.view(world, 3).sum(0))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_narrow_wire_is_summed_in_the_parameters_dtype(world):
    # Each chunk is exact in bf16; their sum (1 + 2**-8 + ...) is not, so a bf16 sum would round it.
    chunks = [torch.tensor([1.0]), torch.tensor([2.0 ** -8]), torch.tensor([2.0 ** -9])][:world]
    received = torch.cat(chunks).to(torch.bfloat16)
    out = torch.zeros(1, dtype=torch.float32)
    collectives.sum_received(received, out, world)
    assert out.dtype == torch.float32
    assert out.item() == sum(c.item() for c in chunks)


def counting_copies(t: torch.Tensor) -> list:
    """``t.copy_`` still copies, and each call's source is noted in the list returned."""
    copies, real = [], t.copy_
    t.copy_ = lambda src, *a, **k: copies.append(src) or real(src, *a, **k)
    return copies


@pytest.mark.parametrize("world", [2, 3])
def test_on_the_same_dtype_the_first_two_chunks_are_added_straight_into_out(world):
    # The fast path the docstring claims (one pass over memory fewer): no copy into ``out`` first.
    received = torch.arange(world * 3, dtype=torch.float32)
    out = torch.zeros(3)
    copies = counting_copies(out)
    collectives.sum_received(received, out, world)
    assert copies == [] and torch.equal(out, received.view(world, 3).sum(0))
    narrow = torch.zeros(3)
    narrow_copies = counting_copies(narrow)
    collectives.sum_received(received.to(torch.bfloat16), narrow, world)
    assert len(narrow_copies) == 1   # a narrower wire is copied into the parameters' dtype once


def test_torchs_current_names_are_used_where_it_has_them():
    # torch 2.13 renamed the two tensor collectives; the old names still work but warn.
    import torch.distributed as dist
    for new, old, ours in [("reduce_scatter_single", "reduce_scatter_tensor", collectives._reduce_scatter),
                           ("all_gather_single", "all_gather_into_tensor", collectives._all_gather)]:
        assert ours is getattr(dist, new) if hasattr(dist, new) else ours is getattr(dist, old)
