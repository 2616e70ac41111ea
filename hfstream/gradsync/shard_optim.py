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
on every rank. How the state outlives a layout (a re-plan, a checkpoint, another process count):
`shard_state`.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist

from . import shard_state

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
        shard_state.remember_groups(optimizer)
        sync._sharded.attach(optimizer, group_of)
        # Checkpoints in the whole, layout-free form load by themselves (shard_state).
        sync._sharded._handles += [
            optimizer.register_state_dict_post_hook(lambda _opt, sd: shard_state.mark_local(sync, sd)),
            optimizer.register_load_state_dict_pre_hook(lambda opt, sd: shard_state.whole_to_local(sync, opt, sd)),
        ]
    return optimizer


def release(optimizer) -> None:
    """Forget that ``optimizer`` was sharded (it was put back on the model's parameters)."""
    _SHARDED.pop(optimizer, None)


def install(optimizer, states) -> None:
    """Point every param group at this rank's shard tensors of that group, in bucket order.

    A group may be empty on a rank whose slices hold none of its elements; the groups stay, in
    order, so schedulers and per-group settings line up on every rank.
    """
    for g, group in enumerate(optimizer.param_groups):
        group["params"] = [t for st in states for gg, t in st.shard.tensors if gg == g]


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
    dtype = tensors[0].grad.dtype if tensors else torch.float32
    # Partial sums in float64: how the gradient is cut into slices (bucket cap, re-plan, process
    # count) then changes the norm far below float32's last bit, so a resumed run, whose layout
    # may differ from the uninterrupted one's, clips with the same coefficient.
    grads = [t.grad for t in tensors]
    if math.isinf(norm_type):
        local = (torch.stack([g.abs().max().to(torch.float64) for g in grads if g.numel()]).max()
                 if any(g.numel() for g in grads) else torch.zeros((), dtype=torch.float64, device=device))
        total = local.to(device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=sync.process_group)
    else:
        total = (torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) for g in grads]).pow(norm_type).sum()
                 if grads else torch.zeros((), dtype=torch.float64)).to(device)   # each element once: slices partition
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=sync.process_group)
        total = total.pow(1.0 / norm_type)
    total = total.to(dtype)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be "
                           f"clipped. To disable this error and scale the gradients by the non-finite norm "
                           f"anyway, set error_if_nonfinite=False")
    if tensors:
        torch.nn.utils.clip_grads_with_norm_(tensors, max_norm, total, foreach)
    return total
