"""Sharded mode's buckets: reduce-scatter gradients in backward, all-gather parameters after the step.

An all-reduce is a reduce-scatter followed by an all-gather of the same bytes. ``GradSync(model,
mode="sharded")`` launches only the first half from the gradient hooks, so each rank ends
``finish()`` holding the mean gradient of its own 1/N slice of every bucket; its optimizer
(`shard_optim`) keeps state for and steps that slice alone (ZeRO-1), and the second half, the
all-gather of the updated slices, runs after the step, hidden behind the next forward
(Megatron-LM's distributed optimizer with ``--overlap-grad-reduce --overlap-param-gather``).

Where the data goes, per bucket (`BucketShard`):

    backward     GradSync._pack: each gradient / N into the bucket's flat buffer (padded to a
                 multiple of N; the model's ``.grad`` is released, the buffer holds it now)
                 launch: reduce-scatter (gloo: all-to-all + local sum, `collectives`)
    finish()     `reduced`: this rank's mean slice -> ``grad``, the ``.grad`` of the optimizer's
                 shard tensors (views of it)
    step()       the optimizer updates ``master`` (its shard tensors are views of it);
                 `step_done` launches the all-gathers of the ``master`` slices, in forward order
    forward      a pre-hook on each module that owns a bucket's parameters waits for that
                 bucket and copies the gathered values into the parameters (`wait_bucket`)

Within a bucket the parameters are laid out by optimizer param group (then in plan order), so
a rank's slice holds at most one contiguous run per group: one shard tensor per (bucket,
group). Padding belongs to no shard tensor: it is never stepped, clipped or counted.
"""

from __future__ import annotations

import datetime
import functools

import torch

from . import collectives, faults, shard_optim, shard_state


class BucketShard:
    """One bucket in sharded mode: its padded layout, this rank's slice, and the buffers both halves use.

    Args:
        st: the bucket's run-time state (GradSync's ``_BucketState``); its ``buffer`` and
            ``views`` are replaced by the padded layout.
        group_of: the optimizer param group of each of ``st.params``.
        world_size, rank: the data-parallel group's size and this rank's place in it.
        local_sum: the reduce-scatter is an all-to-all plus a local sum (gloo).

    Attributes:
        offsets: where each parameter starts in the flat layout.
        size: elements per rank (the padded bucket is ``world_size * size``).
        pieces: ``(group, start, end)`` of this rank's slice, one per group present in it.
        tensors: ``(group, tensor)`` the optimizer steps: views of ``master``, with ``.grad``
            views of ``grad``.
        gather: the all-gather in flight, until `write_back` (None otherwise).
        timing: that gather's times for the step report (`stats.StatsRecorder.gather_launching`).
    """

    def __init__(self, st, group_of: list[int], world_size: int, rank: int, local_sum: bool):
        self.params = st.params
        dtype, device, wire = st.plan.dtype, st.plan.device, st.wire_dtype
        order = sorted(range(len(st.params)), key=lambda s: (group_of[s], s))
        self.offsets, spans, offset = [0] * len(st.params), {}, 0
        for s in order:
            self.offsets[s] = offset
            offset += st.params[s].numel()
            spans.setdefault(group_of[s], [self.offsets[s], offset])[1] = offset
        self.size = -(-offset // world_size)
        padded, lo = self.size * world_size, rank * self.size
        self.lo = lo
        self.pieces = [(g, max(a, lo) - lo, min(b, lo + self.size) - lo) for g, (a, b) in spans.items()
                       if min(b, lo + self.size) > max(a, lo)]
        # Padding is zero and stays zero: _pack writes the parameters' views only.
        st.buffer = torch.zeros(padded, dtype=wire, device=device)
        st.views = [st.buffer[o:o + p.numel()].view(p.shape) for o, p in zip(self.offsets, st.params)]
        st.flags = None   # no "used" flags: an unused parameter's slice simply gets a zero mean
        self.grad = torch.zeros(self.size, dtype=dtype, device=device)
        self.master = torch.zeros(self.size, dtype=dtype, device=device)
        if local_sum:
            self.received = torch.empty(padded, dtype=wire, device=device)
        else:
            self.received = torch.empty(self.size, dtype=wire, device=device) if wire != dtype else None
        # Between finish() and the next launch the gradient buffer is idle: the gather reuses it
        # (the launch waits for a gather still writing there first, `ShardedBuckets.ready_to_pack`).
        self.gathered = st.buffer if wire == dtype else torch.empty(padded, dtype=dtype, device=device)
        self.param_views = [self.gathered[o:o + p.numel()].view(p.shape) for o, p in zip(self.offsets, st.params)]
        self.tensors = []
        for g, a, b in self.pieces:
            t = self.master[a:b].detach().requires_grad_()   # a leaf the optimizer updates in place
            self.tensors.append((g, t))
        self.gather = None
        self.timing = None   # the gather's launch/completion times (`stats`)

    @torch.no_grad()
    def refresh(self) -> None:
        """``master`` = this rank's slice of the parameters as they are now."""
        hi = self.lo + self.size
        for o, p in zip(self.offsets, self.params):
            a, b = max(o, self.lo), min(o + p.numel(), hi)
            if b > a:
                self.master[a - self.lo:b - self.lo].copy_(p.detach().reshape(-1)[a - o:b - o])

    def set_grads(self) -> None:
        for (_, t), (_, a, b) in zip(self.tensors, self.pieces):
            t.grad = self.grad[a:b]

    @torch.no_grad()
    def write_back(self) -> None:
        torch._foreach_copy_(list(self.params), self.param_views)


class ShardedBuckets:
    """Drives `BucketShard`s for one GradSync: attach an optimizer, both halves, the waits.

    GradSync calls in at a few points (``_on_forward``, ``_on_grad_ready``, ``_launch``,
    ``_pack``, ``_unpack``, ``_replan``, ``close``); `shard_optim` converts the optimizer.

    Args:
        sync: the GradSync (``mode="sharded"``, world size > 1).
    """

    def __init__(self, sync):
        self.sync = sync
        self.local_sum = collectives.reduces_locally(sync.process_group)
        self.optimizer = None
        self.group_of: list[int] = []   # per hooked parameter (GradSync._named): its optimizer param group
        self._handles: list = []

    @property
    def attached(self) -> bool:
        return self.optimizer is not None

    @property
    def pending(self) -> list[int]:
        """Buckets whose updated parameters are not in the model yet (all-gather not waited for)."""
        return [st.plan.index for st in self.sync._states if st.shard is not None and st.shard.gather is not None]

    # -- set up -----------------------------------------------------------------------------------
    def attach(self, optimizer, group_of: list[int]) -> None:
        """Shard ``optimizer`` (already checked by `shard_optim`): slices, its param groups, the hooks."""
        self.optimizer, self.group_of = optimizer, group_of
        self._build(self.sync._states)
        shard_optim.install(optimizer, self.sync._states)
        self._handles.append(optimizer.register_step_post_hook(lambda *_: self.step_done()))
        self._hook_modules()
        self.sync._recorder.record_gathers()   # each step's stats carry the previous step's gathers

    def _build(self, states) -> None:
        index = {id(p): i for i, (_, p) in enumerate(self.sync._named)}
        for st in states:
            groups = [self.group_of[index[id(p)]] for p in st.params]
            st.shard = BucketShard(st, groups, self.sync.world_size, self.sync.rank, self.local_sum)
            st.shard.refresh()

    def _hook_modules(self) -> None:
        # A pre-hook on each module that owns hooked parameters (recurse=False: where they are
        # used) waits for their buckets only; modules run in forward order, so the forward
        # overlaps the gathers of the layers after it. A tied parameter hooks both owners.
        index = {id(p): i for i, (_, p) in enumerate(self.sync._named)}
        model = self.sync.model
        for module in model.modules():
            mine = sorted({index[id(p)] for p in module.parameters(recurse=False) if id(p) in index})
            if mine:
                self._handles.append(module.register_forward_pre_hook(functools.partial(self._before_forward, mine)))
        # Whatever reads or replaces the parameters between a step and the next forward.
        self._handles.append(model.register_state_dict_pre_hook(lambda *_: self.wait_for_params()))
        self._handles.append(model.register_load_state_dict_pre_hook(lambda *_: self.wait_for_params()))
        self._handles.append(model.register_load_state_dict_post_hook(lambda *_: self.refresh()))

    def rebuilt(self, old_states) -> None:
        """After a re-plan (between steps, gathers waited): new slices; gradients and optimizer state move along."""
        self._build(self.sync._states)
        shard_state.carry_over(self.optimizer, old_states, self.sync._states, self.sync._named,
                               self.sync.process_group, self.sync.world_size)
        shard_optim.install(self.optimizer, self.sync._states)
        for st in self.sync._states:
            st.shard.set_grads()

    def refresh(self) -> None:
        """The parameters were replaced (``load_state_dict``): take this rank's slices from them again."""
        for st in self.sync._states:
            if st.shard is not None:
                st.shard.refresh()

    # -- the first half: gradients ------------------------------------------------------------------
    def forward_started(self) -> None:
        if not self.attached:
            raise RuntimeError(
                "GradSync(mode='sharded'): call optimizer = sync.shard_optimizer(optimizer) before the first "
                "training forward: each rank keeps only its slice of the mean gradient, which only the "
                "sharded optimizer can step")

    def check_current(self, st, slot: int) -> None:
        """A gradient for a parameter whose update never reached the model: the forward read a stale value."""
        if st.shard is not None and st.shard.gather is not None:
            raise RuntimeError(
                f"GradSync(mode='sharded'): parameter {st.plan.names[slot]!r} got a gradient, but the forward "
                f"read it before its all-gather (bucket {st.plan.index}) was waited for, i.e. the value of the "
                f"previous step. Parameters are waited for in the forward pre-hook of the module that owns them; "
                f"code that uses another module's parameter must call sync.wait_for_params() before the forward")

    def ready_to_pack(self, st) -> None:
        self.forward_started()
        self.wait_bucket(st)   # its gather writes into the buffer the gradients go to (no forward used it)

    @staticmethod
    def packed(st) -> None:
        # The bucket's buffer holds the gradients now, and the mean comes back as the shard tensors'
        # .grad; the model's own .grad would otherwise keep accumulating (the sharded optimizer's
        # zero_grad() never sees it) and hold a second copy of every gradient.
        for p in st.params:
            p.grad = None

    def launch(self, st):
        sh = st.shard
        out = sh.received if (self.local_sum or sh.received is not None) else sh.grad
        return collectives.launch_reduce_scatter(st.buffer, out, self.sync.process_group, self.local_sum)

    @torch.no_grad()
    def reduced(self, st) -> None:
        sh = st.shard
        if self.local_sum:
            collectives.sum_received(sh.received, sh.grad, self.sync.world_size)
        elif sh.received is not None:
            sh.grad.copy_(sh.received)   # back from a compressed wire
        sh.set_grads()

    # -- the second half: parameters ----------------------------------------------------------------
    def step_done(self) -> None:
        """After ``optimizer.step()``: launch every bucket's all-gather, in forward order (reverse plan)."""
        recorder = self.sync._recorder
        for st in reversed(self.sync._states):
            self.wait_bucket(st)   # two steps without a forward between them
            device = st.plan.device
            sh = st.shard
            sh.timing = recorder.gather_launching(st.plan.index, device, events=device in self.sync._streams)
            sh.gather = collectives.launch_all_gather(sh.gathered, sh.master, self.sync.process_group)
            recorder.gather_launched(sh.timing, sh.gather)

    def _before_forward(self, indices: list[int], module, _args) -> None:
        # A training forward's wait is the step's all-gather exposed time; an evaluation's is not.
        for i in indices:
            self.wait_bucket(self.sync._where[i][0], exposed=module.training)

    def wait_bucket(self, st, exposed: bool = False) -> None:
        """Wait for ``st``'s all-gather (if any) and copy the gathered values into its parameters.

        ``exposed``: the forward waits here (a pre-hook), so the wait is what the step report
        shows as all-gather exposed time (host time, or the compute stream's stall from events).
        """
        sh = st.shard
        if sh is None or sh.gather is None:
            return
        work, sh.gather = sh.gather, None
        timeout_s = self.sync.timeout_s
        recorder, device = self.sync._recorder, st.plan.device
        entered = recorder.wait_entered(device, events=device in self.sync._streams) if exposed else None
        try:
            if faults.backend_enforces_timeout(self.sync.process_group):
                work.wait()
            elif work.wait(timeout=datetime.timedelta(seconds=timeout_s)) is False:
                raise RuntimeError(f"no result within timeout={timeout_s:.0f} s")
        except Exception as exc:
            self.sync._abandoned.append((sh.gathered, work))   # may still write there: keep it alive
            raise RuntimeError(
                f"GradSync(mode='sharded') rank {self.sync.rank}: the all-gather of bucket {st.plan.index} "
                f"(parameters {', '.join(st.plan.names[:6])}) did not complete: a peer rank died, stopped, or did "
                f"not call optimizer.step() on its sharded optimizer; the model holds the previous step's values "
                f"for these parameters. Underlying error: {exc}") from exc
        if entered is not None:
            recorder.wait_left(device, entered)
        sh.timing.waited = True
        sh.write_back()

    def wait_for_params(self) -> None:
        """Wait for every pending all-gather, in forward order: the model is then complete and current."""
        for st in reversed(self.sync._states):
            self.wait_bucket(st)

    def close(self) -> None:
        """Remove the hooks; the model is left with its updated parameters (pending gathers are waited for)."""
        if not self.sync.broken:
            self.wait_for_params()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
