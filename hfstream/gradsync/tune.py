"""Online choice of the bucket cap: ``GradSync(model, bucket_mb="auto")``.

The best cap depends on things no formula knows well: how fast this backward produces
gradients, the link's bandwidth and per-collective latency, how much CPU the communication
threads take from compute. So it is measured. The first synchronised steps of training try
candidate caps from the smallest up, each for a warm-up step and then a few scored steps, and
one cap is kept for the rest of training; the choice is logged with the measurements.

The choice holds still (`choose`). Scores measured a minute apart differ by a few per cent for
reasons no cap has (the machine's load drifts; a whole step's data varies), and a plain "lowest
score wins" then picks a different cap in each run of the same job. So ``"auto"`` starts from a
fixed default (`default_cap`: DDP's 25 MiB, or an eighth of the gradients for a model of less
than 8 x 25 MiB) and leaves it only for a candidate that scores lower by
more than the noise: the larger of a median's noise (half the spread of the two candidates'
scored steps over the root of their number) and `MIN_GAIN` (5 %) of the score. Among the
candidates that beat the default so, it takes the one nearest the default (fewest doublings
away, ties to the larger cap) of those within the noise of the lowest score. The rule reads
only the scores and their noise, never the order they came in, so scores that differ by less
than their noise choose the same cap run after run.

The score is what the cap changes and what GradSync can measure on its own, without a Trainer:
the time from the first gradient hook of the synchronised backward to the end of ``finish()``
(backward from its first gradient on, plus exposed communication, plus copying back), the best of
2 scored steps. Under ``mode="overlap"`` forward and the optimizer step do not depend on the cap.
Under ``mode="sharded"`` they do (the next forward waits for the all-gathers bucket by bucket,
the optimizer steps bucket by bucket), so there the score is the whole step, from the end of one
``finish()`` to the end of the next (``whole_step``), the median of 5 scored steps (a whole step
varies more), and the sweep ends with a rematch (``rematch``): the default and the lowest-scoring
candidate are scored once more, in the reverse of the order the sweep tried them (A B ... B A,
which cancels a steady drift of the machine's load), each then scored from all its steps. The
ranks agree on scores and noise with a MAX all-reduce (a step is as slow as its slowest rank), so
every rank holds the same scores; rank 0's choice is broadcast. Every rank therefore switches to
the same plan at the same step, even when their own timings would disagree.

Candidates are 0.25, 0.5, 1, 2, 4, 8, 16 and 32 MiB, minus those that cut this model exactly
like a smaller one. Step time against bucket size is U-shaped (small buckets pay the
per-collective latency many times, large ones start communicating late), so once the default
has been scored the sweep stops at the first candidate that scores more than ``stop_margin``
(10 %) above the best so far: larger caps only start later still. Tuning therefore ends after at
most ``(len(candidates) + 2) x (warmup_steps + scored_steps)`` synchronised steps with the
rematch, ``len(candidates) x ...`` without: 24 with the defaults, 60 under sharded's 5 scored
steps and rematch, usually fewer. Re-planning happens inside ``finish()``, after the step's
gradients are written back, on every rank at the same step: no gradient is lost or counted twice.
What the tuner chose on the bench, and why the rule is what it is: docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist

from .. import streams
from ..log import notice
from .buckets import DDP_BUCKET_MB

logger = logging.getLogger(__name__)

CANDIDATES_MB = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
# The default cap is at most this share of the model's gradients: with larger buckets the last one
# (reduced after backward, never hidden) is a large share of them.
DEFAULT_MIN_BUCKETS = 8
# A candidate must beat the default by at least this share of the score, whatever its spread:
# scores measured a minute apart differ by a few per cent for reasons no cap has.
MIN_GAIN = 0.05


class Score(NamedTuple):
    """One candidate's agreed score: ``ms`` (its statistic), ``noise_ms`` (half the spread of its
    scored steps) and ``steps`` (how many scored steps)."""

    ms: float
    noise_ms: float = 0.0
    steps: int = 1


def default_cap(caps_mb: Sequence[float], gradient_mb: float) -> float:
    """The cap ``"auto"`` keeps unless a candidate is measurably faster (`choose`).

    The largest candidate of at most DDP's 25 MiB and at most 1/`DEFAULT_MIN_BUCKETS` of the
    model's gradients (the smallest candidate where none is that small). A share of the bytes, not
    a count of buckets: a plan's count also has the small buckets its tail is cut into
    (``last_bucket_mb``, sharded's default), more of them the larger the cap.

    Args:
        caps_mb: the candidate caps (`distinct_candidates`), increasing.
        gradient_mb: the model's gradients, in MiB.
    """
    fits = [c for c in caps_mb if c <= min(DDP_BUCKET_MB, gradient_mb / DEFAULT_MIN_BUCKETS)]
    return float(max(fits) if fits else min(caps_mb))


def _noise(a: Score, b: Score, min_gain: float) -> float:
    """By how much two scores may differ and still not be told apart: a median's noise, or ``min_gain``."""
    spread = max(a.noise_ms, b.noise_ms) / math.sqrt(max(1, min(a.steps, b.steps)))
    return max(spread, min_gain * max(a.ms, b.ms))


def choose(scores: Mapping[float, Score], default_mb: float | None, min_gain: float = MIN_GAIN
           ) -> tuple[float, str]:
    """The cap to keep, and why in words: the default unless a candidate beats it by more than the noise.

    Among the candidates that beat the default so, the one nearest the default (fewest doublings
    away, ties to the larger cap) of those within the noise of the lowest score. Reads the scores
    as a set: the same scores in any order give the same cap. Without a default (None, or one
    not scored), the lowest score wins, a tie to the smaller cap.

    Args:
        scores: cap in MiB -> its `Score`.
        default_mb: the cap to keep unless beaten (`default_cap`).
        min_gain: the least share of the score a win must have, whatever the spread.

    >>> choose({1.0: Score(100.0), 4.0: Score(97.0)}, default_mb=1.0)[0]    # 3 %: within the noise
    1.0
    >>> choose({1.0: Score(100.0), 4.0: Score(90.0)}, default_mb=1.0)[0]    # 10 %: a clear win
    4.0
    """
    if not scores:
        raise ValueError("choose() needs at least one scored candidate")
    if default_mb is None or default_mb not in scores:
        low = min(s.ms for s in scores.values())
        return min(c for c, s in scores.items() if s.ms == low), "the lowest score"
    home = scores[default_mb]
    wins = {c: s for c, s in scores.items() if home.ms - s.ms > _noise(s, home, min_gain)}
    if not wins:
        return float(default_mb), (f"the default {default_mb:g} MiB: no cap scored lower by more than the noise "
                                   f"(at least {min_gain:.0%})")
    best = min(wins.values(), key=lambda s: s.ms)
    near = [c for c, s in wins.items() if s.ms - best.ms <= _noise(s, best, min_gain)]
    cap = min(near, key=lambda c: (abs(math.log2(c / default_mb)), -c))
    gain = 1 - wins[cap].ms / home.ms
    return float(cap), (f"{gain:.0%} under the default {default_mb:g} MiB's score, more than the noise "
                        f"({_noise(wins[cap], home, min_gain) / home.ms:.0%})")


@dataclass(frozen=True)
class TuningResult:
    """What ``bucket_mb="auto"`` chose, and why.

    Args:
        bucket_mb: the chosen cap in MiB.
        num_buckets: buckets in the chosen plan.
        scores_ms: per candidate cap tried, its score in ms (best scored step of each rank, or
            the median under ``whole_step``; then the slowest rank). Candidates after the early
            stop are absent.
        steps: synchronised steps that tuning took.
        scored: what a score measures, in words (for the log).
        default_mb: the cap kept unless a candidate beat it by more than the noise (None: none).
        reason: why this cap, in words (`choose`).
    """

    bucket_mb: float
    num_buckets: int
    scores_ms: dict[float, float]
    steps: int
    scored: str = "first gradient hook to end of finish(), best step, slowest rank"
    default_mb: float | None = None
    reason: str = ""


@dataclass
class BucketTuner:
    """Tries the candidate caps in order, ``warmup_steps + scored_steps`` synchronised steps each.

    The caller (`GradSync.finish`) reports one score per synchronised step with `observe` and
    then plans with `current_mb`, which changes only when a candidate is done; `done` turns
    True after the last candidate or the early stop, and `decide` then gives the choice.

    Args:
        candidates_mb: caps to try, in the order they are tried (increasing; each a different plan).
        num_buckets: buckets each candidate's plan has (for the log).
        agree: this rank's score for a candidate -> the score all ranks agree on (GradSync: a
            MAX all-reduce); every rank must call it at the same step. Identity by default.
        warmup_steps: unscored steps after switching to a candidate (fresh buffers, caches).
        scored_steps: scored steps per candidate.
        stop_margin: once ``default_mb`` is scored, stop at a candidate more than this fraction
            above the best one.
        statistic: ``"min"`` or ``"median"``: a rank's score from its scored steps.
        default_mb: the cap kept unless a candidate beats it by more than the noise (`choose`);
            one of ``candidates_mb``, or None: the lowest score wins.
        min_gain: the least share of the score that counts as a win (`choose`).
        rematch: after the sweep, score the default and the lowest-scoring candidate once more
            (the two lowest without a default), the one tried later first (A B ... B A); each
            one's score is then the statistic of all its scored steps.
    """

    candidates_mb: Sequence[float]
    num_buckets: Sequence[int]
    agree: Callable[[float], float] = float
    warmup_steps: int = 1
    scored_steps: int = 2
    stop_margin: float = 0.10
    statistic: str = "min"
    default_mb: float | None = None
    min_gain: float = MIN_GAIN
    rematch: bool = False
    steps: int = 0
    scores_ms: list[float] = field(default_factory=list)   # agreed score per candidate the sweep finished
    noise_ms: list[float] = field(default_factory=list)    # agreed half-spread of its scored steps, likewise
    done: bool = False

    def __post_init__(self):
        if not self.candidates_mb or len(self.candidates_mb) != len(self.num_buckets):
            raise ValueError("BucketTuner needs one bucket count per candidate cap, and at least one candidate")
        if self.warmup_steps < 0 or self.scored_steps < 1 or not self.stop_margin >= 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0, scored_steps={self.scored_steps} >= 1 "
                             f"and stop_margin={self.stop_margin} >= 0")
        if self.statistic not in ("min", "median"):
            raise ValueError(f"statistic={self.statistic!r} must be 'min' or 'median'")
        if self.default_mb is not None and self.default_mb not in self.candidates_mb:
            raise ValueError(f"default_mb={self.default_mb!r} must be one of candidates_mb "
                             f"{list(self.candidates_mb)} (or None)")
        if not self.min_gain >= 0:
            raise ValueError(f"min_gain={self.min_gain} must be >= 0")
        self.current = 0                            # index of the candidate in use (once done: the last one tried)
        self.rematched: list[int] = []              # the candidates scored again after the sweep, in that order
        self._samples: dict[int, list[float]] = {}  # this rank's scored steps, per candidate
        self._next: list[int] = []                  # the rematch's candidates still to score
        self._within = 0                            # steps taken on the current candidate
        # The sweep may stop early only once the default has been scored: the choice starts from it.
        self._home = 0 if self.default_mb is None else list(self.candidates_mb).index(self.default_mb)

    @property
    def max_steps(self) -> int:
        """Synchronised steps tuning takes at most: a bound known in advance."""
        again = min(2, len(self.candidates_mb) - 1) if self.rematch else 0
        return (len(self.candidates_mb) + again) * (self.warmup_steps + self.scored_steps)

    @property
    def current_mb(self) -> float:
        return self.candidates_mb[self.current]

    def observe(self, score_ms: float) -> None:
        """Record the score of the step that just finished, under the current candidate."""
        if self.done:
            raise RuntimeError("BucketTuner.observe() after tuning is done")
        self.steps += 1
        self._within += 1
        i = self.current
        if self._within > self.warmup_steps:
            self._samples.setdefault(i, []).append(float(score_ms))
        if self._within < self.warmup_steps + self.scored_steps:
            return
        # The candidate is done: agree on its score and noise (collectives, at this step on every rank).
        self._within = 0
        local = sorted(self._samples[i])
        score = float(self.agree(local[0] if self.statistic == "min" else _median(local)))
        noise = float(self.agree((local[-1] - local[0]) / 2))
        if self.rematched:                # a rematch: the candidate's score from all its steps
            self.scores_ms[i], self.noise_ms[i] = score, noise
        else:
            best = min(self.scores_ms, default=score)
            self.scores_ms.append(score)
            self.noise_ms.append(noise)
            more = len(self.scores_ms) < len(self.candidates_mb)
            if more and (i < self._home or score <= best * (1 + self.stop_margin)):
                self.current += 1
                return
            self._plan_rematch()
        if self._next:
            self.current = self._next.pop(0)
        else:
            self.done = True

    def _plan_rematch(self) -> None:
        """The candidates to score again (the later-tried first: A B ... B A), if ``rematch``."""
        if not self.rematch or len(self.scores_ms) < 2:
            return
        order = sorted(range(len(self.scores_ms)), key=self.scores_ms.__getitem__)
        two = order[:2] if self.default_mb is None else [order[0], self._home]
        if len(set(two)) == 2:            # the default scored lowest: nothing to tell apart
            self.rematched = sorted(two, reverse=True)
            self._next = list(self.rematched)

    def scores(self) -> dict[float, Score]:
        """The agreed `Score` of every candidate scored so far, by cap."""
        return {float(self.candidates_mb[i]): Score(ms, self.noise_ms[i], len(self._samples.get(i, ())))
                for i, ms in enumerate(self.scores_ms)}

    def decide(self, broadcast: Callable[[int], int] = int) -> TuningResult:
        """The candidate `choose` picks from the agreed scores, as rank 0 picked it: ``broadcast`` sends rank 0's index
        to every rank (GradSync: ``dist.broadcast``)."""
        if not self.done:
            raise RuntimeError("BucketTuner.decide() before tuning is done")
        cap, reason = choose(self.scores(), self.default_mb, self.min_gain)
        best = int(broadcast(list(self.candidates_mb).index(cap)))
        if self.candidates_mb[best] != cap:   # every rank holds the agreed scores: rank 0 picked the same
            reason = "rank 0's pick"
        return TuningResult(
            bucket_mb=float(self.candidates_mb[best]),
            num_buckets=int(self.num_buckets[best]),
            scores_ms={float(c): s for c, s in zip(self.candidates_mb, self.scores_ms)},
            steps=self.steps,
            scored=(f"{'best' if self.statistic == 'min' else 'median'} of {self.scored_steps} steps, slowest rank"
                    + (f"; {' and '.join(f'{self.candidates_mb[i]:g}' for i in sorted(self.rematched))} MiB "
                       f"scored again, of {2 * self.scored_steps} steps" if self.rematched else "")),
            default_mb=self.default_mb,
            reason=reason,
        )

    def __repr__(self) -> str:
        tried = ", ".join(f"{c:g}: {s:.1f}" for c, s in zip(self.candidates_mb, self.scores_ms))
        return (f"BucketTuner(step {self.steps} of at most {self.max_steps}, trying {self.current_mb:g} MiB; "
                f"scores so far (MiB: ms) {{{tried}}})")


def distinct_candidates(plan_for: Callable[[float], list], candidates_mb: Sequence[float] = CANDIDATES_MB
                        ) -> tuple[list[float], list[int]]:
    """The candidates that cut the model differently from every smaller one, with their bucket counts.

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


def _median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    return sorted_values[n // 2] if n % 2 else (sorted_values[n // 2 - 1] + sorted_values[n // 2]) / 2


def log_choice(result: TuningResult) -> None:
    scores = ", ".join(f"{c:g} MiB: {s:.1f} ms" for c, s in result.scores_ms.items())
    notice(logger, "GradSync: bucket_mb='auto' chose %g MiB (%d buckets; %s) after %d synchronised steps; score "
                   "per cap (%s): %s", result.bucket_mb, result.num_buckets, result.reason, result.steps,
           result.scored, scores)


class AutoBucketCap:
    """GradSync's side of ``bucket_mb="auto"``: scores each synchronised step, agrees, picks the cap.

    GradSync calls `step_started` at the first synchronised gradient hook of a step and
    `step_finished` at the end of ``finish()``, on every rank at the same step; the latter
    returns the cap to plan the next step with, and once tuning is over the `TuningResult`.

    Args:
        plan_for: cap in MiB -> the plan GradSync would use (to prune equivalent candidates).
        group: the process group the ranks agree over.
        device: where the agreement's small tensors live (the gradients' device: every backend
            of the group serves it).
    """

    def __init__(self, plan_for: Callable[[float], list], group, device: torch.device, whole_step: bool = False):
        self.group, self.device, self.whole_step = group, device, whole_step
        caps, counts = distinct_candidates(plan_for, CANDIDATES_MB)
        gradient_mb = sum(b.nbytes for b in plan_for(caps[0])) / 2**20
        self.tuner = BucketTuner(caps, counts, agree=self._slowest_rank, default_mb=default_cap(caps, gradient_mb),
                                 **_settings(whole_step))
        self.scored = ("whole step: end of one finish() to the end of the next" if whole_step
                       else "first gradient hook to end of finish()")
        self._start = None   # (host time, event or None, device) of the step's first synchronised hook
        self._last_end = None   # whole_step: (host time, event or None, device) at the end of the last finish()

    @property
    def current_mb(self) -> float:
        return self.tuner.current_mb

    def step_started(self, param: torch.Tensor) -> None:
        if self.whole_step and self._last_end is not None:
            self._start = self._last_end
            return
        self._start = _mark(param.device)

    def step_finished(self) -> tuple[float, TuningResult | None]:
        """Score the step that just ended; the cap for the next step, and the result once done."""
        self.tuner.observe(self._score_ms())
        if not self.tuner.done:
            return self.tuner.current_mb, None
        result = self.tuner.decide(broadcast=self._rank0_pick)
        result = dataclasses.replace(result, scored=f"{self.scored}, {result.scored}")
        log_choice(result)
        return result.bucket_mb, result

    def _score_ms(self) -> float:
        """First synchronised gradient hook (``whole_step``: the end of the last finish()) to the end of finish().

        A rank whose backward fired no hook (its loss reached no parameter) scores 0 from the hook,
        so the slowest rank's score, which every rank takes, is its peers'.
        """
        marked = self._start if self._start is not None else (self._last_end if self.whole_step else None)
        self._start = None
        if marked is None:
            self._last_end = _mark(self.device)
            return 0.0
        start, event, device = marked
        end = _mark(device)
        self._last_end = end
        if event is None:
            return (end[0] - start) * 1e3
        end[1].synchronize()   # tuning steps only: the score must be known before the next step
        return event.elapsed_time(end[1])

    def _slowest_rank(self, score_ms: float) -> float:
        t = torch.tensor([score_ms], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.item()

    def _rank0_pick(self, index: int) -> int:
        t = torch.tensor([index], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
        return int(t.item())


def _settings(whole_step: bool) -> dict:
    """`BucketTuner`'s settings under `AutoBucketCap`: a whole step varies more, so the median of
    more steps, and the default and the lowest-scoring candidate scored again."""
    if whole_step:
        return dict(scored_steps=5, statistic="median", rematch=True)
    return {}


def max_auto_steps() -> int:
    """The most synchronised steps ``bucket_mb="auto"`` can tune for, in either scoring (all candidates distinct)."""
    n = len(CANDIDATES_MB)
    return max(BucketTuner(CANDIDATES_MB, [1] * n, **_settings(w)).max_steps for w in (False, True))


def _mark(device) -> tuple:
    """(host time, an event on the compute stream or None, device)."""
    event = None
    if streams.is_accelerator(device):
        event = streams.new_event(device, enable_timing=True)
        event.record(streams.current_stream(device))
    return time.perf_counter(), event, device
