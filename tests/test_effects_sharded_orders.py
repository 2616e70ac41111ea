"""Effect: every ordering ``grad_sync="sharded"`` advertises, read from the collectives it issues.

docs/design.md section 7 and the docstrings of `sharded`, `param_waits` and `sync` ([Note: buffer
broadcast order]) promise, per step:

1. the reduce-scatters are launched in plan order on every rank, even where the gradients arrive
   in another order on one rank (collectives are matched by the order they are issued);
2. the all-gathers are launched in forward order (reverse plan order): the bucket the next forward
   reads first goes out first;
3. each bucket's all-gather is launched as soon as its pieces are stepped (the pipelined step), so
   gathers are in flight while the later buckets are still being stepped;
4. the next forward waits per bucket, in the pre-hook of the module that reads it: when a block
   starts, the buckets of the blocks after it are still pending;
5. the buffer broadcast the next forward needs does not queue behind the step's all-gathers: one
   process group runs its collectives in the order they are issued, so it goes out before them
   ([Note: buffer broadcast order]), or on another group.

Already held on `GradSync` directly: 3 and 4 by tests/test_effects_pipelined_step.py, 5 by
tests/test_buffer_broadcast_order.py. Held nowhere before: 1 under sharded (tests/test_gradsync.py
holds it for "overlap") and 2 at all (the pipelined-step test counts the gathers in flight, not
which). Here: 1 and 2 on `GradSync`, and all five in one `StreamTrainer(grad_sync="sharded")` run,
whose optimizer is Accelerate's wrapper over the Trainer's and whose ``finish()`` runs from the
autograd engine's callback. The order is read by wrapping the launches (`collectives`, and
``dist.broadcast``) in each rank; no clock is read.

Mutants checked by hand on a copy of the tree (each makes a test here fail; the one without the
agreement by a collective that fails between ranks whose plans differ):
gathers launched in plan order (``reversed`` dropped from the pipelined step's loop in
``ShardedReduction._before_step``); a bucket launched as soon as its own gradients are ready (the plan-order ``while``
in ``GradSync._on_grad_ready``); each rank re-planning in its own arrival order (no broadcast in
``ArrivalOrder.agree``); the step in one call (``__wrapped__`` not found); every wait at the root
(``ForwardWaits.place`` taking the compiled path); the buffer broadcast left to the forward
(``_buffers_before_gathers`` returning None).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hfstream.testing import run_on_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 3
PROBE = 4   # elements of the buffer the Trainer run adds to its model


def record_launches(sync_of):
    """Wrap the reduce-scatter, all-gather and broadcast launches; returns the list they append to.

    Each entry: ``("rs" | "ag", bucket index, bucket names, group)`` or ``("broadcast", group, numel)``; the
    bucket is the one of ``sync_of()`` whose buffer the collective reads (reduce-scatter) or writes
    (gather); a launch on another buffer is ``("rs of no bucket",)`` / ``("ag of no bucket",)``.
    ``group`` is the process group's ``id()`` (the default group's for None).
    """
    import torch.distributed as dist

    from hfstream.gradsync.sharded import collectives

    events = []
    reduce_scatter, all_gather, broadcast = (collectives.launch_reduce_scatter, collectives.launch_all_gather,
                                             dist.broadcast)

    def group_id(group):
        return id(group if group is not None else dist.group.WORLD)

    def bucket(kind, tensor, gathered, group):
        for st in sync_of().bucket_states:
            buf = (st.shard.gathered if st.shard is not None else None) if gathered else st.buffer
            if buf is not None and buf.data_ptr() == tensor.data_ptr():
                return kind, st.plan.index, tuple(st.plan.names), group_id(group)
        return (f"{kind} of no bucket",)   # e.g. a re-plan agreeing on the optimizer state's keys

    def third(args, kwargs, name):   # the process group: the third argument of each of the three
        return kwargs[name] if name in kwargs else args[2] if len(args) > 2 else None

    def recording_reduce_scatter(*args, **kwargs):
        events.append(bucket("rs", args[0], False, third(args, kwargs, "group")))
        return reduce_scatter(*args, **kwargs)

    def recording_all_gather(*args, **kwargs):
        events.append(bucket("ag", args[0], True, third(args, kwargs, "group")))
        return all_gather(*args, **kwargs)

    def recording_broadcast(*args, **kwargs):
        events.append(("broadcast", group_id(third(args, kwargs, "group")), args[0].numel()))
        return broadcast(*args, **kwargs)

    collectives.launch_reduce_scatter, collectives.launch_all_gather = recording_reduce_scatter, recording_all_gather
    dist.broadcast = recording_broadcast
    return events


def _steps(events):
    """``events`` cut at each ``("forward",)`` marker: one list per step."""
    out = []
    for e in events:
        if e == ("forward",):
            out.append([])
        elif out:
            out[-1].append(e)
    return out


# --------------------------------------------------------------------------- GradSync directly
class Branches(nn.Module):
    """Two branches of equal layers; ``flip`` runs branch b first, so its gradients arrive last."""

    def __init__(self, flip: bool):
        super().__init__()
        self.flip = flip
        self.a1, self.a2, self.b1, self.b2 = (nn.Linear(8, 8, bias=False) for _ in range(4))

    def forward(self, x):
        a, b = (self.a1, self.a2), (self.b1, self.b2)
        first, second = (b, a) if self.flip else (a, b)
        y1 = first[1](torch.tanh(first[0](x)))
        y2 = second[1](torch.tanh(second[0](x)))
        return y1 * y2


def _train_gradsync(rank, model, events, holder, arrivals=None):
    """``STEPS`` steps of sharded SGD; per step, the plan its reduce-scatters used and the one its gathers used."""
    from hfstream.gradsync import GradSync

    if arrivals is not None:   # before GradSync's hooks: the order the gradients arrive in on this rank
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: arrivals[-1].append(name))
    sync = GradSync(model, mode="sharded", bucket_mb=0)   # one bucket per parameter
    holder[:] = [sync]
    opt = sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(rank)
    plans = {"backward": [], "step": []}
    for _ in range(STEPS):
        plans["backward"].append([tuple(b.names) for b in sync.buckets])
        events.append(("forward",))
        if arrivals is not None:
            arrivals.append([])
        model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        sync.finish()   # the first one re-plans in rank 0's arrival order
        plans["step"].append([tuple(b.names) for b in sync.buckets])
        opt.step()
        opt.zero_grad()
    sync.wait_for_params()
    sync.close()
    return plans


def gradsync_orders(rank, world_size):
    holder = []
    events = record_launches(lambda: holder[0])
    out = {}
    # 1. reduce-scatters in plan order on every rank, whatever order the gradients arrive in.
    torch.manual_seed(0)
    arrivals = []
    plans = _train_gradsync(rank, Branches(flip=rank == 1), events, holder, arrivals)
    out["branches"] = {"events": list(events), "plans": plans["backward"], "arrivals": arrivals}
    events.clear()
    # 2. all-gathers in forward order: the chain's first layer's buckets first.
    torch.manual_seed(0)
    chain = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    plans = _train_gradsync(rank, chain, events, holder)
    out["chain"] = {"events": list(events), "plans": plans["step"]}
    return out


@pytest.fixture(scope="module")
def direct():
    return run_on_ranks(gradsync_orders, 2, timeout=120)


def test_reduce_scatters_launch_in_plan_order_on_every_rank_whatever_order_gradients_arrive_in(direct):
    r0, r1 = (res["branches"] for res in direct)
    # precondition: rank 1 runs the branches the other way round, so its gradients arrive in another order
    assert r0["arrivals"][0] != r1["arrivals"][0], (r0["arrivals"][0], r1["arrivals"][0])
    for rank, res in enumerate((r0, r1)):
        steps = _steps(res["events"])
        assert len(steps) == STEPS
        for k, step in enumerate(steps):
            launched = [e[1:3] for e in step if e[0] == "rs"]   # (bucket index, names) in launch order
            plan = res["plans"][k]
            assert [i for i, _ in launched] == list(range(len(plan))) and len(plan) == 4, (
                f"rank {rank} step {k}: reduce-scatters launched as buckets {[i for i, _ in launched]}, "
                f"not in plan order (arrival order here {res['arrivals'][k]})")
            assert [names for _, names in launched] == plan
    for k in range(STEPS):   # the same buckets in the same order on both ranks: the collectives match
        rs0 = [e[2] for e in _steps(r0["events"])[k] if e[0] == "rs"]
        rs1 = [e[2] for e in _steps(r1["events"])[k] if e[0] == "rs"]
        assert rs0 == rs1, f"step {k}: rank 0 launched {rs0}, rank 1 {rs1}"


def test_all_gathers_launch_in_forward_order_first_layer_first(direct):
    for rank, res in enumerate(res["chain"] for res in direct):
        steps = _steps(res["events"])
        assert len(steps) == STEPS
        for k, step in enumerate(steps):
            gathered = [e[2] for e in step if e[0] == "ag"]   # the buckets' names, in launch order
            assert len(gathered) == 8, gathered   # one bucket per parameter, 4 layers
            # The layer each gathered bucket belongs to ("2.0.weight" -> 2), in launch order.
            layers = [int(names[0].split(".")[0]) for names in gathered]
            assert layers == sorted(layers), (
                f"rank {rank} step {k}: all-gathers launched for layers {layers}: the next forward reads layer 0 first")
            assert gathered == list(reversed(res["plans"][k])), (gathered, res["plans"][k])


# --------------------------------------------------------------------------- through the Trainer
class RecordingSGD(torch.optim.SGD):
    """SGD that appends ``("opt", pieces it steps)`` to ``events`` at each call of its step."""

    events: list = []

    def step(self, closure=None):
        self.events.append(("opt", sum(len(g["params"]) for g in self.param_groups)))
        raw = torch.optim.SGD.step
        if getattr(raw, "hooked", False):   # patched by torch: the step without the hooks
            raw = raw.__wrapped__
        return raw(self, closure)


def trainer_orders(rank, world_size, tmp):
    from tiny import lm_dataset, tiny_causal_lm, train_args

    from hfstream import StreamTrainer, StreamTrainingArguments

    model = tiny_causal_lm("gpt2", seed=rank)
    # A buffer of the model's (tiny GPT-2 has none): ddp_broadcast_buffers (unset: DDP's True) sends it.
    model.register_buffer("probe", torch.full((PROBE,), float(rank)))
    args = train_args(StreamTrainingArguments, f"{tmp}/sharded", grad_sync="sharded", grad_bucket_mb=0,
                      prefetch_depth=0, max_steps=STEPS)
    opt = RecordingSGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = StreamTrainer(model=model, args=args, train_dataset=lm_dataset(), optimizers=(opt, None))
    events = record_launches(lambda: trainer.grad_sync)
    RecordingSGD.events = events
    # Registered before train() hooks the model: the root's marker runs before GradSync's forward
    # hook, and each block's before that block's own wait, so it sees the block's buckets still pending.
    model.register_forward_pre_hook(lambda m, a: events.append(("forward",)) if m.training else None)
    blocks = [*model.transformer.h, model.transformer.ln_f]
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(
            lambda m, a, i=i: events.append(("pending", i, len(trainer.grad_sync.params_pending)))
            if m.training else None)
    trainer.train()
    n = len(trainer.grad_sync.buckets)
    return {"events": events, "buckets": n, "probe": model.probe.clone()}


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded_orders")
    return run_on_ranks(trainer_orders, 2, str(tmp), init_process_group=False, timeout=180)


def _windows(res):
    """Per step: (forward and backward; then finish() and the optimizer step), cut after the last ``rs``."""
    out = []
    for step in _steps(res["events"]):
        cut = max(j for j, e in enumerate(step) if e[0] == "rs") + 1
        out.append((step[:cut], step[cut:]))
    assert len(out) == STEPS, len(out)
    return out


def test_trainer_reduce_scatters_launch_in_plan_order_the_same_on_every_rank(trainer_runs):
    n = trainer_runs[0]["buckets"]
    assert n > 10
    per_rank = []
    for rank, res in enumerate(trainer_runs):
        launched = []
        for k, (backward, _) in enumerate(_windows(res)):
            rs = [e for e in backward if e[0] == "rs"]
            assert [e[1] for e in rs] == list(range(n)), f"rank {rank} step {k}: {[e[1] for e in rs]}"
            launched.append([e[2] for e in rs])
        per_rank.append(launched)
    assert per_rank[0] == per_rank[1]


def test_trainer_all_gathers_launch_in_forward_order_each_as_soon_as_its_bucket_is_stepped(trainer_runs):
    n = trainer_runs[0]["buckets"]
    for rank, res in enumerate(trainer_runs):
        for k, (_, step) in enumerate(_windows(res)):
            gathers = [e[1] for e in step if e[0] == "ag"]
            assert gathers == list(reversed(range(n))), (
                f"rank {rank} step {k}: all-gathers launched as buckets {gathers}, not in forward (reverse plan) order")
            # The pipelined step: each bucket's pieces stepped, then its gather at once, before the next bucket's.
            kinds = [e[0] for e in step if e[0] == "ag" or (e[0] == "opt" and e[1] > 0)]
            assert kinds == ["opt", "ag"] * n, f"rank {rank} step {k}: {kinds[:8]} ..."


def test_trainer_buffer_broadcast_does_not_queue_behind_the_steps_all_gathers(trainer_runs):
    for rank, res in enumerate(trainer_runs):
        windows = _windows(res)
        for k in range(STEPS - 1):   # every step that a training forward follows
            # From the end of step k's backward to step k + 1's first reduce-scatter: finish(), the
            # optimizer step, the next forward. The probe (4 elements) is the model's only buffer.
            between = windows[k][1] + windows[k + 1][0]
            gathers = [j for j, e in enumerate(between) if e[0] == "ag"]
            sent = [(j, e[1]) for j, e in enumerate(between) if e[0] == "broadcast" and e[2] == PROBE]
            assert len(gathers) == res["buckets"] and len(sent) == 1, (k, gathers, sent)
            (j, group), gather_group = sent[0], between[gathers[0]][3]
            # One group runs its collectives in the order issued: on the gathers' group the broadcast
            # must go out before them, or the forward that waits for it waits for every gather.
            order = ["buffers" if e[0] == "broadcast" and e[2] == PROBE else e[0] for e in between
                     if e[0] in ("ag", "opt") or (e[0] == "broadcast" and e[2] == PROBE)]
            assert group != gather_group or j < gathers[0], (
                f"rank {rank} step {k}: the buffer broadcast was issued after the step's all-gathers on their "
                f"group: {order[:4]} ... {order[-3:]}")
    probes = [res["probe"] for res in trainer_runs]
    assert torch.equal(probes[0], probes[1]) and torch.equal(probes[0], torch.zeros(PROBE))   # rank 0's


def test_trainer_forward_waits_block_by_block_with_the_later_blocks_gathers_still_pending(trainer_runs):
    for rank, res in enumerate(trainer_runs):
        steps = _steps(res["events"])
        for k, step in enumerate(steps[1:], start=1):   # the first forward has no gather to wait for
            pending = [e[2] for e in step if e[0] == "pending"]
            assert len(pending) == 3, pending   # blocks 0 and 1, then ln_f
            # As each block starts (after its own wait, which comes first among its pre-hooks so that a
            # user's pre-hook reads gathered weights) the later blocks' buckets are still pending; the
            # embeddings' were waited for, block 0's by the time block 1 starts; ln_f is the last.
            assert pending[0] > pending[1] > pending[2] >= 0, (
                f"rank {rank} step {k}: gathers pending as blocks 0, 1 and ln_f start: {pending}: "
                f"the forward waited for more than the buckets it had reached")
