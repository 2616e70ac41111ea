"""The report's advice (hfstream/report/advice.py): the change that helps first, with its predicted step.

Three scenarios as a user meets them, each a real StreamTrainer run: data-bound (a collate as
costly as a step, no prefetch), comm-bound (2 gloo ranks, one large bucket, fp32 wire) and a
run already at its ceiling; plus the model by hand, the report on disk and `hfstream doctor`.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from hfstream import StreamTrainer, StreamTrainingArguments
from hfstream.report.advice import MIN_SAVING, CommScaling, RunFacts, advise
from hfstream.cli.doctor import doctor
from tiny import lm_dataset, tiny_causal_lm, train_args


# -- the model, by hand ---------------------------------------------------------------------------
# A run whose collectives took longer in proportion to their bytes (the bf16 wire's premise).
BYTES_BOUND = CommScaling(ms_per_mib=8.0, fixed_ms=0.5, bytes_share=0.95, buckets=7, smallest_mib=1.0, largest_mib=4.0)


def _plan(total=28_000_000):
    return lambda cap: [total] if cap >= 64 else [int(cap * 2**20)] * max(1, int(total / (cap * 2**20)))


def test_data_bound_run_is_told_to_prefetch_with_the_step_it_would_take():
    mean = dict(data_wait_ms=40, forward_ms=10, backward_ms=15, optimizer_ms=5, exposed_comm_ms=0,
                comm_busy_ms=float("nan"), step_ms=70)
    advice = advise(mean, RunFacts(grad_sync=None, prefetch_depth=0))
    assert advice[0]["setting"] == "prefetch_depth" and advice[0]["value"] == 2
    # The producer (40 ms a batch) runs beside the other 30 ms of the step: 40 ms a step.
    assert advice[0]["model_step_ms"] == pytest.approx(40.0)
    assert "40 ms of 70 ms" in advice[0]["reason"] and not advice[0]["changes_results"]
    # Already prefetching and still waiting: more producers (workers), as many as the cores allow.
    advice = advise(mean, RunFacts(grad_sync=None, prefetch_depth=2, cores_per_rank=4, spare_cores=4))
    # One producer takes 70 ms a batch (40 waited + the 30 it runs beside): 3 workers keep up.
    assert advice[0]["setting"] == "dataloader_num_workers" and advice[0]["value"] == 3
    assert advice[0]["model_step_ms"] == pytest.approx(30.0)


def test_comm_bound_run_gets_results_keeping_changes_first():
    mean = dict(data_wait_ms=1, forward_ms=70, backward_ms=115, optimizer_ms=29, exposed_comm_ms=234,
                comm_busy_ms=234, step_ms=455)
    advice = advise(mean, RunFacts(grad_sync="overlap", world_size=2, bucket_mb=64.0, plan=_plan(),
                                   comm_scaling=BYTES_BOUND))
    settings = [a["setting"] for a in advice]
    assert settings[0] in ("grad_sync", "grad_bucket_mb")
    keep = [a["changes_results"] for a in advice]
    assert keep == sorted(keep)   # every results-keeping change before any that changes them
    assert {"grad_comm_dtype", "gradient_accumulation_steps"} <= set(settings)
    changing = [a for a in advice if a["changes_results"]]
    assert all("Changes the results" in a["reason"] for a in changing)
    kept = [a["predicted_step_ms"] for a in advice if not a["changes_results"]]
    assert kept == sorted(kept) and all(p < 455 * (1 - MIN_SAVING) for p in kept)
    # One bucket: sharded would not help (nothing overlaps in either mode), so it is not advised;
    # the one change advised must be enough on its own.
    assert "grad_sync" not in settings
    # At 4 MiB buckets, on a link busier than backward: sharded hides the all-gather in the next
    # forward and halves the optimizer on 2 ranks.
    mean = dict(mean, exposed_comm_ms=120, step_ms=340)
    facts = RunFacts(grad_sync="overlap", world_size=2, bucket_mb=4.0, plan=_plan(), mode_switch_checked=True)
    advice = advise(mean, facts)
    sharded = advice[0]
    assert sharded["setting"] == "grad_sync" and sharded["value"] == "sharded", advice
    assert "29 ms -> 14 ms" in sharded["reason"] and sharded["predicted_step_ms"] < 340 * (1 - MIN_SAVING)
    # Until the sweep has checked mode-switch predictions on this kind of machine, the switch is held
    # back, said among the reasons, its prediction kept.
    why, held = [], []
    advice = advise(mean, RunFacts(grad_sync="overlap", world_size=2, bucket_mb=4.0, plan=_plan()), why, held)
    assert "grad_sync" not in [a["setting"] for a in advice] and held[0]["setting"] == "grad_sync"
    assert any("mode switch is advised only once the sweep" in w for w in why), why


def test_no_core_beside_the_compute_means_no_prefetch_advice():
    mean = dict(data_wait_ms=40, forward_ms=10, backward_ms=15, optimizer_ms=5, exposed_comm_ms=0,
                comm_busy_ms=float("nan"), step_ms=70)
    # 2 ranks x 1 thread on 2 cores: a prefetch thread would take its core from the compute.
    assert advise(mean, RunFacts(grad_sync=None, prefetch_depth=0, spare_cores=0.0)) == []


def test_run_at_its_ceiling_gets_no_advice():
    mean = dict(data_wait_ms=0.5, forward_ms=70, backward_ms=115, optimizer_ms=10, exposed_comm_ms=3,
                comm_busy_ms=60, step_ms=200)
    assert advise(mean, RunFacts(grad_sync="overlap", world_size=2, bucket_mb=2.0, prefetch_depth=2,
                                 plan=_plan())) == []
    assert advise({}, RunFacts(grad_sync=None)) == []   # nothing measured: nothing said


# -- real runs ------------------------------------------------------------------------------------
class SlowCollate:
    """A collate that takes ``ms`` (waiting, as reading from storage does), then pads nothing."""

    def __init__(self, ms):
        self.ms = ms

    def __call__(self, features):
        time.sleep(self.ms / 1000)
        return {k: torch.tensor([f[k] for f in features]) for k in features[0]}


@pytest.fixture
def one_compute_thread():
    """One compute thread, so the producer has a core of its own (the advice checks that it has)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_data_bound_trainer_run_advises_prefetch_and_doctor_prints_it(tmp_path, capsys, one_compute_thread):
    args = train_args(StreamTrainingArguments, tmp_path / "run", max_steps=12, prefetch_depth=0)
    trainer = StreamTrainer(model=tiny_causal_lm(), args=args, train_dataset=lm_dataset(), data_collator=SlowCollate(20))
    said = []
    catch = logging.Handler()
    catch.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("hfstream").addHandler(catch)   # hfstream's logs do not propagate to the root
    try:
        trainer.train()
    finally:
        logging.getLogger("hfstream").removeHandler(catch)
    # The run itself says its first advice, and where the report is, at the end of train().
    advice_said = [m for m in said if "set prefetch_depth=2" in m]
    assert advice_said and "(report: " in advice_said[0] and "stream_report.json" in advice_said[0], said
    report = trainer.stream_report()
    first = report["advice"][0]
    assert first["setting"] == "prefetch_depth", report["advice"]
    assert first["predicted_step_ms"] < report["mean"]["step_ms"] * (1 - MIN_SAVING)
    saved = json.loads((tmp_path / "run" / "stream_report.json").read_text())
    assert saved["advice"][0]["setting"] == "prefetch_depth"
    assert "advice: set prefetch_depth=2" in str(report)
    capsys.readouterr()
    assert doctor(tmp_path / "run") == 0
    out = capsys.readouterr().out
    assert "hfstream step report" in out and "advice: set prefetch_depth=2" in out
    # That prefetching then hides the collate is an effect held without a clock by
    # tests/test_effects_data_wait_hidden.py; how much it saves is the sweep's (docs/benchmarks.md).


def test_doctor_on_a_path_without_a_report_says_what_to_pass(tmp_path, capsys):
    assert doctor(tmp_path) == 2
    err = capsys.readouterr().err
    assert "no step report at" in err and "stream_report.json" in err and "output_dir" in err
    (tmp_path / "stream_report.json").write_text("{not json")
    assert doctor(tmp_path) == 2
    assert "is not a step report" in capsys.readouterr().err


def _comm_bound(rank, world_size, tmp, grad_sync="overlap", bucket_mb=float("inf")):
    # Many parameters, little compute: 2 x 1024 x 1024 fp32 weights (16 MiB of gradients) on a
    # batch of 2, in one bucket, so the all-reduce is all exposed after backward.
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=512, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    args = train_args(StreamTrainingArguments, f"{tmp}/comm", max_steps=10, per_device_train_batch_size=1,
                      grad_sync=grad_sync, grad_bucket_mb=bucket_mb, prefetch_depth=2)
    trainer = StreamTrainer(model=model, args=args, train_dataset=lm_dataset(seq=8))
    trainer.train()
    return dict(trainer.stream_report())


@pytest.mark.multiprocess
@pytest.mark.slow   # 17 s, and its premise (a quarter of the step exposed) needs a quiet machine; the rules: test_advice_premises.py
def test_comm_bound_trainer_run_is_told_to_change_how_gradients_travel(tmp_path, run_distributed):
    reports = run_distributed(_comm_bound, 2, str(tmp_path), init_process_group=False, timeout=300)
    for report in reports:   # every rank holds the same advice
        assert report["advice"] == reports[0]["advice"]
    advice, mean = reports[0]["advice"], reports[0]["mean"]
    # The scenario is comm-bound: a quarter of the step exposed (0.28 measured 2026-12-02 on a quiet machine,
    # where it had been over 0.3 before this round; not yet explained, see the issue note).
    assert mean["exposed_comm_ms"] > 0.25 * mean["step_ms"], mean
    assert advice and advice[0]["setting"] in ("grad_bucket_mb", "grad_sync"), advice
    assert not advice[0]["changes_results"]
    # Each saves 5 %: of the step, or per sample for a larger effective batch (whose step is longer).
    assert all(a["saving"] >= MIN_SAVING for a in advice)
    assert all(a["predicted_step_ms"] <= mean["step_ms"] * (1 - MIN_SAVING) for a in advice
               if "predicted_ms_per_sample" not in a)


@pytest.mark.multiprocess
@pytest.mark.slow   # 17 s; serial's overlap-first rule is held in the default run by test_advice_premises.py
def test_a_serial_trainer_run_is_told_overlap_first_with_the_premise_it_checked(tmp_path, run_distributed):
    reports = run_distributed(_comm_bound, 2, str(tmp_path), "serial", 1.0, init_process_group=False, timeout=300)
    advice, mean = reports[0]["advice"], reports[0]["mean"]
    assert mean["exposed_comm_ms"] > 0.25 * mean["step_ms"], mean   # serial: all of it after backward
    assert advice and (advice[0]["setting"], advice[0]["value"]) == ("grad_sync", "overlap"), advice
    assert advice[0]["premise"].startswith("under serial all ") and not advice[0]["changes_results"]
    # Its buckets (1 MiB caps on 16 MiB) were timed one by one: the wire's premise was measured.
    assert reports[0]["model"]["comm_scaling"] is not None, reports[0]["ruled_out"]


def test_run_at_its_ceiling_trainer_run_gets_no_advice_worth_ten_percent(tmp_path, one_compute_thread):
    # One process, batches ready in time (prefetched, a plain collate): nothing to hide, nothing to sync.
    args = train_args(StreamTrainingArguments, tmp_path / "run", max_steps=12, prefetch_depth=2)
    trainer = StreamTrainer(model=tiny_causal_lm(), args=args, train_dataset=lm_dataset())
    trainer.train()
    report = trainer.stream_report()
    step = report["mean"]["step_ms"]
    assert isinstance(report["advice"], list) and step > 0, report
    worth_ten_percent = [a for a in report["advice"] if a["predicted_step_ms"] <= 0.9 * step]
    assert worth_ten_percent == [], report["advice"]
    # An empty list means "nothing worth it", not "the advisor never ran": it ruled out this run's
    # candidates, each with its reason (one process: nothing to synchronise) ...
    assert "communication: one process, nothing to synchronise" in report["ruled_out"], report["ruled_out"]
    # ... and the same mean with a wait as long as the step, loaded in the step, gets advice.
    waiting = dict(report["mean"], data_wait_ms=step, step_ms=2 * step)
    assert advise(waiting, RunFacts(grad_sync=None, prefetch_depth=0))[0]["setting"] == "prefetch_depth"


def test_bench_advice_refuses_an_unknown_scenario_by_name(capsys):
    from dev.bench.advice import main

    with pytest.raises(SystemExit):
        main(["--scenarios", "data,network"])
    assert "--scenarios: unknown network; accepted: data, comm, serial, ceiling" in capsys.readouterr().err
