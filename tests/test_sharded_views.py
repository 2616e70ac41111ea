"""Sharded mode's parameters are views of the gathered buffer: no copy after a gather.

2 gloo ranks: while sharded mode is on, every plain parameter lies in its bucket's gathered
buffer (the all-gather writes it in place) and holds the same values a copy would have given;
one given new storage between steps still gets its gathered value; the parameters and the
sharded buffers take no more memory than a model plus its copies did before; and at ``close()``
every parameter has storage of its own again, so ``safetensors`` saves the model.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn as nn

from hfstream.gradsync import GradSync
from hfstream.testing import run_on_ranks


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _storages(tensors) -> dict[int, int]:
    """Distinct storages (data pointer -> bytes) behind ``tensors``."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _viewed(sync) -> dict[str, bool]:
    return {name: v for st in sync.bucket_states for name, v in zip(st.plan.names, st.shard.viewed())}


def _train(model, sync, opt, steps, rank, edit_at=None):
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 24, generator=g)
        model(x).pow(2).mean().backward()
        sync.finish()
        opt.step()
        opt.zero_grad()
        if step == edit_at:
            sync.wait_for_params()
            with torch.no_grad():   # new storage for one parameter, as `p.data = ...` in a callback
                model.layers[1].weight.data = model.layers[1].weight.data.clone() * 0.5


def views_suite(rank, world_size):
    out = {}
    torch.manual_seed(0)
    model = Net()
    reference = Net()
    reference.load_state_dict(model.state_dict())
    own_bytes = sum(_storages(model.parameters()).values())
    sync = GradSync(model, mode="sharded", bucket_mb=0.004, last_bucket_mb=None)   # 0.004 MiB: 2 layers a bucket
    opt = sync.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    layouts = [st.shard for st in sync.bucket_states]
    out["buckets"] = len(layouts)
    out["all_viewed"] = all(all(sh.viewed()) for sh in layouts)
    out["in_their_buffer"] = all(
        sh.gathered.data_ptr() <= p.data_ptr() < sh.gathered.data_ptr() + sh.gathered.numel() * sh.gathered.element_size()
        for sh in layouts for p in sh.params)
    # What the parameters and the sharded buffers hold, against the old layout's: the parameters'
    # own storage + a gradient buffer the gather reused + master and gradient slices.
    held = _storages(list(model.parameters()) + [t for sh in layouts for t in (sh.gathered, sh.master, sh.grad)]
                     + [st.buffer for st in sync.bucket_states])
    padded = sum(st.buffer.numel() * st.buffer.element_size() for st in sync.bucket_states)
    slices = sum(sh.master.numel() * sh.master.element_size() * 2 for sh in layouts)
    out["held_bytes"], out["old_bytes"] = sum(held.values()), own_bytes + padded + slices
    out["padding_bytes"] = padded - own_bytes
    _train(model, sync, opt, 3, rank, edit_at=1)
    sync.wait_for_params()
    out["viewed_after_edit"] = _viewed(sync)   # the plan of now (re-planned after the first step)
    # What the gathers wrote is not an edit: the next step re-reads no parameter into its slices.
    out["edited_after_gather"] = [st.shard.edited() for st in sync.bucket_states]
    out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sync.close()
    out["own_storage_after_close"] = len(_storages(model.parameters())) == len(list(model.parameters()))
    from safetensors.torch import load_file, save_file
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        save_file(model.state_dict(), path)
        out["saved_equal"] = all(torch.equal(v, out["params"][k]) for k, v in load_file(path).items())
    # The same run with copies (a parameter subclass cannot be a view: the fallback path).
    torch.manual_seed(0)
    model = Net()
    for layer in model.layers:
        layer.weight = Subclassed(layer.weight.detach().clone())
    sync = GradSync(model, mode="sharded", bucket_mb=0.004, last_bucket_mb=None)
    opt = sync.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    out["subclass_viewed"] = _viewed(sync)
    _train(model, sync, opt, 3, rank, edit_at=1)
    sync.close()
    out["copied_params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


class Subclassed(nn.Parameter):
    pass


@pytest.fixture(scope="module")
def views():
    return run_on_ranks(views_suite, 2, timeout=180)


@pytest.mark.multiprocess
def test_parameters_are_views_of_the_gathered_buffer(views):
    for out in views:
        assert out["buckets"] >= 2
        assert out["all_viewed"] and out["in_their_buffer"]
        # A parameter given new storage is not a view any more; the others still are.
        assert [n for n, v in out["viewed_after_edit"].items() if not v] == ["layers.1.weight"]
        assert out["edited_after_gather"] and not any(out["edited_after_gather"]), out["edited_after_gather"]
        # The subclassed weights are copied into instead; the biases are views.
        assert {n for n, v in out["subclass_viewed"].items() if not v} == {f"layers.{i}.weight" for i in range(4)}


@pytest.mark.multiprocess
def test_views_give_exactly_what_the_copies_gave(views):
    for out in views:
        for name, want in out["copied_params"].items():
            assert torch.equal(out["params"][name], want), name
    assert all(torch.equal(views[0]["params"][k], views[1]["params"][k]) for k in views[0]["params"])


@pytest.mark.multiprocess
def test_views_cost_no_memory_and_the_model_leaves_with_its_own_storage(views):
    for out in views:
        # The gathered buffer replaces the parameters' storage: the same bytes as before, padding aside.
        assert out["held_bytes"] <= out["old_bytes"] + out["padding_bytes"]
        assert out["own_storage_after_close"] and out["saved_equal"]
