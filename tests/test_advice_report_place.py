"""Where the step report lands, and what `hfstream doctor` says about a path.

The report goes inside the checkpoint folder of the step training ended on, so ``output_dir``
lists exactly what the stock Trainer leaves there (transformers' own tests count its entries);
``hfstream doctor output_dir`` finds it there.
"""

from __future__ import annotations

import json
import os

from transformers import Trainer, TrainingArguments

from hfstream import StreamTrainer, StreamTrainingArguments
from hfstream.cli.doctor import REPORT_FILE, doctor
from tiny import lm_dataset, tiny_causal_lm, train_args


def _listing(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


def test_output_dir_lists_what_the_stock_trainer_leaves_and_doctor_finds_the_report(tmp_path, capsys):
    kw = dict(max_steps=3, save_strategy="steps", save_steps=3)
    Trainer(model=tiny_causal_lm(), args=train_args(TrainingArguments, tmp_path / "stock", **kw),
            train_dataset=lm_dataset()).train()
    StreamTrainer(model=tiny_causal_lm(), args=train_args(StreamTrainingArguments, tmp_path / "stream", **kw),
                  train_dataset=lm_dataset()).train()
    assert sorted(os.listdir(tmp_path / "stream")) == sorted(os.listdir(tmp_path / "stock")) == ["checkpoint-3"]
    extra = set(_listing(tmp_path / "stream")) - set(_listing(tmp_path / "stock"))
    assert extra == {os.path.join("checkpoint-3", REPORT_FILE)}, extra
    assert "mean" in json.loads((tmp_path / "stream" / "checkpoint-3" / REPORT_FILE).read_text())
    capsys.readouterr()
    assert doctor(tmp_path / "stream") == 0
    out = capsys.readouterr().out
    assert out.startswith(str(tmp_path / "stream" / "checkpoint-3" / REPORT_FILE)) and "hfstream step report" in out


def test_a_run_that_saved_no_checkpoint_writes_the_report_in_output_dir(tmp_path):
    trainer = StreamTrainer(model=tiny_causal_lm(), train_dataset=lm_dataset(),
                            args=train_args(StreamTrainingArguments, tmp_path / "run", max_steps=3))
    trainer.train()
    assert os.listdir(tmp_path / "run") == [REPORT_FILE]


def test_doctor_on_a_missing_path_says_it_does_not_exist(tmp_path, capsys):
    assert doctor(tmp_path / "nowhere") == 2
    err = capsys.readouterr().err
    assert "nowhere does not exist" in err and "no step report" not in err


def test_doctor_on_a_folder_of_several_reports_lists_them_and_says_which_it_read(tmp_path, capsys):
    report = {"mean": {"step_ms": 10.0}, "per_rank": [{"step_ms": 10.0}], "grad_sync": None, "prefetch_depth": 2,
              "spans": [], "notes": [], "advice": []}
    paths = [tmp_path / "checkpoint-2" / REPORT_FILE, tmp_path / "checkpoint-4" / REPORT_FILE]
    for i, path in enumerate(paths):
        path.parent.mkdir()
        path.write_text(json.dumps(report))
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
    capsys.readouterr()
    assert doctor(tmp_path) == 0
    out = capsys.readouterr().out
    assert f"2 step reports under {tmp_path}" in out
    assert out.index(str(paths[0])) < out.index(str(paths[1]))
    assert f"reading the newest: {paths[1]}" in out


# -- the advice as printed ------------------------------------------------------------------------
def _entry(**kw):
    return {"setting": "dataloader_num_workers", "value": 3, "predicted_step_ms": 30.0, "changes_results": False,
            "reason": "the producer holds the GIL while it builds each batch, so a thread beside the step slows "
                      "the step's own Python as much as it hides; worker processes each have their own "
                      "interpreter and a core of their own", **kw}


def test_advice_lines_fit_100_columns_with_the_reason_wrapped_under_the_setting():
    from hfstream.report.format import ADVICE_WIDTH, format_advice

    (text,) = format_advice([_entry()])
    lines = text.splitlines()
    assert ADVICE_WIDTH == 100 and len(lines) >= 3, lines
    assert lines[0] == "  advice: set dataloader_num_workers=3 (predicted 30.00 ms)"
    assert all(len(line) <= 100 for line in lines) and all(line.startswith("      ") for line in lines[1:])
    assert " ".join(line.strip() for line in lines[1:]) == _entry()["reason"]


def test_a_loaded_machine_marks_the_advice_unreliable_with_the_bench_threshold():
    from hfstream.report.advice import RunFacts, advise
    from hfstream.report.format import format_advice
    from hfstream.report.advice import LOADED_PER_CORE

    mean = dict(data_wait_ms=40, forward_ms=10, backward_ms=15, optimizer_ms=5, exposed_comm_ms=0,
                comm_busy_ms=float("nan"), step_ms=70)
    quiet = advise(mean, RunFacts(grad_sync=None, prefetch_depth=0, loadavg_1min=LOADED_PER_CORE * 2, cores=2))
    loaded = advise(mean, RunFacts(grad_sync=None, prefetch_depth=0, loadavg_1min=LOADED_PER_CORE * 2 + 0.5,
                                   cores=2))
    assert quiet[0]["load"] == {"loadavg_1min": 2.5, "cores": 2, "limit": 2.5, "per_core": 1.25, "limit_per_core": 1.25,
                                "unreliable": False}
    assert loaded[0]["load"]["unreliable"] and loaded[0]["load"]["loadavg_1min"] == 3.0
    assert "unreliable" not in format_advice(quiet)[0]
    assert "unreliable: the machine was loaded (1-minute load 3.0 on 2 cores, above 2.5)" in \
        " ".join(format_advice(loaded)[0].split())


def test_one_rank_reads_one_rank():
    from hfstream.report.format import format_report

    one = format_report({"mean": {"steps": 3, "step_ms": 1.0}, "per_rank": [{"step_ms": 1.0}]}).splitlines()[0]
    two = format_report({"mean": {"steps": 3, "step_ms": 1.0}, "per_rank": [{}, {}]}).splitlines()[0]
    assert one.endswith(", 1 rank)") and two.endswith(", 2 ranks)")


def test_one_bucket_reads_one_bucket():
    from hfstream.report.advice import RunFacts, advise

    mean = dict(data_wait_ms=1, forward_ms=70, backward_ms=115, optimizer_ms=29, exposed_comm_ms=234,
                comm_busy_ms=234, step_ms=455)
    total = 28_000_000

    def reason(cap):   # GradSync's planner by hand: one bucket from 64 MiB up, else cap-sized ones
        plan = lambda c: [total] if c >= 64 else [int(c * 2**20)] * max(1, int(total / (c * 2**20)))  # noqa: E731
        advice = advise(mean, RunFacts(grad_sync="overlap", world_size=2, bucket_mb=cap, plan=plan))
        return next(a["reason"] for a in advice if a["setting"] == "grad_bucket_mb")

    assert "with 1 bucket of at most 64 MiB" in reason(64.0)
    from hfstream.report.advice import _count

    assert (_count(1, "bucket"), _count(6, "bucket")) == ("1 bucket", "6 buckets")


def test_a_run_with_checkpoints_keeps_its_output_dir_stock_and_the_report_in_its_newest_checkpoint(tmp_path):
    kw = dict(max_steps=3, save_strategy="steps", save_steps=2)
    Trainer(model=tiny_causal_lm(), args=train_args(TrainingArguments, tmp_path / "stock", **kw),
            train_dataset=lm_dataset()).train()
    StreamTrainer(model=tiny_causal_lm(), args=train_args(StreamTrainingArguments, tmp_path / "stream", **kw),
                  train_dataset=lm_dataset()).train()
    assert sorted(os.listdir(tmp_path / "stream")) == sorted(os.listdir(tmp_path / "stock"))
    newest = sorted(os.listdir(tmp_path / "stream"), key=lambda d: int(d.split("-")[1]))[-1]
    assert [f for f in _listing(tmp_path / "stream") if f.endswith(REPORT_FILE)] == [os.path.join(newest, REPORT_FILE)]


def test_the_report_goes_to_the_newest_checkpoint_when_none_is_of_the_last_step(tmp_path):
    from hfstream.trainer.report_file import report_dir

    for step in (2, 10):
        (tmp_path / f"checkpoint-{step}").mkdir()
    assert report_dir(tmp_path, step=12) == tmp_path / "checkpoint-10"
    assert report_dir(tmp_path, step=2) == tmp_path / "checkpoint-2"
    assert report_dir(tmp_path / "none", step=2) == tmp_path / "none"
