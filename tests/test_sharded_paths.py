"""Sharded paths the gloo tests did not take, on 2 gloo ranks: the backend's own reduce-scatter (NCCL's
path), the gather wait where the backend enforces its timeout (NCCL's), which clip pieces count as
whole parameters, `close()` leaving no hook behind, and the whole-form state dict refused before
the optimizer is sharded.

On gloo the reduce-scatter is an all-to-all plus a local sum (`collectives.reduces_locally`), so
the path every other backend takes, the backend's reduce-scatter into the slice (or into a
narrower wire's buffer, copied back), never ran here. gloo's own reduce-scatter work has no
future (GradSync chains one), so the test gives that path a reduce-scatter with NCCL's semantics
built from an all-reduce; it must train exactly like the local sum (two ranks: one addition, in
either order the same) and within the wire's tolerance in bf16.
"""

from __future__ import annotations

import sys

import torch

from hfstream.testing import run_on_ranks
from test_gradsync_sharded import CAPS, TiedFrozenBranch, from_bytes, loss_fn, make_batch, make_optimizer, \
    to_bytes, train_parity


class ReduceScatterWork:
    """A reduce-scatter with NCCL's semantics (the sum of chunk ``rank`` in ``out``, in the wire's dtype)
    from an all-reduce: gloo's own ``reduce_scatter_single`` work has no future, which GradSync needs."""

    def __init__(self, out, flat, group):
        import torch.distributed as dist

        self.rank, self.n = dist.get_rank(group), dist.get_world_size(group)
        # What NCCL's reduce_scatter_tensor refuses (a copy below would cast or broadcast silently).
        if out.dtype != flat.dtype or flat.numel() != out.numel() * self.n:
            raise ValueError(f"reduce_scatter_tensor: input {flat.dtype} x {flat.numel()}, "
                             f"output {out.dtype} x {out.numel()} on {self.n} ranks")
        self.out, self.full = out, flat.clone()
        self.work = dist.all_reduce(self.full, group=group, async_op=True)
        self.copied = False

    def _copy(self, *_):
        if not self.copied:
            self.out.copy_(self.full.view(self.n, -1)[self.rank])
            self.copied = True

    def wait(self, *args, **kwargs):
        ok = self.work.wait(*args, **kwargs)
        self._copy()
        return ok

    def get_future(self):
        return self.work.get_future().then(self._copy)


def reduce_paths(rank, world_size):
    from hfstream.gradsync.sharded import collectives

    out = {"local": train_parity(rank, world_size, bucket_mb=CAPS["several"]),
           "local_bf16": train_parity(rank, world_size, bucket_mb=CAPS["several"], comm_dtype="bf16")}
    collectives.reduces_locally = lambda group: False   # the backend reduces, as NCCL does
    collectives._reduce_scatter = lambda out, flat, op, group, async_op: ReduceScatterWork(out, flat, group)
    out["backend"] = train_parity(rank, world_size, bucket_mb=CAPS["several"])
    out["backend_bf16"] = train_parity(rank, world_size, bucket_mb=CAPS["several"], comm_dtype="bf16")
    return to_bytes(out)


def test_the_backends_own_reduce_scatter_trains_as_the_local_sum_does():
    ranks = from_bytes(run_on_ranks(reduce_paths, 2, timeout=240))
    want = ranks[0]["local"]["ref_trace"][-1]
    for rank, out in enumerate(ranks):
        assert out["local"]["final"].keys() == out["backend"]["final"].keys() == want.keys()
        for name in want:
            assert torch.equal(out["backend"]["final"][name], out["local"]["final"][name]), f"rank {rank} {name}"
            assert torch.allclose(out["backend_bf16"]["final"][name], want[name], rtol=1e-2, atol=1e-3), name
        # bf16 summed in bf16 by the backend, then copied back: not the local sum's fp32 addition
        assert any(not torch.equal(out["backend_bf16"]["final"][n], out["local"]["final"][n]) for n in want)
        assert out["backend"]["norms"] == out["local"]["norms"]


class CountedWork:
    def __init__(self, work, log):
        self.work, self.log = work, log

    def wait(self, *args, **kwargs):
        self.log.append("timeout" if "timeout" in kwargs or args else "plain")
        return self.work.wait(*args, **kwargs)

    def get_future(self):
        return self.work.get_future()


def waits_and_pieces(rank, world_size):
    from hfstream.gradsync import GradSync, faults
    from hfstream.gradsync.sharded import collectives, reduction as sharded

    out = {}
    for enforced in (False, True):
        torch.manual_seed(1)
        model = TiedFrozenBranch()
        sync = GradSync(model, mode="sharded", bucket_mb=CAPS["several"])
        try:
            sync.optimizer_state_dict()
            refused = None
        except RuntimeError as exc:
            refused = str(exc)
        opt = sync.shard_optimizer(make_optimizer(model, "sgd"))
        log, real_gather, real_enforces = [], collectives.launch_all_gather, faults.backend_enforces_timeout

        def launch_all_gather(*a, **k):   # the parameters' gathers (a re-plan gathers state too: not counted)
            work = real_gather(*a, **k)
            return CountedWork(work, log) if sys._getframe(1).f_code.co_name == "_launch_gather" else work
        collectives.launch_all_gather = launch_all_gather
        faults.backend_enforces_timeout = lambda group: enforced
        owners = []
        real_clip = sharded.shard_optim.clip_grad_norm_

        def clip(tensors, own, *a, **k):
            owners.extend((t.numel(), i, whole) for t, (i, whole) in zip(tensors, own))
            return real_clip(tensors, own, *a, **k)
        sharded.shard_optim.clip_grad_norm_ = clip
        try:
            for step in range(2):
                loss_fn(model, [t[rank::2] for t in make_batch(step)]).backward()
                sync.finish()
                sync.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
            sync.wait_for_params()
        finally:
            collectives.launch_all_gather, faults.backend_enforces_timeout = real_gather, real_enforces
            sharded.shard_optim.clip_grad_norm_ = real_clip
        hooked = [p.numel() for _, p in sync.hooked_parameters]
        out[enforced] = {"waits": log, "buckets": len(sync.buckets), "owners": owners, "numels": hooked,
                         "refused": refused}
        sync.close()
        out[enforced]["hooks_left"] = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
        out[enforced]["grad_hooks_left"] = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
        # The optimizer's step and state-dict hooks, the model's state-dict hooks (torch's own names, read
        # without a default: a rename fails here rather than passing on an empty count).
        out[enforced]["state_hooks_left"] = sum(len(getattr(obj, name)) for obj, name in [
            (opt, "_optimizer_step_pre_hooks"), (opt, "_optimizer_step_post_hooks"),
            (opt, "_optimizer_state_dict_post_hooks"), (opt, "_optimizer_load_state_dict_pre_hooks"),
            (model, "_state_dict_pre_hooks"), (model, "_load_state_dict_pre_hooks"),
            (model, "_load_state_dict_post_hooks")])
    return out


def test_gathers_are_waited_with_gradsyncs_timeout_or_the_backends_and_close_leaves_no_hook():
    for out in run_on_ranks(waits_and_pieces, 2, timeout=120):
        for enforced, got in out.items():
            # Every bucket's gather, both steps, waited once: with a timeout only where the backend has none.
            assert got["waits"] == ["plain" if enforced else "timeout"] * (2 * got["buckets"]), got["waits"]
            assert got["hooks_left"] == 0 and got["grad_hooks_left"] == 0 and got["state_hooks_left"] == 0
            # The whole-form state dict before the optimizer is sharded: refused with what to call.
            assert got["refused"] and "sync.shard_optimizer(optimizer) called" in got["refused"]


def test_a_clip_piece_is_whole_exactly_when_it_holds_all_of_its_parameter():
    for out in run_on_ranks(waits_and_pieces, 2, timeout=120):
        owners, numels = out[False]["owners"], out[False]["numels"]
        assert owners
        flags = {whole for _, _, whole in owners}
        assert flags == {True, False}   # the plan cuts some parameters between ranks, not all
        for numel, i, whole in owners:
            assert whole == (numel == numels[i]), (numel, i, numels[i])


class SometimesBranch(torch.nn.Module):
    """A branch the forward runs in odd steps only: its bucket's gather is not waited by any forward in between."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(5, 5)
        self.branch = torch.nn.Linear(5, 5)
        self.use_branch = True

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return h + self.branch(h) if self.use_branch else h


def branch_some_steps(rank, world_size):
    from hfstream.gradsync import GradSync

    torch.manual_seed(0)
    model = SometimesBranch()
    sync = GradSync(model, mode="sharded", bucket_mb=0.0)   # a bucket per parameter
    opt = sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        model.use_branch = step % 2 == 0      # used in step 0 (whose forward planned the waits), then not
        model(torch.randn(4, 5, generator=g)).pow(2).sum().backward()
        sync.finish()
        opt.step()
        opt.zero_grad()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sync.close()
    return to_bytes(state)


def test_a_bucket_no_forward_waited_for_is_waited_for_before_its_next_reduce_scatter():
    # Its gather is still in flight when finish() launches it again (every rank launches every
    # bucket): launching would refuse the phase change, or the reduce-scatter race the gather.
    states = from_bytes(run_on_ranks(branch_some_steps, 2, timeout=120))
    assert states[0].keys() == states[1].keys()
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


# -- sharded.py's third mutation sample (docs/design.md): what no test reached ----------------------------


def refusals_and_whole_state(rank, world_size):
    from hfstream.gradsync import GradSync

    out = {}
    # A backward whose forward the hooks did not see as training (eval mode) before shard_optimizer.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    sync = GradSync(model, mode="sharded", bucket_mb=0.0)
    model.eval()
    try:
        model(torch.ones(2, 4)).sum().backward()
        out["eval_backward"] = None
    except RuntimeError as exc:
        out["eval_backward"] = str(exc)
    sync.close()
    # A sparse gradient (an nn.Embedding(sparse=True)): refused at construction, before any forward.
    emb = torch.nn.Embedding(10, 3, sparse=True)
    try:
        GradSync(emb, mode="sharded", bucket_mb=0.0).close()
        out["sparse"] = None
    except ValueError as exc:
        out["sparse"] = str(exc)
    # The whole, layout-free optimizer state on 2 ranks: every parameter's AdamW state, whole.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    sync = GradSync(model, mode="sharded", bucket_mb=0.0)
    opt = sync.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    for step in range(2):
        model(torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))).pow(2).sum().backward()
        sync.finish()
        opt.step()
        opt.zero_grad()
    whole = sync.optimizer_state_dict()
    out["state"] = {i: {k: (list(v.shape), float(v.sum())) for k, v in s.items()} for i, s in whole["state"].items()}
    out["shapes"] = [list(p.shape) for p in model.parameters()]
    sync.close()
    return out


def test_sharded_refuses_by_name_and_gives_the_whole_optimizer_state_on_several_ranks():
    outs = run_on_ranks(refusals_and_whole_state, 2, timeout=120)
    for out in outs:
        assert out["eval_backward"] and "shard_optimizer(optimizer) before" in out["eval_backward"], out
        assert out["sparse"] and "Embedding(sparse=True)" in out["sparse"] and "grad_sync='native'" in out["sparse"], out
        state, shapes = out["state"], out["shapes"]
        assert sorted(state) == list(range(len(shapes)))
        for i, shape in enumerate(shapes):
            assert state[i]["exp_avg"][0] == state[i]["exp_avg_sq"][0] == shape, (i, state[i])
            assert state[i]["step"][1] == 2.0
    assert outs[0]["state"] == outs[1]["state"]   # one whole state, the same on every rank


def two_steps_without_a_forward(rank, world_size):
    from hfstream.gradsync import GradSync

    got = {}
    for closure in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
        sync = GradSync(model, mode="sharded", bucket_mb=0.0)
        opt = sync.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        model(torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))).pow(2).sum().backward()
        sync.finish()
        for _ in range(2):   # a second step on the same gradients, no forward between: its gathers wait the first's
            opt.step((lambda: None) if closure else None)   # with a closure the step runs in one call
        sync.wait_for_params()
        got[closure] = to_bytes({k: v.clone() for k, v in model.state_dict().items()})
        sync.close()
    return got


def test_two_steps_without_a_forward_between_them_give_the_same_parameters_in_one_call_or_bucket_by_bucket():
    for got in run_on_ranks(two_steps_without_a_forward, 2, timeout=120):
        pipelined, one_call = from_bytes([got[False], got[True]])
        assert pipelined.keys() == one_call.keys() and pipelined
        for k in pipelined:
            assert torch.equal(pipelined[k], one_call[k]), k
