"""The sharded optimizer's state across layouts: a re-plan, a checkpoint, another process count.

A sharded optimizer's state is cut by the bucket layout: each piece tensor is one rank's part of
one parameter (`layout.Piece`), so its state means nothing under another plan, rank or
world size. Everything that must outlive a layout goes through the *whole* form instead, per
model parameter, which is the format ``torch.optim.Optimizer.state_dict()`` of the unsharded
optimizer has:

    optimizer_state_dict   every rank's pieces gathered, bucket by bucket, into the unsharded
                           optimizer's state dict (a collective; kept where asked, on the CPU)
    whole_to_local         that dict (or a stock Trainer's optimizer.pt) cut into this rank's
                           pieces: the sharded optimizer's ``load_state_dict`` does it by itself
                           (a load pre-hook), so ``resume_from_checkpoint`` needs no change
    carry_over             a re-plan's move of gradient slices and state to the new pieces,
                           one old bucket at a time, each freed once it has moved

State is of three kinds: per element (shaped like its tensor: momentum, exp_avg), per
parameter (a 0-dim tensor: Adam's "step", which differs between a parameter frozen for a while
and the others), and constants (anything else). A parameter no rank has state for (never
stepped) has no entry, as in the unsharded optimizer.
"""

from __future__ import annotations

import pickle
import weakref

import torch
import torch.distributed as dist

from . import collectives

LOCAL_KEY = "hfstream_shard"   # marks a local (sharded) state dict with the layout it belongs to

# The param groups each sharded optimizer was built with (model parameters), for the whole form.
_ORIGINAL: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[list[torch.Tensor]]]" = weakref.WeakKeyDictionary()


# The state a loaded whole form held for parameters no bucket holds (frozen when the optimizer was sharded):
# kept as loaded, and written back by `optimizer_state_dict`, as the unsharded optimizer keeps it.
_KEPT: "weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, dict]]" = weakref.WeakKeyDictionary()


def remember_groups(optimizer) -> None:
    _ORIGINAL[optimizer] = [list(group["params"]) for group in optimizer.param_groups]


def restore_groups(optimizer) -> None:
    """Put the optimizer back on the model's parameters (before it is sharded again)."""
    for group, params in zip(optimizer.param_groups, _ORIGINAL[optimizer]):
        group["params"] = list(params)


def _kind(key, value, shape) -> str:
    if torch.is_tensor(value) and value.shape == shape and (len(shape) > 0 or key != "step"):
        return "element"
    if torch.is_tensor(value) and value.dim() == 0:
        return "param"
    return "constant"


def _agree_on_keys(optimizer, states, group, world_size) -> tuple[dict, dict, dict]:
    """The state keys of every rank: per element ({param dtype: state dtype}), per parameter, constants.

    Per-parameter keys map to ``(dtype, on_cpu)``: where such a value lives is said as "the host"
    or "the bucket's device", never as another rank's device string (rank 1's ``cuda:1`` means
    nothing on rank 0). A collective: a rank may hold no state at all (all its slices are padding).
    """
    element, param, constant = {}, {}, {}
    for st in states:
        for t in st.shard.tensors:
            for k, v in optimizer.state.get(t, {}).items():
                kind = _kind(k, v, t.shape)
                if kind == "element":
                    element.setdefault(k, {})[t.dtype] = v.dtype
                elif kind == "param":
                    param.setdefault(k, (v.dtype, v.device.type == "cpu"))
                else:
                    constant.setdefault(k, v)
    if not states:   # the plan is the same on every rank: no rank has a bucket, nothing to agree on
        return element, param, constant
    mine = (element, param, {k: v.cpu() if torch.is_tensor(v) else v for k, v in constant.items()})
    views = _all_gather_objects(mine, group, world_size, states[0].shard.master.device)
    for e, p, c in views:
        for k, dtypes in e.items():
            element[k] = {**dtypes, **element.get(k, {})}
        for k, v in p.items():
            param.setdefault(k, v)
        for k, v in c.items():
            constant.setdefault(k, v)
    return element, param, constant


def _all_gather_objects(obj, group, world_size: int, device: torch.device) -> list:
    """Every rank's picklable ``obj``, in rank order, exchanged as bytes on ``device`` (a collective).

    Not ``dist.all_gather_object``: on NCCL it stages the bytes on the *current* CUDA device
    (torch's docs leave ``torch.cuda.set_device`` to the user; the installed torch's version
    takes no device), so a script that never sets it would put every rank's tensors on GPU 0
    and NCCL fails. Here they go on the buckets' device, where every other collective of the
    group runs.
    """
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    sizes = torch.empty(world_size, dtype=torch.int64, device=device)
    collectives.launch_all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device),
                                  group).wait()
    lengths = sizes.tolist()
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    every = torch.empty(longest * world_size, dtype=torch.uint8, device=device)
    collectives.launch_all_gather(every, padded, group).wait()
    rows = every.view(world_size, longest).cpu()
    return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]


def _gathered(sh, local, group, world_size) -> torch.Tensor:
    whole = torch.empty(sh.size * world_size, dtype=local.dtype, device=local.device)
    collectives.launch_all_gather(whole, local, group).wait()
    return whole


def _element_slice(optimizer, sh, key, dtype) -> torch.Tensor:
    """This rank's slice of one bucket for per-element state ``key`` (zeros where a piece has none)."""
    out = torch.zeros(sh.size, dtype=dtype, device=sh.master.device)
    for pc, t in zip(sh.pieces, sh.tensors):
        if key in optimizer.state.get(t, {}):
            out[pc.start:pc.end] = optimizer.state[t][key]
    return out


def _param_values(optimizer, sh, keys, group) -> tuple[list[bool], dict]:
    """Per parameter of one bucket: whether any rank has state, and each per-parameter key's value (a collective)."""
    has, on_host, on_device = [], [], []   # slots with state; (row, slot, value) by where the value lives
    for pc, t in zip(sh.pieces, sh.tensors):
        state = optimizer.state.get(t)
        if state:
            has.append(pc.slot)
            for row, k in enumerate(keys, start=1):
                if k in state:
                    (on_host if state[k].device.type == "cpu" else on_device).append((row, pc.slot, state[k]))
    # The table is filled on the host and goes to the device in one copy: copying each value there
    # (Adam's ``step`` is a CPU tensor) would be one synchronising copy per piece, and reading each
    # one host read per piece. Values already on the device (fused AdamW's) are copied there.
    table = torch.full((1 + len(keys), len(sh.params)), -float("inf"), dtype=torch.float64)
    if has:
        table[0, has] = 1.0
    if on_host:
        rows, slots, values = zip(*on_host)
        table[list(rows), list(slots)] = torch.stack(values).to(torch.float64)
    table = table.to(sh.master.device)
    for row, slot, value in on_device:
        table[row, slot] = value
    dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
    rows = table.tolist()
    return [v > 0 for v in rows[0]], {k: rows[row] for row, k in enumerate(keys, start=1)}


def _whole_of_bucket(optimizer, st, keys, group, world_size, device=None) -> dict[int, dict]:
    """``{id(parameter): its whole state}`` for the parameters of one bucket that have state (a collective)."""
    element, param, constant = keys
    sh = st.shard
    has, values = _param_values(optimizer, sh, sorted(param), group)
    out = {id(p): {} for p, h in zip(sh.params, has) if h}
    for key, dtypes in sorted(element.items()):
        whole = _gathered(sh, _element_slice(optimizer, sh, key, dtypes.get(st.plan.dtype, st.plan.dtype)),
                          group, world_size)
        for p, o, n in zip(sh.params, sh.offsets, sh.numels):
            if id(p) in out:
                piece = whole[o:o + n].view(p.shape)
                out[id(p)][key] = (piece.to(device) if device else piece).clone()
    # Each per-parameter key's values made into one tensor where they go (one copy to the device,
    # not one per parameter), then one 0-dim tensor per parameter cut from it.
    made = {key: torch.tensor([0 if v == -float("inf") else v for v in values[key]], dtype=dtype,
                              device=device or ("cpu" if on_cpu else sh.master.device))
            for key, (dtype, on_cpu) in param.items()}
    for slot, p in enumerate(sh.params):
        if id(p) in out:
            for key in param:
                if values[key][slot] != -float("inf"):
                    out[id(p)][key] = made[key][slot].clone()
            for key, v in constant.items():
                out[id(p)].setdefault(key, v.clone() if torch.is_tensor(v) else v)
    return out


def _cut(whole: dict, p, pc) -> dict:
    """One piece's state from its parameter's whole state."""
    entry = {}
    for k, v in whole.items():
        if _kind(k, v, p.shape) == "element":
            entry[k] = v.reshape(-1)[pc.param_start:pc.param_end].clone()
        else:
            entry[k] = v.clone() if torch.is_tensor(v) else v
    return entry


# -- a re-plan -----------------------------------------------------------------------------------------
@torch.no_grad()
def carry_over(optimizer, old_states, new_buckets, group, world_size: int, retire) -> tuple[dict, dict]:
    """Move the mean-gradient slices and the optimizer's state from the old buckets' pieces to the new ones.

    Collectives (every rank calls it at the same step, between steps), one old bucket at a time.
    The new buckets have no buffers yet: what moves is kept per new piece, and each old bucket
    is handed to ``retire`` (which frees its buffers) as soon as it has moved, so the two layouts
    are never both whole (at most one old bucket's worth more than one layout is in memory).

    Args:
        new_buckets: per new bucket, ``(parameters, this rank's pieces)`` (`layout.slices_of`).
        retire: called with each old `BucketState` once nothing more is read from it.

    Returns:
        ``grads, state``: ``(new bucket, piece) -> `` the piece's mean-gradient values and its
        optimizer state (absent for a piece whose parameter no rank has state for).
    """
    keys = _agree_on_keys(optimizer, old_states, group, world_size)
    where = {}   # id(parameter) -> [((new bucket, piece), Piece)]
    for j, (params, pieces) in enumerate(new_buckets):
        for k, pc in enumerate(pieces):
            where.setdefault(id(params[pc.slot]), []).append(((j, k), pc))
    grads, state = {}, {}
    for st in old_states:
        sh = st.shard
        whole = _gathered(sh, sh.grad, group, world_size)
        for p, o in zip(sh.params, sh.offsets):
            for key, pc in where.get(id(p), []):
                grads[key] = whole[o + pc.param_start:o + pc.param_end].clone()
        del whole
        wholes = _whole_of_bucket(optimizer, st, keys, group, world_size)
        for p in sh.params:
            for key, pc in where.get(id(p), []) if id(p) in wholes else ():
                state[key] = _cut(wholes[id(p)], p, pc)
        del wholes
        for t in sh.tensors:
            optimizer.state.pop(t, None)
        retire(st)
    return grads, state


# -- the whole form: checkpoints -------------------------------------------------------------------
@torch.no_grad()
def optimizer_state_dict(optimizer, states, group, world_size: int, keep: bool = True,
                         device: str | None = "cpu") -> dict | None:
    """The unsharded optimizer's ``state_dict()``, from every rank's pieces (a collective).

    Every rank must call it; ranks with ``keep=False`` drop each gathered bucket at once (the
    Trainer keeps it on the rank that saves). Tensors come back on ``device`` (None: where they are).
    """
    keys = _agree_on_keys(optimizer, states, group, world_size)
    whole: dict[int, dict] = {}
    for st in states:
        bucket = _whole_of_bucket(optimizer, st, keys, group, world_size, device)
        if keep:
            whole.update(bucket)
    if not keep:
        return None
    kept = _KEPT.get(optimizer, {})
    state, groups, pid = {}, [], 0
    for group_, params in zip(optimizer.param_groups, _ORIGINAL[optimizer]):
        ids = []
        for p in params:
            if id(p) in whole:
                state[pid] = whole[id(p)]
            elif id(p) in kept:
                state[pid] = {k: (v.to(device) if device and torch.is_tensor(v) else v)
                              for k, v in kept[id(p)].items()}
            ids.append(pid)
            pid += 1
        groups.append({**{k: v for k, v in group_.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def layout(rank: int, world_size: int, states) -> dict:
    """What a local state dict belongs to: this rank, the world size and the bucket plan."""
    return {"rank": rank, "world_size": world_size, "buckets": [list(st.plan.names) for st in states]}


def mark_local(state_dict: dict, now: dict) -> dict:
    """``optimizer.state_dict()`` post-hook: the local form says which layout it belongs to."""
    state_dict[LOCAL_KEY] = now
    return state_dict


def whole_to_local(optimizer, state_dict: dict, states, now: dict) -> dict:
    """``optimizer.load_state_dict()`` pre-hook: the whole form cut into this rank's pieces.

    A local form passes through if it belongs to the current layout, and is refused otherwise.
    """
    if LOCAL_KEY in state_dict:
        saved = state_dict[LOCAL_KEY]
        if saved != now:
            raise ValueError(
                f"this optimizer state dict is one rank's shard (rank {saved['rank']} of {saved['world_size']}, "
                f"{len(saved['buckets'])} buckets), but this optimizer is rank {now['rank']} of {now['world_size']} "
                f"with {len(now['buckets'])} buckets: a shard only fits the layout it was cut from. Save with "
                f"sync.optimizer_state_dict() (the whole, layout-free form, what the Trainer's checkpoints hold) "
                f"and load that instead")
        return {k: v for k, v in state_dict.items() if k != LOCAL_KEY}
    originals = _ORIGINAL[optimizer]
    saved_groups = state_dict["param_groups"]
    sizes = [len(g["params"]) for g in saved_groups]
    if sizes != [len(params) for params in originals]:
        raise ValueError(
            f"the optimizer state dict has param groups of {sizes} parameters, but this optimizer was built with "
            f"{[len(params) for params in originals]}: it was saved for another model or another optimizer setup "
            f"(e.g. other weight-decay groups). Resume with the same model and optimizer settings")
    param_of = {pid: p for saved, params in zip(saved_groups, originals) for pid, p in zip(saved["params"], params)}
    group_of = {id(p): g for g, params in enumerate(originals) for p in params}
    whole = {}
    for pid, s in state_dict["state"].items():
        p = param_of.get(pid)
        if p is None:
            continue
        for k, v in s.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.numel() != p.numel():
                raise ValueError(f"optimizer state {k!r} of parameter {pid} has {v.numel()} elements, the parameter "
                                 f"{p.numel()}: the state dict was saved for another model")
        whole[id(p)] = s
    sharded = {id(st.params[pc.slot]) for st in states for pc in st.shard.pieces}
    _KEPT[optimizer] = {i: s for i, s in whole.items() if i not in sharded}
    state, groups, idx = {}, [], 0
    for g, group in enumerate(optimizer.param_groups):
        ids = []
        for st in states:   # the order `shard_optim.install` puts the pieces in
            for pc in st.shard.pieces:
                p = st.params[pc.slot]
                if group_of[id(p)] != g:
                    continue
                if id(p) in whole:
                    state[idx] = _cut(whole[id(p)], p, pc)
                ids.append(idx)
                idx += 1
        groups.append({**{k: v for k, v in saved_groups[g].items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}
