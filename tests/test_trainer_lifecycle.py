"""What `StreamTrainer.train()` leaves behind and what its report keeps, on one process.

Each of these keeps every value equal when it is lost, so only these tests hold it: the forward
hook that times the step is removed when training ends (a model handed on keeps no hook of
hfstream's); the report's timeline keeps the spans of the last four steps; a forward in eval mode
inside the step (a metric, a frozen reference) does not move the step's forward mark; the loader
the prefetcher reads from hands it host tensors, which the prefetcher then copies ahead.
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from hfstream import StreamTrainer, StreamTrainingArguments
from hfstream.gradsync.eager import ModelHook
from tiny import lm_dataset, tiny_causal_lm, train_args


def _hfstream_hooks(model) -> int:
    return sum(isinstance(hook, ModelHook) for hook in model._forward_hooks.values())


def test_train_removes_its_forward_hook_and_a_second_train_adds_one_again(tmp_path):
    model = tiny_causal_lm()
    seen = []
    model.register_forward_hook(lambda m, a, o: seen.append(_hfstream_hooks(m)) if m.training else None)
    trainer = StreamTrainer(model=model, train_dataset=lm_dataset(),
                            args=train_args(StreamTrainingArguments, tmp_path, max_steps=2, prefetch_depth=0))
    for _ in range(2):
        trainer.train()
        assert _hfstream_hooks(model) == 0 and trainer._forward_hook is None
    assert seen == [1] * 4, seen   # one hook during each of the four training forwards, none after


def test_the_report_keeps_the_spans_of_the_last_four_steps(tmp_path):
    trainer = StreamTrainer(model=tiny_causal_lm(), train_dataset=lm_dataset(),
                            args=train_args(StreamTrainingArguments, tmp_path, max_steps=7, prefetch_depth=0))
    trainer.train()
    kept = list(trainer._timeline.spans)
    assert [step for step, _ in kept] == list(range(1, 8))   # the timeline has all seven
    expected = [list(span) for _, spans in kept[-4:] for span in spans]
    assert expected and trainer.stream_report()["spans"] == expected


class EvalForwardAfterLoss(StreamTrainer):
    """A metric computed in eval mode after the training forward, as a distillation or a probe would."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        model.eval()
        with torch.no_grad():
            model(input_ids=inputs["input_ids"])
        model.train()
        return loss


def test_a_forward_in_eval_mode_inside_the_step_does_not_move_the_forward_mark(tmp_path):
    trainer = EvalForwardAfterLoss(model=tiny_causal_lm(), train_dataset=lm_dataset(),
                                   args=train_args(StreamTrainingArguments, tmp_path, max_steps=3,
                                                   gradient_accumulation_steps=2, prefetch_depth=0))
    trainer.train()
    kinds = [kind for kind, *_ in trainer._timeline.host_intervals]
    # One forward and one backward interval per micro-step: 3 steps of 2. The eval forward ends
    # after the training forward; taken as a second end it would add a forward interval.
    assert kinds.count("forward") == 6 and kinds.count("backward") == 6, kinds


class ForwardAtStepBegin(TrainerCallback):
    """A probe in training mode at every step's start, before the step's own forward is marked."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            model(input_ids=torch.tensor(lm_dataset(n=2, seed=7)["input_ids"]))


def test_a_forward_in_a_callback_before_the_steps_own_is_not_timed_as_the_step(tmp_path):
    trainer = StreamTrainer(model=tiny_causal_lm(), train_dataset=lm_dataset(), callbacks=[ForwardAtStepBegin()],
                            args=train_args(StreamTrainingArguments, tmp_path, max_steps=3, prefetch_depth=0))
    trainer.train()   # the stock Trainer finishes such a run; so must this one
    kinds = [kind for kind, *_ in trainer._timeline.host_intervals]
    assert trainer.state.global_step == 3 and kinds.count("forward") == 3, kinds


def test_the_loader_hands_the_prefetcher_host_tensors_and_places_them_itself_without_one(tmp_path):
    for depth, device in ((2, None), (0, torch.device("cpu"))):
        trainer = StreamTrainer(model=tiny_causal_lm(), train_dataset=lm_dataset(),
                                args=train_args(StreamTrainingArguments, tmp_path, max_steps=1, prefetch_depth=depth))
        assert trainer.get_train_dataloader().device == device, depth


def test_train_returns_what_the_stock_trainer_returns(tmp_path):
    # Scripts read it (`metrics = trainer.train().metrics; trainer.log_metrics("train", metrics)`).
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_utils import TrainOutput

    stock = Trainer(model=tiny_causal_lm(), train_dataset=lm_dataset(),
                    args=train_args(TrainingArguments, tmp_path / "stock", max_steps=3)).train()
    ours = StreamTrainer(model=tiny_causal_lm(), train_dataset=lm_dataset(),
                         args=train_args(StreamTrainingArguments, tmp_path / "ours", max_steps=3)).train()
    assert isinstance(ours, TrainOutput)
    assert ours.global_step == stock.global_step == 3 and ours.training_loss == stock.training_loss
    assert set(ours.metrics) == set(stock.metrics) and ours.metrics["train_loss"] == stock.metrics["train_loss"]


def test_each_logged_breakdown_covers_only_the_steps_since_the_last_log(tmp_path):
    # The `stream/*` scalars of a log are that interval's means, not the run's so far.
    trainer = StreamTrainer(model=tiny_causal_lm(), train_dataset=lm_dataset(),
                            args=train_args(StreamTrainingArguments, tmp_path, max_steps=6, logging_steps=2,
                                            prefetch_depth=0))
    asked, logged = [], []
    real = trainer._timeline.summary

    def summary(*args, **kwargs):
        out = real(*args, **kwargs)
        asked.append(kwargs.get("since_step"))
        logged.append(out.get("steps"))
        return out

    trainer._timeline.summary = summary
    trainer.train()
    # On a CPU every step is resolved when logged: steps 1-2, 3-4, 5-6 (the first log has no warmup
    # to skip: since_step is given from the start).
    assert asked[:3] == [0, 2, 4] and logged[:3] == [2.0, 2.0, 2.0], (asked, logged)
