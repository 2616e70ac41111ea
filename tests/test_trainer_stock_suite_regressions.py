"""What transformers' own `tests/trainer` suite caught StreamTrainer doing differently, in small.

The suite (run against StreamTrainer by rebinding ``transformers.Trainer``; docs/benchmarks.md)
counts the entries of ``output_dir`` after `train()`: `TrainerBestModelTest::test_save_best_checkpoint`
(``save_strategy="best"``) and `::test_best_model_checkpoint_behavior` (a checkpoint every step,
rotated to ``save_total_limit=1``) failed while the step report was written beside the checkpoints.
Here each of those runs, stock and StreamTrainer, must leave the same ``output_dir`` listing.
"""

from __future__ import annotations

import os

import pytest
from transformers import Trainer, TrainingArguments

from hfstream import StreamTrainer, StreamTrainingArguments
from hfstream.cli.doctor import REPORT_FILE, find_report
from tiny import lm_dataset, tiny_causal_lm, train_args

CASES = {
    # test_save_best_checkpoint: only the checkpoints that improved the metric are written
    "save_best": dict(eval_strategy="steps", eval_steps=2, save_strategy="best", metric_for_best_model="loss"),
    # test_best_model_checkpoint_behavior, case 2: one checkpoint a step, rotated down to the last one
    "rotated_to_one": dict(save_strategy="steps", save_steps=1, save_total_limit=1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_output_dir_lists_what_the_stock_trainer_leaves(tmp_path, case):
    kw = dict(max_steps=6, **CASES[case])
    listings = {}
    for name, trainer_cls, args_cls in (("stock", Trainer, TrainingArguments),
                                        ("stream", StreamTrainer, StreamTrainingArguments)):
        out = tmp_path / name
        trainer_cls(model=tiny_causal_lm(), args=train_args(args_cls, out, **kw),
                    train_dataset=lm_dataset(), eval_dataset=lm_dataset(n=16, seed=3)).train()
        listings[name] = sorted(os.listdir(out))
    assert listings["stream"] == listings["stock"], listings
    assert REPORT_FILE not in listings["stream"]
    # ... and the report is still there for `hfstream doctor`, inside a checkpoint the Trainer owns
    report = find_report(tmp_path / "stream")
    assert report is not None and report.parent.name in listings["stream"], report
