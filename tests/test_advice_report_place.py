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
from hfstream.doctor import REPORT_FILE, doctor
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


def test_a_run_without_a_checkpoint_at_its_last_step_writes_the_report_in_output_dir(tmp_path):
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
