"""The step's schedule on one link: what overlap and sharded mode leave exposed, from part times.

One model, two users: the planner (`hfstream.tools.plan.predict`, from FLOPs and a link it is
told) and the report's advice (`hfstream.advice`, from a run's measured parts). Times in ms;
``ready`` is the fraction of backward done when each bucket's last gradient exists, buckets in
plan (backward) order, one collective at a time on the link.
"""

from __future__ import annotations

from .timeline import cross_step_limit


def overlap_exposed(times: list[float], ready: list[float], bwd: float) -> float:
    """What overlap leaves after backward: each bucket's all-reduce (``times``) starts when the bucket is
    ready and the link is free."""
    end = 0.0
    for t, r in zip(times, ready):
        end = max(r * bwd, end) + t
    return max(0.0, end - bwd)


def sharded_step(half_times: list[float], ready: list[float], world_size: int,
                 fwd: float, bwd: float, opt: float) -> dict:
    """The sharded step (docs/design.md section 7): both halves' busy and exposed times, the step, the limit.

    ``half_times``: one reduce-scatter (= one all-gather) per bucket; ``opt``: the unsharded
    optimizer, which each rank runs on 1/N. Steady state, time 0 = the forward's start, the
    previous step's all-gathers launched then (the data wait and the optimizer's own tail hidden).
    """
    t = half_times
    opt_sharded = opt / world_size
    if world_size <= 1:
        step = fwd + bwd + opt
        return {"optimizer_sharded_ms": opt, "reduce_scatter_busy_ms": 0.0, "reduce_scatter_exposed_ms": 0.0,
                "all_gather_busy_ms": 0.0, "all_gather_exposed_ms": 0.0, "step_sharded_ms": step,
                "cross_step_limit_ms": step}
    # All-gathers in forward order (reverse plan); bucket k's parameters are where forward has done
    # 1 - ready[k] of its FLOPs (backward reaches them after ready[k - 1] and finishes them at ready[k]).
    link, clock = 0.0, 0.0
    for k in reversed(range(len(t))):
        link += t[k]                                   # its gather completes
        span = (ready[k] - (ready[k - 1] if k else 0.0)) * fwd
        clock = max(clock, link) + span                # forward waits for it, then computes its share
    exposed_ag = max(0.0, clock - fwd)
    forward_end = fwd + exposed_ag
    # Reduce-scatters: the overlap schedule, on a link free once the last gather is done.
    end = link
    for tk, r in zip(t, ready):
        end = max(forward_end + r * bwd, end) + tk
    exposed_rs = max(0.0, end - (forward_end + bwd))
    busy = 2 * sum(t)
    return {"optimizer_sharded_ms": opt_sharded, "reduce_scatter_busy_ms": sum(t),
            "reduce_scatter_exposed_ms": exposed_rs, "all_gather_busy_ms": sum(t),
            "all_gather_exposed_ms": exposed_ag, "step_sharded_ms": fwd + exposed_ag + bwd + exposed_rs + opt_sharded,
            "cross_step_limit_ms": cross_step_limit(fwd, bwd, opt_sharded, busy)}
