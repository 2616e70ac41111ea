"""`gradsync/tune.py`'s pieces the spawned tuning runs do not reach: a device's score, the median, rank 0's pick.

Written against the mutants of tune.py lines 184-308 that `test_gradsync_tune.py` and
`test_effects_auto_bucket_cap.py` let through (docs/design.md, "Mutation testing").
"""

import re
import types

import pytest
import torch

import hfstream.gradsync.tune as tune


class FakeEvent:
    """A timing event on a device whose clock (ms) the test sets; counts the host's waits on it."""

    def __init__(self, clock):
        self.clock, self.t, self.synchronized = clock, None, 0

    def record(self, stream=None):
        self.t = self.clock["now"]

    def synchronize(self):
        self.synchronized += 1

    def elapsed_time(self, other):
        return other.t - self.t


def test_on_an_accelerator_a_step_is_scored_by_its_events_not_the_host_clock(monkeypatch):
    clock, made = {"now": 0.0}, []

    def new_event(device, enable_timing=False):
        assert enable_timing
        made.append(FakeEvent(clock))
        return made[-1]

    monkeypatch.setattr(tune, "streams", types.SimpleNamespace(
        is_accelerator=lambda device: True, new_event=new_event, current_stream=lambda device: None))
    host = iter([1.0, 1.5])   # the host's clock says 500 ms: the host ran ahead of the device
    monkeypatch.setattr(tune.time, "perf_counter", lambda: next(host))
    scores = []
    cap = tune.AutoBucketCap.__new__(tune.AutoBucketCap)
    cap.whole_step, cap._start, cap._last_end = False, None, None
    cap.tuner = types.SimpleNamespace(observe=scores.append, done=False, current_mb=1.0)
    clock["now"] = 10.0
    cap.step_started(torch.zeros(1))
    clock["now"] = 17.5
    cap.step_finished()
    assert scores == [7.5]
    assert [e.synchronized for e in made] == [0, 1]   # the end event waited for, once: the score is needed now


def test_the_median_of_an_even_number_of_steps_is_the_mean_of_the_middle_two():
    assert tune._median([1.0, 2.0, 4.0, 10.0]) == 3.0
    assert tune._median([1.0, 3.0]) == 2.0
    assert tune._median([1.0, 2.0, 7.0]) == 2.0 and tune._median([5.0]) == 5.0
    assert tune._median([1.0, 2.0, 3.0, 8.0, 9.0]) == 3.0   # five: sharded's scored steps


def pick_on_ranks(rank, world_size):
    import torch.distributed as dist

    cap = tune.AutoBucketCap.__new__(tune.AutoBucketCap)
    cap.group, cap.device = dist.group.WORLD, torch.device("cpu")
    return cap._rank0_pick(3 + rank)   # each rank's own pick differs


def test_every_rank_takes_rank_0s_pick_even_where_its_own_differs(run_distributed):
    assert run_distributed(pick_on_ranks, 2, timeout=60) == [3, 3]


@pytest.mark.parametrize("scores", [[5.0, 2.0], [1.0, 9.0]])
def test_rank_0s_pick_is_what_decide_reports(scores):
    tuner = tune.BucketTuner([0.5, 1.0], [4, 2], warmup_steps=0, scored_steps=1)
    for ms in scores:
        tuner.observe(ms)
    result = tuner.decide(broadcast=lambda index: 1 - index)   # rank 0 picked the other one
    assert result.bucket_mb == [0.5, 1.0][1 - scores.index(min(scores))]


def test_the_sweep_tries_every_documented_cap_on_a_model_each_cuts_differently():
    from hfstream.gradsync.buckets import plan_buckets

    named = [(f"p{i}", torch.empty(2**16, device="meta")) for i in range(200)]   # 0.25 MiB each, 50 MiB
    caps, counts = tune.distinct_candidates(lambda cap: plan_buckets(named, cap))
    assert caps == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0]   # the module docstring's list
    assert counts == [200, 100, 50, 25, 13, 7, 4, 2]
    # The bound the module docstring gives (24; 60 under sharded) is what the bench waits for at most.
    plans = {w: tune.AutoBucketCap(lambda cap: plan_buckets(named, cap), None, torch.device("cpu"), whole_step=w)
             for w in (False, True)}
    assert [plans[w].tuner.max_steps for w in (False, True)] == [24, 60] and tune.max_auto_steps() == 60


@pytest.mark.parametrize("kwargs, match", [
    (dict(candidates_mb=[], num_buckets=[]), "at least one candidate"),
    (dict(candidates_mb=[1.0, 2.0], num_buckets=[4]), "one bucket count per candidate"),
    (dict(warmup_steps=-1), "warmup_steps=-1"),
    (dict(scored_steps=0), "scored_steps=0"),
    (dict(stop_margin=-0.1), "stop_margin=-0.1"),
    (dict(stop_margin=float("nan")), "stop_margin=nan"),
    (dict(statistic="mean"), "statistic='mean'"),
])
def test_a_tuner_with_a_bad_setting_is_refused_by_name(kwargs, match):
    args = dict(candidates_mb=[1.0, 2.0], num_buckets=[4, 2]) | kwargs
    with pytest.raises(ValueError, match=re.escape(match)):
        tune.BucketTuner(**args)


def test_the_smallest_settings_are_accepted():
    t = tune.BucketTuner([1.0], [1], warmup_steps=0, scored_steps=1, stop_margin=0.0)
    assert t.max_steps == 1


# -- the rematch (sharded's whole steps): the two best scored again, A B ... B A, medians of all their steps --


def _run(tuner, scores_for):
    """Feed the tuner one step at a time; ``scores_for(cap, visit)`` gives a visit's scored steps."""
    visits, tried = {}, []
    while not tuner.done:
        cap = tuner.current_mb
        tried.append(cap)
        visit = visits[cap] = visits.get(cap, -1) + 1
        for ms in [0.0] * tuner.warmup_steps + list(scores_for(cap, visit)):
            tuner.observe(ms)
    return tried


def _rematch_tuner(**kw):
    return tune.BucketTuner([1.0, 2.0, 4.0, 8.0], [8, 4, 2, 1], scored_steps=5, statistic="median",
                            tie_within_noise=True, **kw)


def test_the_rematch_scores_the_two_best_again_in_reverse_order():
    sweep = {1.0: 100.0, 2.0: 103.0, 4.0: 120.0, 8.0: 130.0}   # 4 MiB is past the 10 % margin: the sweep stops
    t = _rematch_tuner(rematch=True)
    tried = _run(t, lambda cap, visit: [sweep[cap]] * 5)
    assert tried == [1.0, 2.0, 4.0, 2.0, 1.0]          # A B C, then B A
    assert t.rematched == [1, 0] and t.steps == 5 * 6 <= t.max_steps == 6 * 6
    assert t.decide().bucket_mb == 1.0


def test_a_rematch_overturns_a_sweep_whose_two_best_were_told_apart_by_when_they_ran():
    # In the sweep 1 MiB ran while the machine was quiet (100) and 2 MiB once it was loaded (103, 3 %
    # behind: past the 2 % tie). Scored again in reverse, 2 MiB is ahead; each one's median of ten
    # steps decides.
    scores = {(1.0, 0): 100.0, (2.0, 0): 103.0, (4.0, 0): 120.0, (2.0, 1): 95.0, (1.0, 1): 104.0}

    def feed(cap, visit):
        return [scores[cap, visit]] * 5

    once = _rematch_tuner()
    assert _run(once, feed) == [1.0, 2.0, 4.0] and once.decide().bucket_mb == 1.0
    again = _rematch_tuner(rematch=True)
    _run(again, feed)
    assert again.scores_ms == [102.0, 99.0, 120.0]    # medians of both visits' ten steps
    result = again.decide()
    assert result.bucket_mb == 2.0 and result.scores_ms == {1.0: 102.0, 2.0: 99.0, 4.0: 120.0}
    assert "the two best (1, 2 MiB) scored again, of 10 steps" in result.scored


def test_a_rematched_tie_is_judged_by_the_noise_of_all_its_steps():
    # Both visits spread +-3 around the candidate's middle: half the spread 3, over the root of the
    # ten steps each score is now the median of: 0.95. 0.9 ms apart is a tie (to the larger cap);
    # 1.2 ms apart is not, though it would be within a five-step median's noise (3 / root 5 = 1.34).
    def tuned(second_mb_ms):
        t = _rematch_tuner(rematch=True)
        mids = {1.0: 100.0, 2.0: second_mb_ms, 4.0: 130.0}
        _run(t, lambda cap, visit: [mids[cap] - 3, mids[cap], mids[cap], mids[cap], mids[cap] + 3])
        assert t.scores_ms[:2] == [100.0, second_mb_ms] and t.noise_ms[:2] == [3.0, 3.0]
        return t.decide().bucket_mb

    assert tuned(100.9) == 2.0
    assert tuned(101.2) == 1.0


def test_one_candidate_has_nothing_to_rematch():
    t = tune.BucketTuner([1.0], [1], scored_steps=2, rematch=True)
    assert t.max_steps == 3
    assert _run(t, lambda cap, visit: [5.0, 5.0]) == [1.0] and t.done and t.rematched == []
    assert "scored again" not in t.decide().scored


def test_the_rematch_agrees_on_each_visits_score_on_every_rank():
    # Every finished visit is one agreement (two with the noise), the same count on every rank.
    agreed = []
    t = tune.BucketTuner([1.0, 2.0], [2, 1], scored_steps=1, statistic="median", rematch=True,
                         tie_within_noise=True, agree=lambda v: agreed.append(v) or v)
    _run(t, lambda cap, visit: [{1.0: 10.0, 2.0: 20.0}[cap] + visit])
    assert len(agreed) == 2 * 4
    assert t.scores_ms == [10.5, 20.5]   # each the median of its two visits


@pytest.mark.parametrize("whole_step", [False, True])
def test_a_rank_whose_backward_fired_no_hook_scores_from_what_it_has(monkeypatch, whole_step):
    # Its loss reached no parameter: no step_started this step. Scored 0 from the hook (the slowest
    # rank's score is the peers'), or, scoring whole steps, from the end of its last finish().
    from hfstream.gradsync.buckets import plan_buckets

    named = [(f"p{i}", torch.empty(2**16, device="meta")) for i in range(8)]
    cap = tune.AutoBucketCap(lambda c: plan_buckets(named, c), None, torch.device("cpu"), whole_step=whole_step)
    clock = iter([1.0, 1.25, 2.0])
    monkeypatch.setattr(tune.time, "perf_counter", lambda: next(clock))
    cap.step_started(named[0][1])                    # a step with hooks, ended at 1.25
    assert cap._score_ms() == pytest.approx(250.0)
    assert cap._score_ms() == pytest.approx(750.0 if whole_step else 0.0)   # no hook; ends at 2.0
    assert cap._start is None and cap._last_end[0] == 2.0
