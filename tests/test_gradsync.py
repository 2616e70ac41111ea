"""GradSync on CPU with gloo and two processes: what a user relies on.

- parity: training with GradSync on two ranks, each on half the batch, gives step by step the
  parameters of single-process training on the whole batch (frozen and tied parameters, one
  bucket / several / one parameter per bucket, serial mode, ``zero_grad(set_to_none=False)``),
  and bf16 on the wire stays within its documented tolerance;
- one all-reduce per bucket per optimizer step, launched in the same order on every rank even
  when gradients arrive in a different order;
- misuse is clear and never hangs: a second GradSync, ``finish()`` without backward, a rank that
  skips backward, bad arguments; with one process it does nothing.

The ranks start from different seeds, so the broadcast at construction is exercised too.
Several checks share one multi-process run (a spawn costs seconds); each test reads its part.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hfstream.gradsync import GradSync, plan_buckets
from hfstream.testing import run_on_ranks

# fp32 parity: the two runs differ only in how the batch mean is summed.
RTOL, ATOL = 1e-5, 1e-7
# bf16 on the wire: one bf16 rounding of the scaled gradient per rank plus one of the sum.
BF16_WIRE_RTOL = 2**-6


# -- models and data (module level: spawned ranks import them by name) ---------------------------
class FrozenBiasMLP(nn.Module):
    """Three linear layers; the first layer's bias is frozen (requires_grad=False).

    With ``checkpointing`` the two hidden layers are recomputed in backward
    (``torch.utils.checkpoint``, non-reentrant), which changes when their hooks fire.
    """

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.fc1.bias.requires_grad_(False)
        self.checkpointing = False

    def hidden(self, x):
        return torch.tanh(self.fc2(torch.tanh(self.fc1(x))))

    def forward(self, x):
        if self.checkpointing:
            return self.fc3(torch.utils.checkpoint.checkpoint(self.hidden, x, use_reentrant=False))
        return self.fc3(self.hidden(x))


class TiedLM(nn.Module):
    """Embedding tied to the output projection: one tensor, two uses, one reduction."""

    def __init__(self, vocab=20, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.embed(ids))))


class TwoBranches(nn.Module):
    """Two independent branches; the one computed last in forward gets its gradients first."""

    def __init__(self):
        super().__init__()
        self.a1, self.a2 = nn.Linear(4, 3, bias=False), nn.Linear(3, 2, bias=False)    # 12, 6 elements
        self.b1, self.b2 = nn.Linear(4, 5, bias=False), nn.Linear(5, 2, bias=False)    # 20, 10 elements

    def forward(self, x, b_first=False):
        if b_first:
            b = self.b2(self.b1(x))
            a = self.a2(self.a1(x))
        else:
            a = self.a2(self.a1(x))
            b = self.b2(self.b1(x))
        return a + b


def mlp_batch(step, n=8):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def mlp_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def tied_batch(step, n=8, seq=6):
    g = torch.Generator().manual_seed(2000 + step)
    return (torch.randint(0, 20, (n, seq), generator=g),)


def tied_loss(model, batch):
    (ids,) = batch
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


MODELS = {"mlp": (FrozenBiasMLP, mlp_batch, mlp_loss), "tied": (TiedLM, tied_batch, tied_loss)}


def _shard(batch, rank, world_size, accum):
    """This rank's contiguous share of the global batch, split into ``accum`` micro-batches."""
    per_rank = batch[0].shape[0] // world_size
    mine = [t[rank * per_rank:(rank + 1) * per_rank] for t in batch]
    per_micro = per_rank // accum
    return [tuple(t[k * per_micro:(k + 1) * per_micro] for t in mine) for k in range(accum)]


def to_bytes(obj) -> bytes:
    """Results travel back as torch.save bytes: exact tensors, whatever pickling the queue uses
    (torch's own shares tensors by file descriptors that die with the rank that sent them)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(per_rank: list[bytes]) -> list:
    return [torch.load(io.BytesIO(b), weights_only=False) for b in per_rank]


def _snapshot(model, grads=False):
    if grads:
        return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_parity(rank, world_size, model_key, *, steps=5, accum=1, set_to_none=True, lr=0.1,
                 reference=True, checkpointing=False, **sync_kwargs):
    """Train with GradSync on this rank's share; on rank 0 also train a single-process reference
    on the whole batch. Returns parameter and gradient snapshots after every step."""
    make_model, make_batch, loss_fn = MODELS[model_key]
    torch.manual_seed(100 + rank)   # different weights per rank until the broadcast
    model = make_model()
    ref = copy.deepcopy(model) if (rank == 0 and reference) else None   # rank 0 is the broadcast source
    model.checkpointing = checkpointing   # the reference never recomputes
    sync = GradSync(model, **sync_kwargs)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    out = {"params": [], "grads": [], "ref_params": [], "ref_grads": [], "num_buckets": len(sync.buckets),
           "num_collectives": []}
    if ref is not None:
        ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=lr)
    for step in range(steps):
        batch = make_batch(step)
        micro = _shard(batch, rank, world_size, accum)
        for k, mb in enumerate(micro):
            with sync.no_sync() if k < accum - 1 else contextlib.nullcontext():
                (loss_fn(model, mb) / accum).backward()
        sync.finish()
        out["grads"].append(_snapshot(model, grads=True))
        out["num_collectives"].append(sync.stats.num_collectives)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        out["params"].append(_snapshot(model))
        if ref is not None:
            loss_fn(ref, batch).backward()
            out["ref_grads"].append(_snapshot(ref, grads=True))
            ref_opt.step()
            ref_opt.zero_grad()
            out["ref_params"].append(_snapshot(ref))
    sync.close()
    return out


CAPS = {"one_bucket": float("inf"), "several": 0.0002, "per_param": 0.0}   # 0.0002 MiB: 3 and 2 buckets


def parity_suite(rank, world_size):
    results = {}
    for model_key in ("mlp", "tied"):
        for cap_name, cap in CAPS.items():
            results[f"{model_key}/{cap_name}"] = train_parity(rank, world_size, model_key, bucket_mb=cap)
    results["mlp/serial"] = train_parity(rank, world_size, "mlp", bucket_mb=0.0004, mode="serial")
    results["mlp/keep_grads"] = train_parity(rank, world_size, "mlp", bucket_mb=0.0004, set_to_none=False,
                                             comm_stream_priority="normal")   # accepted, no effect on gloo
    results["mlp/accum4"] = train_parity(rank, world_size, "mlp", bucket_mb=0.0004, accum=4)
    results["mlp/checkpointing"] = train_parity(rank, world_size, "mlp", bucket_mb=0, accum=2, checkpointing=True)
    results["tied/uncompressed"] = train_parity(rank, world_size, "tied", reference=False, bucket_mb=0.0004)
    results["tied/bf16_wire"] = train_parity(rank, world_size, "tied", reference=False, bucket_mb=0.0004,
                                             comm_dtype="bf16")
    results["mlp/fp16_wire"] = train_parity(rank, world_size, "mlp", reference=False, bucket_mb=0.0004,
                                            comm_dtype=torch.float16)
    results["mlp/uncompressed"] = train_parity(rank, world_size, "mlp", reference=False, bucket_mb=0.0004)
    return to_bytes(results)


@pytest.fixture(scope="module")
def parity():
    return from_bytes(run_on_ranks(parity_suite, 2, timeout=180))


def _assert_close(got, want, rtol=RTOL, atol=ATOL, what=""):
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None or got[name] is None:
            assert got[name] is None and want[name] is None, f"{what} {name}: {got[name]} vs {want[name]}"
            continue
        assert torch.allclose(got[name], want[name], rtol=rtol, atol=atol), (
            f"{what} {name}: max abs diff {(got[name] - want[name]).abs().max().item():.3g}")


# -- parity ----------------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.parametrize("config", [
    "mlp/one_bucket", "mlp/several", "mlp/per_param", "tied/one_bucket", "tied/several", "tied/per_param",
    "mlp/serial", "mlp/keep_grads", "mlp/accum4", "mlp/checkpointing",
])
def test_step_by_step_parity_with_single_process(parity, config):
    rank0, rank1 = parity[0][config], parity[1][config]
    for step in range(5):
        for rank, res in enumerate((rank0, rank1)):
            _assert_close(res["grads"][step], rank0["ref_grads"][step], what=f"{config} rank {rank} step {step} grad")
            _assert_close(res["params"][step], rank0["ref_params"][step], what=f"{config} rank {rank} step {step}")
        # Both ranks hold bit-identical parameters: they applied the same reduced gradient.
        for name, value in rank0["params"][step].items():
            assert torch.equal(value, rank1["params"][step][name]), f"{config} step {step}: ranks differ at {name}"


@pytest.mark.multiprocess
def test_frozen_parameter_untouched_and_tied_weight_reduced_once(parity):
    mlp = parity[1]["mlp/several"]
    assert all(g["fc1.bias"] is None for g in mlp["grads"])
    # rank 1 started from other weights: the frozen bias is rank 0's (broadcast) and never moves.
    for step in range(5):
        assert torch.equal(mlp["params"][step]["fc1.bias"], parity[0]["mlp/several"]["ref_params"][0]["fc1.bias"])
    tied = parity[1]["tied/per_param"]
    assert "out.weight" not in tied["params"][0]     # one tensor, one name, one bucket
    assert tied["num_buckets"] == 3                  # embed (tied), mix.weight, mix.bias


@pytest.mark.multiprocess
def test_one_collective_per_bucket_per_step_in_parity_runs(parity):
    for config in ("mlp/one_bucket", "mlp/several", "mlp/per_param", "mlp/serial", "mlp/accum4"):
        res = parity[0][config]
        assert res["num_collectives"] == [res["num_buckets"]] * 5, config
    assert parity[0]["mlp/one_bucket"]["num_buckets"] == 1
    assert 1 < parity[0]["mlp/several"]["num_buckets"] < parity[0]["mlp/per_param"]["num_buckets"] == 5


@pytest.mark.multiprocess
@pytest.mark.parametrize("compressed, plain", [("tied/bf16_wire", "tied/uncompressed"),
                                               ("mlp/fp16_wire", "mlp/uncompressed")])
def test_compressed_wire_within_tolerance(parity, compressed, plain):
    rtol = BF16_WIRE_RTOL if "bf16" in compressed else 2**-9
    for rank in (0, 1):
        got, want = parity[rank][compressed], parity[rank][plain]
        # Same weights and data at step 0: only the wire differs.
        for name, g in want["grads"][0].items():
            if g is None:
                continue
            scale = g.abs().max()
            assert (got["grads"][0][name] - g).abs().max() <= rtol * scale, f"{compressed} {name}"
        assert any(not torch.equal(got["grads"][0][n], g) for n, g in want["grads"][0].items() if g is not None), \
            "compressed run is bit-identical to the uncompressed one: was the wire really compressed?"
        for name, p in want["params"][-1].items():
            assert torch.allclose(got["params"][-1][name], p, rtol=1e-2, atol=1e-3), f"{compressed} {name}"


# -- launch order, collective count, overlap, finish() semantics, second instance ----------------------
def behaviour_suite(rank, world_size):
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    out = {}

    # 1. Gradients arrive in a different order on each rank; launches follow the plan on both.
    torch.manual_seed(0)
    model = TwoBranches()
    sync = GradSync(model, bucket_mb=0)
    arrival = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: arrival.append(name))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
    calls.clear()
    model(x, b_first=(rank == 1)).pow(2).sum().backward()
    sync.finish()
    out["plan"] = [b.names[0] for b in sync.buckets]
    out["plan_numel"] = [b.numel for b in sync.buckets]
    out["arrival"] = arrival
    out["launched_numel"] = list(calls)   # each bucket's flat buffer: its numel plus one flag per parameter
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}

    # 2. Accumulation: 4 micro-steps, 3 under no_sync, one all-reduce per bucket per optimizer step.
    per_step = []
    for step in range(3):
        calls.clear()
        for k in range(4):
            sync.require_backward_grad_sync = k == 3
            model(x).sum().backward()
            sync.finish()        # a no-op after the no_sync micro-steps
        per_step.append(len(calls))
        model.zero_grad()
    sync.require_backward_grad_sync = True
    out["collectives_per_step"], out["num_buckets"] = per_step, len(sync.buckets)

    # 3. finish() before any backward and twice in a row: nothing is sent, nothing changes.
    model.zero_grad(set_to_none=True)
    calls.clear()
    sync.finish()
    out["finish_before_backward"] = (len(calls), [p.grad is None for p in model.parameters()])
    model(x).sum().backward()
    sync.finish()
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    calls.clear()
    sync.finish()
    out["finish_twice"] = (len(calls), all(torch.equal(first[n], p.grad) for n, p in model.named_parameters()))

    # 3b. A second backward before finish() would be overwritten by the mean: it raises instead,
    #     and finish() still completes the reductions already launched (no rank is left waiting).
    model.zero_grad()
    model(x).sum().backward()
    try:
        model(x).sum().backward()
        out["second_backward"] = None
    except RuntimeError as exc:
        out["second_backward"] = str(exc)
    sync.finish()

    # 4. Overlap launches during backward; serial only inside finish(). Stats describe the step.
    big = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    for mode in ("overlap", "serial"):
        with GradSync(big, bucket_mb=0.02, mode=mode) as s:
            big(torch.randn(32, 64)).sum().backward()
            t_finish = time.perf_counter()
            s.finish()
            st = s.stats
            out[f"stats_{mode}"] = dict(
                num_buckets=len(s.buckets), num_collectives=st.num_collectives,
                launched_before_finish=sum(launch < t_finish for _, launch, _ in st.bucket_spans),
                spans_ok=all(end >= launch for _, launch, end in st.bucket_spans),
                span_order=[i for i, _, _ in st.bucket_spans],
                comm_busy_ms=st.comm_busy_ms, exposed_comm_ms=st.exposed_comm_ms)
            big.zero_grad()

    # 5. A second GradSync on a hooked model is refused; after close() it is allowed, and the
    #    closed one no longer communicates.
    try:
        GradSync(model)
        out["second"] = None
    except RuntimeError as exc:
        out["second"] = str(exc)
    sync.close()
    with GradSync(model, bucket_mb=float("inf")) as again:
        out["after_close_buckets"] = len(again.buckets)
    calls.clear()
    model.zero_grad()
    model(x).sum().backward()
    out["calls_after_close"] = len(calls)
    dist.all_reduce = real_all_reduce
    return to_bytes(out)


@pytest.fixture(scope="module")
def behaviour():
    return from_bytes(run_on_ranks(behaviour_suite, 2, timeout=120))


@pytest.mark.multiprocess
def test_launch_order_is_plan_order_on_every_rank(behaviour):
    r0, r1 = behaviour
    assert r0["plan"] == ["b2.weight", "b1.weight", "a2.weight", "a1.weight"]   # reverse registration
    assert r0["arrival"] != r1["arrival"], "precondition: gradients must arrive in a different order per rank"
    expected = [n + 1 for n in r0["plan_numel"]]
    assert r0["launched_numel"] == r1["launched_numel"] == expected
    assert r0["grads"] and set(r0["grads"]) == set(r1["grads"])
    for name, g in r0["grads"].items():
        assert torch.equal(g, r1["grads"][name])


@pytest.mark.multiprocess
def test_one_collective_per_bucket_per_optimizer_step_with_accumulation(behaviour):
    for res in behaviour:
        assert res["collectives_per_step"] == [res["num_buckets"]] * 3


@pytest.mark.multiprocess
def test_finish_without_backward_and_twice_is_a_noop(behaviour):
    for res in behaviour:
        assert res["finish_before_backward"] == (0, [True] * 4)
        assert res["finish_twice"] == (0, True)


@pytest.mark.multiprocess
def test_second_backward_before_finish_raises(behaviour):
    for res in behaviour:
        assert res["second_backward"] is not None and "finish()" in res["second_backward"]


@pytest.mark.multiprocess
def test_overlap_launches_during_backward_and_stats(behaviour):
    for res in behaviour:
        ov, se = res["stats_overlap"], res["stats_serial"]
        for st in (ov, se):
            assert st["num_collectives"] == st["num_buckets"] > 1
            assert st["spans_ok"] and st["span_order"] == list(range(st["num_buckets"]))
            assert st["comm_busy_ms"] > 0 and st["exposed_comm_ms"] >= 0
        assert ov["launched_before_finish"] == ov["num_buckets"]   # every bucket completed during backward
        assert se["launched_before_finish"] == 0


@pytest.mark.multiprocess
def test_second_gradsync_is_refused_until_close(behaviour):
    for res in behaviour:
        assert res["second"] is not None and "close()" in res["second"]
        assert res["after_close_buckets"] == 1
        assert res["calls_after_close"] == 0


# -- a rank that never calls backward ---------------------------------------------------------------
PG_TIMEOUT_S = 5


def skip_backward_on_rank1(rank, world_size):
    torch.manual_seed(0)
    model = FrozenBiasMLP()
    sync = GradSync(model, bucket_mb=0.0004)
    if rank == 1:
        time.sleep(PG_TIMEOUT_S + 4)    # never runs backward nor finish(); outlives the peer's timeout
        return None
    mlp_loss(model, mlp_batch(0)).backward()
    t0 = time.monotonic()
    try:
        sync.finish()
    except RuntimeError as exc:
        # The works that did not complete are kept alive with their buffers (gloo's thread may
        # still use them): every launched bucket's, none that was never launched.
        kept = [(buf is not None, work is not None) for buf, work in sync._wiring.abandoned]
        return str(exc), time.monotonic() - t0, [list(b.names) for b in sync.buckets], kept
    return "finish() returned", time.monotonic() - t0, [], []


@pytest.mark.multiprocess
def test_rank_that_skips_backward_fails_peer_with_named_buckets(run_distributed):
    t0 = time.monotonic()
    (message, waited, buckets, kept), _ = run_distributed(skip_backward_on_rank1, 2, timeout=60,
                                                         pg_timeout_s=PG_TIMEOUT_S)
    assert kept == [(True, True)] * len(buckets), kept
    assert time.monotonic() - t0 < 45
    assert waited < PG_TIMEOUT_S + 5, message
    assert "did not complete" in message and "bucket(s) [0, 1" in message, message
    assert all(name in message for names in buckets for name in names), message


# -- single process: validation, planning, world size 1 ------------------------------------------------
@pytest.mark.parametrize("kwargs, argument", [
    (dict(mode="async"), "mode"),
    (dict(bucket_mb=-1), "bucket_mb"),
    (dict(bucket_mb=float("nan")), "bucket_mb"),
    (dict(bucket_mb="fast"), "bucket_mb"),
    (dict(bucket_mb="AUTO"), "bucket_mb"),
    (dict(first_bucket_mb=-1), "first_bucket_mb"),
    (dict(first_bucket_mb="1"), "first_bucket_mb"),
    (dict(last_bucket_mb=-1), "last_bucket_mb"),
    (dict(last_bucket_mb=float("nan")), "last_bucket_mb"),
    (dict(mode="sharded", last_bucket_mb="small"), "last_bucket_mb"),
    (dict(comm_dtype="int8"), "comm_dtype"),
    (dict(comm_dtype=torch.float32), "comm_dtype"),
    (dict(comm_stream_priority="urgent"), "comm_stream_priority"),
])
def test_bad_arguments_name_the_argument_and_accepted_values(kwargs, argument):
    with pytest.raises(ValueError, match=rf"{argument}=.*accepted values"):
        GradSync(FrozenBiasMLP(), **kwargs)


def test_broadcast_buffers_must_be_a_bool():
    with pytest.raises(TypeError, match="broadcast_buffers must be True or False"):
        GradSync(FrozenBiasMLP(), broadcast_buffers="yes")


def test_world_size_one_does_nothing():
    assert not dist.is_initialized() or dist.get_world_size() == 1   # this test process: one rank
    torch.manual_seed(0)
    model = FrozenBiasMLP()
    plain = copy.deepcopy(model)
    with GradSync(model, bucket_mb=0) as sync:
        assert sync.world_size == 1
        assert all(not p._post_accumulate_grad_hooks for p in model.parameters())   # no hooks (a rename fails here)
        batch = mlp_batch(0)
        mlp_loss(model, batch).backward()
        mlp_loss(plain, batch).backward()
        before = _snapshot(model, grads=True)
        sync.finish()
        assert sync.stats.num_collectives == 0
    for name, g in _snapshot(plain, grads=True).items():
        assert (g is None and before[name] is None) or torch.equal(g, before[name])
        assert (g is None and model.get_parameter(name).grad is None) or torch.equal(g, model.get_parameter(name).grad)


def test_plan_reverse_order_caps_and_keys():
    model = FrozenBiasMLP()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert [b.names for b in plan_buckets(named, 0)] == [("fc3.bias",), ("fc3.weight",), ("fc2.bias",),
                                                        ("fc2.weight",), ("fc1.weight",)]
    (one,) = plan_buckets(named, math.inf)
    assert one.names == ("fc3.bias", "fc3.weight", "fc2.bias", "fc2.weight", "fc1.weight")
    assert one.numel == 4 + 64 + 16 + 256 + 128 and one.nbytes == 4 * one.numel
    # DDP's rule: a bucket is filled until it reaches the cap (16 + 256 + 64 bytes >= 300), a
    # parameter is never split (fc2.weight, 1024 bytes, is a bucket of its own), the last one
    # holds what is left.
    cap_mb = 300 / 2**20
    buckets = plan_buckets(named, cap_mb)
    assert [b.names for b in buckets] == [("fc3.bias", "fc3.weight", "fc2.bias"), ("fc2.weight",), ("fc1.weight",)]
    assert all(b.nbytes >= 300 for b in buckets[:-1])
    assert all(b.nbytes - 4 * model.get_parameter(b.names[-1]).numel() < 300 for b in buckets)   # cap + one param
    # Exactly at the cap closes the bucket.
    assert [b.names for b in plan_buckets(named, 272 / 2**20)][0] == ("fc3.bias", "fc3.weight")
    # A smaller first bucket: the first gradients leave on their own, the rest at the cap.
    assert [b.names for b in plan_buckets(named, cap_mb, first_bucket_mb=0)] == [
        ("fc3.bias",), ("fc3.weight", "fc2.bias"), ("fc2.weight",), ("fc1.weight",)]
    # One bucket per dtype: a bf16 parameter travels apart, ordered by when it is expected ready.
    mixed = [("a", torch.zeros(4)), ("h", torch.zeros(4, dtype=torch.bfloat16)), ("b", torch.zeros(4))]
    assert [(b.names, b.dtype) for b in plan_buckets(mixed, math.inf)] == [
        (("b", "a"), torch.float32), (("h",), torch.bfloat16)]


def test_plan_matches_ddp_bucket_assignment():
    """Same cap, same buckets as DistributedDataParallel's assignment (reversed into launch order)."""
    from torch.distributed import _compute_bucket_assignment_by_size as ddp_assignment

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64 + 8 * i, 64 + 8 * (i + 1)) for i in range(8)])
    named = list(model.named_parameters())
    params = [p for _, p in named]
    for cap_mb, first_mb in [(0.0, None), (0.01, None), (0.03, None), (0.03, 0.005), (0.1, 0.02), (math.inf, None)]:
        limits = [int(min(c, 2**62)) for c in (
            [cap_mb * 2**20] if first_mb is None else [first_mb * 2**20, cap_mb * 2**20])]
        # DDP assigns in the order it is given and reverses the result; give it reverse order.
        indices, _ = ddp_assignment(params[::-1], limits, [False] * len(params))
        want = [tuple(named[len(params) - 1 - i][0] for i in bucket) for bucket in indices]
        got = [b.names for b in plan_buckets(named, cap_mb, first_mb)]
        assert got == want, (cap_mb, first_mb)


def test_first_bucket_mb_caps_only_the_first_bucket():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(24)])   # 256 KiB + 1 KiB per layer
    with GradSync(model, bucket_mb=4.0) as sync:                       # alone: nothing is reduced
        assert all(b.nbytes / 2**20 >= 4.0 for b in sync.buckets[:-1])   # by default, like the others
    with GradSync(model, bucket_mb=4.0, first_bucket_mb=1.0) as sync:
        first, rest = sync.buckets[0].nbytes / 2**20, [b.nbytes / 2**20 for b in sync.buckets[1:-1]]
    assert 1.0 <= first < 1.3 and rest and all(r >= 4.0 for r in rest)   # DDP's 1 MiB first bucket
    with GradSync(model, bucket_mb=math.inf, first_bucket_mb=1.0) as sync:
        assert len(sync.buckets) == 2


def test_tied_weight_planned_once():
    model = TiedLM()
    names = [n for b in GradSync(model, bucket_mb=0).buckets for n in b.names]
    assert names == ["mix.bias", "mix.weight", "embed.weight"]


# -- gradients as views of the bucket buffers (DDP's gradient_as_bucket_view) -------------------------
def _grad_storage_suite(rank, world_size):
    torch.manual_seed(0)
    out = {}
    for wire in (None, "bf16"):
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        ref = [p.detach().clone() for p in model.parameters()]
        with GradSync(model, bucket_mb=0.0005, comm_dtype=wire) as sync:
            for step in range(2):
                x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
                model(x).pow(2).mean().backward()
                sync.finish()
                buffers = {st.buffer.untyped_storage().data_ptr() for st in sync.bucket_states}
                separate = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                               if p.grad.untyped_storage().data_ptr() not in buffers)
                means = [p.grad.clone() for p in model.parameters()]
                model.zero_grad()
        out[wire or "fp32"] = dict(separate_bytes=separate, grad_bytes=sum(p.numel() * 4 for p in ref),
                                   means=means)
    return to_bytes(out)


@pytest.mark.multiprocess
def test_gradients_are_views_of_the_bucket_buffers_where_the_wire_has_their_dtype(run_distributed):
    ranks = from_bytes(run_distributed(_grad_storage_suite, 2, timeout=60))
    for out in ranks:
        assert out["fp32"]["separate_bytes"] == 0                                 # held once: in the buckets
        assert out["bf16"]["separate_bytes"] == out["bf16"]["grad_bytes"]      # bf16 wire: fp32 .grad of their own
    assert ranks[0]["fp32"]["means"] and len(ranks[0]["fp32"]["means"]) == len(ranks[1]["fp32"]["means"])
    for a, b in zip(ranks[0]["fp32"]["means"], ranks[1]["fp32"]["means"], strict=True):    # and they are the mean
        assert torch.equal(a, b)
