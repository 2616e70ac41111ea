"""10.gather_hook: the all-gather after a sharded step, waited for layer by layer by forward pre-hooks."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, replace

import torch

from course.checks.drawn import after_colon, falsify, root_error, run_thread_ranks
from course.grading import Exercise, Wrong

from .threads import ThreadWorld, _close, _your_line, run_ranks


# =============================================================================================
# 10.gather_hook
# =============================================================================================
gather_ex = Exercise("10.gather_hook", uses=["ParamGather"], title="the all-gather, waited for by forward pre-hooks")

G_DIM, G_HIDDEN, G_LAYERS = 6, 9, 4        # layer 0: 6 x 9 + 9 = 63 values, which 2 ranks do not divide
GATHER_HINT = ("launch() starts every layer's gather, in the order the forward needs them; just before layer i runs, "
               "a hook makes it current: its gather finished, its parameters holding what the gather brought")
GATHER_REVEAL = ("__init__: S = -(-numel // N); full[i] = torch.zeros(N * S, dtype=the layer's dtype); views into "
                 "full[i] shaped like each parameter; mine[i] = full[i][rank*S:(rank+1)*S].clone(); self.handles = "
                 "[m.register_forward_pre_hook(lambda mod, args, i=i: self.wait_for(i)) for i, m in "
                 "enumerate(self.layers)]; launch: self.works = [dist.all_gather_single(f, m, async_op=True) for f, m "
                 "in zip(self.full, self.mine)]; wait_for(i): work = self.works[i]; if work: work.wait(); "
                 "self.works[i] = None; copy each view into its parameter under torch.no_grad()")
LAYOUT_CASE = "the buffers: this rank's slice of every layer, N slices covering it (63 values on 2 ranks)"
RESULT_CASE = "after launch() and a forward, every layer computes with the gathered values (2 ranks, 2 steps)"


@dataclass(frozen=True)
class GatherDraw:
    """A TinyMLP(dim, hidden, layers) in ``dtype`` on ``world_size`` ranks (the old check's: 6, 9, 4, float32, 2)."""

    world_size: int = 2
    dim: int = G_DIM
    hidden: int = G_HIDDEN
    layers: int = G_LAYERS
    dtype: torch.dtype = torch.float32
    seed: int = 0

    @property
    def sizes(self) -> list[int]:
        """Each layer's number of values (weight and bias)."""
        return [a * b + b for a, b in zip([self.dim] + [self.hidden] * (self.layers - 1),
                                          [self.hidden] * (self.layers - 1) + [self.dim])]

    def __str__(self) -> str:
        return (f"{self.world_size} ranks, {str(self.dtype).replace('torch.', '')}, TinyMLP(dim={self.dim}, "
                f"hidden={self.hidden}, layers={self.layers}) with layers of {', '.join(map(str, self.sizes))} values")


def _gather_models(case: GatherDraw = GatherDraw()):
    from course.lib import TinyMLP

    models = [TinyMLP(dim=case.dim, hidden=case.hidden, layers=case.layers, seed=case.seed + s).to(case.dtype)
              for s in (0, 1, 2)]
    if case.dtype == torch.float64:       # values float32 cannot hold: a float32 buffer on the way shows
        with torch.no_grad():
            for m in models:
                for p in m.parameters():
                    p.div_(3)
    return models


def _layout_problem(g, layers, world_size) -> str | None:
    """What is wrong with the learner's buffers, in words, or None."""
    got = getattr(g, "layers", None)
    if got is None or [id(m) for m in got] != [id(m) for m in layers]:
        return ("self.layers should list the modules that own parameters directly, in model.modules() order "
                f"(here the {len(layers)} Linear layers)")
    mine = getattr(g, "mine", None)
    if not isinstance(mine, (list, tuple)) or len(mine) != len(layers) or not all(isinstance(t, torch.Tensor)
                                                                                  for t in mine):
        return f"self.mine should be a list of {len(layers)} tensors, one per layer: this rank's slice of it"
    for i, (m, t) in enumerate(zip(layers, mine)):
        numel = sum(p.numel() for p in m.parameters(recurse=False))
        size = -(-numel // world_size)
        if t.dim() != 1:
            return f"self.mine[{i}] has shape {tuple(t.shape)}: a slice of the flattened layer is 1-D"
        if t.numel() == size:
            continue
        if t.numel() * world_size < numel:
            return (f"layer {i} has {numel} values and your slices hold {t.numel()} each: {world_size} slices cover "
                    f"{t.numel() * world_size}, so {numel - t.numel() * world_size} value(s) belong to no rank and no "
                    f"gather ever brings them. The N slices must cover the whole layer, also when N does not divide "
                    f"its size")
        if t.numel() >= numel:
            return (f"self.mine[{i}] holds {t.numel()} values, the whole layer ({numel}): each rank owns and sends "
                    f"only its 1/N slice, that is the point of sharding")
        return (f"self.mine[{i}] holds {t.numel()} values; {world_size} equal slices covering layer {i}'s {numel} "
                f"values need {size} each (the last one partly padding)")
    return None


def _gather_rank(rank, world_size, world, cls, case: GatherDraw = GatherDraw()):
    from course.lib import random_regression

    model, *targets = _gather_models(case)
    layers = list(model.layers)
    g = cls(model)
    problem = _layout_problem(g, layers, world_size)
    if problem:
        return {"layout": problem, "steps": [], "layers": len(layers), "ptr": {}}
    mine_ptr = {t.data_ptr(): i for i, t in enumerate(g.mine)}
    for i, m in enumerate(layers):
        m.register_forward_pre_hook(lambda mod, args, i=i: world.note(rank, "forward", layer=i))
    world.take(rank)
    x = random_regression(n=4, dim=case.dim, seed=3)[0].to(case.dtype)
    steps = []
    for target in targets:
        # What the sharded step left on this rank: its own slice of every layer's updated values.
        for i, (m, t) in enumerate(zip(layers, target.layers)):
            flat = torch.cat([p.detach().reshape(-1) for p in t.parameters()])
            size = g.mine[i].numel()
            padded = torch.zeros(size * world_size, dtype=case.dtype)
            padded[:flat.numel()] = flat
            with torch.no_grad():
                g.mine[i].copy_(padded[rank * size:(rank + 1) * size])
        world.note(rank, "step")
        g.launch()
        with torch.no_grad():
            out = model(x)
            again = model(x)          # a forward with nothing in flight (an evaluation, say) runs as it is
        stale = [i for i, (m, t) in enumerate(zip(layers, target.layers))
                 if not all(torch.equal(a, b) for a, b in zip(m.parameters(), t.parameters()))]
        garbage = [i for i, m in enumerate(layers) if any(bool(p.isnan().any()) for p in m.parameters())]
        rounded = [i for i, (m, t) in enumerate(zip(layers, target.layers))
                   if case.dtype != torch.float32 and i in stale and all(
                       torch.equal(a, b.float().to(case.dtype)) for a, b in zip(m.parameters(), t.parameters()))]
        steps.append({"right": _close(out, target(x)), "again": _close(again, target(x)), "stale": stale,
                      "garbage": garbage, "rounded": rounded, "log": world.take(rank)})
    hooks_left = None
    if hasattr(g, "close"):
        g.close()
        # one pre-hook per layer is the check's own (the "forward" note); the rest are the learner's
        hooks_left = sum(len(m._forward_pre_hooks) for m in layers) - len(layers)
    return {"layout": None, "steps": steps, "layers": len(layers), "ptr": mine_ptr, "hooks_left": hooks_left}


def _gather_facts(learner) -> dict:
    def compute():
        return run_ranks(functools.partial(_gather_rank, cls=learner.ParamGather), 2, GATHER_HINT, GATHER_REVEAL)
    return learner.once("10.gather_hook", compute)


def _gather_layer(entry: dict, ptr: dict) -> int | None:
    return ptr.get(entry.get("src_ptr"))


def _one_handle_for_every_layer(st: dict, ptr: dict, layers: int) -> str | None:
    """What went wrong when every layer's pre-hook waited for the same gather (the loop's last i, read late by a
    lambda); None otherwise."""
    gathers = {e["op"]: _gather_layer(e, ptr) for e in st["log"] if e["event"] == "launch" and e["kind"] == "all_gather"}
    waited = {gathers.get(e["op"]) for e in st["log"] if e["event"] == "wait" and e["op"] in gathers}
    if layers < 2 or len(waited) != 1 or not st["stale"]:
        return None
    return (f"layer {st['stale'][0]} ran with values that never arrived: every layer's pre-hook waited for layer "
            f"{waited.pop()}'s gather. A lambda made in a loop reads i when it runs, after the loop has ended "
            f"(bind it: lambda module, args, i=i: ...)")


@gather_ex.case(LAYOUT_CASE,
                hint="cut each layer's parameters, flattened one after the other, into N equal slices that cover "
                     "all of them; self.mine[i] is this rank's", reveal=GATHER_REVEAL, timeout=60)
def _(learner):
    """Property: on each of 2 thread ranks, the buffers hold this rank's slice of every layer's flattened parameters, N
    equal slices covering the layer, the last one padded (layer 0: 63 values in 2 slices of 32)."""
    results = _gather_facts(learner)
    for rank, res in enumerate(results):
        if res["layout"]:
            raise Wrong(f"rank {rank}: {res['layout']}", reveal=GATHER_REVEAL)
    return "layer 0: 63 values in 2 slices of 32, the last one padded"


@gather_ex.case(RESULT_CASE, hint=GATHER_HINT, reveal=GATHER_REVEAL, timeout=60, after=LAYOUT_CASE)
def _(learner):
    """Property: on both of 2 thread ranks, for 2 steps, after launch() and a forward every layer computes with the
    gathered, updated values, and no hook is left behind."""
    results = _gather_facts(learner)
    for rank, res in enumerate(results):
        for s, st in enumerate(res["steps"], 1):
            gathers = [e for e in st["log"] if e["event"] == "launch" and e["kind"] == "all_gather"]
            waited = {e["op"] for e in st["log"] if e["event"] == "wait"}
            if not gathers:
                raise Wrong(f"step {s}: launch() started no all-gather: each layer's updated slices are on "
                            f"different ranks until an all-gather brings them together", reveal=GATHER_REVEAL)
            if st["right"] and st["again"] and not st["stale"]:
                continue
            if st["stale"]:
                i = st["stale"][0]
                late = _one_handle_for_every_layer(st, res["ptr"], res["layers"])
                if late is not None:
                    raise Wrong(f"step {s}: rank {rank}'s {late}", reveal=GATHER_REVEAL)
                if not any(e["op"] in waited for e in gathers):
                    raise Wrong(f"step {s}: layer {i} ran with values that never arrived: an all-gather's output is "
                                f"only there once its work is waited for. Wait in the layer's pre-hook, then copy",
                                reveal=GATHER_REVEAL)
                if i in st["garbage"]:
                    raise Wrong(f"step {s}: rank {rank}'s layer {i} computed with NaN, what its gather's output held "
                                f"while the gather was in flight: you read the buffer before waiting. The output of "
                                f"an asynchronous collective is only the result once its work has been waited for",
                                reveal=GATHER_REVEAL)
                raise Wrong(f"step {s}: rank {rank}'s layer {i} does not hold the gathered values after the "
                            f"forward: once its gather is waited for, every parameter of the layer must take its "
                            f"part of what the gather wrote (under torch.no_grad())", reveal=GATHER_REVEAL)
            if st["right"] and not st["again"]:
                raise Wrong("a second forward with no gather in flight gave a different result: wait_for(i) must do "
                            "nothing when layer i has no pending gather (forget a work once it is waited for)",
                            reveal=GATHER_REVEAL)
            raise AssertionError(f"step {s}: the forward's output differs from the model with the updated values")
        if res.get("hooks_left"):
            raise Wrong(f"rank {rank}: after close() the model still carries {res['hooks_left']} forward pre-hook(s) "
                        f"of yours: every later forward would still wait for gathers (a model handed back to "
                        f"plain training, or evaluated, keeps paying for them). close() removes what __init__ "
                        f"registered", reveal=GATHER_REVEAL)
    return "2 steps, the updated parameters on both ranks"


@gather_ex.case("the gathers go out in forward order, and layer i waits for its own gather only, as it starts",
                hint="launch everything in launch(), first layer first; wait in each layer's own pre-hook",
                reveal=GATHER_REVEAL, timeout=60,
                after=RESULT_CASE)
def _(learner):
    """Property: on rank 0, launch() sends every layer's all-gather before the forward starts, first layer first, and
    layer i waits, as it starts, for gather i and no later one."""
    results = _gather_facts(learner)
    res = results[0]
    n_layers, ptr = res["layers"], res["ptr"]
    for s, st in enumerate(res["steps"], 1):
        log = st["log"]
        launches = [e for e in log if e["event"] == "launch" and e["kind"] == "all_gather"]
        first_forward = next(e["order"] for e in log if e["event"] == "forward")
        if any(e["order"] > first_forward for e in launches):
            raise Wrong("a gather was launched during the forward, in a pre-hook: it then starts only when its "
                        "layer is about to run, and the layer waits for the whole transfer. Launch every gather in "
                        "launch(), right after the step, so they travel while the earlier layers compute",
                        reveal=GATHER_REVEAL)
        order = [_gather_layer(e, ptr) for e in launches]
        if len(order) != n_layers or None in order:
            raise Wrong(f"{len(order)} all-gathers of the layers' slices for {n_layers} layers: one collective per "
                        f"layer, each sending that layer's self.mine[i]", reveal=GATHER_REVEAL)
        if order != list(range(n_layers)):
            raise Wrong(f"the gathers went out in the order {order}: a link carries one transfer after the other, "
                        f"so the first layer's parameters arrive last and the forward waits for all of them. "
                        f"Launch in forward order: layer 0 first", reveal=GATHER_REVEAL)
        op_layer = {e["op"]: _gather_layer(e, ptr) for e in launches}
        seen: set[int] = set()
        for e in log:
            if e["event"] == "wait" and e["op"] in op_layer:
                seen.add(op_layer[e["op"]])
            if e["event"] == "forward" and not any(x["event"] == "forward" and x["layer"] == e["layer"]
                                                   and x["order"] < e["order"] for x in log):
                early = sorted(i for i in seen if i > e["layer"])
                if early:
                    which = "every gather" if len(early) == n_layers - 1 - e["layer"] else f"the gathers of layers {early}"
                    raise Wrong(f"step {s}: when layer {e['layer']} started, you had already waited for {which} of "
                                f"the layers after it: the forward then waits for all the parameters before it "
                                f"computes anything, and nothing overlaps. Wait in layer i's pre-hook for gather i "
                                f"only", reveal=GATHER_REVEAL)
                if e["layer"] not in seen:
                    raise AssertionError(f"layer {e['layer']} started before its gather was waited for")
    return f"{n_layers} gathers in forward order; layer i waited only for gather i"


# Drawn cases (course/checks/drawn.py): 2, 3 and 4 ranks, drawn TinyMLP shapes whose layer sizes the world size does
# not divide, float32 and float64; every rank read. The property: on every rank, the buffers hold this rank's slice of
# every layer (N slices of ceil(numel / N) covering it), and after launch() and a forward each of 2 steps every layer
# computes with the gathered values, exactly, each layer's pre-hook waiting for its own gather.
def draw_gather(seed: int = 41, count: int = 4) -> list[GatherDraw]:
    rng = random.Random(seed)
    out = []
    for k in range(count):
        n = (3, 4, 2, 3)[k % 4]
        while True:
            case = GatherDraw(n, rng.randint(2, 7), rng.randint(2, 9), rng.randint(2, 4),
                              (torch.float64, torch.float32)[k % 2], rng.randrange(1000))
            if any(size % n for size in case.sizes):
                out.append(case)
                break
    return out


def _gather_drawn_mistake(learner, case: GatherDraw) -> str | None:
    """None when every rank holds the property above; else what the first rank that broke it did."""
    world = ThreadWorld(case.world_size, timeout_s=3.0, fail_fast=True)
    results, errors = run_thread_ranks(case.world_size,
                                       lambda r: _gather_rank(r, case.world_size, world, learner.ParamGather, case),
                                       world=world)
    found = root_error(errors)
    if found is not None:
        rank, exc = found
        text = str(exc).strip().splitlines()
        said = f"rank {rank} raised {type(exc).__name__}: {text[-1] if text else ''}{_your_line(exc)}"
        if "is invalid for input of size" in said:
            odd = [size for size in case.sizes if size % case.world_size]
            return (f"{said}: a layer's values did not fit in N slices of the size you chose (N x S < numel; here "
                    f"{case.world_size} does not divide {', '.join(map(str, odd))}): the N slices must cover the whole "
                    f"layer, the last one padded, whatever N is")
        return said
    for rank, res in enumerate(results):
        if res["layout"]:
            return f"rank {rank}: {res['layout']}"
        for s, st in enumerate(res["steps"], 1):
            if st["right"] and st["again"] and not st["stale"]:
                continue
            if st["rounded"]:
                return (f"rank {rank}, step {s}: layer {st['rounded'][0]} holds the gathered values rounded to float32 "
                        f"on a {str(case.dtype).replace('torch.', '')} model: the gather's buffer was made without "
                        f"dtype= (torch.zeros(...) is float32); make it in the layer's dtype")
            late = _one_handle_for_every_layer(st, res["ptr"], res["layers"])
            if late is not None:
                return f"rank {rank}, step {s}: {late}"
            if st["garbage"]:
                return (f"rank {rank}, step {s}: layer {st['garbage'][0]} computed with NaN, what its gather's output "
                        f"held while in flight: the buffer was read before its work was waited for")
            if st["stale"]:
                return f"rank {rank}, step {s}: layer {st['stale'][0]} does not hold the gathered values after the forward"
            return f"rank {rank}, step {s}: the forward's output differs from the model with the updated values"
    return None


def _smaller_gather(case: GatherDraw):
    for w in (2, 3):
        if w < case.world_size:
            yield replace(case, world_size=w)
    if case.layers > 2:
        yield replace(case, layers=2)
    if case.dtype != torch.float32:
        yield replace(case, dtype=torch.float32)
    if (case.dim, case.hidden) != (2, 2):
        yield replace(case, dim=2, hidden=2)


@gather_ex.case("drawn: 2, 3 and 4 ranks, layer sizes N does not divide, float32 and float64, every rank read",
                hint=GATHER_HINT, reveal=GATHER_REVEAL, timeout=60, after=LAYOUT_CASE)
def _(learner):
    """Property: on drawn cases (2, 3 and 4 thread ranks, drawn TinyMLP shapes with layer sizes N does not divide,
    float32 and float64), on every rank the buffers hold this rank's slice of every layer, and after launch() and a
    forward, for 2 steps, every layer computes with exactly the gathered values."""
    cases = draw_gather()
    found = falsify(cases, lambda c: None if (why := _gather_drawn_mistake(learner, c)) is None else f"{c}: {why}",
                    smaller=_smaller_gather, budget=12, kind=after_colon)
    if found is not None:
        raise Wrong(str(found), reveal=GATHER_REVEAL)
    return f"{len(cases)} drawn cases, every rank read"
