"""Effect: the report's exposed communication shrinks when the reductions overlap backward.

Two trainings on 2 gloo ranks in one run, the same model, data and buckets: ``grad_sync=
"overlap"`` (buckets launched from the gradient hooks) and ``"serial"`` (every bucket launched
in ``finish()``). Read from the report itself, relative to each run's own busy time (so the
load of the machine cancels out):

- the spans: under overlap every reported step has a bucket launched before its backward span
  ends; under serial none is;
- the fields: exposed/busy is below 1 under overlap (part of the busy time lay inside
  backward), and at 1 under serial (every reduction waited for after backward).

A GradSync whose overlap mode launches at ``finish()`` (the same gradients, the same losses)
reads like the serial run and fails. Slow (``make test-slow``): two 2-rank Trainer runs.
"""

from __future__ import annotations

import pytest

from hfstream import StreamTrainer, StreamTrainingArguments
from tiny import lm_dataset, losses, train_args

STEPS = 6


def _model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)   # large enough that backward has compute between its buckets
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=128, n_layer=4, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


def overlap_and_serial(rank, world_size, tmp):
    import torch

    torch.set_num_threads(1)
    out = {}
    for mode in ("overlap", "serial"):
        trainer = StreamTrainer(model=_model(), train_dataset=lm_dataset(),
                                args=train_args(StreamTrainingArguments, f"{tmp}/{mode}", max_steps=STEPS,
                                                grad_sync=mode, grad_bucket_mb=0.25, prefetch_depth=0))
        trainer.train()
        report = trainer.stream_report()
        mine = [tuple(s) for s in report["spans"] if s[0] == rank]
        steps, cur = [], None
        for _, lane, name, t0, t1 in mine:   # spans in step order: a forward opens the next step's group
            if name == "forward":
                cur = {"backward_end": None, "launches": []}
                steps.append(cur)
            if name == "backward":
                cur["backward_end"] = t1
            if lane == "comm" and name.startswith("bucket"):
                cur["launches"].append(t0)
        mean = report["per_rank"][rank]
        out[mode] = {"steps": steps, "busy": mean["comm_busy_ms"], "exposed": mean["exposed_comm_ms"],
                     "losses": losses(trainer)}
    return out


@pytest.mark.slow        # two 2-rank trainings: ~50 s on the loaded 2-core machine
@pytest.mark.multiprocess
def test_overlap_launches_inside_backward_and_exposes_less_of_its_busy_time_than_serial(tmp_path, run_distributed):
    for rank, res in enumerate(run_distributed(overlap_and_serial, 2, str(tmp_path), init_process_group=False,
                                               timeout=300)):
        overlap, serial = res["overlap"], res["serial"]
        assert overlap["losses"] == serial["losses"] and len(overlap["losses"]) == STEPS
        for mode, r in res.items():
            assert r["steps"] and all(s["launches"] and s["backward_end"] is not None for s in r["steps"]), mode
            assert r["busy"] > 0, mode
        assert all(min(s["launches"]) < s["backward_end"] for s in overlap["steps"]), f"rank {rank}"
        assert all(min(s["launches"]) >= s["backward_end"] for s in serial["steps"]), f"rank {rank}"
        ratio = {m: res[m]["exposed"] / res[m]["busy"] for m in res}
        assert ratio["overlap"] < 1.0 and ratio["serial"] == pytest.approx(1.0), (rank, ratio)
        assert ratio["overlap"] < ratio["serial"], (rank, ratio)
