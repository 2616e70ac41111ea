"""Sharded mode: reduce-scatter gradients in backward, all-gather parameters after the step.

An all-reduce is a reduce-scatter followed by an all-gather of the same bytes. ``GradSync(model,
mode="sharded")`` launches only the first half from the gradient hooks, so each rank ends
``finish()`` holding the mean gradient of its own 1/N slice of every bucket; its optimizer
(`optim`) keeps state for and steps that slice alone (ZeRO-1), and the second half, the
all-gather of the updated slices, runs after the step, hidden behind the next forward
(Megatron-LM's distributed optimizer with ``--overlap-grad-reduce --overlap-param-gather``).

Where the data goes, per bucket (`layout.BucketShard`):

    backward     `pack`: each gradient / N into the bucket's flat buffer (padded to a multiple
                 of N; the model's ``.grad`` is released, the buffer holds it now)
                 `launch`: reduce-scatter (gloo: all-to-all + local sum, `collectives`)
    finish()     `reduced`: this rank's mean slice -> ``grad``, the ``.grad`` of the optimizer's
                 piece tensors (views of it)
    step()       a pre-hook takes in parameters written since the last gather (`adopt_edits`);
                 the optimizer updates ``master``; a post-hook launches the all-gathers (`step_done`)
    forward      a pre-hook on the first module that reads a bucket waits for it (`param_waits`,
                 `wait_bucket`); the parameters are views of the gathered buffer, so the
                 gather wrote them in place (`layout`)

Between the step and the next forward the parameters are stale; whatever reads them there
(`wait_for_params`; ``state_dict`` does it by itself; the Trainer for callbacks and
``compute_loss``) must wait first.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from hfstream import streams
from .. import faults
from . import collectives, optim as shard_optim, state as shard_state
from ..bucket_state import BucketState, Phase
from ..eager import ModelHook
from .param_waits import ForwardWaits
from ..reduction import Reduction, Wiring, check_dense
from .layout import BucketShard, slices_of


class ShardedReduction(Reduction):
    """The sharded strategy: both halves, the sharded optimizer's hooks, the forward's waits.

    Args:
        wiring: what GradSync shares (`reduction.Wiring`).

    Attributes:
        optimizer: the sharded optimizer, once `shard_optimizer` was called (None before).
        waits: where forwards wait for the gathers (`param_waits.ForwardWaits`).
    """

    tune_whole_step = True   # the cap changes the forward's waits and the bucket-by-bucket step too
    # What is left after backward is the last bucket's reduce-scatter: a small one keeps that
    # tail short (DDP's small first bucket, at the other end). 1 MiB, as DDP's first.
    last_bucket_mb = 1.0

    def __init__(self, wiring: Wiring):
        super().__init__(wiring)   # self.states: the current plan's buckets, each with its `BucketShard`
        # gloo: the reduce-scatter is an all-to-all plus a local sum (`collectives.reduces_locally`).
        self.local_sum = wiring.group is not None and collectives.reduces_locally(wiring.group)
        self.optimizer: torch.optim.Optimizer | None = None   # the ZeRO-1 optimizer, once `attach` ran
        self.group_of: list[int] = []   # per hooked parameter: its optimizer param group
        self._index = {id(p): i for i, (_, p) in enumerate(wiring.hooked)}   # id(parameter) -> hooked position
        self._bucket_of: list[BucketState] = []   # per hooked parameter: its bucket now
        self.waits = ForwardWaits(wiring.model, wiring.hooked, self._wait_indices, wiring.note)   # the forward's waits
        self._handles: list = []   # the optimizer's and the model's hooks, removed by close()
        self.closed = False   # after close(): a second train() re-cuts the optimizer it sharded
        self._stepped_groups = None   # the param groups, while a pipelined step left them empty
        self._bucket_groups: list = []   # per bucket: its pieces per param group (`_install`)
        self._unhooked: list = []   # (name, parameter) the optimizer holds but GradSync does not hook (`attach`)
        self._outside: list = []    # every parameter of the model GradSync does not hook (`attach`; the clip)
        # A further backward of the same step (FGM, two losses) adds its mean to the slices' mean
        # instead of replacing it, as .grad accumulates in stock; the Trainer sets it after the
        # step's first backward. _carried: bucket index -> the slice's mean before that backward.
        self.accumulate = False
        self._carried: dict[int, torch.Tensor] = {}
        # [Note: unused under sharded] Which parameters some rank used this step, OR-ed over the
        # ranks on the host (`collectives.host_group`: no device waits): one that no rank used keeps
        # its pieces' .grad None and is not stepped, as DDP(find_unused_parameters=True) leaves it.
        self._flags_group = (collectives.host_group(wiring.group, wiring.note)
                             if wiring.group is not None and wiring.world_size > 1 else None)
        self._flags = None   # (the step's flags all-reduce in flight, its tensor)
        self._used_before: list[bool] | None = None   # the flags a carrying backward adds to
        self._unused: set[int] = set()   # id() of the parameters no rank used in the step just reduced

    @property
    def attached(self) -> bool:
        return self.optimizer is not None

    @property
    def params_pending(self) -> list[int]:
        return [st.plan.index for st in self.states if st.phase is Phase.GATHERING]

    # -- set up -----------------------------------------------------------------------------------
    def planned(self, states, previous) -> None:
        if previous is not None:
            for st in reversed(previous):
                self.wait_bucket(st)
        self.states = states
        self._bucket_of = [None] * len(self.wiring.hooked)
        for st in states:
            for p in st.params:
                self._bucket_of[self._index[id(p)]] = st
        if self.attached:
            if previous is None:
                self._build()
            else:
                self._rebuild(previous)
            self._install()
            for st in states:
                self._set_grads(st)

    def _build(self) -> None:
        w = self.wiring
        for st in self.states:
            self._shard(st)
            st.shard.refresh()

    def _rebuild(self, previous: list[BucketState]) -> None:
        """A re-plan: the old layout's slices and state move to the new one, one bucket at a time.

        [Note: a re-plan holds one layout] Each layout is about a model's worth of gathered
        parameters plus this rank's slices and state; building the new one whole while the old
        one is alive would need that twice at every arrival-order re-plan and every
        ``bucket_mb="auto"`` candidate. So the new buckets are cut first without buffers
        (`layout.slices_of`), each old bucket's gradient slices and optimizer state move to
        the new pieces (held per piece, the same bytes) and the old bucket is freed at once, its
        parameters back in storage of their own (`BucketShard.release`); then the new buckets
        are built one by one, each taking its parameters into its gathered buffer and freeing
        their own storage. The peak is one layout plus about one bucket (tests/test_replan_peak.py).
        """
        w = self.wiring
        for group in self.optimizer.param_groups:
            group["params"] = []   # the old pieces (views of the old masters) go with their buckets
        self._bucket_groups = []
        cuts = [(st.params, slices_of([p.numel() for p in st.params], w.world_size, w.rank)[2]) for st in self.states]
        grads, state = shard_state.carry_over(self.optimizer, previous, cuts, w.group, w.world_size, self._retire)
        for j, st in enumerate(self.states):
            sh = self._shard(st)
            sh.refresh()
            for k, (pc, t) in enumerate(zip(sh.pieces, sh.tensors)):
                if (j, k) in grads:
                    sh.grad[pc.start:pc.end] = grads.pop((j, k))
                if (j, k) in state:
                    self.optimizer.state[t] = state.pop((j, k))

    def _shard(self, st: BucketState) -> BucketShard:
        """A bucket's shard (`layout.BucketShard`) and its wire buffer, the padded layout of the bucket.

        The buffer's padding is zero and stays zero: packing writes the parameters' views only.
        """
        w = self.wiring
        sh = st.shard = BucketShard(st, w.world_size, w.rank, self.local_sum)
        st.buffer = torch.zeros(sh.size * w.world_size, dtype=st.wire_dtype, device=st.plan.device)
        st.views = [st.buffer[o:o + n].view(p.shape) for o, n, p in zip(sh.offsets, sh.numels, st.params)]
        return sh

    def release(self, states: list[BucketState]) -> None:
        super().release(states)
        for st in states:
            if st.shard is not None:
                st.shard.received = None   # a compressed wire's receive buffer

    @staticmethod
    def _retire(st: BucketState) -> None:
        """An old bucket whose slices and state have moved: free its buffers (its parameters keep their values)."""
        st.shard.release()
        st.shard, st.buffer, st.views = None, None, []

    def shard_optimizer(self, optimizer, mode: str):
        return shard_optim.shard_optimizer(self, optimizer)

    def attach(self, optimizer, group_of: list[int], whole: dict | None = None) -> None:
        """Shard ``optimizer`` (checked by `optim`): pieces, its param groups, the hooks, its state.

        ``whole``: state it had before (the unsharded form), cut into this rank's pieces.
        """
        self.optimizer, self.group_of = optimizer, group_of
        names = {id(p): n for n, p in self.wiring.model.named_parameters()}
        # Parameters the optimizer was given that GradSync does not hook (frozen when it was built):
        # the sharded optimizer holds no piece of them (`_say_unhooked_gradients`).
        self._unhooked = [(names[id(p)], p) for group in optimizer.param_groups for p in group["params"]
                          if id(p) not in self._index and id(p) in names]
        self._outside = [p for p in self.wiring.model.parameters() if id(p) not in self._index]
        self._build()
        self._install()
        w = self.wiring
        self._handles += [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
            # Checkpoints in the whole, layout-free form load by themselves (`state`).
            optimizer.register_state_dict_post_hook(lambda _opt, sd: shard_state.mark_local(sd, self._layout())),
            optimizer.register_load_state_dict_pre_hook(
                lambda opt, sd: shard_state.whole_to_local(opt, sd, self.states, self._layout())),
        ]
        model = self.waits.inner
        # Whatever reads or replaces the parameters between a step and the next forward.
        self._handles += [model.register_state_dict_pre_hook(ModelHook(lambda *_: self.wait_for_params())),
                          model.register_load_state_dict_pre_hook(ModelHook(lambda *_: self.wait_for_params())),
                          model.register_load_state_dict_post_hook(ModelHook(lambda *_: self.refresh()))]
        self.waits.watch()
        w.recorder.record_gathers()   # each step's stats carry the previous step's gathers
        if whole is not None:
            optimizer.load_state_dict(whole)

    def _layout(self) -> dict:
        return shard_state.layout(self.wiring.rank, self.wiring.world_size, self.states)

    def _group(self, p) -> int:
        return self.group_of[self._index[id(p)]]

    def _install(self) -> None:
        """The optimizer's groups on this rank's pieces, and each bucket's share of them (the pipelined step's)."""
        shard_optim.install(self.optimizer, self.states, self._group)
        n = len(self.optimizer.param_groups)
        self._bucket_groups = [shard_optim.pieces_by_group(n, [st], self._group) for st in self.states]

    def refresh(self) -> None:
        """The parameters were replaced (``load_state_dict``): take this rank's slices from them again."""
        for st in self.states:
            if st.shard is not None:
                st.shard.refresh()

    # -- the first half: gradients ------------------------------------------------------------------
    def forward_started(self) -> None:
        if not self.attached:
            raise RuntimeError(
                "GradSync(mode='sharded'): call optimizer = sync.shard_optimizer(optimizer) before the first "
                "training forward: each rank keeps only its slice of the mean gradient, which only the "
                "sharded optimizer can step")

    def grad_ready(self, st: BucketState, slot: int) -> None:
        if st.phase is Phase.GATHERING:   # a gradient of a value the forward read before its gather landed
            raise RuntimeError(
                f"GradSync(mode='sharded'): parameter {st.plan.names[slot]!r} got a gradient, but the forward "
                f"read it before its all-gather (bucket {st.plan.index}) was waited for, i.e. a value the gather may "
                f"not have written yet (the previous step's, or part of this one's). The forward waits in the pre-hook of the module that first read it in the first "
                f"step; code that reads it elsewhere first must call sync.wait_for_params() before")

    def prepare(self, st: BucketState) -> None:
        self.forward_started()
        self.wait_bucket(st)   # a bucket no forward used: its gather lands before its next reduce-scatter

    @torch.no_grad()
    def pack(self, st: BucketState, stream) -> None:
        n = self.wiring.world_size
        for slot, (p, dst) in enumerate(zip(st.params, st.views)):
            grad = p.grad
            if grad is None:
                dst.zero_()
                continue
            check_dense(grad, st, slot)
            if stream is not None:
                streams.record_stream(grad, stream)   # freed below while the side stream may still read it
            torch.div(grad, n, out=dst)
            # The buffer holds it now, and the mean comes back as the pieces' .grad; the model's own
            # .grad would otherwise keep accumulating and hold a second copy of every gradient.
            p.grad = None

    def launch(self, st: BucketState):
        sh = st.shard
        if self.accumulate:
            self._carried[st.plan.index] = sh.grad.clone()   # the collective writes sh.grad (or received, then it)
        out = sh.received if (self.local_sum or sh.received is not None) else sh.grad
        work = collectives.launch_reduce_scatter(st.buffer, out, self.wiring.group, self.local_sum)
        if st is self.states[-1] and self._flags_group is not None:
            self._launch_flags()   # launched in plan order: every parameter's flag is final now
        return work

    def _launch_flags(self) -> None:
        used = [u for st in self.states for u in st.used]
        if self.accumulate and self._used_before is not None:   # a further backward of the step
            used = [a or b for a, b in zip(used, self._used_before)]
        # Host bytes, reduced in place on the host group (the tensor is a view of them): on an
        # accelerator nothing here touches the device, and reading them back reads no tensor.
        flags = bytearray(used)
        t = torch.frombuffer(flags, dtype=torch.uint8)
        self._flags = (dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._flags_group, async_op=True), flags)

    @torch.no_grad()
    def all_reduced(self, ok: bool) -> None:
        flags, self._flags = self._flags, None
        if not ok or flags is None:
            return
        work, reduced = flags
        work.wait()
        used = self._used_before = [bool(u) for u in reduced]
        params = [p for st in self.states for p in st.params]
        self._unused = {id(p) for p, u in zip(params, used) if not u}
        for st in self.states:
            self._set_grads(st)

    def _set_grads(self, st: BucketState) -> None:
        """The pieces' ``.grad`` from the slices, None for what no rank used in the step just reduced."""
        st.shard.set_grads(frozenset(slot for slot, p in enumerate(st.params) if id(p) in self._unused))

    @torch.no_grad()
    def reduced(self, st: BucketState) -> None:
        sh = st.shard
        if self.local_sum:
            collectives.sum_received(sh.received, sh.grad, self.wiring.world_size)
        elif sh.received is not None:
            sh.grad.copy_(sh.received)   # back from a compressed wire
        carried = self._carried.pop(st.plan.index, None)
        if carried is not None:
            sh.grad.add_(carried)
        sh.set_grads()

    # -- between the halves: the optimizer ---------------------------------------------------------
    def adopt_edits(self) -> None:
        """Before ``step()``: parameters written since their last gather (a callback, an EMA swap-in) are kept."""
        for st in self.states:
            edited = st.shard.edited()
            if edited:
                st.shard.refresh(edited)

    def clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite, foreach) -> torch.Tensor:
        if not self.attached:
            if self.wiring.world_size > 1:
                raise RuntimeError("GradSync(mode='sharded').clip_grad_norm_() needs the sharded optimizer: call "
                                   "sync.shard_optimizer(optimizer) first, then finish() after backward")
            return super().clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)
        tensors, owners = [], []   # each piece, and which parameter it is part of (stock's norm is per parameter)
        for st in self.states:
            for pc, t in zip(st.shard.pieces, st.shard.tensors):
                p = st.params[pc.slot]
                tensors.append(t)
                owners.append((self._index[id(p)], pc.param_start == 0 and pc.param_end == p.numel()))
        # A parameter unfrozen since the optimizer was sharded: this rank's own gradient, as in stock's norm.
        return shard_optim.clip_grad_norm_(tensors, owners, len(self.wiring.hooked), self.wiring.group, max_norm,
                                           norm_type, error_if_nonfinite, foreach,
                                           self.states[0].plan.device if self.states else None, self._outside)

    @torch.no_grad()
    def grad_norms(self) -> dict[str, torch.Tensor]:
        """Each parameter's mean-gradient norm from the pieces: one all-reduce of a vector of squares."""
        if not self.attached:
            return super().grad_norms()
        names = [n for n, _ in self.wiring.hooked]
        device = self.states[0].plan.device if self.states else torch.device("cpu")
        squares = torch.zeros(len(names), dtype=torch.float64, device=device)
        has = torch.zeros(len(names), dtype=torch.float64, device=device)
        for st in self.states:
            for pc, t in zip(st.shard.pieces, st.shard.tensors):
                if t.grad is not None:
                    i = self._index[id(st.params[pc.slot])]
                    squares[i] += t.grad.double().pow(2).sum()
                    has[i] = 1
        both = torch.stack([squares, has])
        dist.all_reduce(both, group=self.wiring.group)
        has_any = both[1].tolist()   # one host read, not one per parameter
        return {n: both[0, i].sqrt().to(self.wiring.hooked[i][1].dtype) for i, n in enumerate(names) if has_any[i] > 0}

    @torch.no_grad()
    def gather_gradients(self) -> None:
        """Every parameter's ``.grad`` = the whole mean gradient, from all ranks' slices (a collective).

        After ``finish()`` a bucket's wire buffer is free until the next backward packs into it, so
        the whole gradient lands there and ``.grad`` are views of it, as DDP's
        ``gradient_as_bucket_view``: no memory beyond what backward already holds. Only a compressed
        wire's buffer (another dtype) needs one of its own. A parameter no rank used keeps None.
        """
        for st in self.states:
            sh = st.shard
            in_place = st.buffer is not None and st.buffer.dtype == sh.grad.dtype
            whole = (st.buffer if in_place else
                     torch.empty(sh.size * self.wiring.world_size, dtype=sh.grad.dtype, device=sh.grad.device))
            collectives.launch_all_gather(whole, sh.grad, self.wiring.group).wait()
            for slot, (p, o, n) in enumerate(zip(st.params, sh.offsets, sh.numels)):
                if not p.requires_grad or id(p) in self._unused:
                    p.grad = None
                else:
                    p.grad = st.views[slot] if in_place else whole[o:o + n].view(p.shape).clone()

    @torch.no_grad()
    def scatter_gradients(self) -> None:
        """This rank's slices back from ``.grad`` (a callback may have changed it), which is released."""
        for st in self.states:
            sh = st.shard
            for pc in sh.pieces:
                g = st.params[pc.slot].grad
                if g is not None:
                    sh.grad[pc.start:pc.end].copy_(g.reshape(-1)[pc.param_start:pc.param_end])
            for p in st.params:
                p.grad = None

    def optimizer_state_dict(self, keep: bool = True) -> dict | None:
        if not self.attached or self.wiring.world_size == 1:
            return super().optimizer_state_dict(keep)
        self.wait_for_params()
        return shard_state.optimizer_state_dict(self.optimizer, self.states, self.wiring.group,
                                                self.wiring.world_size, keep)

    # -- the second half: parameters ----------------------------------------------------------------
    def _say_unhooked_gradients(self) -> None:
        """Said once: a parameter frozen when the optimizer was sharded has a gradient now (unfrozen mid-run)."""
        thawed = [n for n, p in self._unhooked if p.grad is not None]
        if thawed:
            self.wiring.note(
                f"GradSync(mode='sharded'): {', '.join(thawed[:4])}{' ...' if len(thawed) > 4 else ''} "
                f"{'was' if len(thawed) == 1 else 'were'} frozen when the optimizer was sharded and now "
                f"{'has a gradient' if len(thawed) == 1 else 'have gradients'} (unfrozen during train()): the sharded "
                f"optimizer holds slices of the parameters trainable then only, so these are not stepped. (DDP "
                f"steps them with each rank's own gradient, not averaged, and the replicas drift apart.) Unfreeze "
                f"before train() (a new train() hooks and shards them), or use grad_sync='overlap' for DDP's behaviour")

    def _before_step(self, optimizer, args, kwargs) -> None:
        """The step's pre-hook: keep edits, then step bucket by bucket, each gather launched at once.

        [Note: pipelined step] The optimizer's own ``step()`` runs after its pre-hooks. Here it
        is run first, once per bucket in forward order, on that bucket's pieces only (the
        class's step without the hooks: ``__wrapped__``), and each bucket's all-gather is
        launched as soon as its pieces are updated, so the gathers overlap the rest of the
        step. The step proper then finds empty param groups; the post-hook puts them back. For
        an elementwise optimizer (the only kind `optim` accepts) stepping the pieces in
        several calls is the same arithmetic as in one (tested: equal parameters). With a
        closure the step runs in one call and the gathers follow it.
        """
        self.adopt_edits()
        self.waits.place()
        if self._unhooked:
            self._say_unhooked_gradients()
        # A step pre-hook gets the wrapper's own args, the optimizer first (torch's
        # ``profile_hook_step``): the closure, when passed positionally, is the second.
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        step = getattr(type(optimizer).step, "__wrapped__", None)
        if closure is not None or step is None:
            return
        groups = [g["params"] for g in optimizer.param_groups]
        try:
            for st, split in zip(reversed(self.states), reversed(self._bucket_groups)):
                self.wait_bucket(st)   # two steps without a forward between them
                for group, params in zip(optimizer.param_groups, split):
                    group["params"] = params
                step(optimizer)
                self._launch_gather(st)
        except BaseException:
            for group, params in zip(optimizer.param_groups, groups):
                group["params"] = params
            raise
        self._stepped_groups = groups
        for group in optimizer.param_groups:
            group["params"] = []

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self._stepped_groups is None:
            return self.step_done()
        for group, params in zip(optimizer.param_groups, self._stepped_groups):
            group["params"] = params
        self._stepped_groups = None

    def step_done(self) -> None:
        """After a one-call ``optimizer.step()``: launch every bucket's all-gather, in forward order."""
        self.waits.place()
        for st in reversed(self.states):
            self.wait_bucket(st)   # two steps without a forward between them
            self._launch_gather(st)

    def _launch_gather(self, st: BucketState) -> None:
        recorder, device, sh = self.wiring.recorder, st.plan.device, st.shard
        sh.timing = recorder.gather_launching(st.plan.index, device, events=device in self.wiring.comm_streams)
        sh.gather = collectives.launch_all_gather(sh.gathered, sh.master, self.wiring.group)
        st.move(Phase.GATHERING)
        recorder.gather_launched(sh.timing, sh.gather)

    def _wait_indices(self, indices: list[int], module) -> None:
        # A training forward's wait is the step's all-gather exposed time; an evaluation's is not.
        for i in indices:
            self.wait_bucket(self._bucket_of[i], exposed=module.training)

    def wait_bucket(self, st: BucketState, exposed: bool = False) -> None:
        """Wait for ``st``'s all-gather (if any); its parameters then hold the gathered values.

        ``exposed``: the forward waits here, so the wait is what the step report shows as
        all-gather exposed time (host time, or the compute stream's stall from events).
        """
        if st.phase is not Phase.GATHERING:
            return
        sh, w = st.shard, self.wiring
        work, sh.gather = sh.gather, None
        recorder, device = w.recorder, st.plan.device
        entered = recorder.wait_entered(device, events=device in w.comm_streams) if exposed else None
        try:
            if faults.backend_enforces_timeout(w.group):
                work.wait()
            elif work.wait(timeout=datetime.timedelta(seconds=w.timeout_s)) is False:
                raise RuntimeError(f"no result within timeout={w.timeout_s:.0f} s")
        except Exception as exc:
            w.abandoned.append((sh.gathered, work))   # may still write there: keep it alive
            raise RuntimeError(
                f"GradSync(mode='sharded') rank {w.rank}: the all-gather of bucket {st.plan.index} "
                f"(parameters {', '.join(st.plan.names[:6])}) did not complete: a peer rank died, stopped, or did "
                f"not call optimizer.step() on its sharded optimizer; these parameters hold the previous step's "
                f"values, or some of this step's where the gather got that far. Underlying error: {exc}") from exc
        if entered is not None:
            recorder.wait_left(device, entered)
        sh.timing.waited = True
        sh.write_back()
        st.move(Phase.COLLECTING)

    def wait_for_params(self) -> None:
        """Wait for every pending all-gather, in forward order: the model is then complete and current."""
        for st in reversed(self.states):
            self.wait_bucket(st)

    def close(self) -> None:
        """Remove the hooks; the model is left with its updated parameters (pending gathers are waited for),
        each in storage of its own again (`BucketShard.release`)."""
        if not self.wiring.abandoned:
            self.wait_for_params()
        for st in self.states:
            if st.shard is not None:
                st.shard.release()
        self.waits.close()
        self.closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
