"""A stuck step is reported and ended, never left hanging: StepWatchdog and GradSync's timeout."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hfstream.trainer.watchdog import EXIT_CODE, StepWatchdog


def test_a_step_past_the_limit_is_reported_once_with_what_it_waits_for():
    dog = StepWatchdog(report_after_s=0.3, exit_after_s=None, describe=lambda: "bucket 3: never became ready",
                       rank=1, poll_s=0.05)
    try:
        dog.begin(7)
        time.sleep(0.9)
        dog.end()
        dog.begin(8)
        time.sleep(0.1)          # under the limit: nothing to say
        dog.end()
    finally:
        dog.close()
    assert len(dog.reports) == 1
    assert "rank 1 has been inside step 7" in dog.reports[0] and "bucket 3: never became ready" in dog.reports[0]


def test_a_step_past_the_exit_limit_ends_the_process_with_code_124():
    code = textwrap.dedent("""
        import time
        from hfstream.trainer.watchdog import StepWatchdog
        dog = StepWatchdog(report_after_s=0.2, exit_after_s=0.6, describe=lambda: "waiting for bucket 0", poll_s=0.05)
        dog.begin(5)
        time.sleep(30)
    """)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_CODE == 124   # timeout(1)'s code, as the README says
    assert time.monotonic() - start < 20
    assert "waiting for bucket 0" in done.stderr and f"Exiting with code {EXIT_CODE}" in done.stderr


def test_a_report_is_logged_as_an_error(caplog):
    import hfstream.trainer.watchdog as watchdog

    dog = StepWatchdog(report_after_s=10.0, exit_after_s=None, describe=lambda: "bucket 0 pending", poll_s=3600.0)
    try:
        dog.watch("inside step 2")
        with caplog.at_level("ERROR", logger=watchdog.__name__):
            dog._report("inside step 2", dog._since, 12.0)
    finally:
        dog.close()
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert caplog.records[0].getMessage() == dog.reports[0] == ("hfstream watchdog: rank 0 has been inside step 2 "
                                                               "for 12 s.\nbucket 0 pending")


def test_watchdog_arguments_are_checked():
    with pytest.raises(ValueError, match="report_after_s"):
        StepWatchdog(0, None, describe=str)
    with pytest.raises(ValueError, match="exit_after_s"):
        StepWatchdog(5, 1, describe=str)


def _late_peer(rank, world_size, timeout):
    from hfstream import GradSync

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    sync = GradSync(model, bucket_mb=0, timeout=timeout)
    if rank == 1:
        time.sleep(timeout + 4)   # alive but late: rank 0 must not wait forever
    model(torch.randn(4, 8)).sum().backward()
    start = time.monotonic()
    try:
        sync.finish()
        return ("ok", time.monotonic() - start, "")
    except RuntimeError as exc:
        return ("error", time.monotonic() - start, str(exc))


@pytest.mark.multiprocess
def test_finish_gives_up_after_its_timeout_and_names_the_pending_buckets(run_distributed):
    results = run_distributed(_late_peer, 2, 2.0, timeout=90, pg_timeout_s=30)
    status, waited, message = results[0]
    assert status == "error" and waited < 6, results[0]
    assert "did not complete" in message and "timeout=2 s" in message
    assert "reduction not complete" in message and "1.bias" in message   # the first bucket: the last layer's


def _unused_layer(rank, world_size):
    from hfstream import GradSync

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(8, 8), "skipped": torch.nn.Linear(8, 8)})
    sync = GradSync(model, bucket_mb=0, timeout=30)
    model["used"](torch.randn(4, 8)).sum().backward()   # "skipped" never gets a gradient this step
    report = sync.pending_report()
    sync.finish()                                       # unused parameters still travel: no hang
    return report


@pytest.mark.multiprocess
def test_pending_report_names_the_buckets_that_never_became_ready_and_their_parameters(run_distributed):
    report = run_distributed(_unused_layer, 2, timeout=90)[0]
    assert "never became ready; no gradient yet for skipped.bias" in report
    assert "skipped.weight" in report and "used.weight" not in report


@pytest.mark.parametrize("bad", [0, -5, "soon", True, float("nan")])
def test_gradsync_timeout_must_be_positive_seconds(bad):
    from hfstream import GradSync

    with pytest.raises(ValueError, match="timeout="):
        GradSync(torch.nn.Linear(2, 2), timeout=bad)


def test_evaluation_during_training_is_a_phase_the_watchdog_names(tmp_path):
    # The watchdog runs on several processes only; here its phases are recorded where the trainer
    # tells it, with a watchdog in place as the first multi-process phase would have started it.
    from hfstream import StreamTrainer, StreamTrainingArguments
    from tiny import lm_dataset, tiny_causal_lm, train_args

    args = train_args(StreamTrainingArguments, tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1)
    trainer = StreamTrainer(model=tiny_causal_lm(), args=args, train_dataset=lm_dataset(), eval_dataset=lm_dataset(8))
    phases = []
    trainer._watch = phases.append
    trainer._watchdog = type("Watchdog", (), {"close": lambda self: None})()
    trainer.train()
    loading = [p for p in phases if p.startswith("loading the batches of step")]
    assert [p.split(" (")[0] for p in loading] == ["loading the batches of step 1", "loading the batches of step 2"]
    evaluating = [p for p in phases if p.startswith("evaluating during training")]
    assert evaluating and evaluating[0] == "evaluating during training, after step 1", phases
    trainer.evaluate()   # after train(): not a phase of training
    assert len([p for p in phases if p.startswith("evaluating")]) == len(evaluating)


def test_the_pending_report_says_how_long_ago_each_unfinished_bucket_was_launched():
    import types

    from hfstream.gradsync.faults import pending_report

    def bucket(index, names, work, launched, ready):
        return types.SimpleNamespace(plan=types.SimpleNamespace(index=index, names=names), work=work,
                                     launch_time=launched, ready=ready)

    in_flight = types.SimpleNamespace(is_completed=lambda: False)
    done = types.SimpleNamespace(is_completed=lambda: True)
    now = time.perf_counter()
    report = pending_report(1, [bucket(0, ["w0"], in_flight, now - 2.0, [True]),
                                bucket(1, ["w1"], done, now - 5.0, [True]),
                                bucket(2, ["a", "b"], None, None, [True, False])], [0, 1], serial=False)
    lines = report.splitlines()
    assert lines[0] == "GradSync rank 1, launched so far [0, 1]:"
    assert lines[1].startswith("  bucket 0: launched 2.") and "reduction not complete" in lines[1], lines
    assert lines[2] == "  bucket 2: never became ready; no gradient yet for b", lines   # bucket 1 completed
    assert len(lines) == 3


def test_a_stuck_step_is_described_by_who_owns_the_reduction(tmp_path):
    import types

    from hfstream import StreamTrainer, StreamTrainingArguments
    from tiny import lm_dataset, tiny_causal_lm, train_args

    args = train_args(StreamTrainingArguments, tmp_path, max_steps=1)
    trainer = StreamTrainer(model=tiny_causal_lm(), args=args, train_dataset=lm_dataset(8))
    assert trainer.grad_sync is None   # one process: hfstream reduces nothing
    assert trainer._describe_stuck_step().startswith(f"grad_sync={trainer.grad_sync_mode!r}: hfstream does not own")
    trainer.grad_sync = types.SimpleNamespace(pending_report=lambda: "bucket 2 (h.0.w) launched 3.0 s ago")
    assert trainer._describe_stuck_step() == "bucket 2 (h.0.w) launched 3.0 s ago"
    trainer.grad_sync = types.SimpleNamespace(pending_report=lambda: "")
    assert trainer._describe_stuck_step() == "GradSync has nothing pending: the step is in forward or backward"
    trainer.grad_sync = None


def test_the_trainer_reports_at_half_ddp_timeout_and_ends_the_process_15_s_past_it(tmp_path, monkeypatch):
    # The watchdog runs on several processes only: the world size is faked once the trainer is built.
    from hfstream import StreamTrainer, StreamTrainingArguments
    from tiny import lm_dataset, tiny_causal_lm, train_args

    cases = {(None, 600): (300.0, 615.0), (30, 600): (30.0, 615.0), (900, 600): (900.0, 900.0), (0, 600): None}
    for (limit, timeout), expected in cases.items():
        args = train_args(StreamTrainingArguments, tmp_path, max_steps=1, ddp_timeout=timeout, step_watchdog_s=limit)
        trainer = StreamTrainer(model=tiny_causal_lm(), args=args, train_dataset=lm_dataset(8))
        with monkeypatch.context() as patch:
            patch.setattr(StreamTrainingArguments, "world_size", property(lambda self: 2))
            trainer._watch("a phase")
        watchdog = trainer._watchdog
        try:
            got = None if watchdog is None else (watchdog.report_after_s, watchdog.exit_after_s)
            assert got == expected, (limit, timeout, got)
        finally:
            trainer._close_watchdog()


def test_train_closes_its_watchdog_so_no_phase_outlives_the_run(tmp_path):
    # Left running, the watchdog would still watch train()'s last phase, and report it as stuck (and
    # end the process at ddp_timeout + 15 s) while the script evaluates or saves after train().
    from hfstream import StreamTrainer, StreamTrainingArguments
    from tiny import lm_dataset, tiny_causal_lm, train_args

    args = train_args(StreamTrainingArguments, tmp_path, max_steps=1)
    trainer = StreamTrainer(model=tiny_causal_lm(), args=args, train_dataset=lm_dataset(8))
    dog = StepWatchdog(report_after_s=60.0, exit_after_s=None, describe=lambda: "", poll_s=0.05)
    trainer._watchdog = dog   # as the first multi-process phase would have started it
    trainer.train()
    assert trainer._watchdog is None and not dog._thread.is_alive()
