"""With its features off (prefetch_depth=0, grad_sync="native"), StreamTrainer trains exactly
like the stock Trainer: same losses and bit-identical parameters, 1 and 2 processes."""

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hfstream import StreamTrainer, StreamTrainerMixin, StreamTrainingArguments
from tiny import cls_dataset, lm_dataset, losses, params, tiny_bert_classifier, tiny_causal_lm, train_args

OFF = dict(prefetch_depth=0, grad_sync="native")


class ScaledLossTrainer(Trainer):
    """A user's own subclass that overrides compute_loss."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        loss = out.loss * 0.5
        return (loss, out) if return_outputs else loss


class StreamScaledLossTrainer(StreamTrainerMixin, ScaledLossTrainer):
    pass


def _build(case):
    if case == "bert":
        return tiny_bert_classifier(), cls_dataset()
    return tiny_causal_lm(case), lm_dataset()


def _run_pair(tmp, case="gpt2", stock_cls=Trainer, stream_cls=StreamTrainer, **extra):
    results = []
    for cls, args_cls, kw in ((stock_cls, TrainingArguments, {}), (stream_cls, StreamTrainingArguments, OFF)):
        model, ds = _build(case)
        trainer = cls(model=model, args=train_args(args_cls, tmp, **kw, **extra), train_dataset=ds)
        trainer.train()
        results.append((losses(trainer), params(trainer.model)))
    return results


def _assert_identical(stock, stream):
    (l0, p0), (l1, p1) = stock, stream
    assert len(l0) == 20 and l0 == l1
    assert p0.keys() == p1.keys()
    for k in p0:
        assert torch.equal(p0[k], p1[k]), k


@pytest.mark.parametrize("case", ["gpt2", "llama", "bert"])
def test_single_process_parity(tmp_path, case):
    _assert_identical(*_run_pair(tmp_path, case))


def test_user_subclass_with_compute_loss(tmp_path):
    stock, stream = _run_pair(tmp_path, "gpt2", ScaledLossTrainer, StreamScaledLossTrainer,
                              gradient_accumulation_steps=2)
    _assert_identical(stock, stream)


def _two_process_parity(rank, world_size, tmp, case):
    stock, stream = _run_pair(f"{tmp}/{case}", case, gradient_accumulation_steps=2)
    return stock[0], stream[0], all(torch.equal(stock[1][k], stream[1][k]) for k in stock[1]), \
        {k: v for k, v in stream[1].items() if k.endswith("bias")}


@pytest.mark.multiprocess
def test_two_process_parity(tmp_path, run_distributed):
    out = run_distributed(_two_process_parity, 2, str(tmp_path), "gpt2", init_process_group=False, timeout=240)
    for stock_losses, stream_losses, same_params, _ in out:
        assert len(stock_losses) == 20 and stock_losses == stream_losses
        assert same_params
    # DDP kept the replicas identical: both ranks end with the same parameters.
    for k, v in out[0][3].items():
        assert torch.equal(v, out[1][3][k]), k


def test_plain_training_arguments_rejected(tmp_path):
    model, ds = _build("gpt2")
    with pytest.raises(TypeError, match="StreamTrainingArguments"):
        StreamTrainer(model=model, args=train_args(TrainingArguments, tmp_path), train_dataset=ds)


def test_default_args_are_stream_args():
    model, _ = _build("gpt2")
    trainer = StreamTrainer(model=model)
    assert isinstance(trainer.args, StreamTrainingArguments)
