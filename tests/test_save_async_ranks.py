"""save_async=True on 2 gloo ranks, in every mode: the blocking save's files, resumable by the stock Trainer.

Each rank writes its own files (its RNG state; under sharded the optimizer is gathered at the
snapshot, on the training thread); the checkpoint is renamed only once both ranks are done, and a
write that fails on one rank fails both, at the same step, instead of leaving the other waiting.
"""

from __future__ import annotations

import filecmp
import os
import threading

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainingArguments

from hfstream import StreamTrainer, StreamTrainingArguments
from tiny import lm_dataset, params, tiny_causal_lm, train_args

pytestmark = pytest.mark.multiprocess

MODES = ("native", "overlap", "sharded")
IGNORED = ("training_args.bin", "stream_report.json")   # save_async itself; timings


def _train(cls, args_cls, out, resume=None, **kw):
    trainer = cls(model=tiny_causal_lm("gpt2", seed=0), train_dataset=lm_dataset(),
                  args=train_args(args_cls, out, ddp_timeout=60, **kw))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _runs(rank, world_size, tmp, modes, blocking):
    save = dict(max_steps=4, save_strategy="steps", save_steps=2)
    for mode in modes:
        for save_async in (False, True) if blocking else (True,):
            _train(StreamTrainer, StreamTrainingArguments, f"{tmp}/{mode}-{int(save_async)}", grad_sync=mode,
                   prefetch_depth=0, save_async=save_async, **save)
    out = {"stock": params(_train(Trainer, TrainingArguments, f"{tmp}/stock", **save).model)}
    resumed = _train(Trainer, TrainingArguments, f"{tmp}/resumed", resume=f"{tmp}/{modes[-1]}-1/checkpoint-2",
                     max_steps=4, save_strategy="no")
    out["resumed"] = params(resumed.model)
    return out


def _same_content(got: str, ref: str, what: str) -> None:
    if got.endswith(".safetensors"):
        a, b = load_file(got), load_file(ref)
    else:
        a, b = torch.load(got, weights_only=False), torch.load(ref, weights_only=False)
    if "python" in b:   # an RNG state: tensors and the Python/NumPy generators' states
        assert a["python"] == b["python"], what
        assert all((x == y).all() if hasattr(x, "all") else x == y for x, y in zip(a["numpy"], b["numpy"])), what
        a, b = a["cpu"], b["cpu"]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _check(tmp_path, ranks, modes, blocking):
    stock = tmp_path / "stock"
    for mode in modes:
        assert sorted(os.listdir(tmp_path / f"{mode}-1")) == ["checkpoint-2", "checkpoint-4"], mode
        for step in (2, 4):
            async_, ref = tmp_path / f"{mode}-1" / f"checkpoint-{step}", stock / f"checkpoint-{step}"
            names = [n for n in sorted(os.listdir(async_)) if n not in IGNORED]
            assert names == [n for n in sorted(os.listdir(ref)) if n not in IGNORED], (mode, step)
            assert "rng_state_1.pth" in names and "optimizer.pt" in names
            for name in names:
                if name.endswith((".safetensors", ".pt", ".pth")):
                    _same_content(str(async_ / name), str(ref / name), f"{mode} checkpoint-{step} {name}")
            if blocking:   # the same mode's blocking save: byte for byte
                same, differ, errors = filecmp.cmpfiles(tmp_path / f"{mode}-0" / f"checkpoint-{step}", async_, names,
                                                        shallow=False)
                assert (differ, errors) == ([], []), (mode, step)
    for k, v in ranks[0]["stock"].items():   # the stock Trainer resumed from the async checkpoint
        torch.testing.assert_close(ranks[0]["resumed"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_sharded_async_checkpoint_on_2_ranks_is_the_stock_trainers_and_resumes_in_stock(tmp_path, run_distributed):
    ranks = run_distributed(_runs, 2, str(tmp_path), ("sharded",), False, init_process_group=False, timeout=300)
    _check(tmp_path, ranks, ("sharded",), blocking=False)


@pytest.mark.slow
def test_async_checkpoints_on_2_ranks_equal_the_blocking_save_byte_for_byte_in_every_mode(tmp_path, run_distributed):
    ranks = run_distributed(_runs, 2, str(tmp_path), MODES, True, init_process_group=False, timeout=600)
    _check(tmp_path, ranks, MODES, blocking=True)


def _one_rank_fails(rank, world_size, tmp):
    real_save = torch.save

    def full_on_rank_1(obj, f, *args, **kwargs):
        if rank == 1 and threading.current_thread() is not threading.main_thread():
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    trainer = None
    try:
        # torch.save is what DeferredWrites recorded as the original: patch it before the save step.
        torch.save = full_on_rank_1
        trainer = StreamTrainer(model=tiny_causal_lm("gpt2", seed=0), train_dataset=lm_dataset(),
                                args=train_args(StreamTrainingArguments, tmp, max_steps=8, save_strategy="steps",
                                                save_steps=2, grad_sync="overlap", prefetch_depth=0, save_async=True,
                                                ddp_timeout=60))
        trainer.train()
    except RuntimeError as exc:
        return str(exc), trainer.state.global_step
    finally:
        torch.save = real_save
    return None, trainer.state.global_step


def test_a_write_failing_on_one_rank_fails_every_rank_at_the_same_step(tmp_path, run_distributed):
    (msg0, step0), (msg1, step1) = run_distributed(_one_rank_fails, 2, str(tmp_path), init_process_group=False,
                                                   timeout=200)
    assert msg1 is not None and "rng_state_1.pth" in msg1 and "No space left" in msg1
    assert msg0 is not None and "another rank failed" in msg0 and "checkpoint-2" in msg0
    assert step0 == step1 and step1 in (3, 4)   # the step after the save (4 if the writer had not yet failed)
    assert not (tmp_path / "checkpoint-2").exists()
