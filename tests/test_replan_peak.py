"""A re-plan never holds two layouts: the bytes held while GradSync re-plans its buckets, measured on CPU.

GradSync re-plans in ``finish()``: after the first synchronised step, in the order gradients
arrived, and under ``bucket_mb="auto"`` at every candidate cap. Under ``mode="sharded"`` a
layout is the gathered parameters, the wire buffers, this rank's gradient slices, master
slices and optimizer state; a re-plan that built the new layout whole while the old one was
alive would hold about two of them. The bytes held are those of every storage an op of this
rank's training created and that is not freed yet (`HeldBytes`, counted after every op from
before the model exists): the parameters, gradients, buffers, slices and optimizer state.

- sharded: the peak during a re-planning ``finish()`` is within 10 % of what was held when it
  began (a whole layout); once at the arrival-order re-plan (no optimizer state yet) and once at
  an ``"auto"`` candidate switch (with AdamW's state); and a later steady step holds no more than
  one layout (nothing of the old one is kept);
- overlap: the step after a re-plan (whose backward allocates the new buckets, bucket by bucket,
  as the old gradients move into them) peaks within 10 % of a steady step, with
  ``zero_grad(set_to_none=False)`` keeping the old gradients (views of the old buckets) alive.

Two gloo ranks, one spawn for all of it. The model uses its layers in the reverse of their
registration order, so the arrival order is the opposite of the first plan's: the re-plan
moves every parameter to another bucket.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hfstream.gradsync import GradSync
from hfstream.testing import run_on_ranks

WITHIN = 1.10   # the brief's bound: a re-plan's peak within 10 % of the steady state
DIM, LAYERS = 256, 8   # 2 MiB of fp32 parameters: the "auto" candidates 0.25 and 0.5 MiB cut it differently


class UsedInReverse(nn.Module):
    """Layers registered in one order and used in the other: backward's order is registration order."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x.square().mean()


class HeldBytes(TorchDispatchMode):
    """Bytes of every storage alive, counted after each op this thread runs; the most held per named window.

    Each op's output storages are tracked through weak references (``StorageWeakRef``), so a
    storage counts until it is really freed, by whichever thread drops the last reference (gloo's
    threads drop the works' tensors): what the allocator holds for this rank's training.
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}   # storage -> (weak ref, bytes)
        self.held = 0
        self.windows: dict[str, list[int]] = {}   # name -> [held when it began, most held inside]
        self._open: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                ref = StorageWeakRef(t.untyped_storage())
                self._live.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        self._count()
        return out

    def _count(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            del self._live[key]
        self.held = sum(n for _, n in self._live.values())
        for name in self._open:
            self.windows[name][1] = max(self.windows[name][1], self.held)

    @contextlib.contextmanager
    def window(self, name: str):
        self._count()
        self.windows[name] = [self.held, self.held]
        self._open.append(name)
        try:
            yield
        finally:
            self._count()
            self._open.remove(name)


def _train(mode: str, steps: int, set_to_none: bool = True, bucket_mb="auto") -> tuple[dict, list]:
    """``steps`` steps of training; the held bytes of each finish() and each whole step, and the plans.

    ``bucket_mb`` other than ``"auto"``: that cap in registration order, never re-planned.
    """
    torch.manual_seed(0)
    with HeldBytes() as held:
        model = UsedInReverse()
        sync = GradSync(model, bucket_mb=bucket_mb, mode=mode)
        if bucket_mb != "auto":
            sync.keep_plan()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if mode == "sharded":
            opt = sync.shard_optimizer(opt)
        plans = [[b.names for b in sync.buckets]]   # plans[s]: the plan step s runs on
        for step in range(steps):
            with held.window(f"step{step}"):
                model(torch.randn(4, DIM)).backward()
                with held.window(f"finish{step}"):
                    sync.finish()
                plans.append([b.names for b in sync.buckets])
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
        sync.close()
    return {name: tuple(v) for name, v in held.windows.items()}, plans


def measure(rank, world_size):
    # sharded: 6 steps per candidate (1 warm-up, 5 scored), so the first switch ends step 5.
    sharded = _train("sharded", 8)
    # The same training on the cap "auto" ends on, never re-planned: what one layout holds.
    unplanned = _train("sharded", 3, bucket_mb=0.5)
    # overlap: 3 steps per candidate; the arrival re-plan ends step 0, the first switch step 2.
    # zero_grad(set_to_none=False): the old gradients, views of the old buckets, stay alive into the
    # next backward (with True they are freed before it, and nothing of the old plan is left).
    overlap = {False: _train("overlap", 6, set_to_none=False)}
    return {"sharded": sharded, "unplanned": unplanned, "overlap": overlap}


@pytest.fixture(scope="module")
def measured():
    return run_on_ranks(measure, 2, timeout=300)


def _replanned(plans: list, step: int) -> bool:
    """Whether finish() of ``step`` changed the plan."""
    return plans[step + 1] != plans[step]


def test_sharded_replan_peak_is_within_ten_percent_of_the_layout_it_replaces(measured):
    for rank, result in enumerate(measured):
        held, plans = result["sharded"]
        assert _replanned(plans, 0) and _replanned(plans, 5), "precondition: both re-plans happened"
        for step, what in ((0, "arrival-order re-plan"), (5, "'auto' candidate switch, with AdamW state")):
            before, peak = held[f"finish{step}"]
            assert peak <= WITHIN * before, (
                f"rank {rank}: the {what} in finish() of step {step} held {peak} B at its peak, "
                f"{peak / before:.2f}x the {before} B held when it began (the bound is {WITHIN}x)")


def test_sharded_steady_state_after_replans_holds_one_layout(measured):
    for rank, result in enumerate(measured):
        (held, plans), (reference, _) = result["sharded"], result["unplanned"]
        assert _replanned(plans, 0) and _replanned(plans, 5), "precondition: both re-plans happened"
        after, one = held["finish7"][0], reference["finish2"][0]   # both: a 0.5 MiB layout and AdamW state
        assert after <= WITHIN * one, (
            f"rank {rank}: {after} B held between steps after two re-plans, {after / one:.2f}x the {one} B "
            f"the same cap holds never re-planned: something of an old layout is still alive")


def test_overlap_steps_around_a_replan_peak_within_ten_percent_of_a_steady_step(measured):
    for rank, result in enumerate(measured):
        for set_to_none, (held, plans) in result["overlap"].items():
            assert [_replanned(plans, s) for s in range(5)] == [True, False, True, False, False], \
                "precondition: re-plans at the end of steps 0 (arrival order) and 2 (the next candidate)"
            steady = held["step4"][1]   # neither re-plans nor follows a re-plan
            for step in (0, 1, 2, 3):   # a re-plan in its finish(), or a backward that fills new buckets
                peak = held[f"step{step}"][1]
                assert peak <= WITHIN * steady, (
                    f"rank {rank}, zero_grad(set_to_none={set_to_none}): step {step}, the first after a re-plan, "
                    f"peaked at {peak} B, {peak / steady:.2f}x the {steady} B of a steady step")
