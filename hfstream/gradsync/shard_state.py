"""The sharded optimizer's state across layouts: a re-plan, a checkpoint, another process count.

A sharded optimizer's state is cut by the bucket layout: each shard tensor is one rank's piece of
one bucket, so its state means nothing under another plan, rank or world size. Everything that
must outlive a layout goes through the *whole* form instead, per model parameter, which is the
format ``torch.optim.Optimizer.state_dict()`` of the unsharded optimizer has:

    optimizer_state_dict   every rank's slices gathered, bucket by bucket, into the unsharded
                           optimizer's state dict (a collective; kept where asked, on the CPU)
    whole_to_local         that dict (or a stock Trainer's optimizer.pt) cut into this rank's
                           shard tensors: the sharded optimizer's ``load_state_dict`` does it by
                           itself (a load pre-hook), so ``resume_from_checkpoint`` needs no change
    carry_over             a re-plan's move of gradient slices and state to the new slices

A checkpoint is therefore layout-free: resumed on another process count, with another bucket cap,
or by the stock Trainer, it loads the same. The local form (``optimizer.state_dict()`` of a sharded
optimizer) is marked with the layout it belongs to and loads only into that layout.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from . import collectives

LOCAL_KEY = "hfstream_shard"   # marks a local (sharded) state dict with the layout it belongs to

# The param groups each sharded optimizer was built with (model parameters), for the whole form.
_ORIGINAL: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[list[torch.Tensor]]]" = weakref.WeakKeyDictionary()


def remember_groups(optimizer) -> None:
    _ORIGINAL[optimizer] = [list(group["params"]) for group in optimizer.param_groups]


def original_groups(optimizer) -> list[list[torch.Tensor]]:
    return _ORIGINAL[optimizer]


def _per_element(key, value, shape) -> bool:
    """State shaped like its tensor (momentum, exp_avg); anything else ("step") is shared by all."""
    return torch.is_tensor(value) and value.shape == shape and (len(shape) > 0 or key != "step")


def _agree_on_keys(optimizer, states, group, world_size) -> tuple[dict, dict]:
    """Per-element keys (with their dtypes per parameter dtype) and scalar state, the same on every rank.

    A collective: a rank may hold no state at all (all its slices are padding).
    """
    per_element, scalars = {}, {}
    for st in states:
        for _, t in st.shard.tensors:
            for k, v in optimizer.state.get(t, {}).items():
                if _per_element(k, v, t.shape):
                    per_element.setdefault(k, {})[t.dtype] = v.dtype
                else:
                    scalars.setdefault(k, v)
    views = [None] * world_size
    dist.all_gather_object(views, (per_element, {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in scalars.items()}),
                           group=group)
    for keys, values in views:
        for k, dtypes in keys.items():
            per_element[k] = {**dtypes, **per_element.get(k, {})}
        for k, v in values.items():
            scalars.setdefault(k, v)
    return per_element, scalars


def _local_slice(optimizer, st, key, dtype) -> torch.Tensor:
    """This rank's slice of bucket ``st`` for state ``key`` (zeros where a shard tensor has none)."""
    sh = st.shard
    out = torch.zeros(sh.size, dtype=dtype, device=sh.master.device)
    for (_, t), (_, a, b) in zip(sh.tensors, sh.pieces):
        if key in optimizer.state.get(t, {}):
            out[a:b] = optimizer.state[t][key]
    return out


def _gather(sh, mine, group, world_size) -> torch.Tensor:
    whole = torch.empty(sh.size * world_size, dtype=mine.dtype, device=mine.device)
    collectives.launch_all_gather(whole, mine, group).wait()
    return whole


def _sliced(sh) -> list[tuple[int, int, torch.Tensor, int, int]]:
    """Where each parameter of ``sh`` falls in this rank's slice: (start, end, parameter, start, end in it)."""
    windows = []
    hi = sh.lo + sh.size
    for o, p in zip(sh.offsets, sh.params):
        a, b = max(o, sh.lo), min(o + p.numel(), hi)
        if b > a:
            windows.append((a - sh.lo, b - sh.lo, p, a - o, b - o))
    return windows


# -- a re-plan -----------------------------------------------------------------------------------------
@torch.no_grad()
def carry_over(optimizer, old_states, new_states, named, group, world_size: int) -> None:
    """Move the gradient slices and the optimizer's state from the old buckets' slices to the new ones.

    Collectives (every rank calls it at the same step, between steps): per state key, each old
    bucket's slices are all-gathered and the parts every new slice needs are copied out, one old
    bucket at a time (so at most one whole bucket per key is in memory). Per-element state is a
    tensor shaped like its shard tensor; anything else ("step") is the same for every shard tensor.
    """
    per_element, scalars = _agree_on_keys(optimizer, old_states, group, world_size)
    new_windows = [(st, _sliced(st.shard)) for st in new_states]
    position = {}   # parameter -> [(new state, start in its slice, start in the parameter, length)]
    for st, windows in new_windows:
        for a, b, p, pa, pb in windows:
            position.setdefault(id(p), []).append((st, a, pa, b - a))

    def move(dtype_of, old_slice, new_buffers) -> None:
        for st in old_states:
            sh = st.shard
            whole = _gather(sh, old_slice(st).to(dtype_of(st)), group, world_size)
            for o, p in zip(sh.offsets, sh.params):
                for new_st, a, pa, n in position.get(id(p), []):
                    new_buffers[id(new_st)][a:a + n] = whole[o + pa:o + pa + n]

    grads = {id(st): torch.zeros(st.shard.size, dtype=st.shard.grad.dtype, device=st.shard.grad.device)
             for st in new_states}
    move(lambda st: st.shard.grad.dtype, lambda st: st.shard.grad, grads)
    for st in new_states:
        st.shard.grad.copy_(grads[id(st)])
    old_tensors = [t for st in old_states for _, t in st.shard.tensors]
    for key, dtypes in sorted(per_element.items()):
        def dtype_of(st, dtypes=dtypes):
            return dtypes.get(st.plan.dtype, st.plan.dtype)

        buffers = {id(st): torch.zeros(st.shard.size, dtype=dtype_of(st), device=st.shard.master.device)
                   for st in new_states}
        move(dtype_of, lambda st, key=key, dtype_of=dtype_of: _local_slice(optimizer, st, key, dtype_of(st)), buffers)
        for st in new_states:
            for (_, t), (_, a, b) in zip(st.shard.tensors, st.shard.pieces):
                optimizer.state[t][key] = buffers[id(st)][a:b].clone()
    for t in old_tensors:
        optimizer.state.pop(t, None)
    for st in new_states:
        for _, t in st.shard.tensors:
            for k, v in scalars.items():   # a rank that held no state gets them from a peer, on the CPU
                optimizer.state[t][k] = v.clone() if torch.is_tensor(v) else v


# -- the whole form: checkpoints -------------------------------------------------------------------
@torch.no_grad()
def optimizer_state_dict(sync, keep: bool = True, group=None, device: str | None = "cpu") -> dict | None:
    """The unsharded optimizer's ``state_dict()``, from every rank's slices (a collective).

    Every rank must call it; ranks with ``keep=False`` drop each gathered bucket at once (the
    Trainer keeps it on the rank that saves). Tensors come back on ``device`` (None: where they are).
    """
    sharded = sync._sharded
    optimizer, states = sharded.optimizer, sync._states
    group = group if group is not None else sync.process_group
    sync.wait_for_params()
    per_element, scalars = _agree_on_keys(optimizer, states, group, sync.world_size)
    whole: dict[int, dict] = {}
    for key, dtypes in sorted(per_element.items()):
        for st in states:
            sh = st.shard
            dtype = dtypes.get(st.plan.dtype, st.plan.dtype)
            gathered = _gather(sh, _local_slice(optimizer, st, key, dtype), group, sync.world_size)
            if keep:
                for o, p in zip(sh.offsets, sh.params):
                    piece = gathered[o:o + p.numel()].view(p.shape)
                    whole.setdefault(id(p), {})[key] = (piece.to(device) if device else piece).clone()
    if not keep:
        return None
    state, groups, pid = {}, [], 0
    for group, params in zip(optimizer.param_groups, original_groups(optimizer)):
        ids = []
        for p in params:
            if id(p) in whole:
                state[pid] = {**{k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()}, **whole[id(p)]}
            ids.append(pid)
            pid += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def layout(sync) -> dict:
    """What a local state dict belongs to: this rank, the world size and the bucket plan."""
    return {"rank": sync.rank, "world_size": sync.world_size, "buckets": [list(b.names) for b in sync.buckets]}


def mark_local(sync, state_dict: dict) -> dict:
    """``optimizer.state_dict()`` post-hook: the local form says which layout it belongs to."""
    state_dict[LOCAL_KEY] = layout(sync)
    return state_dict


def whole_to_local(sync, optimizer, state_dict: dict) -> dict:
    """``optimizer.load_state_dict()`` pre-hook: the whole form cut into this rank's shard tensors.

    A local form passes through if it belongs to the current layout, and is refused otherwise.
    """
    if LOCAL_KEY in state_dict:
        saved, now = state_dict[LOCAL_KEY], layout(sync)
        if saved != now:
            raise ValueError(
                f"this optimizer state dict is one rank's shard (rank {saved['rank']} of {saved['world_size']}, "
                f"{len(saved['buckets'])} buckets), but this optimizer is rank {now['rank']} of {now['world_size']} "
                f"with {len(now['buckets'])} buckets: a shard only fits the layout it was cut from. Save with "
                f"sync.optimizer_state_dict() (the whole, layout-free form, what the Trainer's checkpoints hold) "
                f"and load that instead")
        return {k: v for k, v in state_dict.items() if k != LOCAL_KEY}
    originals = original_groups(optimizer)
    saved_groups = state_dict["param_groups"]
    sizes = [len(g["params"]) for g in saved_groups]
    if sizes != [len(params) for params in originals]:
        raise ValueError(
            f"the optimizer state dict has param groups of {sizes} parameters, but this optimizer was built with "
            f"{[len(params) for params in originals]}: it was saved for another model or another optimizer setup "
            f"(e.g. other weight-decay groups). Resume with the same model and optimizer settings")
    param_of = {pid: p for saved, params in zip(saved_groups, originals) for pid, p in zip(saved["params"], params)}
    whole = {id(param_of[pid]): s for pid, s in state_dict["state"].items() if pid in param_of}
    for pid, s in state_dict["state"].items():
        p = param_of.get(pid)
        for k, v in s.items():
            if p is not None and torch.is_tensor(v) and v.dim() > 0 and v.numel() != p.numel():
                raise ValueError(f"optimizer state {k!r} of parameter {pid} has {v.numel()} elements, the parameter "
                                 f"{p.numel()}: the state dict was saved for another model")
    state, groups, idx = {}, [], 0
    for g, group in enumerate(optimizer.param_groups):
        ids = []
        for st in sync._states:
            sh = st.shard
            windows = _sliced(sh)
            for (gg, t), (_, a, b) in zip(sh.tensors, sh.pieces):
                if gg != g:
                    continue
                entry: dict = {}
                for wa, wb, p, pa, pb in windows:
                    lo, hi = max(wa, a), min(wb, b)
                    if hi <= lo or id(p) not in whole:
                        continue
                    for k, v in whole[id(p)].items():
                        if _per_element(k, v, p.shape):
                            if k not in entry:
                                entry[k] = torch.zeros(b - a, dtype=v.dtype, device=v.device)
                            entry[k][lo - a:hi - a] = v.reshape(-1)[pa + lo - wa:pa + hi - wa]
                        else:
                            entry.setdefault(k, v.clone() if torch.is_tensor(v) else v)
                if entry:
                    state[idx] = entry
                ids.append(idx)
                idx += 1
        groups.append({**{k: v for k, v in saved_groups[g].items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def reshard(old, new, optimizer) -> None:
    """The optimizer ``old`` (a closed GradSync of the same model) sharded, onto ``new``'s slices.

    A second ``train()`` of one Trainer: the state is gathered whole (a collective; for that
    moment every rank holds all of it, where the parameters are, as an unsharded optimizer always
    does), the optimizer goes back to the model's parameters, is sharded by ``new`` and loads it.
    """
    from . import shard_optim

    state = optimizer_state_dict(old, keep=True, group=new.process_group, device=None)
    for group, params in zip(optimizer.param_groups, original_groups(optimizer)):
        group["params"] = list(params)
    optimizer.state.clear()
    shard_optim.release(optimizer)
    new.shard_optimizer(optimizer)
    optimizer.load_state_dict(state)
