"""The step's schedule on one link: what overlap and sharded mode leave exposed, from part times.

One model, two users: the planner (`hfstream.plan.predict`, from FLOPs and a link it is
told) and the report's advice (`hfstream.report.advice`, from a run's measured parts). Times in ms;
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
    optimizer, which each rank runs on 1/N. Steady state, as the engine runs it (the pipelined
    step, `hfstream.gradsync.sharded`): time 0 = the optimizer step's start, the link idle (the
    step follows the last reduce-scatter: clipping needs the global norm). The step goes bucket
    by bucket in forward order, each taking its share of ``opt / N`` (in proportion to its time
    on the wire), and launches that bucket's all-gather at once; the forward starts when the step
    ends and waits for a bucket when it reaches its parameters; backward's reduce-scatters follow
    on the same link, one collective at a time; the step ends when backward and the last
    reduce-scatter have. The data wait is taken as hidden.
    """
    t = half_times
    opt_sharded = opt / world_size
    if world_size <= 1:
        step = fwd + bwd + opt
        return {"optimizer_sharded_ms": opt, "reduce_scatter_busy_ms": 0.0, "reduce_scatter_exposed_ms": 0.0,
                "all_gather_busy_ms": 0.0, "all_gather_exposed_ms": 0.0, "step_sharded_ms": step,
                "cross_step_limit_ms": step}
    total = sum(t) or 1.0
    # The step in forward order (reverse plan), each bucket's gather launched once it is stepped.
    link, clock, gathered = 0.0, 0.0, [0.0] * len(t)
    for k in reversed(range(len(t))):
        clock += opt_sharded * t[k] / total
        link = max(link, clock) + t[k]
        gathered[k] = link
    # The forward: bucket k's parameters are where forward has done 1 - ready[k] of its FLOPs
    # (backward reaches them after ready[k - 1] and finishes them at ready[k]).
    clock = opt_sharded
    for k in reversed(range(len(t))):
        span = (ready[k] - (ready[k - 1] if k else 0.0)) * fwd
        clock = max(clock, gathered[k]) + span         # forward waits for it, then computes its share
    exposed_ag = max(0.0, clock - opt_sharded - fwd)
    backward_start = clock
    # Reduce-scatters: the overlap schedule, on a link free once the last gather is done.
    end = link
    for tk, r in zip(t, ready):
        end = max(backward_start + r * bwd, end) + tk
    exposed_rs = max(0.0, end - (backward_start + bwd))
    busy = 2 * sum(t)
    return {"optimizer_sharded_ms": opt_sharded, "reduce_scatter_busy_ms": sum(t),
            "reduce_scatter_exposed_ms": exposed_rs, "all_gather_busy_ms": sum(t),
            "all_gather_exposed_ms": exposed_ag, "step_sharded_ms": fwd + exposed_ag + bwd + exposed_rs + opt_sharded,
            "cross_step_limit_ms": cross_step_limit(fwd, bwd, opt_sharded, busy)}
