"""StreamTrainer(grad_sync="sharded") trains like the stock Trainer with DDP, and what surrounds
training sees whole parameters and a whole optimizer: the logged grad_norm, evaluation during
training, save_model, checkpoints (the stock Trainer's format), resuming, a second train().

Each rank's optimizer holds its 1/N of the state; the checkpoint holds all of it."""

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainingArguments

from hfstream import StreamTrainer, StreamTrainingArguments
from tiny import lm_dataset, losses, params, tiny_causal_lm, train_args

pytestmark = pytest.mark.multiprocess

SGD = dict(optim="sgd", optim_args="momentum=0.9", learning_rate=0.05, weight_decay=0.01)
ADAMW = dict(optim="adamw_torch", weight_decay=0.1)


def _state_bytes(optimizer) -> int:
    optimizer = getattr(optimizer, "optimizer", optimizer)
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


def _run(cls, args_cls, out_dir, rank, resume=None, second=False, **kw):
    model = tiny_causal_lm("gpt2", seed=0 if cls is Trainer else rank)   # hfstream broadcasts rank 0's
    stream = dict(grad_sync="sharded", prefetch_depth=2) if cls is StreamTrainer else {}
    trainer = cls(model=model, train_dataset=lm_dataset(), eval_dataset=lm_dataset(n=16, seed=5),
                  args=train_args(args_cls, out_dir, gradient_accumulation_steps=2, max_grad_norm=0.5,
                                  eval_strategy="steps", eval_steps=5, save_strategy="steps", save_steps=10,
                                  **stream, **kw))
    phases = []
    if cls is StreamTrainer:   # the watchdog's phases, as a stuck rank would report them
        watch = trainer._watch
        trainer._watch = lambda what: (phases.append(what), watch(what))
    trainer.train(resume_from_checkpoint=resume)
    history = trainer.state.log_history
    out = dict(losses=losses(trainer), params=params(trainer.model), state_bytes=_state_bytes(trainer.optimizer),
               grad_norms=[h["grad_norm"] for h in history if "grad_norm" in h],
               evals=[h["eval_loss"] for h in history if "eval_loss" in h], phases=phases)
    if second:   # a second train() of the same trainer: its optimizer state carries on, as stock
        trainer.args.output_dir = f"{out_dir}-second"
        trainer.train()
        out["second"] = params(trainer.model)
    return out


def _sharded_vs_ddp(rank, world_size, tmp):
    out = {}
    for name, opt in (("sgd", SGD), ("adamw", ADAMW)):
        out[f"ddp-{name}"] = _run(Trainer, TrainingArguments, f"{tmp}/ddp-{name}", rank, second=name == "sgd", **opt)
        out[f"sharded-{name}"] = _run(StreamTrainer, StreamTrainingArguments, f"{tmp}/sharded-{name}", rank,
                                      second=name == "sgd", **opt)
    # Resuming: from the sharded run's own checkpoint, and from the stock Trainer's one.
    out["resumed"] = _run(StreamTrainer, StreamTrainingArguments, f"{tmp}/resumed", rank,
                          resume=f"{tmp}/sharded-sgd/checkpoint-10", **SGD)
    out["from-ddp"] = _run(StreamTrainer, StreamTrainingArguments, f"{tmp}/from-ddp", rank,
                           resume=f"{tmp}/ddp-sgd/checkpoint-10", **SGD)
    return out


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    from hfstream.testing import run_on_ranks

    tmp = tmp_path_factory.mktemp("sharded")
    return tmp, run_on_ranks(_sharded_vs_ddp, 2, str(tmp), init_process_group=False, timeout=420)


def _close(got, ref, what, rtol=1e-5, atol=1e-6):
    assert ref and set(got) == set(ref), f"{what}: keys {sorted(set(got) ^ set(ref))} in one only"
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=rtol, atol=atol,
                                   msg=lambda m, k=k: f"{what}: {k}: {m}")


def test_sharded_matches_ddp_losses_parameters_grad_norm_and_evaluation(sharded_runs):
    _, ranks = sharded_runs
    for out in ranks:
        for name in ("sgd", "adamw"):
            ref, got = out[f"ddp-{name}"], out[f"sharded-{name}"]
            assert len(got["losses"]) == 20 and len(got["grad_norms"]) == 20 and len(got["evals"]) == 4
            for key in ("losses", "grad_norms", "evals"):   # grad_norm: the whole gradient's, clipped at 0.5
                torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(ref[key]), rtol=1e-5, atol=1e-6,
                                           msg=f"{name}: {key}")
            # AdamW: the clip coefficient differs from torch's in its last bit (the norm is summed in
            # another order), and Adam's division by sqrt(v) magnifies that for gradients near zero
            # (measured: 2.4e-6 at most after 20 steps of lr 1e-3; SGD stays within 1e-6).
            _close(got["params"], ref["params"], name, atol=1e-6 if name == "sgd" else 1e-5)
    assert max(ranks[0]["ddp-sgd"]["grad_norms"]) > 0.5, "the test must clip for the norm to matter"
    for k, v in ranks[0]["sharded-sgd"]["params"].items():   # replicas identical after the last gather
        assert torch.equal(v, ranks[1]["sharded-sgd"]["params"][k]), k


def test_sharded_optimizer_state_per_rank_is_about_half_of_ddps(sharded_runs):
    _, ranks = sharded_runs
    for out in ranks:
        ratio = out["sharded-adamw"]["state_bytes"] / out["ddp-adamw"]["state_bytes"]
        assert 0.4 < ratio < 0.55, ratio


def test_checkpoint_holds_the_whole_optimizer_in_the_stock_format_and_complete_weights(sharded_runs):
    tmp, ranks = sharded_runs
    for name in ("sgd", "adamw"):
        ddp = torch.load(tmp / f"ddp-{name}" / "checkpoint-20" / "optimizer.pt", weights_only=True)
        ours = torch.load(tmp / f"sharded-{name}" / "checkpoint-20" / "optimizer.pt", weights_only=True)
        assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in ddp["param_groups"]]
        assert set(ours["state"]) == set(ddp["state"]) and ddp["state"]
        for i, s in ddp["state"].items():
            assert set(ours["state"][i]) == set(s)
            for k, v in s.items():
                torch.testing.assert_close(ours["state"][i][k], v, rtol=1e-5, atol=1e-7, msg=f"{name} state {i} {k}")
        ours_dir, ddp_dir = tmp / f"sharded-{name}" / "checkpoint-20", tmp / f"ddp-{name}" / "checkpoint-20"
        # The stock files, the scheduler's too, and hfstream's report beside them:
        assert sorted(os.listdir(ours_dir)) == sorted(os.listdir(ddp_dir) + ["stream_report.json"])
        schedulers = [torch.load(d / "scheduler.pt", weights_only=False) for d in (ours_dir, ddp_dir)]
        assert schedulers[0] == schedulers[1] and schedulers[0]["last_epoch"] == 20
        weights = load_file(str(tmp / f"sharded-{name}" / "checkpoint-20" / "model.safetensors"))
        final = ranks[0][f"sharded-{name}"]["params"]
        for k, v in weights.items():   # save_model waited for the last step's all-gathers
            assert torch.equal(v, final[k]), k
    assert not any(f.startswith("rank") for f in os.listdir(tmp / "sharded-sgd" / "checkpoint-10"))
    # A rank stuck while the slices are gathered for the save says so (not the step before it).
    for out in ranks:
        saving = [p for p in out["sharded-adamw"]["phases"] if p.startswith("saving the optimizer")]
        assert saving == [f"saving the optimizer of step {s} (gathering every rank's slices)" for s in (10, 20)], saving


def test_resume_from_a_sharded_or_a_stock_checkpoint_continues_like_the_uninterrupted_run(sharded_runs):
    _, ranks = sharded_runs
    for out in ranks:
        for k, v in out["sharded-sgd"]["params"].items():
            assert torch.equal(out["resumed"]["params"][k], v), f"resumed differs: {k}"
        _close(out["from-ddp"]["params"], out["ddp-sgd"]["params"], "resumed from the stock Trainer's checkpoint")


def test_second_train_of_the_same_trainer_carries_the_sharded_state_like_ddp(sharded_runs):
    _, ranks = sharded_runs
    for out in ranks:
        _close(out["sharded-sgd"]["second"], out["ddp-sgd"]["second"], "second train()")


def test_sharded_refuses_fp16_naming_what_to_use():
    with pytest.raises(ValueError, match="grad_sync='sharded' cannot be combined with fp16=True.*bf16=True"):
        StreamTrainingArguments(output_dir="unused", grad_sync="sharded", fp16=True, use_cpu=True)


# -- what users combine it with ---------------------------------------------------------------------
def _setups(rank, world_size, tmp):
    from peft import LoraConfig, get_peft_model

    out = {}
    for setup in ("lora", "checkpointing", "iterable"):
        for name, cls, args_cls, kw in (("ddp", Trainer, TrainingArguments, {}),
                                        ("sharded", StreamTrainer, StreamTrainingArguments, dict(grad_sync="sharded"))):
            model, data = tiny_causal_lm("gpt2", seed=0), lm_dataset()
            if setup == "lora":        # frozen base, trainable adapters
                model = get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0))
            if setup == "checkpointing":   # the forward runs again inside backward
                kw = dict(kw, gradient_checkpointing=True)
            if setup == "iterable":    # batches dispatched from rank 0
                data = data.to_iterable_dataset()
            trainer = cls(model=model, train_dataset=data,
                          args=train_args(args_cls, f"{tmp}/{setup}-{name}", gradient_accumulation_steps=2,
                                          max_grad_norm=0.5, **kw))
            trainer.train()
            out[f"{setup}-{name}"] = dict(losses=losses(trainer), params=params(trainer.model))
    return out


def test_sharded_with_lora_gradient_checkpointing_and_streaming_data_matches_ddp(tmp_path):
    pytest.importorskip("peft")
    from hfstream.testing import run_on_ranks

    for out in run_on_ranks(_setups, 2, str(tmp_path), init_process_group=False, timeout=420):
        for setup in ("lora", "checkpointing", "iterable"):
            ref, got = out[f"{setup}-ddp"], out[f"{setup}-sharded"]
            assert len(got["losses"]) == 20
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
            _close(got["params"], ref["params"], setup, atol=1e-5)   # AdamW, clipping: see above
