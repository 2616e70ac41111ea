"""GradSync on a Hugging Face model: a tiny GPT-2 (built from its config, no hub) trained on two
gloo ranks matches single-process full-batch training step by step, with everything a real
Trainer step does at once: gradient accumulation over 4 micro-steps (3 under ``no_sync()``),
a parameter used on one rank only (and only in some micro-steps), a parameter no rank uses,
the tied embedding/output matrix, clipping at 1.0 after ``finish()``, and, in separate runs,
bf16 autocast and non-reentrant activation checkpointing (``gradient_checkpointing_enable``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import time

import pytest
import torch
import torch.nn as nn

from hfstream.gradsync import GradSync
from hfstream.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess

STEPS, ACCUM, BATCH, SEQ, VOCAB = 5, 4, 16, 8, 64
# Tolerances, as (rtol, atol) for elementwise torch.allclose unless marked per-tensor.
# fp32: the runs differ only in the order the batch mean is summed (measured: gradients within
# 1e-6 of each tensor's largest entry, parameters within 2e-8 after 5 steps).
FP32 = dict(grad=(1e-5, 1e-6), param=(1e-5, 1e-7))
# bf16 autocast: the matmuls of a 2-sample micro-batch and of the 16-sample batch round
# differently in bf16 (8 significant bits) whatever the gradient sync does, and the weights
# drift apart a little each step (measured: gradients within 0.4% of each tensor's largest
# entry at step 0 and 2.2% at step 4, parameters within 4e-4). Gradients are compared per
# tensor, against its largest entry: an entry near zero has no relative precision in bf16.
BF16 = dict(grad=(5e-2, 0.0), grad_per_tensor=True, param=(1e-2, 1e-3))


class GPT2WithSideHead(nn.Module):
    """GPT-2 plus a side head used only for samples whose first token is 0, and a layer never used.

    Registered before the language model so that they sit in the last buckets of the plan
    (reverse registration order) and the language model's buckets launch during backward.
    """

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.never = nn.Linear(4, 4)
        self.side = nn.Linear(32, 1)
        cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)
        self.lm = GPT2LMHeadModel(cfg)

    def forward(self, ids):
        out = self.lm(input_ids=ids, labels=ids, output_hidden_states=True)
        loss = out.loss
        flagged = ids[:, 0] == 0
        if flagged.any():
            # Summed over flagged samples and divided by the batch size: additive across shards.
            loss = loss + self.side(out.hidden_states[-1][flagged, -1]).pow(2).sum() / ids.shape[0]
        return 3.0 * loss   # large enough that clipping at 1.0 is active


def gpt2_batch(step):
    g = torch.Generator().manual_seed(3000 + step)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    # Rank 1 owns samples 8..15 and sees them as 4 micro-batches of 2; flag one micro-batch per
    # step. Rank 0 never uses the side head; rank 1 uses it under no_sync() in most steps and in
    # the synchronised micro-step in step 3.
    first = BATCH // 2 + 2 * (step % ACCUM)
    ids[first:first + 2, 0] = 0
    return ids


def to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _grads(model):
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_gpt2(rank, world_size, *, autocast=False, checkpointing=False, bucket_mb=0.01):
    torch.manual_seed(100 + rank)   # different weights per rank until the broadcast
    model = GPT2WithSideHead()
    ref = copy.deepcopy(model) if rank == 0 else None
    if checkpointing:
        model.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    sync = GradSync(model, bucket_mb=bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    out = {"grads": [], "params": [], "norms": [], "ref_grads": [], "ref_params": [], "ref_norms": [],
           "launched_in_backward": [], "num_buckets": len(sync.buckets), "num_collectives": []}
    if ref is not None:
        ref.train()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    per_rank = BATCH // world_size
    for step in range(STEPS):
        ids = gpt2_batch(step)
        mine = ids[rank * per_rank:(rank + 1) * per_rank]
        for k, micro in enumerate(mine.chunk(ACCUM)):
            with sync.no_sync() if k < ACCUM - 1 else contextlib.nullcontext():
                with amp():
                    loss = model(micro) / ACCUM
                loss.backward()
        t_finish = time.perf_counter()
        sync.finish()
        out["launched_in_backward"].append(sum(t < t_finish for _, t, _ in sync.stats.bucket_spans))
        out["grads"].append(_grads(model))
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        out["num_collectives"].append(sync.stats.num_collectives)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["params"].append(_params(model))
        if ref is not None:
            with amp():
                loss = ref(ids)
            loss.backward()
            out["ref_grads"].append(_grads(ref))
            out["ref_norms"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            out["ref_params"].append(_params(ref))
    sync.close()
    return out


def gpt2_suite(rank, world_size):
    return to_bytes({
        "fp32": train_gpt2(rank, world_size),
        "bf16_autocast": train_gpt2(rank, world_size, autocast=True),
        "checkpointing": train_gpt2(rank, world_size, checkpointing=True),
    })


@pytest.fixture(scope="module")
def gpt2():
    per_rank = run_on_ranks(gpt2_suite, 2, timeout=240)
    return [torch.load(io.BytesIO(b), weights_only=False) for b in per_rank]


def _assert_close(got, want, tol, per_tensor, what):
    rtol, atol = tol
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        if w is None or g is None:
            assert g is None and w is None, f"{what} {name}: grad None on one side only"
            continue
        err = (g - w).abs().max().item()
        ok = err <= atol + rtol * w.abs().max().item() if per_tensor else torch.allclose(g, w, rtol=rtol, atol=atol)
        assert ok, f"{what} {name}: max abs diff {err:.3g}"


@pytest.mark.parametrize("config, tol", [("fp32", FP32), ("bf16_autocast", BF16), ("checkpointing", FP32)])
def test_gpt2_parity_with_accumulation_unused_params_and_clipping(gpt2, config, tol):
    r0, r1 = gpt2[0][config], gpt2[1][config]
    assert r0["num_buckets"] > 2
    assert r0["num_collectives"] == [r0["num_buckets"]] * STEPS      # one per bucket per optimizer step
    # The language model's buckets launch during backward; only the tail waits for finish().
    assert min(r0["launched_in_backward"] + r1["launched_in_backward"]) >= r0["num_buckets"] - 2
    assert max(r0["ref_norms"]) > 1.0                                 # clipping really clipped
    for step in range(STEPS):
        for rank, res in enumerate((r0, r1)):
            what = f"{config} rank {rank} step {step}"
            assert res["norms"][step] == pytest.approx(r0["ref_norms"][step], rel=tol["grad"][0])
            _assert_close(res["grads"][step], r0["ref_grads"][step], tol["grad"], tol.get("grad_per_tensor", False),
                          what + " grad")
            _assert_close(res["params"][step], r0["ref_params"][step], tol["param"], False, what)
        for name, p in r0["params"][step].items():
            assert torch.equal(p, r1["params"][step][name]), f"{config} step {step}: ranks differ at {name}"


def test_parameter_used_on_one_rank_gets_the_mean_and_unused_everywhere_stays_none(gpt2):
    for rank in (0, 1):
        res = gpt2[rank]["fp32"]
        for step in range(STEPS):
            grads = res["grads"][step]
            # Rank 0 never ran the side head, yet holds the same (mean) gradient as rank 1.
            assert grads["side.weight"] is not None and grads["side.weight"].abs().sum() > 0
            assert torch.equal(grads["side.weight"], gpt2[1 - rank]["fp32"]["grads"][step]["side.weight"])
            # No rank used this layer: its gradient stays None, so the optimizer skips it.
            assert grads["never.weight"] is None and grads["never.bias"] is None
    assert torch.equal(gpt2[0]["fp32"]["params"][-1]["never.weight"], gpt2[0]["fp32"]["ref_params"][0]["never.weight"])
