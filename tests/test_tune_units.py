"""`gradsync/tune.py`'s pieces the spawned tuning runs do not reach: the choice (`choose`) on synthetic scores,
the default cap, a device's score, the median, rank 0's pick.

Written against the mutants of tune.py lines 184-308 that `test_gradsync_tune.py` and
`test_effects_auto_bucket_cap.py` let through (docs/design.md, "Mutation testing").
"""

import random
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


# -- the rematch (sharded's whole steps): the default and the lowest scored again, A B ... B A, medians of all --


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
    return tune.BucketTuner([1.0, 2.0, 4.0, 8.0], [8, 4, 2, 1], scored_steps=5, statistic="median", **kw)


def test_the_rematch_scores_the_two_best_again_in_reverse_order():
    sweep = {1.0: 100.0, 2.0: 103.0, 4.0: 120.0, 8.0: 130.0}   # 4 MiB is past the 10 % margin: the sweep stops
    t = _rematch_tuner(rematch=True)
    tried = _run(t, lambda cap, visit: [sweep[cap]] * 5)
    assert tried == [1.0, 2.0, 4.0, 2.0, 1.0]          # A B C, then B A
    assert t.rematched == [1, 0] and t.steps == 5 * 6 <= t.max_steps == 6 * 6
    assert t.decide().bucket_mb == 1.0


def test_a_rematch_overturns_a_sweep_whose_two_best_were_told_apart_by_when_they_ran():
    # In the sweep 1 MiB ran while the machine was quiet (100) and 2 MiB once it was loaded (103, 3 %
    # behind). Scored again in reverse, 2 MiB is ahead; each one's median of ten steps decides.
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
    assert "1 and 2 MiB scored again, of 10 steps" in result.scored


def test_a_rematched_win_over_the_default_is_judged_by_the_noise_of_all_its_steps():
    # Both visits spread +-3 around the candidate's middle: half the spread 3, over the root of the
    # ten steps each score is now the median of: 0.95. 0.9 ms under the default is within the noise
    # (the default stays); 1.2 ms under is not, though it would be within a five-step median's
    # noise (3 / root 5 = 1.34).
    def tuned(second_mb_ms):
        t = _rematch_tuner(rematch=True, default_mb=1.0, min_gain=0.0)
        mids = {1.0: 100.0, 2.0: second_mb_ms, 4.0: 130.0}
        _run(t, lambda cap, visit: [mids[cap] - 3, mids[cap], mids[cap], mids[cap], mids[cap] + 3])
        assert t.rematched == [1, 0] and t.scores_ms[:2] == [100.0, second_mb_ms] and t.noise_ms[:2] == [3.0, 3.0]
        return t.decide().bucket_mb

    assert tuned(99.1) == 1.0
    assert tuned(98.8) == 2.0


def test_the_rematch_scores_the_default_against_the_lowest_and_none_when_the_default_is_lowest():
    sweep = {1.0: 100.0, 2.0: 90.0, 4.0: 95.0, 8.0: 130.0}
    t = _rematch_tuner(rematch=True, default_mb=4.0)
    assert _run(t, lambda cap, visit: [sweep[cap]] * 5) == [1.0, 2.0, 4.0, 8.0, 4.0, 2.0]   # 4 tried after 2
    assert t.rematched == [2, 1]
    home = _rematch_tuner(rematch=True, default_mb=2.0)
    assert _run(home, lambda cap, visit: [{**sweep, 1.0: 120.0}[cap]] * 5) == [1.0, 2.0, 4.0, 8.0]
    assert home.rematched == [] and home.decide().bucket_mb == 2.0


def test_one_candidate_has_nothing_to_rematch():
    t = tune.BucketTuner([1.0], [1], scored_steps=2, rematch=True)
    assert t.max_steps == 3
    assert _run(t, lambda cap, visit: [5.0, 5.0]) == [1.0] and t.done and t.rematched == []
    assert "scored again" not in t.decide().scored


def test_the_rematch_agrees_on_each_visits_score_on_every_rank():
    # Every finished visit is one agreement (two with the noise), the same count on every rank.
    agreed = []
    t = tune.BucketTuner([1.0, 2.0], [2, 1], scored_steps=1, statistic="median", rematch=True,
                         agree=lambda v: agreed.append(v) or v)
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


# -- the choice holds still: the default unless a candidate beats it by more than the noise --------------


def _scores(ms: dict, noise: float = 0.0, steps: int = 2) -> dict:
    return {cap: tune.Score(v, noise, steps) for cap, v in ms.items()}


def test_scores_within_their_noise_keep_the_default_whichever_is_lowest():
    # Every candidate within 5 % of the default's 100 ms: the lowest (16 MiB, 96) is not a win.
    cap, reason = tune.choose(_scores({0.25: 98.0, 1.0: 100.0, 4.0: 97.5, 16.0: 96.0}), default_mb=1.0)
    assert cap == 1.0 and "the default 1 MiB" in reason
    # The held-out sharded bench of 2026-12-06: scores within 8 % of each other, where the spread
    # of five whole steps (+-40 ms: 40 / root 5 = 18 ms) is more than the 8 %.
    held_out = {0.25: 402.0, 1.0: 385.0, 4.0: 379.0, 8.0: 381.0, 16.0: 371.0}
    assert tune.choose(_scores(held_out, noise=40.0, steps=5), default_mb=1.0)[0] == 1.0


def test_a_clear_win_over_the_default_replaces_it():
    cap, reason = tune.choose(_scores({0.25: 80.0, 1.0: 100.0, 4.0: 99.0}), default_mb=1.0)
    assert cap == 0.25 and "20% under the default 1 MiB" in reason
    # A win is more than the spread's noise, not only more than MIN_GAIN: 8 % under with steps
    # spread +-20 ms over 5 (noise 20 / root 5 = 8.9 ms) is not one; with steady steps it is.
    assert tune.choose(_scores({1.0: 100.0, 4.0: 92.0}, noise=20.0, steps=5), default_mb=1.0)[0] == 1.0
    assert tune.choose(_scores({1.0: 100.0, 4.0: 92.0}, noise=1.0, steps=5), default_mb=1.0)[0] == 4.0


def test_among_clear_wins_within_noise_of_each_other_the_one_nearest_the_default_is_taken():
    # 0.25 and 0.5 MiB both beat the 1 MiB default by far and are within 5 % of each other: 0.5 is
    # one doubling from it, 0.25 two. Which of them scored lower does not matter.
    for low in (85.0, 87.0):
        assert tune.choose(_scores({0.25: low, 0.5: 86.0, 1.0: 100.0, 2.0: 101.0}), default_mb=1.0)[0] == 0.5
    # Equally near on both sides: the larger cap (fewer collectives).
    assert tune.choose(_scores({0.5: 80.0, 1.0: 100.0, 2.0: 81.0}), default_mb=1.0)[0] == 2.0
    # A win far ahead of the others is taken, however far from the default.
    assert tune.choose(_scores({0.25: 60.0, 0.5: 86.0, 1.0: 100.0}), default_mb=1.0)[0] == 0.25


def test_the_same_scores_in_any_order_give_the_same_choice():
    rng = random.Random(0)
    for _ in range(200):
        caps = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
        scores = {c: tune.Score(rng.uniform(80, 120), rng.uniform(0, 10), rng.choice((2, 5, 10))) for c in caps}
        default = rng.choice(caps)
        first = tune.choose(scores, default)
        for _ in range(5):
            order = list(scores.items())
            rng.shuffle(order)
            assert tune.choose(dict(order), default) == first


def test_runs_whose_scores_differ_only_by_noise_choose_the_same_cap_every_time():
    # Each run of the same job scores every cap at its true 100 ms plus noise of +-2 %: the lowest
    # score differs from run to run (three runs chose 0.25, 0.5 and 2 MiB); the choice does not.
    rng = random.Random(1)
    caps = [0.25, 0.5, 1.0, 2.0, 4.0]
    lowest, chosen = set(), set()
    for _ in range(100):
        scores = {c: tune.Score(100.0 * (1 + rng.uniform(-0.02, 0.02)), 1.0, 2) for c in caps}
        lowest.add(min(scores, key=lambda c: scores[c].ms))
        chosen.add(tune.choose(scores, default_mb=1.0)[0])
    assert len(lowest) == len(caps) and chosen == {1.0}


def test_the_default_is_ddps_cap_or_an_eighth_of_a_smaller_models_gradients():
    assert tune.DEFAULT_MIN_BUCKETS == 8
    # The bench's GPT-2 4x384 (28 MiB of gradients; 2 MiB cuts it like 1): at most 3.5 MiB.
    assert tune.default_cap([0.25, 1.0, 4.0, 8.0, 16.0, 32.0], 28.0) == 1.0
    assert tune.default_cap([0.25, 1.0, 4.0, 8.0, 16.0, 32.0], 41.6) == 4.0   # its 6-layer sibling
    # A large model: the largest candidate under DDP's 25 MiB.
    assert tune.default_cap([0.25, 1.0, 4.0, 16.0, 32.0], 420.0) == 16.0
    # A model whose eighth is under every candidate: the smallest.
    assert tune.default_cap([0.25, 0.5, 1.0], 1.5) == 0.25


def test_under_sharded_the_default_is_not_pushed_up_by_the_small_buckets_of_the_tail():
    # Sharded cuts the end of backward's order into 1 MiB buckets: a 16 MiB cap has as many
    # buckets as a 4 MiB one on the bench's model. The default goes by bytes, so it is the same.
    import transformers

    from hfstream.gradsync.buckets import plan_buckets

    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4, n_embd=384, n_head=6, vocab_size=512,
                                                                     n_positions=128))
    named = list(model.named_parameters())
    for last in (None, 1.0):
        cap = tune.AutoBucketCap(lambda c: plan_buckets(named, c, None, last), None, torch.device("cpu"))
        assert cap.tuner.default_mb == 1.0, last


def test_the_sweep_does_not_stop_before_it_has_scored_the_default():
    t = tune.BucketTuner([0.25, 1.0, 4.0, 8.0], [16, 8, 4, 2], scored_steps=1, default_mb=4.0)
    _run(t, lambda cap, visit: [{0.25: 100.0, 1.0: 120.0, 4.0: 130.0, 8.0: 90.0}[cap]])
    assert list(t.decide().scores_ms) == [0.25, 1.0, 4.0]   # 1 MiB 20 % above the best, yet the default is tried
    assert t.decide().bucket_mb == 0.25


def test_a_default_that_is_not_a_candidate_is_refused_by_name():
    with pytest.raises(ValueError, match=re.escape("default_mb=3.0 must be one of candidates_mb")):
        tune.BucketTuner([1.0, 2.0], [4, 2], default_mb=3.0)


@pytest.mark.parametrize("whole_step", [False, True])
def test_auto_on_the_same_job_chooses_the_same_cap_run_after_run_when_its_scores_differ_by_noise(whole_step):
    # Thirty runs of one job whose caps all take 100 ms a step, each step measured +-2 %: as GradSync
    # tunes it (the candidates, the sweep, the rematch, the pick), every run keeps one cap.
    from hfstream.gradsync.buckets import plan_buckets

    named = [(f"p{i}", torch.empty(2**16, device="meta")) for i in range(200)]   # 50 MiB, every cap distinct
    rng, chosen = random.Random(2), set()
    for _ in range(30):
        cap = tune.AutoBucketCap(lambda c: plan_buckets(named, c), None, torch.device("cpu"), whole_step=whole_step)
        tuner = cap.tuner
        tuner.agree = float   # one process: nothing to agree with
        while not tuner.done:
            tuner.observe(100.0 * (1 + rng.uniform(-0.02, 0.02)))
        chosen.add(tuner.decide().bucket_mb)
    assert chosen == {4.0}   # the default: the largest cap that cuts 50 MiB into at least 8 buckets
