"""The sharded optimizer and global-norm clipping for ``GradSync(mode="sharded")``.

`shard_optimizer` converts an optimizer built normally over the model's parameters so that it
holds this rank's pieces (`shard_layout`) instead: the same object, class, hyperparameters and
param groups (weight decay and per-group learning rates keep working, an LR scheduler built on
it before or after keeps working), but its parameters are flat piece tensors, one per part of a
parameter in this rank's slice, so its state is about 1/N of the unsharded optimizer's.
Converting in place rather than constructing a new instance avoids guessing each optimizer
class's constructor arguments from its ``defaults``.

Only an optimizer whose update is elementwise gives the unsharded result on pieces: one that
looks at a parameter's shape (Adafactor factors its second moment by rows and columns) or at
all of it (LAMB's trust ratio, Muon's orthogonalisation) is refused by name (`ELEMENTWISE`); an
optimizer of one's own is accepted once its class declares ``hfstream_elementwise = True``.

`clip_grad_norm_` gives the result of ``torch.nn.utils.clip_grad_norm_`` on the full mean
gradient from the slices, computed as stock computes it: one norm per parameter (taken whole,
in the gradient's dtype, by the rank whose slice holds the whole parameter), one all-reduce of
that vector, then the norm of the vector in the model's parameter order; the same coefficient
on every rank.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist

from . import shard_state

# The torch optimizers whose update of an element reads only that element's gradient and state
# (a subclass counts: transformers and PEFT subclass these without changing the update).
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD,
               torch.optim.Adadelta)

# The class attribute a user's optimizer sets to declare its update elementwise (`check_elementwise`).
DECLARATION = "hfstream_elementwise"


def declared_elementwise(optimizer) -> bool:
    """Whether ``optimizer``'s update is elementwise: as its class declares it, else a torch one listed above.

    A declaration wins both ways: a subclass of a listed optimizer whose own step is not
    elementwise says ``hfstream_elementwise = False`` and is refused.
    """
    declared = getattr(type(optimizer), DECLARATION, None)
    if declared is not None:
        return declared is True
    return isinstance(optimizer, ELEMENTWISE)


def check_elementwise(optimizer) -> None:
    """Refuse, by its class name, an optimizer whose update is not known to be elementwise.

    An optimizer of one's own (Lion, say) is sharded once its class declares it:
    ``class Lion(torch.optim.Optimizer): hfstream_elementwise = True``. Schedule-free optimizers
    (``train()``/``eval()`` swap the model's weights for another sequence) are refused even so:
    the swap writes the parameters the optimizer holds, which under sharded are this rank's
    pieces, not the model's weights.
    """
    name = type(optimizer).__name__
    if callable(getattr(optimizer, "train", None)) and callable(getattr(optimizer, "eval", None)):
        raise ValueError(
            f"grad_sync='sharded' cannot shard {name}: its train()/eval() swap the weights between two sequences "
            f"(schedule-free), and under sharded the parameters it holds are this rank's flat pieces, not the "
            f"model's weights, so evaluation would not see the averaged ones. Use grad_sync='overlap' with {name}")
    if declared_elementwise(optimizer):
        return
    raise ValueError(
        f"grad_sync='sharded' cannot shard {name}: each rank steps flat pieces of the parameters, which gives the "
        f"unsharded result only for an optimizer whose update of an element reads only that element's gradient "
        f"and state ({', '.join(c.__name__ for c in ELEMENTWISE)}, or a class that declares it). If {name}'s "
        f"update is elementwise (Lion is; Adafactor, LAMB, Shampoo and Muon look at a whole parameter and are "
        f"not), declare it on the class: {name}.{DECLARATION} = True. Otherwise use grad_sync='overlap' (the "
        f"same backward overlap, whole gradients on every rank)")


# Optimizers already sharded, and by which strategy (weakly: nothing is kept alive here).
_SHARDED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, object]" = weakref.WeakKeyDictionary()


def check_optimizer(hooked, model, optimizer) -> list[int]:
    """Refuse an optimizer that cannot be sharded correctly; return each hooked parameter's group index.

    Raises:
        TypeError: not a ``torch.optim.Optimizer``.
        ValueError: its update is not elementwise, a parameter is not the model's, or a
            trainable parameter of the model is missing.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_elementwise(optimizer)
    named = {id(p): n for n, p in model.named_parameters()}
    hooked_index = {id(p): i for i, (_, p) in enumerate(hooked)}
    group_of = [None] * len(hooked)
    for g, group in enumerate(optimizer.param_groups):
        for k, p in enumerate(group["params"]):
            if id(p) not in named:
                raise ValueError(f"optimizer.param_groups[{g}]['params'][{k}] (shape {tuple(p.shape)}) is not a parameter "
                                 f"of the model this GradSync hooks; build the optimizer over model.parameters() "
                                 f"(or a selection of them)")
            if id(p) in hooked_index:
                group_of[hooked_index[id(p)]] = g
    missing = [name for (name, _), g in zip(hooked, group_of) if g is None]
    if missing:
        raise ValueError(f"the optimizer does not optimize trainable parameter(s) {', '.join(missing[:6])}"
                         f"{' ...' if len(missing) > 6 else ''}; add them to a param group, or freeze them with "
                         f"requires_grad_(False) before constructing GradSync")
    return group_of


def shard_optimizer(reduction, optimizer):
    """``GradSync.shard_optimizer``: check, shard in place (world size > 1), return the optimizer."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    previous = _SHARDED.get(optimizer)
    if previous is not None and not getattr(previous, "closed", False):
        raise RuntimeError(f"this {type(optimizer).__name__} is already sharded; call shard_optimizer() once, on an "
                           f"optimizer built over model.parameters(), and use what it returns")
    wiring = reduction.wiring
    whole = None
    if previous is not None and previous.attached:
        # A second train(): the state the closed GradSync's layout holds, whole, then cut anew.
        whole = shard_state.optimizer_state_dict(optimizer, previous.states, wiring.group, wiring.world_size,
                                                 keep=True, device=None)
        shard_state.restore_groups(optimizer)
        optimizer.state.clear()
    group_of = check_optimizer(wiring.hooked, wiring.model, optimizer)
    _SHARDED[optimizer] = reduction
    if wiring.world_size == 1:   # nothing to shard, nothing to pay
        if whole is not None:
            optimizer.load_state_dict(whole)
        return optimizer
    if whole is None and any(state for state in optimizer.state.values()):
        whole = optimizer.state_dict()   # state from construction (Adagrad) or a load: cut it, do not drop it
        optimizer.state.clear()
    shard_state.remember_groups(optimizer)
    reduction.attach(optimizer, group_of, whole)
    return optimizer


def pieces_by_group(num_groups: int, states, group_of) -> list[list[torch.Tensor]]:
    """This rank's piece tensors of ``states``, per param group, in bucket order (``group_of(p)``: ``p``'s group)."""
    per_group = [[] for _ in range(num_groups)]
    for st in states:
        for pc, t in zip(st.shard.pieces, st.shard.tensors):
            per_group[group_of(st.params[pc.slot])].append(t)
    return per_group


def install(optimizer, states, group_of) -> None:
    """Point every param group at this rank's piece tensors of that group, in bucket order.

    A group may be empty on a rank whose slices hold none of its elements; the groups stay, in
    order, so schedulers and per-group settings line up on every rank.
    """
    for group, params in zip(optimizer.param_groups, pieces_by_group(len(optimizer.param_groups), states, group_of)):
        group["params"] = params


def check_norm_type(norm_type) -> float:
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"norm_type={norm_type!r} is not valid; give a p > 0 (2.0 = Euclidean) or float('inf')")
    return norm_type


@torch.no_grad()
def clip_grad_norm_(tensors, owners, n_params: int, group, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None, device=None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over every rank's piece tensors (each element in exactly one).

    Args:
        tensors: this rank's piece tensors; their ``.grad`` are its slices of the mean gradient.
        owners: for each tensor, ``(i, whole)``: its parameter's position in the model's parameter
            order (the same on every rank) and whether the piece holds all of that parameter.
        n_params: how many parameters ``i`` ranges over (the same on every rank).
        group: the process group the slices are spread over.

    Stock takes each parameter's norm (``_foreach_norm``, in the gradient's dtype), stacks them in
    parameter order and takes the norm of that. A parameter whole in one piece gets exactly that
    per-parameter norm here; one cut between pieces (a bucket's slice boundary) gets its norm from
    float64 partial sums, rounded once: it can differ from stock's in the last bit, and only then
    can the coefficient.
    """
    norm_type = check_norm_type(norm_type)
    kept = [(t, i, whole) for t, (i, whole) in zip(tensors, owners) if t.grad is not None]
    device = kept[0][0].device if kept else (device or torch.device("cpu"))
    dtype = kept[0][0].grad.dtype if kept else torch.float32
    if math.isinf(norm_type):   # a max is exact in any order and dtype
        grads = [t.grad for t, _, _ in kept if t.grad.numel()]
        total = (torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float64)).max() if grads
                 else torch.zeros((), dtype=torch.float64, device=device)).to(device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        # Rows: a whole parameter's norm, or a cut one's sum of |g|^p over this rank's pieces; whether
        # the parameter is whole somewhere; whether it has a gradient. One all-reduce (SUM) of it all.
        table = torch.zeros(3, n_params, dtype=torch.float64, device=device)
        whole = [(t.grad, i) for t, i, w in kept if w]
        cut = [(t.grad, i) for t, i, w in kept if not w and t.grad.numel()]
        if whole:   # as stock: each parameter's norm in its gradient's dtype
            index = torch.tensor([i for _, i in whole], device=device)
            norms = torch._foreach_norm([g for g, _ in whole], norm_type)
            table[0].index_add_(0, index, torch.stack(norms).to(device, torch.float64))
            table[1].index_fill_(0, index, 1.0)
        if cut:
            index = torch.tensor([i for _, i in cut], device=device)
            norms = torch._foreach_norm([g for g, _ in cut], norm_type, dtype=torch.float64)
            table[0].index_add_(0, index, torch.stack(norms).to(device).pow(norm_type))
        if kept:
            table[2].index_fill_(0, torch.tensor([i for _, i, _ in kept], device=device), 1.0)
        dist.all_reduce(table, group=group)
        per_param = torch.where(table[1] > 0, table[0], table[0].pow(1.0 / norm_type))[table[2] > 0]
        total = torch.linalg.vector_norm(per_param.to(dtype), norm_type)
    total = total.to(dtype)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be "
                           f"clipped. To disable this error and scale the gradients by the non-finite norm "
                           f"anyway, set error_if_nonfinite=False")
    if kept:
        torch.nn.utils.clip_grads_with_norm_([t for t, _, _ in kept], max_norm, total, foreach)
    return total
