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
