"""StreamTrainer with prefetching trains on exactly the batches the stock Trainer would, in the
same order, with the same results: 1 and 2 processes, gradient accumulation 3, dropout on (so
the random stream must not be disturbed by the prefetch thread), resumption mid-epoch, and
evaluation/prediction untouched."""

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hfstream import StreamTrainer, StreamTrainerMixin, StreamTrainingArguments
from tiny import lm_dataset, losses, params, reported, tiny_causal_lm, train_args


class RecordingTrainer(Trainer):
    """Records a fingerprint of every micro-batch it trains on."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.seen = getattr(self, "seen", [])
        ids = inputs["input_ids"]
        self.seen.append((ids * torch.arange(1, ids.shape[1] + 1)).sum().item())
        state = self.accelerator.gradient_state
        self.ends = getattr(self, "ends", []) + [(state.end_of_dataloader, state.remainder)]
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class StreamRecordingTrainer(StreamTrainerMixin, RecordingTrainer):
    pass


def _pair(tmp, stream_kw, **kw):
    out = {}
    for name, cls, args_cls, extra in (("stock", RecordingTrainer, TrainingArguments, {}),
                                       ("stream", StreamRecordingTrainer, StreamTrainingArguments, stream_kw)):
        model = tiny_causal_lm("gpt2", dropout=0.1)
        trainer = cls(model=model, args=train_args(args_cls, f"{tmp}/{name}", max_steps=30,
                                                   gradient_accumulation_steps=3, **extra, **kw),
                      train_dataset=lm_dataset())
        logs = reported(trainer)
        trainer.train()
        out[name] = dict(losses=losses(trainer), params=params(trainer.model), seen=trainer.seen, ends=trainer.ends,
                         waits=[h["stream/data_wait_ms"] for h in logs if "stream/data_wait_ms" in h])
    return out


def _assert_same(out):
    s, t = out["stock"], out["stream"]
    assert len(s["losses"]) == 30 and s["seen"] == t["seen"] and s["losses"] == t["losses"]
    # Accelerate's end-of-dataloader flag as the loop sees it, not as the prefetcher does.
    assert any(end for end, _ in s["ends"]) and s["ends"] == t["ends"]
    for k, v in s["params"].items():
        assert torch.equal(v, t["params"][k]), k


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_single_process_identical(tmp_path, depth):
    out = _pair(tmp_path, dict(prefetch_depth=depth, grad_sync="native"))
    _assert_same(out)
    assert out["stream"]["waits"], "data_wait_ms is logged"


def _two_process(rank, world_size, tmp):
    return _pair(tmp, dict(prefetch_depth=2, grad_sync="native")), \
        _pair(f"{tmp}/overlap", dict(prefetch_depth=2, grad_sync="overlap"))


@pytest.mark.multiprocess
def test_two_processes_identical(tmp_path, run_distributed):
    for native, overlap in run_distributed(_two_process, 2, str(tmp_path), init_process_group=False, timeout=300):
        _assert_same(native)
        s, t = overlap["stock"], overlap["stream"]
        assert s["seen"] == t["seen"]
        torch.testing.assert_close(torch.tensor(t["losses"]), torch.tensor(s["losses"]), rtol=1e-5, atol=1e-6)
        for k, v in s["params"].items():
            torch.testing.assert_close(t["params"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_resume_mid_epoch_same_batches(tmp_path):
    def run(out_dir, resume=None):
        args = train_args(StreamTrainingArguments, out_dir, max_steps=12, gradient_accumulation_steps=3,
                          prefetch_depth=2, grad_sync="native", save_strategy="steps", save_steps=4)
        trainer = StreamRecordingTrainer(model=tiny_causal_lm("gpt2", dropout=0.1), args=args, train_dataset=lm_dataset())
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "a")
    again = run(tmp_path / "a", resume=str(tmp_path / "a" / "checkpoint-4"))   # 8 steps per epoch: mid-epoch
    assert again.seen == full.seen[4 * 3:]
    for k, v in params(full.model).items():
        assert torch.equal(v, params(again.model)[k]), k


def _eval_predict(rank, world_size, tmp):
    res = {}
    for name, cls, args_cls, extra in (("stock", Trainer, TrainingArguments, {}),
                                       ("stream", StreamTrainer, StreamTrainingArguments, dict(prefetch_depth=2))):
        trainer = cls(model=tiny_causal_lm("gpt2"), args=train_args(args_cls, f"{tmp}/{name}", max_steps=4,
                                                                    per_device_eval_batch_size=4, **extra),
                      train_dataset=lm_dataset(), eval_dataset=lm_dataset(n=25, seed=9))
        trainer.train()
        metrics = trainer.evaluate()
        pred = trainer.predict(lm_dataset(n=25, seed=9))
        res[name] = (metrics["eval_loss"], pred.predictions[0].shape if isinstance(pred.predictions, tuple)
                     else pred.predictions.shape, params(trainer.model))
    return res


@pytest.mark.multiprocess
def test_eval_and_predict_unchanged_two_processes(tmp_path, run_distributed):
    for res in run_distributed(_eval_predict, 2, str(tmp_path), init_process_group=False, timeout=300):
        (l0, shape0, p0), (l1, shape1, p1) = res["stock"], res["stream"]
        assert shape0[0] == 25 and shape1 == shape0           # gather_for_metrics drops the padding
        assert l1 == pytest.approx(l0, rel=1e-5, abs=1e-6)
