"""StreamTrainer with hfstream's gradient sync ("overlap", "serial") trains like the stock
Trainer with DDP, and everything around training keeps working: evaluation during training,
checkpoints and resumption, a second train() call, the step report in the logs."""

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hfstream import StreamTrainer, StreamTrainingArguments
from tiny import lm_dataset, losses, params, reported, tiny_causal_lm, train_args

pytestmark = pytest.mark.multiprocess


def _stock_vs_stream(rank, world_size, tmp):
    out = {}
    for name, cls, args_cls, kw in (
        ("ddp", Trainer, TrainingArguments, {}),
        ("overlap", StreamTrainer, StreamTrainingArguments, dict(grad_sync="overlap", prefetch_depth=0, grad_bucket_mb=0.01)),
        ("serial", StreamTrainer, StreamTrainingArguments, dict(grad_sync="serial", prefetch_depth=0)),
        ("auto", StreamTrainer, StreamTrainingArguments, dict(prefetch_depth=0)),
        ("bucket-auto", StreamTrainer, StreamTrainingArguments, dict(prefetch_depth=2, grad_bucket_mb="auto")),
    ):
        # Different initial weights per rank: hfstream's broadcast from rank 0 must fix that, as DDP's does.
        model = tiny_causal_lm("gpt2", seed=0 if name == "ddp" else rank)
        trainer = cls(model=model, args=train_args(args_cls, f"{tmp}/{name}", gradient_accumulation_steps=2, **kw),
                      train_dataset=lm_dataset())
        logs = reported(trainer)
        trainer.train()
        out[name] = dict(losses=losses(trainer), params=params(trainer.model),
                         mode=getattr(trainer, "grad_sync_mode", "ddp"),
                         logged=sorted({k for h in logs for k in h if k.startswith("stream/")}),
                         buckets=len(trainer.grad_sync.buckets) if getattr(trainer, "grad_sync", None) else 0)
    return out


def test_overlap_and_serial_match_ddp(tmp_path, run_distributed):
    ranks = run_distributed(_stock_vs_stream, 2, str(tmp_path), init_process_group=False, timeout=300)
    for out in ranks:
        ref = out["ddp"]
        assert len(ref["losses"]) == 20
        for name in ("overlap", "serial", "auto", "bucket-auto"):   # re-planning buckets loses nothing
            got = out[name]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
            for k, v in ref["params"].items():
                torch.testing.assert_close(got["params"][k], v, rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
        assert out["auto"]["mode"] == "overlap"
        assert out["overlap"]["buckets"] > 1           # grad_bucket_mb=0.01: several buckets
        assert "stream/comm_busy_ms" in out["overlap"]["logged"] and "stream/exposed_comm_ms" in out["overlap"]["logged"]
    for name in ("overlap", "serial"):                 # replicas stay identical
        for k, v in ranks[0][name]["params"].items():
            assert torch.equal(v, ranks[1][name]["params"][k]), (name, k)


def _checkpoint_resume_eval(rank, world_size, tmp):
    def trainer_for(out_dir, **kw):
        args = train_args(StreamTrainingArguments, out_dir, grad_sync="overlap", max_steps=12, save_strategy="steps",
                          save_steps=6, eval_strategy="steps", eval_steps=6, per_device_eval_batch_size=8, **kw)
        return StreamTrainer(model=tiny_causal_lm("gpt2", seed=rank), args=args, train_dataset=lm_dataset(),
                             eval_dataset=lm_dataset(n=24, seed=5))

    full = trainer_for(f"{tmp}/full")
    full.train()
    hooks_after_first = full.grad_sync
    full.train()                                        # a second call: the first GradSync was closed at the end
    same_sync = (hooks_after_first.closed and full.grad_sync is not hooks_after_first
                 and full.grad_sync.closed)             # ... and so is the second one: the model is left unhooked
    first = trainer_for(f"{tmp}/full2")
    first.train()
    resumed = trainer_for(f"{tmp}/full2")
    resumed.train(resume_from_checkpoint=f"{tmp}/full2/checkpoint-6")
    evals = [h["eval_loss"] for h in first.state.log_history if "eval_loss" in h]
    return dict(same_sync=same_sync, final=params(first.model), resumed=params(resumed.model), evals=evals,
                resumed_evals=[h["eval_loss"] for h in resumed.state.log_history if "eval_loss" in h])


def test_checkpoint_resume_eval_and_second_train(tmp_path, run_distributed):
    ranks = run_distributed(_checkpoint_resume_eval, 2, str(tmp_path), init_process_group=False, timeout=300)
    for out in ranks:
        assert out["same_sync"]
        assert len(out["evals"]) == 2
        assert out["resumed_evals"][-1] == pytest.approx(out["evals"][-1], rel=1e-5)
        for k, v in out["final"].items():
            torch.testing.assert_close(out["resumed"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    for k, v in ranks[0]["final"].items():
        assert torch.equal(v, ranks[1]["final"][k]), k


def test_auto_is_native_on_one_process(tmp_path):
    trainer = StreamTrainer(model=tiny_causal_lm(), args=train_args(StreamTrainingArguments, tmp_path, max_steps=2),
                            train_dataset=lm_dataset())
    assert trainer.grad_sync_mode == "native"
    trainer.train()
    assert trainer.grad_sync is None


def _auto_bucket(rank, world_size, tmp):
    args = train_args(StreamTrainingArguments, tmp, max_steps=24, grad_sync="overlap", grad_bucket_mb="auto",
                      prefetch_depth=0)
    trainer = StreamTrainer(model=tiny_causal_lm("gpt2", seed=0), args=args, train_dataset=lm_dataset())
    logs = reported(trainer)
    trainer.train()
    logged = [h["stream/bucket_mb"] for h in logs if "stream/bucket_mb" in h]
    return trainer.grad_sync.cap_mb, logged, params(trainer.model)


def test_auto_bucket_is_tuned_identically_on_every_rank(tmp_path, run_distributed):
    (mb0, logged0, p0), (mb1, logged1, p1) = run_distributed(_auto_bucket, 2, str(tmp_path),
                                                             init_process_group=False, timeout=300)
    assert isinstance(mb0, float) and mb0 == mb1 and logged0 and logged0[-1] == mb0
    for k, v in p0.items():
        assert torch.equal(v, p1[k]), k
