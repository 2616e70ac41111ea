"""Online choice of the bucket cap: ``GradSync(model, bucket_mb="auto")``.

The best cap depends on things no formula knows well: how fast this backward produces
gradients, the link's bandwidth and per-collective latency, how much CPU the communication
threads take from compute. So it is measured. The first synchronised steps of training try a
few candidate caps, each for a warm-up step and then a couple of scored steps; the cap with the
lowest score is kept for the rest of training, and the choice is logged with the measurements.

The score is what the cap changes and what GradSync can measure on its own, without a Trainer:
the time from the first gradient hook of the synchronised backward to the end of ``finish()``
(backward from its first gradient on, plus exposed communication, plus copying back). Forward
and the optimizer step do not depend on the cap. A rank's score is the best of its scored steps
(interference from other processes only ever adds time); the ranks' scores are combined with a
MAX all-reduce (a step is as slow as its slowest rank), rank 0 picks the lowest and broadcasts
its pick, so every rank switches to the same plan even when their own timings would disagree.

Candidates are 1, 2, 4, 8, 16 and 32 MiB, minus those that give the same buckets as a smaller
one for this model (a 4 MiB and an 8 MiB cap can cut a small model identically). Tuning therefore
ends after at most ``len(candidates) x (warmup_steps + scored_steps)`` synchronised steps (18
with the defaults). Re-planning happens inside ``finish()``, after the step's gradients are
written back, on every rank at the same step: no gradient is lost or counted twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

CANDIDATES_MB = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


@dataclass(frozen=True)
class TuningResult:
    """What ``bucket_mb="auto"`` chose, and why.

    Args:
        bucket_mb: the chosen cap in MiB.
        num_buckets: buckets in the chosen plan.
        scores_ms: per candidate cap, its score in ms (best scored step of each rank, then the
            slowest rank): time from the first gradient hook of backward to the end of ``finish()``.
        steps: synchronised steps that tuning took.
    """

    bucket_mb: float
    num_buckets: int
    scores_ms: dict[float, float]
    steps: int


@dataclass
class BucketTuner:
    """Tries each candidate cap for ``warmup_steps + scored_steps`` synchronised steps.

    The caller (`GradSync.finish`) reports one score per synchronised step with `observe`; it
    returns the cap to use from the next step on (the same one until a candidate is done).

    Args:
        candidates_mb: caps to try, in the order they are tried (each gives a different plan).
        num_buckets: buckets each candidate's plan has (for the log).
        warmup_steps: unscored steps after switching to a candidate (fresh buffers, caches).
        scored_steps: scored steps per candidate; a candidate's score is the best of them.
    """

    candidates_mb: Sequence[float]
    num_buckets: Sequence[int]
    warmup_steps: int = 1
    scored_steps: int = 2
    steps: int = 0
    scores_ms: list[list[float]] = field(default_factory=list)

    def __post_init__(self):
        if not self.candidates_mb or len(self.candidates_mb) != len(self.num_buckets):
            raise ValueError("BucketTuner needs one bucket count per candidate cap, and at least one candidate")
        if self.warmup_steps < 0 or self.scored_steps < 1:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0 and scored_steps={self.scored_steps} >= 1")
        self.scores_ms = [[] for _ in self.candidates_mb]

    @property
    def per_candidate(self) -> int:
        return self.warmup_steps + self.scored_steps

    @property
    def total_steps(self) -> int:
        """Synchronised steps tuning takes: an upper bound known in advance."""
        return len(self.candidates_mb) * self.per_candidate

    @property
    def current(self) -> int:
        """Index of the candidate in use for the step being run."""
        return min(self.steps // self.per_candidate, len(self.candidates_mb) - 1)

    @property
    def current_mb(self) -> float:
        return self.candidates_mb[self.current]

    @property
    def done(self) -> bool:
        return self.steps >= self.total_steps

    def observe(self, score_ms: float) -> None:
        """Record the score of the step that just finished, under the current candidate."""
        within = self.steps % self.per_candidate
        if within >= self.warmup_steps:
            self.scores_ms[self.current].append(float(score_ms))
        self.steps += 1

    def local_scores(self) -> list[float]:
        """This rank's score per candidate: the best of its scored steps."""
        return [min(s) if s else float("inf") for s in self.scores_ms]

    def decide(self, process_group=None, world_size: int = 1) -> TuningResult:
        """Agree on the best candidate across ranks (a collective: every rank calls it once).

        Scores are combined with a MAX all-reduce; rank 0 picks the lowest, ties to the smaller
        cap, and broadcasts the index it picked, so the choice cannot differ between ranks.
        """
        scores = torch.tensor(self.local_scores(), dtype=torch.float64)
        if world_size > 1:
            dist.all_reduce(scores, op=dist.ReduceOp.MAX, group=process_group)
        pick = torch.tensor([int(torch.argmin(scores))], dtype=torch.int64)
        if world_size > 1:
            dist.broadcast(pick, src=dist.get_global_rank(process_group, 0), group=process_group)
        best = int(pick.item())
        return TuningResult(
            bucket_mb=float(self.candidates_mb[best]),
            num_buckets=int(self.num_buckets[best]),
            scores_ms={float(c): float(s) for c, s in zip(self.candidates_mb, scores.tolist())},
            steps=self.steps,
        )

    def __repr__(self) -> str:
        return (f"BucketTuner(step {self.steps}/{self.total_steps}, trying {self.current_mb:g} MiB, "
                f"candidates {[f'{c:g}' for c in self.candidates_mb]})")


def distinct_candidates(plan_for: Callable[[float], list], candidates_mb: Sequence[float] = CANDIDATES_MB
                        ) -> tuple[list[float], list[int]]:
    """The candidates that give a plan no smaller candidate gives, with their bucket counts.

    Args:
        plan_for: cap in MiB -> the list of `Bucket` GradSync would use.
        candidates_mb: caps to consider, in increasing order.
    """
    seen, keep, counts = set(), [], []
    for cap in candidates_mb:
        plan = plan_for(cap)
        key = tuple(b.names for b in plan)
        if key not in seen:
            seen.add(key)
            keep.append(float(cap))
            counts.append(len(plan))
    return keep, counts


def log_choice(result: TuningResult) -> None:
    scores = ", ".join(f"{c:g} MiB: {s:.1f} ms" for c, s in result.scores_ms.items())
    logger.info("GradSync: bucket_mb='auto' chose %g MiB (%d buckets) after %d synchronised steps; score per cap "
                "(first gradient hook to end of finish(), best step, slowest rank): %s",
                result.bucket_mb, result.num_buckets, result.steps, scores)
