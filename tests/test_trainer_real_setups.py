"""Real training setups finish like the stock Trainer: streaming data, a second stage on the same
model, an unused trainable parameter, and the Trainer's own observable state left as stock."""

from __future__ import annotations

import gc
import json
import logging
import weakref

import pytest
import torch
from torch.utils.data import IterableDataset
from transformers import Trainer, TrainingArguments

from hfstream import StreamTrainer, StreamTrainingArguments
from tiny import lm_dataset, losses, params, reported, tiny_causal_lm, train_args


class Stream(IterableDataset):
    """A streaming train set (no length): Accelerate dispatches its batches from rank 0."""

    def __init__(self, n=96, seq=16, vocab=64, seed=1):
        self.rows = lm_dataset(n=n, seq=seq, vocab=vocab, seed=seed)

    def __iter__(self):
        for row in self.rows:
            yield {"input_ids": torch.tensor(row["input_ids"]), "labels": torch.tensor(row["labels"])}


def _streaming(rank, world_size, tmp):
    out = {}
    for name, cls, args_cls, kw in (("stock", Trainer, TrainingArguments, {}),
                                    ("stream", StreamTrainer, StreamTrainingArguments,
                                     dict(ddp_timeout=30, grad_bucket_mb=0.01))):
        trainer = cls(model=tiny_causal_lm("gpt2", seed=0), train_dataset=Stream(),
                      args=train_args(args_cls, f"{tmp}/{name}", max_steps=10, gradient_accumulation_steps=2, **kw))
        trainer.train()
        out[name] = dict(losses=losses(trainer), params=params(trainer.model))
    return out


@pytest.mark.multiprocess
def test_an_iterable_dataset_on_two_processes_trains_like_stock(tmp_path, run_distributed):
    for out in run_distributed(_streaming, 2, str(tmp_path), init_process_group=False, timeout=300):
        ref, got = out["stock"], out["stream"]
        assert len(ref["losses"]) == 10
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
        assert ref["params"] and set(got["params"]) == set(ref["params"])   # every parameter compared
        for k, v in ref["params"].items():
            torch.testing.assert_close(got["params"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def _two_stages(rank, world_size, tmp):
    model = tiny_causal_lm("gpt2", seed=0)
    first = StreamTrainer(model=model, train_dataset=lm_dataset(),
                          args=train_args(StreamTrainingArguments, f"{tmp}/a", max_steps=4, grad_sync="overlap"))
    first.train()
    first_sync, first_ref = first.grad_sync, weakref.ref(first)
    second = StreamTrainer(model=model, train_dataset=lm_dataset(seed=3),   # stage 2: new data, new arguments
                           args=train_args(StreamTrainingArguments, f"{tmp}/b", max_steps=4, grad_sync="overlap",
                                           learning_rate=5e-4))
    del first
    gc.collect()
    second.train()
    hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())   # a rename fails here
    return dict(first_closed=first_sync.closed, first_alive=first_ref() is not None,
                second_losses=losses(second), hooks_left=hooks, params=params(model))


@pytest.mark.multiprocess
def test_a_second_trainer_on_the_same_model_trains_and_the_first_is_released(tmp_path, run_distributed):
    r0, r1 = run_distributed(_two_stages, 2, str(tmp_path), init_process_group=False, timeout=300)
    for out in (r0, r1):
        assert out["first_closed"] and not out["first_alive"]     # nothing on the model keeps it alive
        assert len(out["second_losses"]) == 4
        assert out["hooks_left"] == 0                             # train() leaves the model unhooked
    assert r0["params"] and set(r0["params"]) == set(r1["params"])
    for k, v in r0["params"].items():
        assert torch.equal(v, r1["params"][k]), k


class WithUnusedHead(torch.nn.Module):
    """A tiny LM plus a trainable pooler registered last that the loss never uses."""

    def __init__(self):
        super().__init__()
        self.lm = tiny_causal_lm("gpt2", seed=0)
        self.pooler = torch.nn.Linear(32, 32)

    def forward(self, input_ids=None, labels=None, **kwargs):
        return self.lm(input_ids=input_ids, labels=labels)


def _unused_head(rank, world_size, tmp):
    out = {}
    for name, cls, args_cls, kw in (("ddp", Trainer, TrainingArguments, dict(ddp_find_unused_parameters=True)),
                                    ("stream", StreamTrainer, StreamTrainingArguments,
                                     dict(grad_sync="overlap", grad_bucket_mb=0.002, prefetch_depth=0))):
        torch.manual_seed(0)
        trainer = cls(model=WithUnusedHead(), train_dataset=lm_dataset(),
                      args=train_args(args_cls, f"{tmp}/{name}", max_steps=6, **kw))
        early = []
        if name == "stream":
            real = StreamTrainer._stream_training_step

            def spy(self, *a, **k):
                loss = real(self, *a, **k)
                early.append((self.grad_sync.stats.launched_in_backward, len(self.grad_sync.buckets)))
                return loss

            trainer._stream_training_step = spy.__get__(trainer)
        trainer.train()
        notes = list(trainer.stream_report().get("notes", [])) if name == "stream" else []
        out[name] = dict(losses=losses(trainer), params=params(trainer.model), early=early, notes=notes)
    return out


@pytest.mark.multiprocess
def test_an_unused_trainable_parameter_costs_only_its_own_bucket_in_the_trainer(tmp_path, run_distributed):
    for out in run_distributed(_unused_head, 2, str(tmp_path), init_process_group=False, timeout=300):
        ref, got = out["ddp"], out["stream"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
        for k, v in ref["params"].items():
            torch.testing.assert_close(got["params"][k], v, rtol=1e-5, atol=1e-6, msg=k)
        first, later = got["early"][0], got["early"][1:]
        assert first[0] == 0                                   # before re-planning: the head blocks bucket 0
        assert all(launched == buckets - 1 for launched, buckets in later), later
        assert not any("overlap lost" in n for n in got["notes"]), got["notes"]


# -- the Trainer's observable state is the stock one --------------------------------------------------
def _state(trainer_cls, args_cls, out_dir, **kw):
    trainer = trainer_cls(model=tiny_causal_lm(), train_dataset=lm_dataset(),
                          args=train_args(args_cls, out_dir, max_steps=4, save_strategy="steps", save_steps=4, **kw))
    trainer.train()
    with open(f"{out_dir}/checkpoint-4/trainer_state.json") as f:
        saved = json.load(f)
    return trainer, saved


def test_callbacks_and_saved_state_are_the_stock_trainers(tmp_path):
    stock, stock_saved = _state(Trainer, TrainingArguments, tmp_path / "stock")
    ours, our_saved = _state(StreamTrainer, StreamTrainingArguments, tmp_path / "ours")
    assert [type(cb) for cb in ours.callback_handler.callbacks] == [type(cb) for cb in stock.callback_handler.callbacks]
    keys = lambda history: [sorted(h) for h in history]   # noqa: E731
    assert keys(ours.state.log_history) == keys(stock.state.log_history)
    assert keys(our_saved["log_history"]) == keys(stock_saved["log_history"])
    assert not any(k.startswith("stream/") for h in our_saved["log_history"] for k in h)


def test_the_reporters_still_get_the_step_breakdown(tmp_path):
    trainer = StreamTrainer(model=tiny_causal_lm(), train_dataset=lm_dataset(),
                            args=train_args(StreamTrainingArguments, tmp_path, max_steps=4))
    logs = reported(trainer)
    trainer.train()
    assert any("stream/step_ms" in h and "loss" in h for h in logs)
    assert not any(k.startswith("stream/") for h in trainer.state.log_history for k in h)


def test_a_missing_checkpoint_directory_gets_the_trainers_own_message(tmp_path):
    messages = []
    for cls, args_cls in ((Trainer, TrainingArguments), (StreamTrainer, StreamTrainingArguments)):
        trainer = cls(model=tiny_causal_lm(), train_dataset=lm_dataset(),
                      args=train_args(args_cls, tmp_path / cls.__name__, max_steps=2))
        with pytest.raises(ValueError) as info:
            trainer.train(resume_from_checkpoint=str(tmp_path / "no-such-checkpoint"))
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "Can't find a valid checkpoint at" in messages[1]


def test_training_never_reads_the_stats_that_would_make_the_host_wait(tmp_path, monkeypatch):
    # On an accelerator GradSync.stats waits for the step's events; the report reads them later.
    import hfstream.gradsync.sync as sync_module

    def forbidden(self):
        raise AssertionError("GradSync.stats read inside a training step")

    monkeypatch.setattr(sync_module.GradSync, "stats", property(forbidden))
    from hfstream.gradsync import GradSync

    calls = []
    real = GradSync.stats_deferred
    monkeypatch.setattr(GradSync, "stats_deferred", lambda self: calls.append(1) or real(self))
    trainer = StreamTrainer(model=tiny_causal_lm(), train_dataset=lm_dataset(),
                            args=train_args(StreamTrainingArguments, tmp_path, max_steps=3, grad_sync="overlap"))
    trainer.train()   # one process: GradSync does nothing, but the Trainer's path is the same
    assert calls and trainer.stream_report()["mean"]


def test_ddp_options_that_do_nothing_here_are_said_once(tmp_path, caplog):
    trainer = StreamTrainer(model=tiny_causal_lm(), train_dataset=lm_dataset(),
                            args=train_args(StreamTrainingArguments, tmp_path, max_steps=2, grad_sync="overlap",
                                            ddp_static_graph=True, ddp_find_unused_parameters=True))
    with caplog.at_level(logging.WARNING, logger="hfstream"):
        trainer.train()
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert len(said) == 2 and any("ddp_static_graph" in m for m in said), said
    assert any("ddp_static_graph" in n for n in trainer.stream_report()["notes"])


def test_a_model_sharded_at_load_time_is_left_to_native(tmp_path):
    model = tiny_causal_lm()
    model._is_distributed_loading_by_transformers = True     # what from_pretrained(distributed_config=...) sets
    trainer = StreamTrainer(model=model, train_dataset=lm_dataset(),
                            args=train_args(StreamTrainingArguments, tmp_path, max_steps=2))
    assert trainer._model_is_tensor_parallel()
    with pytest.raises(ValueError, match="grad_sync='native'"):
        StreamTrainer(model=model, train_dataset=lm_dataset(),
                      args=train_args(StreamTrainingArguments, tmp_path, max_steps=2, grad_sync="overlap"))


def test_a_subclass_whose_parent_builds_its_own_arguments_is_told_what_to_pass(tmp_path):
    from hfstream import StreamTrainerMixin

    class TheirTrainer(Trainer):
        pass

    class Mixed(StreamTrainerMixin, TheirTrainer):
        pass

    with pytest.raises(TypeError, match="stream_arguments"):
        Mixed(model=tiny_causal_lm(), train_dataset=lm_dataset())


def _compiled(rank, world_size, tmp):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=256, n_layer=4, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    args = train_args(StreamTrainingArguments, tmp, max_steps=8, grad_sync="overlap", grad_bucket_mb=0.5,
                      prefetch_depth=0, torch_compile=True)
    trainer = StreamTrainer(model=model, args=args, train_dataset=lm_dataset(seq=64))
    trainer.train()
    return trainer.stream_report()["notes"], str(trainer.stream_report())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torch_compile_trains_and_says_once_that_its_backward_gives_up_overlap(tmp_path, run_distributed):
    """A compiled backward returns every gradient at once, at its end (measured: 0.3 ms apart in a
    90 ms step), so no bucket can overlap it; hfstream says so, with the remedy, in the log and report."""
    for notes, text in run_distributed(_compiled, 2, str(tmp_path), init_process_group=False, timeout=600):
        lost = [n for n in notes if "overlap lost" in n]
        assert len(lost) == 1 and "at once" in lost[0] and "torch.compile" in lost[0], notes
        assert "note: GradSync(mode='overlap'): overlap lost" in text
