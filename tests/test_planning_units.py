"""`gradsync/planning.py`'s `Planner` without processes: when a step's end re-plans, and when it must not.

A re-plan rebuilds every bucket's buffers (and, sharded, moves the optimizer's state), so a step
that changes nothing must return no plan. Written against the mutants of planning.py that the
tuning and order tests let through (docs/design.md, "Mutation testing").
"""

import torch

from hfstream.gradsync.planning import Planner


class FakeAuto:
    """What `AutoBucketCap.step_finished` returns, step by step: (the cap to plan at, the result or None)."""

    def __init__(self, caps, result_at=None):
        self.caps, self.result_at, self.steps = list(caps), result_at, 0

    def step_finished(self):
        self.steps += 1
        cap = self.caps.pop(0)
        return cap, ("result" if self.steps == self.result_at else None)


def _planner(auto=None):
    params = [torch.nn.Parameter(torch.zeros(2**16)) for _ in range(4)]   # 256 KiB each
    planner = Planner([(f"p{i}", p) for i, p in enumerate(params)], 1.0, None, group=None)
    planner.arrival.done = True   # the arrival order is agreed (a collective, tested elsewhere)
    planner._auto = auto
    return planner


def test_a_step_that_keeps_the_cap_returns_no_plan_and_a_changed_cap_returns_one():
    auto = FakeAuto([1.0, 1.0, 0.25, 0.25])
    planner = _planner(auto)
    planner.planned_mb = 1.0
    plans = [planner.step_finished()[0] for _ in range(4)]
    assert plans[0] is None and plans[1] is None and plans[3] is None
    assert plans[2] is not None and len(plans[2]) == 4 and planner.planned_mb == 0.25


def test_without_tuning_nor_a_first_step_nothing_is_replanned():
    planner = _planner()
    assert [planner.step_finished() for _ in range(3)] == [(None, [])] * 3


def test_the_first_step_plans_in_arrival_order_and_names_what_never_arrived():
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(3)]
    planner = Planner([(f"p{i}", p) for i, p in enumerate(params)], 0, None, group=None)
    for i in (0, 2):   # p0 first, then p2; p1 never
        planner.gradient_arrived(i, params[i], first_of_step=i == 0)
    # One process: the agreement is this rank's own order, read without a collective.
    planner.arrival.agree = lambda group, device: (setattr(planner.arrival, "done", True) or [0, 2, 1])
    plan, unused = planner.step_finished()
    assert unused == ["p1"] and [b.names for b in plan] == [("p0",), ("p2",), ("p1",)]
    assert planner.step_finished() == (None, [])


def test_a_model_of_one_parameter_agrees_on_its_device():
    p = torch.nn.Parameter(torch.zeros(3))
    assert Planner([("w", p)], 1.0, None, group=None).device == p.device
    assert Planner([], 1.0, None, group=None).device == torch.device("cpu")
