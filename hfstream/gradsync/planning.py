"""Which buckets there are, and when they change: registration order, then arrival order, then the tuned cap.

GradSync starts from a plan in reverse registration order (`buckets.plan_buckets`). After the
first synchronised step it re-plans in the order the gradients arrived on rank 0 (`order`), and
under ``bucket_mb="auto"`` it re-plans at each cap the tuner tries and once more at the one it
chooses (`tune`). Every decision here is the same on every rank (rank 0's order is broadcast,
the tuner's choice is agreed), so every rank plans the same buckets at the same step.
"""

from __future__ import annotations

import logging

import torch

from .buckets import DDP_BUCKET_MB, Bucket, plan_buckets
from .order import ArrivalOrder, planning_sequence
from .tune import AutoBucketCap, BucketTuner, TuningResult

logger = logging.getLogger(__name__)


class Planner:
    """The bucket plan over time.

    Args:
        hooked: ``(name, parameter)`` GradSync hooks, in registration order.
        bucket_mb, first_bucket_mb, last_bucket_mb: GradSync's arguments (``bucket_mb`` may be ``"auto"``).
        group: the process group (``"auto"`` agrees on its choice over it); None with one process.
        tune_whole_step: ``"auto"`` scores whole steps, not backward and finish() alone (`tune`).

    Attributes:
        planned_mb: the cap of the plan in use (under ``"auto"``: the candidate tried, then the choice).
        tuning_result: the `TuningResult` once ``"auto"`` has chosen.
        arrival: the order gradients arrive in, recorded in the first synchronised step.
    """

    def __init__(self, hooked, bucket_mb, first_bucket_mb, group, tune_whole_step: bool = False,
                 last_bucket_mb: float | None = None):
        self.hooked, self.first_bucket_mb, self.group = hooked, first_bucket_mb, group
        self.last_bucket_mb = last_bucket_mb
        self.device = hooked[-1][1].device if hooked else torch.device("cpu")   # where agreements travel
        self._named = list(hooked)   # what the planner walks (backwards): registration order at first
        self.arrival = ArrivalOrder(len(hooked))
        self.tuning_result: TuningResult | None = None
        self._auto: AutoBucketCap | None = None
        auto = bucket_mb == "auto"
        self.planned_mb: float = DDP_BUCKET_MB if auto else float(bucket_mb)
        if auto and group is not None:
            # Every rank prunes the same candidates from the same model, so all agree on the
            # schedule without talking; only the final choice needs a collective (tune.py).
            self._auto = AutoBucketCap(self.plan, group, self.device, whole_step=tune_whole_step)
            self.planned_mb = self._auto.current_mb

    @property
    def tuning(self) -> BucketTuner | None:
        return self._auto.tuner if self._auto is not None else None

    def plan(self, cap_mb: float | None = None) -> list[Bucket]:
        return plan_buckets(self._named, self.planned_mb if cap_mb is None else cap_mb, self.first_bucket_mb,
                            self.last_bucket_mb)

    def gradient_arrived(self, i: int, param: torch.Tensor, first_of_step: bool) -> None:
        if first_of_step and self._auto is not None:
            self._auto.step_started(param)
        if not self.arrival.done:
            self.arrival.arrived(i)

    def step_finished(self) -> tuple[list[Bucket] | None, list[str]]:
        """Between steps, on every rank alike: the next plan (None: keep it), and the parameters never seen.

        A collective in the first synchronised step (rank 0's arrival order) and at the end of tuning.
        """
        unused, plan = [], None
        if not self.arrival.done:
            order = self.arrival.agree(self.group, self.device)
            unused = [name for i, (name, _) in enumerate(self.hooked) if not self.arrival.seen(i)]
            self._named = planning_sequence(self.hooked, order)
            plan = self.plan()
        if self._auto is not None:
            cap, result = self._auto.step_finished()
            if result is not None:
                self._auto, self.tuning_result = None, result
            if cap != self.planned_mb or plan is not None:
                self.planned_mb = cap
                plan = self.plan()
        return plan, unused

    def close(self) -> None:
        self._auto, self.group = None, None   # the tuner holds the group too (see GradSync.close)
