"""Effect: mode="overlap" and "sharded" launch reductions from the gradient hooks, during backward.

A hook on the model's first parameter (the last gradient backward produces), registered before
GradSync's, reads how many buckets have their reduction in flight at that moment: some must,
before backward's last hook fires. The hand-made mutant that removes the overlap (the same
reduction with ``launch_from_hooks = False``: every bucket launched at finish()) reads 0 there
and gives the same gradients. The live runs take the mode's own setting (a mutant of the mode's
default is caught too), and mode="serial" is held to launching nothing before finish().
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hfstream.gradsync import GradSync
from hfstream.gradsync.bucket_state import Phase
from hfstream.testing import run_on_ranks


def in_flight_at_last_hook(rank, world_size, mode, from_hooks):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    first = model[0].weight
    seen = []
    sync = None
    first.register_post_accumulate_grad_hook(
        lambda p: seen.append(sum(st.phase is Phase.REDUCING for st in sync.reduction.states)))
    sync = GradSync(model, mode=mode, bucket_mb=0)   # one bucket per parameter
    if not from_hooks:   # the hand-made mutant; the live runs keep what each mode sets itself
        sync.reduction.launch_from_hooks = False
    if mode == "sharded":
        sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    sync.finish()
    if mode == "sharded":
        grads = [g.clone() for g in sync.grad_norms().values()]
    else:
        grads = [p.grad.clone() for p in model.parameters()]
    n = len(sync.reduction.states)
    sync.close()
    return {"seen": seen, "grads": grads, "num_buckets": n}


def suite(rank, world_size):
    return {(mode, hooks): in_flight_at_last_hook(rank, world_size, mode, hooks)
            for mode in ("overlap", "sharded", "serial") for hooks in (True, False)}


def test_reductions_are_in_flight_before_backwards_last_hook_and_not_when_launched_at_finish():
    for res in run_on_ranks(suite, 2, timeout=60):
        assert res[("serial", True)]["seen"] == [0], "serial: a reduction launched during backward"
        for mode in ("overlap", "sharded"):
            live, mutant = res[(mode, True)], res[(mode, False)]
            assert live["num_buckets"] > 2 and len(live["seen"]) == 1 == len(mutant["seen"])
            assert live["seen"][0] >= 1, f"{mode}: no reduction launched before the last gradient hook"
            assert mutant["seen"] == [0], f"{mode}: launched at finish(), yet in flight during backward"
            assert live["grads"] and len(live["grads"]) == len(mutant["grads"])
            for a, b in zip(live["grads"], mutant["grads"], strict=True):
                assert torch.equal(a, b), mode
