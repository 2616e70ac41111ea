"""The sharded optimizer and global-norm clipping for ``GradSync(mode="sharded")``.

`shard_optimizer` converts an optimizer built normally over the model's parameters so that it
holds this rank's pieces (`layout`) instead: the same object, class, hyperparameters and
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
that vector, then the norm of the vector grouped by dtype as stock groups it; the same
coefficient on every rank, and no host sync in a steady step (`_ClipPlan`).
"""

from __future__ import annotations

import functools
import math
import weakref

import torch
import torch.distributed as dist
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from . import state as shard_state

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


# The dtypes a parameter's norm can have, by code (0: no gradient). The code crosses ranks in the
# clip's table: it is how a rank learns the dtype of a parameter it holds no piece of.
NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Where torch's norm of a reduced-precision gradient accumulates before it is rounded to the gradient's dtype.
_ACCUMULATES_IN = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


class _ClipPlan:
    """The clip's index tensors for one set of pieces (one layout) and stock's grouping of the norms.

    [Note: the clip without host syncs] The clip runs every step (the Trainer clips at
    ``max_grad_norm=1.0`` by default), so none of it may make the host wait for the device: the
    index tensors are built here once and stay on the device, and a step is ``index_add_`` and
    ``index_select`` on them. A boolean mask would need a ``nonzero``, a list made into a tensor a
    copy from pageable memory, each a host sync on an accelerator (tests/test_host_syncs.py).

    Stock (``torch.nn.utils.clip_grad_norm_``) takes each norm in its gradient's dtype, groups the
    norms by dtype as ``_group_tensors_by_device_and_dtype`` orders them and stacks them in the
    promoted dtype. That needs every parameter's gradient dtype, and a rank sees only those of the
    pieces it holds, so the plan's first step reads them once from the table every rank reduced
    (`learn`, the plan's one host read). A parameter frozen or unfrozen later, that this rank holds
    no piece of, changes the table but not this rank's pieces: the step sees it on the device and
    takes the norm of every parameter with a gradient in float64 instead of in stock's order.

    Args:
        tensors, owners, n_params: as `clip_grad_norm_` gets them.
        device: where the pieces (and the table) are.
    """

    def __init__(self, tensors, owners, n_params: int, device: torch.device):
        self.device = device
        self.kept = [k for k, t in enumerate(tensors) if t.grad is not None]   # pieces with a gradient
        by_dtype: dict[torch.dtype, list[int]] = {}
        for k in self.kept:
            if owners[k][1]:
                by_dtype.setdefault(tensors[k].grad.dtype, []).append(k)
        # Whole parameters: one fused norm per dtype, in the gradient's dtype (stock's own call).
        self.whole = [self._indexed(positions, owners) for positions in by_dtype.values()]
        # Cut parameters: each piece's norm in float64, summed over ranks as |g|^p.
        self.cut = self._indexed([k for k in self.kept if not owners[k][1] and tensors[k].numel()], owners)
        self.every = self._indexed([k for k in self.kept if tensors[k].numel()], owners)   # the inf norm's
        # What this rank adds to the table's other rows, the same every step: whether it holds the
        # parameter whole, its norm dtype's code, and that it holds a piece with a gradient.
        flags = [[0.0] * n_params for _ in range(3)]
        for k in self.kept:
            i, whole = owners[k]
            flags[0][i], flags[1][i], flags[2][i] = float(whole), float(_code(tensors[k].grad.dtype, i)), 1.0
        self.flags = torch.tensor(flags, dtype=torch.float64, device=device)
        self.groups: list[tuple[torch.dtype, torch.Tensor]] | None = None   # stock's groups, once learned
        self.dtype = torch.float32       # the promoted dtype the norm is taken in (stock's empty norm: float32)
        self.codes: torch.Tensor | None = None   # per parameter, the code the groups were learned from

    def _indexed(self, positions: list[int], owners) -> tuple[list[int], torch.Tensor]:
        return positions, torch.tensor([owners[k][0] for k in positions], dtype=torch.long, device=self.device)

    def local_norms(self, tensors, norm_type: float) -> torch.Tensor:
        """Per parameter, this rank's part: a whole one's norm, a cut one's sum of |g|^p (inf: its max)."""
        values = torch.zeros(self.flags.shape[1], dtype=torch.float64, device=self.device)
        if math.isinf(norm_type):   # a max is exact in any dtype
            positions, index = self.every
            if positions:
                norms = torch._foreach_norm([tensors[k].grad for k in positions], norm_type, dtype=torch.float64)
                values.scatter_reduce_(0, index, torch.stack(norms), "amax")
            return values
        for positions, index in self.whole:
            norms = torch._foreach_norm([tensors[k].grad for k in positions], norm_type)
            values.index_add_(0, index, torch.stack(norms).to(torch.float64))
        positions, index = self.cut
        if positions:
            norms = torch._foreach_norm([tensors[k].grad for k in positions], norm_type, dtype=torch.float64)
            values.index_add_(0, index, torch.stack(norms).pow(norm_type))
        return values

    def learn(self, codes: torch.Tensor) -> None:
        """Stock's groups and dtype from every parameter's code (the plan's one host read)."""
        present = [(i, NORM_DTYPES[int(c) - 1]) for i, c in enumerate(codes.tolist()) if c > 0]
        # torch's own grouping, on empty stand-ins of the same dtypes in the same order: its
        # dict's order is not the order of first appearance, and the sum's order is the norm's rounding.
        stand_ins = [torch.empty(0, dtype=d, device=self.device) for _, d in present]
        grouped = _group_tensors_by_device_and_dtype([stand_ins], with_indices=True)
        self.groups = [(d, torch.tensor([present[k][0] for k in positions], dtype=torch.long, device=self.device))
                       for (_, d), (_, positions) in grouped.items()]
        if self.groups:
            self.dtype = functools.reduce(torch.promote_types, [d for d, _ in self.groups])
        self.codes = codes

    def total_norm(self, table: torch.Tensor, norm_type: float) -> torch.Tensor:
        """The norm of every rank's gradients from the reduced table: stock's arithmetic, on the device."""
        codes = table[2] / table[3].clamp(min=1)   # summed over the ranks holding a piece: code * count
        norms = table[0]   # inf: each parameter's max; else a whole one's norm, a cut one's sum of |g|^p
        if not math.isinf(norm_type):
            norms = torch.where(table[1] > 0, norms, norms.pow(1.0 / norm_type))
        if self.groups is None:
            self.learn(codes)
        # Each norm rounded as stock's: a cut one, exact in float64, first to where torch accumulates.
        parts = [norms.index_select(0, index).to(_ACCUMULATES_IN.get(d, d)).to(d).to(self.dtype)
                 for d, index in self.groups]
        total = (torch.linalg.vector_norm(torch.cat(parts), norm_type) if parts
                 else torch.zeros((), dtype=self.dtype, device=self.device))
        # Which parameters have a gradient changed since `learn` (see the class's note): all of them, in float64.
        now = torch.where(codes > 0, norms, 0.0)
        anyway = now.amax() if math.isinf(norm_type) else now.pow(norm_type).sum().pow(1.0 / norm_type)
        return torch.where((codes != self.codes).any(), anyway.to(self.dtype), total)


def _code(dtype: torch.dtype, i: int) -> int:
    if dtype not in NORM_DTYPES:
        raise ValueError(f"clip_grad_norm_ under grad_sync='sharded' takes norms of {', '.join(map(str, NORM_DTYPES))} "
                         f"gradients; parameter {i} has a {dtype} gradient. Use grad_sync='overlap' for it")
    return NORM_DTYPES.index(dtype) + 1


# Plans by this rank's pieces (`_plan_for`); a few, for a re-plan that goes back to a layout (bucket_mb="auto").
_PLANS: dict[tuple, _ClipPlan] = {}
_PLANS_KEPT = 8


def _plan_for(tensors, owners, n_params: int, device) -> _ClipPlan:
    """This rank's plan for these pieces, built on first use (a host read there, none in later steps)."""
    key = (tuple(owners), tuple(None if t.grad is None else t.grad.dtype for t in tensors), n_params, device)
    plan = _PLANS.get(key)
    if plan is None:
        while len(_PLANS) >= _PLANS_KEPT:
            del _PLANS[next(iter(_PLANS))]
        plan = _PLANS[key] = _ClipPlan(tensors, owners, n_params, device)
    return plan


@torch.no_grad()
def clip_grad_norm_(tensors, owners, n_params: int, group, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None, device=None,
                    local=()) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over every rank's piece tensors (each element in exactly one).

    Args:
        tensors: this rank's piece tensors; their ``.grad`` are its slices of the mean gradient.
        owners: for each tensor, ``(i, whole)``: its parameter's position in the model's parameter
            order (the same on every rank) and whether the piece holds all of that parameter.
        n_params: how many parameters ``i`` ranges over (the same on every rank).
        group: the process group the slices are spread over.
        local: parameters outside the slices whose ``.grad`` this rank counts and clips as its own
            (unfrozen after the optimizer was sharded: DDP never reduces them either, so stock's
            norm counts each rank's own gradient). Combined in the norm's last step: the rounding
            can differ from stock's in the last bit.

    Stock takes each parameter's norm (``_foreach_norm``, in the gradient's dtype), stacks them
    grouped by dtype in the promoted dtype and takes the norm of that. A parameter whole in one
    piece gets exactly that per-parameter norm here; one cut between pieces (a bucket's slice
    boundary) gets its norm from float64 partial sums, rounded as torch rounds its own (through
    float32 to a bfloat16 or float16 gradient's dtype): it can differ from stock's in the last bit,
    and only then can the coefficient. One all-reduce; no host sync after a plan's first step
    (`_ClipPlan`) unless ``error_if_nonfinite``, which reads the norm as stock does.
    """
    norm_type = check_norm_type(norm_type)
    grads = [t.grad for t in tensors if t.grad is not None]
    device = grads[0].device if grads else (device or torch.device("cpu"))
    if n_params == 0:   # the same on every rank: nothing to reduce
        return torch.zeros((), device=device)
    plan = _plan_for(tensors, owners, n_params, device)
    # Rows: each parameter's norm (or sum of |g|^p, or max), then the plan's flags (`_ClipPlan`).
    table = torch.cat([plan.local_norms(tensors, norm_type)[None], plan.flags])
    dist.all_reduce(table, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group)
    total = plan.total_norm(table, norm_type)
    own = [p for p in local if p.grad is not None]
    if own:
        norms = [n.to(device) for n in torch._foreach_norm([p.grad for p in own], norm_type)]
        dtype = functools.reduce(torch.promote_types, [n.dtype for n in norms], total.dtype)
        total = torch.linalg.vector_norm(torch.stack([total.to(dtype)] + [n.to(dtype) for n in norms]), norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):   # a host read, as in stock
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be "
                           f"clipped. To disable this error and scale the gradients by the non-finite norm "
                           f"anyway, set error_if_nonfinite=False")
    if plan.kept:
        torch.nn.utils.clip_grads_with_norm_([tensors[k] for k in plan.kept], max_norm, total, foreach)
    if own:
        torch.nn.utils.clip_grads_with_norm_(own, max_norm, total.to(own[0].grad.device), foreach)
    return total
