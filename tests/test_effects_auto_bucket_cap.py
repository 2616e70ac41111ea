"""Effect: ``bucket_mb="auto"`` trains on the cap its scores chose, under overlap and sharded alike.

The scores are fed by hand (every rank the same, per candidate cap) so that one cap in the
middle of the sweep must win: neither the first candidate, nor the last one tried, nor the
largest. After tuning, every later step's buckets must be that cap's plan and the step must
launch one collective per bucket of it. A GradSync that finishes tuning but keeps planning with
another cap (the last candidate it tried, its default) trains to the same values and fails here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hfstream.gradsync import GradSync
from hfstream.testing import run_on_ranks

DIM, LAYERS = 256, 6   # 0.25 MiB layers: 0.25, 0.5 and 1 MiB cut the model differently


def chosen_and_used(rank, world_size, mode):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(LAYERS)])
    sync = GradSync(model, mode=mode, bucket_mb="auto")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if mode == "sharded":
        opt = sync.shard_optimizer(opt)
    tuner = sync.tuning
    caps = list(tuner.candidates_mb)
    # The second candidate clearly best; the third more than 10% above it stops the sweep there.
    fake = {caps[0]: 50.0, caps[1]: 10.0, caps[2]: 40.0}
    real_observe = tuner.observe
    tuner.observe = lambda ms: real_observe(fake.get(tuner.current_mb, 99.0))
    after = []
    for step in range(tuner.max_steps + 3):   # tuning ends within max_steps; then 3 more
        if len(after) == 3:
            break
        tuned = sync.tuning is None   # this step runs wholly after tuning (the last tuning step used its cap)
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).pow(2).mean().backward()
        sync.finish()
        opt.step()
        opt.zero_grad()
        if tuned:
            after.append({"plan": [b.names for b in sync.buckets], "collectives": sync.stats.num_collectives})
    result = sync.tuning_result
    out = {"caps": caps, "chosen": result.bucket_mb, "scores": dict(result.scores_ms), "after": after,
           "plans": {c: [b.names for b in sync.plan_for(c)] for c in caps[:3]}}
    sync.wait_for_params()
    sync.close()
    return out


def both_modes(rank, world_size):
    return {mode: chosen_and_used(rank, world_size, mode) for mode in ("overlap", "sharded")}


@pytest.mark.multiprocess
def test_auto_plans_every_later_step_with_the_cap_its_scores_chose():
    for res in run_on_ranks(both_modes, 2, timeout=120):
        for mode, r in res.items():
            caps, plans = r["caps"], r["plans"]
            assert len(caps) >= 3 and len({tuple(map(tuple, p)) for p in plans.values()}) == 3, (mode, caps)
            assert list(r["scores"]) == caps[:3], (mode, r["scores"])   # stopped after the third
            assert r["chosen"] == caps[1], mode
            assert len(r["after"]) >= 3, mode
            for step in r["after"]:
                assert step["plan"] == plans[caps[1]], f"{mode}: a later step planned with another cap"
                assert step["collectives"] == len(plans[caps[1]]), mode
