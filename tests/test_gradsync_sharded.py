"""GradSync(mode="sharded") on CPU with gloo and two processes: ZeRO-1 with both halves overlapped.

- parity: two ranks, each on half the batch, reduce-scatter gradients, step their slices with a
  sharded optimizer (two param groups: weight decay and a per-group learning rate, an LR
  scheduler), clip by the global norm and all-gather the parameters; after 6 steps they hold the
  parameters of single-process training on the whole batch, and ``sync.clip_grad_norm_``
  returns ``torch.nn.utils.clip_grad_norm_``'s norm. The model has a tied embedding, a frozen
  layer and a branch that rank 1 never uses; one bucket, several, one per parameter; gradient
  accumulation under ``no_sync()``; AdamW; buckets re-planned while the optimizer has state
  (``bucket_mb="auto"``); bf16 on the wire within its tolerance;
- each rank's optimizer state is about half the unsharded optimizer's (measured bytes);
- the next forward waits only for the parameters it reaches: module by module, in forward
  order; ``wait_for_params()`` and ``state_dict()`` give the complete, current model;
- misuse is refused with what to do: sharding after a step, twice, parameters not the model's,
  a forward before the optimizer is sharded, a parameter read before its all-gather arrived.
"""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hfstream.gradsync import GradSync
from hfstream.testing import run_on_ranks

STEPS = 6
MAX_NORM = 1.0
# fp32 parity: the two runs differ only in how the batch mean is summed.
RTOL, ATOL = 1e-5, 1e-7
# AdamW divides by sqrt(v): a rounding difference in a gradient near zero moves a parameter by up
# to lr * (difference / sqrt(v)), so its absolute error does not shrink with the parameter.
# Measured: max abs diff 1.2e-7 (6 steps, tiny model), 3e-7 (16 steps, 1.5M parameters, re-plans).
ADAMW_RTOL, ADAMW_ATOL = 1e-5, 1e-6
NORM_RTOL = 1e-5
CAPS = {"one_bucket": float("inf"), "several": 0.0004, "per_param": 0.0}   # 0.0004 MiB: 3-4 buckets


# -- model and data (module level: spawned ranks import them by name) -----------------------------
class TiedFrozenBranch(nn.Module):
    """A tied embedding/output, a frozen layer, and a branch used only by flagged samples.

    The batch flags only samples in rank 0's half, so on rank 1 the branch gets no gradient at
    all (its hooks never fire). Odd sizes (vocabulary 19, width 7) make every bucket need padding.
    """

    def __init__(self, vocab=19, dim=7):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.mix = nn.Linear(dim, dim)
        self.branch = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids, flag):
        h = torch.tanh(self.frozen(self.embed(ids)))
        h = torch.tanh(self.mix(h))
        if bool(flag.any()):
            h = h + flag[:, None, None] * self.branch(h)
        return self.out(self.norm(h))


def make_batch(step, n=16, seq=6):
    g = torch.Generator().manual_seed(3000 + step)
    flag = torch.zeros(n)
    flag[: n // 4] = 1.0      # the first quarter: inside rank 0's half only
    return torch.randint(0, 19, (n, seq), generator=g), flag


def loss_fn(model, batch):
    """Cross-entropy, scaled so that the gradient norm crosses MAX_NORM during the run (clipped, then not)."""
    ids, flag = batch
    logits = model(ids[:, :-1], flag)
    return 0.3 * F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def make_optimizer(model, kind):
    """Two groups: decayed weights (the frozen one included, as a user would), and biases/norm at half the lr."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and not n.startswith("norm")]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and not n.startswith("norm"))]
    groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 0.05 if kind == "sgd" else 5e-3}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.1)
    if kind == "adagrad":   # creates its state in __init__
        return torch.optim.Adagrad(groups, lr=0.1, initial_accumulator_value=0.5, weight_decay=0.1)
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)


def make_scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.5 * step))


def _shard(batch, rank, world_size, accum):
    per_rank = batch[0].shape[0] // world_size
    mine = [t[rank * per_rank:(rank + 1) * per_rank] for t in batch]
    per_micro = per_rank // accum
    return [tuple(t[k * per_micro:(k + 1) * per_micro] for t in mine) for k in range(accum)]


def to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(per_rank):
    return [torch.load(io.BytesIO(b), weights_only=False) for b in per_rank]


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- parity ----------------------------------------------------------------------------------------
def train_parity(rank, world_size, *, bucket_mb, kind="sgd", accum=1, comm_dtype=None, trace=False, prestep=False,
                 one_call=False):
    """Sharded training on this rank's share; on rank 0 also the single-process reference on the whole batch.

    ``trace`` records the parameters after every step (through ``wait_for_params()``); otherwise
    the steps run untouched (gathers overlap the next forward) and the final parameters are
    read through ``state_dict()``. ``prestep``: the optimizer steps once, unsharded, before it is
    sharded (every rank alike): that state must be kept. ``one_call``: the step gets a closure,
    so it runs in one call instead of bucket by bucket (the gathers then follow it).
    """
    torch.manual_seed(100 + (0 if prestep else rank))   # different weights per rank until the broadcast
    model = TiedFrozenBranch()
    ref = copy.deepcopy(model) if rank == 0 else None   # rank 0 is the broadcast source
    opt = make_optimizer(model, kind)
    ref_opt = make_optimizer(ref, kind) if ref is not None else None
    if prestep:
        for m, o in ((model, opt), (ref, ref_opt)):
            if m is not None:
                loss_fn(m, make_batch(99)).backward()
                o.step()
                o.zero_grad()
    sync = GradSync(model, mode="sharded", bucket_mb=bucket_mb, comm_dtype=comm_dtype)
    opt = sync.shard_optimizer(opt)
    sched = make_scheduler(opt)
    out = {"norms": [], "ref_norms": [], "trace": [], "ref_trace": [], "num_buckets": len(sync.buckets),
           "gathering_at_step": []}
    # Registered after GradSync's pre-hook: which path the step took. Bucket by bucket, every
    # all-gather is already in flight when the step proper runs; in one call, none is yet.
    opt.register_step_pre_hook(lambda *_: out["gathering_at_step"].append(len(sync.params_pending)))
    if ref is not None:
        ref_sched = make_scheduler(ref_opt)
    for step in range(STEPS):
        batch = make_batch(step)
        for k, micro in enumerate(_shard(batch, rank, world_size, accum)):
            with sync.no_sync() if k < accum - 1 else contextlib.nullcontext():
                (loss_fn(model, micro) / accum).backward()
        sync.finish()
        out["norms"].append(sync.clip_grad_norm_(MAX_NORM).item())
        if step == 0:
            out["grad_norms"] = {n: v.item() for n, v in sync.grad_norms().items()}
        opt.step((lambda: None) if one_call else None)
        sched.step()
        opt.zero_grad()
        if trace:
            sync.wait_for_params()
            out["trace"].append(_state(model))
        if ref is not None:
            loss_fn(ref, batch).backward()
            out["ref_norms"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
            if step == 0:
                out["ref_grad_norms"] = {n: p.grad.norm().item() for n, p in ref.named_parameters()
                                         if p.grad is not None}
            ref_opt.step()
            ref_sched.step()
            ref_opt.zero_grad()
            out["ref_trace"].append(_state(ref))
    out["final"] = _state(model)   # state_dict() waits for the pending gathers
    out["lrs"] = [g["lr"] for g in opt.param_groups]
    out["model_grads_none"] = all(p.grad is None for p in model.parameters())
    out["notes"] = list(sync.notes)
    sync.close()
    return out


def parity_suite(rank, world_size):
    results = {}
    for name, cap in CAPS.items():
        results[name] = train_parity(rank, world_size, bucket_mb=cap, trace=name == "several")
    results["accum4"] = train_parity(rank, world_size, bucket_mb=CAPS["several"], accum=4)
    results["adamw"] = train_parity(rank, world_size, bucket_mb=CAPS["several"], kind="adamw")
    results["adamw_one_call"] = train_parity(rank, world_size, bucket_mb=CAPS["several"], kind="adamw", one_call=True)
    results["several_one_call"] = train_parity(rank, world_size, bucket_mb=CAPS["several"], one_call=True)
    results["adagrad"] = train_parity(rank, world_size, bucket_mb=CAPS["several"], kind="adagrad")
    results["adamw_stepped"] = train_parity(rank, world_size, bucket_mb=CAPS["several"], kind="adamw", prestep=True)
    results["bf16_wire"] = train_parity(rank, world_size, bucket_mb=CAPS["several"], comm_dtype="bf16")
    return to_bytes(results)


@pytest.fixture(scope="module")
def parity():
    return from_bytes(run_on_ranks(parity_suite, 2, timeout=240))


def _assert_close(got, want, rtol, atol, what):
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=rtol, atol=atol), (
            f"{what} {name}: max abs diff {(got[name] - want[name]).abs().max().item():.3g}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", ["one_bucket", "several", "per_param", "accum4", "adamw", "adagrad",
                                    "adamw_stepped"])
def test_sharded_training_matches_single_process_on_the_whole_batch(parity, config):
    rtol, atol = (ADAMW_RTOL, ADAMW_ATOL) if config.startswith("adamw") else (RTOL, ATOL)
    ref = parity[0][config]
    for rank in (0, 1):
        res = parity[rank][config]
        _assert_close(res["final"], ref["ref_trace"][-1], rtol, atol, f"{config} rank {rank} final")
        for step, (got, want) in enumerate(zip(res["norms"], ref["ref_norms"])):
            assert got == pytest.approx(want, rel=NORM_RTOL), f"{config} rank {rank} step {step} norm"
        assert res["lrs"] == ref["lrs"]   # the scheduler drove both param groups of the sharded optimizer
    # Both ranks hold bit-identical parameters: every slice was all-gathered to every rank.
    for name, value in parity[0][config]["final"].items():
        assert torch.equal(value, parity[1][config]["final"][name]), f"{config}: ranks differ at {name}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", ["several", "adamw"])
def test_stepping_bucket_by_bucket_is_exactly_the_one_call_step(parity, config):
    for rank in (0, 1):
        piecewise, whole = parity[rank][config], parity[rank][f"{config}_one_call"]
        assert piecewise["num_buckets"] > 1
        # the two runs really took the two paths (not one path compared with itself)
        assert piecewise["gathering_at_step"] == [piecewise["num_buckets"]] * STEPS
        assert whole["gathering_at_step"] == [0] * STEPS
        assert whole["final"] and set(piecewise["final"]) == set(whole["final"])
        for name, value in whole["final"].items():
            assert torch.equal(piecewise["final"][name], value), f"{config} rank {rank}: {name}"


@pytest.mark.multiprocess
def test_grad_norms_give_each_parameters_mean_gradient_norm_from_the_slices(parity):
    want = parity[0]["several"]["ref_grad_norms"]
    assert len(want) >= 6
    for rank in (0, 1):
        got = parity[rank]["several"]["grad_norms"]
        assert got.keys() == want.keys()   # the frozen layer has no gradient, as unsharded
        for name, norm in want.items():
            assert got[name] == pytest.approx(norm, rel=1e-5), name


@pytest.mark.multiprocess
def test_parameters_match_after_every_step_through_wait_for_params(parity):
    ref = parity[0]["several"]
    for rank in (0, 1):
        for step in range(STEPS):
            _assert_close(parity[rank]["several"]["trace"][step], ref["ref_trace"][step], RTOL, ATOL,
                          f"rank {rank} step {step}")


@pytest.mark.multiprocess
def test_parity_runs_exercise_clipping_buckets_and_the_tied_frozen_and_unused_parameters(parity):
    ref = parity[0]["several"]
    assert any(n > MAX_NORM for n in ref["ref_norms"]) and any(n < MAX_NORM for n in ref["ref_norms"]), \
        "precondition: clipping must be active in some steps and not in others"
    assert parity[0]["one_bucket"]["num_buckets"] == 1
    assert 1 < parity[0]["several"]["num_buckets"] < parity[0]["per_param"]["num_buckets"]
    final = parity[1]["several"]["final"]
    assert torch.equal(final["out.weight"], final["embed.weight"])   # still one tensor
    # The frozen layer is rank 0's (broadcast) and never moves; the branch (unused on rank 1) trained.
    start = parity[0]["several"]["ref_trace"][0]
    assert torch.equal(final["frozen.weight"], start["frozen.weight"])
    assert not torch.allclose(final["branch.weight"], start["branch.weight"])
    # The model's own .grad is released: the gradient lives in the sharded optimizer's slices.
    assert all(parity[r][c]["model_grads_none"] for r in (0, 1) for c in CAPS)


@pytest.mark.multiprocess
def test_a_parameter_used_on_one_rank_only_needs_no_note(parity):
    # The branch is unused on rank 1 only: it gets the mean (rank 0's gradient / 2), as under DDP, so
    # there is nothing to say (until round 5 a note said sharded stepped a parameter no rank used;
    # now such a parameter keeps .grad None: tests/test_trainer_rank_asymmetric.py, "moe-idle-experts").
    for rank in (0, 1):
        assert not [n for n in parity[rank]["several"]["notes"] if "got no gradient" in n]


def test_bf16_wire_stays_within_tolerance(parity):
    want = parity[0]["several"]["ref_trace"][-1]
    for rank in (0, 1):
        got = parity[rank]["bf16_wire"]
        for name, p in want.items():
            assert torch.allclose(got["final"][name], p, rtol=1e-2, atol=1e-3), f"rank {rank} {name}"
        assert any(not torch.equal(got["final"][n], parity[rank]["several"]["final"][n]) for n in want), \
            "bf16 run is bit-identical to the fp32 one: was the wire really compressed?"


# -- re-planning with optimizer state, and the state's size ----------------------------------------
def auto_and_memory_suite(rank, world_size, steps=16):
    torch.manual_seed(7 + rank)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])   # 6 x 257 KB: several distinct plans
    ref = copy.deepcopy(model) if rank == 0 else None
    sync = GradSync(model, mode="sharded", bucket_mb="auto")
    opt = sync.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    out = {"num_buckets": [], "norms": [], "ref_norms": []}
    if ref is not None:
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 256, generator=g), torch.randn(8, 256, generator=g)
        F.mse_loss(model(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
        sync.finish()
        out["num_buckets"].append(len(sync.buckets))
        out["norms"].append(sync.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        if ref is not None:
            F.mse_loss(ref(x), y).backward()
            out["ref_norms"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
            ref_opt.step()
            ref_opt.zero_grad()
    sync.wait_for_params()
    out["final"] = _state(model)
    out["ref_final"] = _state(ref) if ref is not None else None
    out["state_bytes"] = _state_bytes(opt)
    if ref is not None:
        out["ref_state_bytes"] = _state_bytes(ref_opt)
    sync.close()
    return to_bytes(out)


def _state_bytes(optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v))


@pytest.fixture(scope="module")
def auto_and_memory():
    return from_bytes(run_on_ranks(auto_and_memory_suite, 2, timeout=240))


@pytest.mark.multiprocess
def test_buckets_replanned_while_the_optimizer_has_state_keep_parity(auto_and_memory):
    ref = auto_and_memory[0]
    changes = [k for k in range(1, len(ref["num_buckets"])) if ref["num_buckets"][k] != ref["num_buckets"][k - 1]]
    assert changes and changes[-1] > 1, f"precondition: a re-plan after the first step, got {ref['num_buckets']}"
    for rank in (0, 1):
        res = auto_and_memory[rank]
        assert res["num_buckets"] == ref["num_buckets"]
        _assert_close(res["final"], ref["ref_final"], ADAMW_RTOL, ADAMW_ATOL, f"rank {rank}")
        assert res["norms"] == pytest.approx(ref["ref_norms"], rel=NORM_RTOL)


@pytest.mark.multiprocess
def test_each_rank_holds_about_half_the_optimizer_state(auto_and_memory):
    full = auto_and_memory[0]["ref_state_bytes"]
    for rank in (0, 1):
        assert auto_and_memory[rank]["state_bytes"] <= 0.6 * full, (auto_and_memory[rank]["state_bytes"], full)
    assert sum(r["state_bytes"] for r in auto_and_memory) >= 0.95 * full   # the slices cover the model


# -- the gathers behind the next forward, and misuse that needs two ranks --------------------------
class Chain(nn.Module):
    """Four layers used in order, and a layer ``side`` that the parent may call, read directly, or skip."""

    def __init__(self, side: str = "skip"):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.side = nn.Linear(16, 16)
        self.use_side = side   # "skip", "call" or "read" (self.side's own forward does not run)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.use_side == "call":
            x = x + self.side(x)
        elif self.use_side == "read":
            x = x + F.linear(x, self.side.weight)
        return x


def behaviour_suite(rank, world_size):
    out = {}
    torch.manual_seed(0)
    model = Chain()
    sync = GradSync(model, mode="sharded", bucket_mb=0)   # one bucket per parameter
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    try:
        model(x)
        out["forward_before_shard"] = None
    except RuntimeError as exc:
        out["forward_before_shard"] = str(exc)
    opt = sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    model(x).pow(2).mean().backward()
    sync.finish()
    before = _state(model)
    opt.step()
    out["pending_after_step"] = sorted(sync.params_pending)
    out["num_buckets"] = len(sync.buckets)
    # Not read here: the parameters are views of the gathered buffers, so a gather that has landed
    # has already written them; only the forward's wait makes them current for certain.
    seen = []
    handles = [layer.register_forward_pre_hook(lambda m, a, i=i: seen.append((i, len(sync.params_pending))))
               for i, layer in enumerate(model.layers)]   # registered after GradSync's: run once its wait is done
    model(x)
    for handle in handles:
        handle.remove()
    out["pending_per_layer"] = seen
    out["pending_after_forward"] = sorted(sync.params_pending)
    sync.wait_for_params()
    out["pending_after_wait"] = list(sync.params_pending)
    out["after_wait"] = _state(model)
    out["moved_by_the_step"] = sorted(k for k, v in out["after_wait"].items() if not torch.equal(v, before[k]))
    # load_state_dict() between steps takes effect: the slices are taken from the loaded values, so
    # the next all-gather brings those back, not the slices from before.
    loaded = {k: v + 1.0 for k, v in _state(model).items()}
    model.load_state_dict(loaded)
    opt.zero_grad()   # no gradient: the step changes nothing, the gathers still run
    opt.step()
    sync.wait_for_params()
    out["after_load"] = all(torch.equal(v, loaded[k]) for k, v in _state(model).items())
    # `side` never ran in the first forward: its parent waits for it, so reading it there is current.
    model.use_side = "read"
    model(x).pow(2).mean().backward()
    sync.finish()
    opt.step()
    opt.zero_grad()
    out["read_by_parent"] = None
    try:
        model(x).pow(2).mean().backward()
        sync.finish()
    except RuntimeError as exc:
        out["read_by_parent"] = str(exc)
    sync.close()
    # A module that ran in the first forward waits in its own pre-hook; reading its weight elsewhere
    # first, before its gather arrived, is refused, not silently stale.
    torch.manual_seed(0)
    model = Chain(side="call")
    sync = GradSync(model, mode="sharded", bucket_mb=0)
    opt = sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    model(x).pow(2).mean().backward()
    sync.finish()
    opt.step()
    opt.zero_grad()
    model.use_side = "read"
    try:
        model(x).pow(2).mean().backward()
        out["stale_read"] = None
    except RuntimeError as exc:
        out["stale_read"] = str(exc)
    sync.close()
    return to_bytes(out)


@pytest.fixture(scope="module")
def behaviour():
    return from_bytes(run_on_ranks(behaviour_suite, 2, timeout=120))


@pytest.mark.multiprocess
def test_next_forward_waits_for_each_layers_parameters_only_when_it_reaches_them(behaviour):
    for res in behaviour:
        n = res["num_buckets"]
        assert n == 10 and res["pending_after_step"] == list(range(n))
        # Every layer's parameters came back stepped (`side` got no gradient: plain SGD leaves it).
        assert res["moved_by_the_step"] == sorted(f"layers.{i}.{w}" for i in range(4) for w in ("weight", "bias"))
        # Layer i's two buckets (weight, bias) are waited for as layer i starts; the later layers' are not
        # yet. `side` never ran in the first forward, so the root waited for its two buckets at the start.
        assert res["pending_per_layer"] == [(0, 6), (1, 4), (2, 2), (3, 0)]
        assert res["pending_after_forward"] == []


@pytest.mark.multiprocess
def test_a_parameter_whose_module_never_ran_is_current_when_its_parent_reads_it(behaviour):
    for res in behaviour:   # a PEFT ParameterDict, a weight read with F.linear: never "read before its gather"
        assert res["read_by_parent"] is None, res["read_by_parent"]


@pytest.mark.multiprocess
def test_wait_for_params_leaves_complete_identical_parameters(behaviour):
    r0, r1 = behaviour
    assert r0["pending_after_wait"] == r1["pending_after_wait"] == []
    for name, value in r0["after_wait"].items():
        assert torch.equal(value, r1["after_wait"][name]), name


@pytest.mark.multiprocess
def test_load_state_dict_between_steps_is_what_the_next_gather_brings_back(behaviour):
    for res in behaviour:
        assert res["after_load"]


@pytest.mark.multiprocess
def test_forward_before_the_optimizer_is_sharded_is_refused(behaviour):
    for res in behaviour:
        assert res["forward_before_shard"] is not None and "shard_optimizer" in res["forward_before_shard"]


@pytest.mark.multiprocess
def test_parameter_read_before_its_gather_arrived_is_refused(behaviour):
    for res in behaviour:
        msg = res["stale_read"]
        assert msg is not None and "side.weight" in msg and "wait_for_params()" in msg, msg


# -- the probe behind the choice of primitives ----------------------------------------------------
@pytest.mark.multiprocess
def test_collectives_probe_checks_every_primitive_it_times():
    from dev.bench.collectives import probe

    for res in run_on_ranks(probe, 2, 0.01, 1, timeout=60):
        assert set(res) >= {"all_reduce", "reduce_scatter", "all_to_all + local sum", "all_gather (single tensor)"}
        assert all(ok and ms > 0 for ok, ms in res.values()), res


# -- single process: misuse, world size 1 ------------------------------------------------------------
def test_sharding_an_optimizer_twice_is_refused():
    model = TiedFrozenBranch()
    with GradSync(model, mode="sharded") as sync:
        opt = sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(RuntimeError, match=r"already sharded.*call shard_optimizer\(\) once"):
            sync.shard_optimizer(opt)


def test_optimizer_over_parameters_not_in_the_model_is_refused():
    model = TiedFrozenBranch()
    with GradSync(model, mode="sharded") as sync:
        stranger = nn.Parameter(torch.zeros(3))
        with pytest.raises(ValueError, match=r"not a parameter of the model.*model.parameters\(\)"):
            sync.shard_optimizer(torch.optim.SGD([*model.parameters(), stranger], lr=0.1))
        with pytest.raises(ValueError, match=r"does not optimize trainable parameter\(s\) mix.weight.*requires_grad_"):
            sync.shard_optimizer(torch.optim.SGD([p for n, p in model.named_parameters() if n != "mix.weight"], lr=0.1))
        with pytest.raises(TypeError, match="torch.optim.Optimizer"):
            sync.shard_optimizer([p for p in model.parameters()])


def test_shard_optimizer_needs_sharded_mode():
    model = TiedFrozenBranch()
    with GradSync(model, mode="overlap") as sync:
        with pytest.raises(ValueError, match=r"needs GradSync\(model, mode='sharded'\)"):
            sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_world_size_one_returns_the_optimizer_unchanged_and_clips_like_torch():
    torch.manual_seed(0)
    model = TiedFrozenBranch()
    plain = copy.deepcopy(model)
    with GradSync(model, mode="sharded", bucket_mb=0) as sync:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        groups_before = [list(g["params"]) for g in opt.param_groups]
        assert sync.shard_optimizer(opt) is opt
        assert [list(g["params"]) for g in opt.param_groups] == groups_before
        batch = make_batch(0)
        loss_fn(model, batch).backward()
        loss_fn(plain, batch).backward()
        sync.finish()
        norm = sync.clip_grad_norm_(0.1)
        want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
        assert torch.equal(norm, want)
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name
        sync.wait_for_params()   # a no-op
        assert sync.params_pending == []


def test_bad_norm_type_names_the_argument():
    with GradSync(TiedFrozenBranch(), mode="sharded") as sync:
        with pytest.raises(ValueError, match="norm_type=0.0 is not valid"):
            sync.clip_grad_norm_(1.0, norm_type=0)


def misfit_state_dicts(rank, world_size):
    torch.manual_seed(0)
    model = TiedFrozenBranch()
    sync = GradSync(model, mode="sharded", bucket_mb=CAPS["several"])
    opt = sync.shard_optimizer(make_optimizer(model, "sgd"))
    errors = {}
    local = opt.state_dict()
    local["hfstream_shard"] = dict(local["hfstream_shard"], rank=1 - rank)   # another rank's shard
    other_model = {"state": {}, "param_groups": [{**g, "params": [0]} for g in local["param_groups"]]}
    for name, sd in (("other rank", local), ("other model", other_model)):
        try:
            opt.load_state_dict(sd)
            errors[name] = None
        except ValueError as exc:
            errors[name] = str(exc)
    sync.close()
    return errors


def test_a_state_dict_for_another_shard_or_model_is_refused_with_what_to_load():
    for errors in run_on_ranks(misfit_state_dicts, 2, timeout=60):
        assert "only fits the layout it was cut from" in errors["other rank"] and "optimizer_state_dict()" in errors["other rank"]
        assert "saved for another model or another optimizer setup" in errors["other model"]
