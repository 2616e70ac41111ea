"""The sharded optimizer and global-norm clipping for ``GradSync(mode="sharded")``.

`shard_optimizer` converts an optimizer built normally over the model's parameters so that it
holds this rank's slices (`sharded.BucketShard`) instead: the same object, class,
hyperparameters and param groups (weight decay and per-group learning rates keep working, an
LR scheduler built on it before or after keeps working), but its parameters are flat shard
tensors, one per (bucket, group) present in this rank's slice, so its state is about 1/N of
the unsharded optimizer's. Converting in place rather than constructing a new instance avoids
guessing each optimizer class's constructor arguments from its ``defaults``.

`clip_grad_norm_` gives the result of ``torch.nn.utils.clip_grad_norm_`` on the full mean
gradient from the slices: each rank's local norm, one scalar all-reduce, the same coefficient
on every rank. `carry_over` moves gradients and optimizer state to new slices when the buckets
are re-planned (the first step's arrival order, ``bucket_mb="auto"``).
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist

from . import collectives

# Optimizers already sharded, and by which GradSync (weakly: the registry keeps nothing alive).
_SHARDED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, str]" = weakref.WeakKeyDictionary()


def check_optimizer(sync, optimizer) -> list[int]:
    """Refuse an optimizer that cannot be sharded correctly; return each hooked parameter's group index.

    Raises:
        TypeError: not a ``torch.optim.Optimizer``.
        RuntimeError: already sharded, or it has state (it stepped): sharding it would lose that state.
        ValueError: the GradSync is not ``mode="sharded"``, a parameter is not the model's, or a
            trainable parameter of the model is missing.
    """
    if sync.mode != "sharded":
        raise ValueError(f"shard_optimizer() needs GradSync(model, mode='sharded'); this GradSync has "
                         f"mode={sync.mode!r}, which all-reduces full gradients: step the optimizer as it is")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if optimizer in _SHARDED:
        raise RuntimeError(f"this {type(optimizer).__name__} is already sharded (by {_SHARDED[optimizer]}); call "
                           f"shard_optimizer() once, on an optimizer built over model.parameters(), and use what it returns")
    if any(state for state in optimizer.state.values()):
        raise RuntimeError(f"this {type(optimizer).__name__} has state already (it has stepped): sharding it would "
                           f"drop that state. Call sync.shard_optimizer(optimizer) right after building the "
                           f"optimizer, before its first optimizer.step()")
    named = dict((id(p), n) for n, p in sync.model.named_parameters())
    hooked = {id(p): i for i, (_, p) in enumerate(sync._named)}
    group_of = [None] * len(sync._named)
    for g, group in enumerate(optimizer.param_groups):
        for k, p in enumerate(group["params"]):
            if id(p) not in named:
                raise ValueError(f"optimizer.param_groups[{g}]['params'][{k}] (shape {tuple(p.shape)}) is not a parameter "
                                 f"of the model this GradSync hooks; build the optimizer over model.parameters() "
                                 f"(or a selection of them)")
            if id(p) in hooked:
                group_of[hooked[id(p)]] = g
    missing = [name for (name, _), g in zip(sync._named, group_of) if g is None]
    if missing:
        raise ValueError(f"the optimizer does not optimize trainable parameter(s) {', '.join(missing[:6])}"
                         f"{' ...' if len(missing) > 6 else ''}; add them to a param group, or freeze them with "
                         f"requires_grad_(False) before constructing GradSync")
    return group_of


def shard_optimizer(sync, optimizer):
    """``GradSync.shard_optimizer``: check, shard in place (world size > 1), return the optimizer."""
    group_of = check_optimizer(sync, optimizer)
    _SHARDED[optimizer] = repr(sync)
    if sync._sharded is not None:   # None with one process: nothing to shard, nothing to pay
        sync._sharded.attach(optimizer, group_of)
    return optimizer


def install(optimizer, states) -> None:
    """Point every param group at this rank's shard tensors of that group, in bucket order.

    A group may be empty on a rank whose slices hold none of its elements; the groups stay, in
    order, so schedulers and per-group settings line up on every rank.
    """
    for g, group in enumerate(optimizer.param_groups):
        group["params"] = [t for st in states for gg, t in st.shard.tensors if gg == g]


@torch.no_grad()
def carry_over(optimizer, old_states, new_states, named, group, world_size: int) -> None:
    """Move the gradient slices and the optimizer's state from the old buckets' slices to the new ones.

    Collectives (every rank calls it at the same step, between steps): per state key, the old
    slices are all-gathered into whole parameters and cut into the new slices. Per-element state
    is a tensor shaped like its shard tensor (momentum, exp_avg, ...); anything else ("step") is
    the same for every shard tensor and is copied.
    """
    old_tensors = [t for st in old_states for _, t in st.shard.tensors]
    per_element, scalars = {}, {}   # per_element: key -> {parameter dtype: state dtype}
    for t in old_tensors:
        for k, v in optimizer.state.get(t, {}).items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape == t.shape:
                per_element.setdefault(k, {})[t.dtype] = v.dtype
            else:
                scalars.setdefault(k, v)
    # A rank may hold no state (all its slices are padding): agree on the keys, dtypes and scalars.
    views = [None] * world_size
    dist.all_gather_object(views, (per_element, {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in scalars.items()}),
                           group=group)
    for keys, values in views:
        for k, dtypes in keys.items():
            per_element[k] = {**dtypes, **per_element.get(k, {})}
        for k, v in values.items():
            scalars.setdefault(k, v)
    index = {id(p): i for i, (_, p) in enumerate(named)}

    def move(dtype_of, old_slice, assign) -> None:
        # Buckets hold one dtype each; a parameter's old and new bucket have the same one.
        whole = {}
        for st in old_states:
            sh = st.shard
            gathered = torch.empty(sh.size * world_size, dtype=dtype_of(st), device=sh.master.device)
            collectives.launch_all_gather(gathered, old_slice(st), group).wait()
            for o, p in zip(sh.offsets, sh.params):
                whole[index[id(p)]] = gathered[o:o + p.numel()]
        for st in new_states:
            sh = st.shard
            new = torch.zeros(sh.size, dtype=dtype_of(st), device=sh.master.device)
            for o, p in zip(sh.offsets, sh.params):
                a, b = max(o, sh.lo), min(o + p.numel(), sh.lo + sh.size)
                if b > a:
                    new[a - sh.lo:b - sh.lo] = whole[index[id(p)]][a - o:b - o]
            assign(st, new)

    move(lambda st: st.shard.grad.dtype, lambda st: st.shard.grad, lambda st, new: st.shard.grad.copy_(new))
    for key, dtypes in sorted(per_element.items()):
        def dtype_of(st, dtypes=dtypes):
            return dtypes.get(st.plan.dtype, st.plan.dtype)

        def old_slice(st, key=key, dtype_of=dtype_of):
            out = torch.zeros(st.shard.size, dtype=dtype_of(st), device=st.shard.master.device)
            for (_, t), (_, a, b) in zip(st.shard.tensors, st.shard.pieces):
                if key in optimizer.state.get(t, {}):
                    out[a:b] = optimizer.state[t][key]
            return out

        def assign(st, new, key=key):
            for (_, t), (_, a, b) in zip(st.shard.tensors, st.shard.pieces):
                optimizer.state[t][key] = new[a:b].clone()
        move(dtype_of, old_slice, assign)
    for t in old_tensors:
        optimizer.state.pop(t, None)
    for st in new_states:
        for _, t in st.shard.tensors:
            for k, v in scalars.items():   # a rank that held no state gets them from a peer, on the CPU
                optimizer.state[t][k] = v.clone() if torch.is_tensor(v) else v


@torch.no_grad()
def clip_grad_norm_(sync, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """``GradSync.clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_`` over all ranks' slices."""
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"norm_type={norm_type!r} is not valid; give a p > 0 (2.0 = Euclidean) or float('inf')")
    sharded = sync._sharded
    if sharded is None:   # one process, or an unsharded mode: the gradients are whole on every rank
        return torch.nn.utils.clip_grad_norm_([p for _, p in sync._named], max_norm, norm_type,
                                              error_if_nonfinite, foreach)
    if not sharded.attached:
        raise RuntimeError("GradSync(mode='sharded').clip_grad_norm_() needs the sharded optimizer: call "
                           "sync.shard_optimizer(optimizer) first, then finish() after backward")
    tensors = [t for st in sync._states for _, t in st.shard.tensors if t.grad is not None]
    device = tensors[0].device if tensors else sync._agree_device
    if tensors:
        local = torch.nn.utils.get_total_norm([t.grad for t in tensors], norm_type, False, foreach).to(device)
    else:
        local = torch.zeros((), device=device)
    local = local.to(torch.float32) if local.dtype not in (torch.float32, torch.float64) else local
    if math.isinf(norm_type):
        total = local.clone()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=sync.process_group)
    else:
        total = local.pow(norm_type)   # each element counted once: the slices partition the gradient
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=sync.process_group)
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be "
                           f"clipped. To disable this error and scale the gradients by the non-finite norm "
                           f"anyway, set error_if_nonfinite=False")
    if tensors:
        torch.nn.utils.clip_grads_with_norm_(tensors, max_norm, total, foreach)
    return total
