"""Lesson 04 checks: data parallelism from scratch, run in two real gloo processes.

The learner's exercise cells are written to a file (`Learner.module_file`) that each rank imports;
top-level statements other than definitions, imports and plain assignments are left out of that
file, so a test call the learner left in a cell does not run (or spawn) again in every rank. The
results are compared in this process with a single-process reference trained on the full batch.

`on_ranks` gives the notebook the same machinery for its own functions.
"""

from __future__ import annotations

import random
import traceback
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from course.checks.drawn import after_colon, falsify, root_error, run_thread_ranks
from course.grading import Exercise, Learner, Wrong, load_module
from course.lib import TinyMLP, random_regression

WORLD = 2
STEPS, LR = 8, 0.2
_SPAWN_TIMEOUT_S = 90.0
_PG_TIMEOUT_S = 20.0


def _call_from_file(rank: int, world_size: int, path: str, name: str, args: tuple, kwargs: dict):
    return getattr(load_module(path), name)(rank, world_size, *args, **kwargs)


def on_ranks(fn, world_size: int = WORLD, *args, also=(), timeout: float = 120.0, **kwargs):
    """Run a function defined in this notebook on ``world_size`` gloo processes; return each rank's result.

    ``fn(rank, world_size, *args, **kwargs)`` runs in every rank after
    ``dist.init_process_group("gloo")``. A spawned process cannot unpickle a notebook function,
    so the cells that define ``fn`` and the functions in ``also`` are written to a file that each
    rank imports (only their definitions: statements that would run something are left out),
    exactly as the checks do. Those cells may use the lessons' standard imports.

    Args:
        fn: a function of the notebook taking ``(rank, world_size, ...)``; it returns something picklable.
        world_size: number of processes.
        also: other notebook functions ``fn`` calls (their cells are written to the file too).
        timeout: seconds for the whole run; a hang fails instead of waiting forever.
    """
    from course.grading import is_stub
    from hfstream.testing import run_on_ranks

    funcs = [fn, *also]
    for f in funcs:
        if is_stub(f):
            raise NotImplementedError(f"{f.__name__} is still the exercise stub: write it (and pass its check) first")
    names = [f.__name__ for f in funcs]
    spec = types.SimpleNamespace(id="04.on_ranks", uses=names, preamble="")
    path = Learner({f.__name__: f for f in funcs}, spec).module_file()
    return run_on_ranks(_call_from_file, world_size, path, fn.__name__, args, kwargs,
                        timeout=timeout, pg_timeout_s=_PG_TIMEOUT_S)


def _spawn(learner: Learner, rank_fn, *args):
    """Run ``rank_fn(rank, world, path, *args)`` on 2 ranks once per check; cache the outcome."""
    cache = learner.__dict__.setdefault("_lesson04_runs", {})
    if rank_fn.__name__ not in cache:
        from hfstream.testing import RankFailure, run_on_ranks

        path = learner.module_file()
        try:
            cache[rank_fn.__name__] = ("ok", run_on_ranks(rank_fn, WORLD, path, *args, timeout=_SPAWN_TIMEOUT_S,
                                                          pg_timeout_s=_PG_TIMEOUT_S))
        except RankFailure as e:
            cache[rank_fn.__name__] = ("failed", str(e))
    status, value = cache[rank_fn.__name__]
    if status == "failed":
        raise Wrong(_explain_failure(value))
    return value


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else text


def _explain_failure(text: str) -> str:
    """A rank failed: its last traceback line, and what usually causes it."""
    body = text.split("--- rank", 1)[-1]
    last = _last_line(body)
    if "timed out" in body or "Timeout" in body or "timed out" in text:
        why = ("the ranks hung: every rank must call the same collectives, in the same order, with the same "
               "src (a collective that only some ranks reach waits forever)")
    elif "leaf Variable" in body:
        why = ("you all-reduced a parameter itself; reduce its gradient, p.grad (parameters are kept equal by "
               "the broadcast at the start and identical steps after it)")
    elif "NoneType" in body:
        why = "a parameter without a gradient (frozen, or unused) has .grad None: skip it"
    elif "is not initialized" in body or "Default process group" in body:
        why = "call the collectives through torch.distributed (dist.*) in the rank; the group is already set up"
    else:
        why = "the rank raised this while running your code"
    return f"a rank failed: {last}. {why[0].upper() + why[1:]}"


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _diff(a, b) -> float:
    return float((_flat(a) - _flat(b)).abs().max())


def _seeded_grads(rank: int, model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(1000 + rank)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g)


def _guard(fn, *args):
    """Run one part in a rank; return (value, None) or (None, 'Error: message (in your code: line)')."""
    try:
        return fn(*args), None
    except Exception as e:   # noqa: BLE001 - reported to the parent, per part
        frames = traceback.extract_tb(e.__traceback__)
        where = next((f" (in your code: `{(fr.line or '').strip()}`)" for fr in reversed(frames)
                      if "learner_" in fr.filename), "")
        return None, f"{type(e).__name__}: {_last_line(str(e)) or repr(e)}{where}"


# --------------------------------------------------------------------------- 04.average_gradients
def _rank_average(rank: int, world_size: int, path: str):
    mod = load_module(path)
    out = {}

    def broadcast():
        model = TinyMLP(seed=10 + rank)          # each process built its own model: different weights
        mod.broadcast_parameters(model)
        return [p.detach().clone() for p in model.parameters()]

    def average():
        model = TinyMLP(seed=20 + rank)          # different weights, so reducing them would show
        _seeded_grads(rank, model)
        before = [p.detach().clone() for p in model.parameters()]
        mod.average_gradients(model)
        grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
        return grads, _diff(before, model.parameters())

    def frozen():
        model = TinyMLP(seed=0)
        model.layers[0].weight.requires_grad_(False)
        _seeded_grads(rank, model)
        mod.average_gradients(model)
        return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]

    out["broadcast"] = _guard(broadcast)
    out["average"] = _guard(average)
    out["frozen"] = _guard(frozen)
    return out


def _hung(err: str | None) -> bool:
    text = (err or "").lower()
    return "timeout" in text or "timed out" in text or "pair closure" in text or "connection" in text


def _broken_by_broadcast(runs) -> None:
    """A collective that hung in broadcast_parameters breaks every later one: say so once, plainly."""
    if any(_hung(out["broadcast"][1]) for out in runs):
        raise Wrong("the ranks lost each other in broadcast_parameters (see the first case), so every later "
                    "collective failed too: fix broadcast_parameters first")


def _expected_grads(world: int = WORLD):
    per_rank = []
    for r in range(world):
        m = TinyMLP(seed=0)
        _seeded_grads(r, m)
        per_rank.append([p.grad for p in m.parameters()])
    return per_rank


average_ex = Exercise("04.average_gradients", uses=["broadcast_parameters", "average_gradients"],
                      title="broadcast the start, average the gradients")


# --------------------------------------------------------------------------- drawn worlds on thread ranks
class _Net(nn.Module):
    """A drawn model: a few linear layers, maybe one frozen (requires_grad=False), maybe a `spare` layer the
    forward never uses (requires_grad=True, yet its .grad stays None), in float32 or float64."""

    def __init__(self, case, seed: int):
        super().__init__()
        world, sizes, frozen, spare, dtype = case
        g = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(a, b, dtype=dtype) for a, b in zip(sizes[:-1], sizes[1:]))
        if spare:
            self.spare = nn.Linear(2, 2, dtype=dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.3)
        if frozen is not None:
            self.layers[frozen].weight.requires_grad_(False)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def _draw_worlds(seed: int = 41, count: int = 6) -> list[tuple]:
    """``(world_size, layer sizes, frozen layer or None, spare layer?, dtype)``: 2, 3 and 4 ranks in turn."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        sizes = [rng.randint(2, 6) for _ in range(rng.randint(2, 4))]
        out.append(((3, 4, 2)[k % 3], tuple(sizes), rng.choice([None, 0]) if k % 2 else 0, k % 2 == 1,
                    (torch.float32, torch.float64)[k // 3 % 2]))
    return out


def _describe_world(case) -> str:
    world, sizes, frozen, spare, dtype = case
    bits = [f"{world} ranks", f"Linear layers {' -> '.join(map(str, sizes))}", str(dtype).replace("torch.", "")]
    if frozen is not None:
        bits.append(f"layers.{frozen}.weight frozen")
    if spare:
        bits.append("a layer `spare` no forward uses")
    return ", ".join(bits)


def _seeded_grads_drawn(rank: int, model: nn.Module) -> dict:
    g = torch.Generator().manual_seed(1000 + rank)
    for name, p in model.named_parameters():
        if p.requires_grad and not name.startswith("spare"):
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def _rank_error(errors, case) -> str | None:
    found = root_error(errors)
    if found is None:
        return None
    rank, exc = found
    text = str(exc).strip().splitlines()
    line = f"rank {rank} raised {type(exc).__name__}: {text[-1] if text else ''}"
    if "NoneType" in line or "'NoneType'" in line:
        return (f"{line}. A parameter that requires grad can still have no gradient: `spare` took no part in this "
                f"forward, so its .grad is None on every rank. Skip parameters whose .grad is None (test the "
                f"gradient, not requires_grad)")
    return line


def _average_mistake(learner, case) -> str | None:
    world = case[0]
    locals_ = [_seeded_grads_drawn(r, _Net(case, 20 + r)) for r in range(world)]

    def fn(rank):
        model = _Net(case, 20 + rank)
        _seeded_grads_drawn(rank, model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        learner.average_gradients(model)
        moved = max(float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters())
        return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}, moved

    results, errors = run_thread_ranks(world, fn)
    why = _rank_error(errors, case)
    if why:
        return why
    for rank, (grads, moved) in enumerate(results):
        own = all((g is None) == (locals_[rank][n] is None) and (g is None or torch.equal(g, locals_[rank][n]))
                  for n, g in grads.items())
        if moved > 0 and own:
            return (f"rank {rank}: the gradients are unchanged but the parameters moved: you reduced the parameters, "
                    f"not their gradients (each rank keeps its own gradient, so the ranks drift apart)")
        if moved > 0:
            return (f"rank {rank}: average_gradients changed the parameters themselves (by {moved:.3g}): it must only "
                    f"average .grad; the optimizer moves the parameters")
        summed, meaned, other = [], [], []
        for name, got in grads.items():
            local = [loc[name] for loc in locals_]
            if local[0] is None:
                if got is not None:
                    return f"rank {rank}: {name} had no gradient and got one: leave a parameter without a .grad alone"
                continue
            total = sum(local)
            if got is None:
                return f"rank {rank}: {name}.grad is None after average_gradients: reduce each gradient in place"
            if got.dtype != total.dtype:
                return (f"rank {rank}: {name}.grad came back as {got.dtype}, the gradient was {total.dtype}: reduce "
                        f"the gradient itself, in place")
            if torch.allclose(got, total / world, rtol=1e-5, atol=1e-7):
                meaned.append(name)
            elif torch.allclose(got, total, rtol=1e-5, atol=1e-7):
                summed.append(name)
            elif world != 2 and torch.allclose(got, total / 2, rtol=1e-5, atol=1e-7):
                return (f"rank {rank}: {name}.grad is the sum over the ranks divided by 2, with {world} ranks: the "
                        f"mean divides by the world size, dist.get_world_size(), whatever it is")
            elif torch.allclose(got, local[rank], rtol=1e-5, atol=1e-7):
                return (f"rank {rank}: {name}.grad came back unchanged, its own gradient: all_reduce works in place "
                        f"on the tensor you pass it, so a copy would be reduced and then thrown away")
            else:
                other.append(name)
        if summed and meaned:
            return (f"rank {rank}: {', '.join(summed)} hold{'s' if len(summed) == 1 else ''} the SUM over the ranks "
                    f"while {meaned[-1]} holds the mean: the division ran once, after the loop, for the last "
                    f"parameter only. Divide every gradient, inside the loop")
        if summed:
            return (f"rank {rank}: the gradients are the SUM over ranks, not the mean: all_reduce sums by default "
                    f"(without the mean every step is world_size times too large)")
        if other:
            return f"rank {rank}: {other[0]}.grad is not the mean over the {world} ranks"
    return None


DRAWN_BROADCAST = "drawn worlds: on 2, 3 and 4 ranks every rank starts from rank 0's weights"
DRAWN_AVERAGE = "drawn worlds: on 2, 3 and 4 ranks every rank holds the mean gradient"


def _broadcast_mistake(learner, case) -> str | None:
    world = case[0]

    def fn(rank):
        model = _Net(case, 10 + rank)
        learner.broadcast_parameters(model)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    results, errors = run_thread_ranks(world, fn)
    why = _rank_error(errors, case)
    if why:
        return why
    want = dict(_Net(case, 10).named_parameters())
    for rank, got in enumerate(results):
        for name, value in got.items():
            if torch.equal(value, want[name].detach()):
                continue
            own = dict(_Net(case, 10 + rank).named_parameters())[name].detach()
            if torch.equal(value, own):
                return (f"rank {rank} kept its own initial weights ({name}): the broadcast wrote somewhere else (into "
                        f"a copy, such as p.detach().clone(), that is then thrown away), or each rank named itself as "
                        f"the source. A collective writes in place into the tensor you pass it: pass the parameter's "
                        f"own storage, with rank 0 as the source on every rank")
            last = dict(_Net(case, 10 + world - 1).named_parameters())[name].detach()
            if torch.equal(value, last):
                return (f"rank {rank}'s {name} holds rank {world - 1}'s weights: the source of the broadcast is rank 0 "
                        f"on every rank, whatever the world size")
            return f"rank {rank}'s {name} holds neither its own weights nor rank 0's"
    return None


def _smaller_world(case):
    world, sizes, frozen, spare, dtype = case
    for w in (2, 3):
        if w < world:
            yield (w, sizes, frozen, spare, dtype)
    if len(sizes) > 2:
        yield (world, sizes[:2], 0 if frozen is not None else None, spare, dtype)


def _drawn_world_case(learner, mistake, reveal):
    cases = _draw_worlds()
    found = falsify(cases, lambda case: (None if (why := mistake(learner, case)) is None
                                         else f"{_describe_world(case)}: {why}"),
                    smaller=_smaller_world, budget=8, kind=after_colon)
    if found is None:
        return f"{len(cases)} drawn worlds of 2, 3 and 4 thread ranks"
    raise Wrong(str(found), reveal=reveal)


@average_ex.case(DRAWN_BROADCAST,
                 hint="every rank must receive rank 0's values into each of its own parameter tensors, whatever the "
                      "number of ranks", timeout=60)
def _(learner):
    """Property: on drawn models (2 to 4 layers, a frozen weight, a layer no forward uses, float32 and float64) on
    2, 3 and 4 thread ranks whose models were built with different seeds, broadcast_parameters leaves every rank's
    parameters equal to rank 0's; the first rank that breaks it is named."""
    return _drawn_world_case(learner, _broadcast_mistake, BROADCAST_CODE)


@average_ex.case(DRAWN_AVERAGE,
                 hint="average_gradients leaves every rank's .grad the mean over all ranks, whatever their number, and "
                      "leaves a parameter without a .grad alone", timeout=60)
def _(learner):
    """Property: on the same drawn worlds, average_gradients leaves every rank's .grad the mean over the ranks, None
    where there was none, the parameters untouched; the first rank that breaks it is named."""
    return _drawn_world_case(learner, _average_mistake, AVERAGE_CODE)


BROADCAST_CODE = "for p in model.parameters(): dist.broadcast(p.data, src=0)   # on every rank"
AVERAGE_CODE = ("for p in model.parameters(): if p.grad is not None: dist.all_reduce(p.grad); "
                "p.grad /= dist.get_world_size()")


@average_ex.case("broadcast_parameters: every rank starts from rank 0's weights",
                 hint="every rank must receive rank 0's values into each of its own parameter tensors",
                 reveal=BROADCAST_CODE, timeout=150, after=DRAWN_BROADCAST)
def _(learner):
    """Property: on 2 gloo processes whose models were built with different seeds, every rank ends with rank 0's
    weights."""
    runs = _spawn(learner, _rank_average)
    want = list(TinyMLP(seed=10).parameters())
    for rank, out in enumerate(runs):
        got, err = out["broadcast"]
        if err and _hung(err):
            raise Wrong(f"broadcast_parameters hung until the group's timeout on rank {rank}: every rank must "
                        "make the same broadcasts, for the same parameters in the same order, all naming the same "
                        "source rank (when each rank names itself, each waits to send and none receives)",
                        reveal=BROADCAST_CODE)
        if err:
            raise Wrong(f"broadcast_parameters raised on rank {rank}: {err}")
        if _diff(got, want) < 1e-7:
            continue
        own = list(TinyMLP(seed=10 + rank).parameters())
        if _diff(got, own) < 1e-7:
            raise Wrong(f"rank {rank} kept its own initial weights: the broadcast wrote somewhere else (into a copy, "
                        "such as p.detach().clone(), that is then thrown away), or each rank named itself as the "
                        "source. A collective writes in place into the tensor you pass it: pass the parameter's own "
                        "storage, with rank 0 as the source on every rank", reveal=BROADCAST_CODE)
        mean = [(a + b) / 2 for a, b in zip(TinyMLP(seed=10).parameters(), TinyMLP(seed=11).parameters())]
        if _diff(got, mean) < 1e-6:
            raise Wrong("you averaged the initial weights: the ranks agree, but on a model nobody initialised, "
                        "and a checkpoint or a seed no longer reproduces it. Broadcast rank 0's weights instead")
        raise AssertionError(f"after broadcast_parameters rank {rank}'s weights differ from rank 0's by "
                             f"{_diff(got, want):.3g}")
    return "both ranks hold rank 0's weights"


@average_ex.case("average_gradients: every .grad becomes the mean over ranks, the parameters untouched",
                 hint="every rank's .grad must end as the mean over ranks (all_reduce gives the sum), and only "
                      ".grad may change", reveal=AVERAGE_CODE, timeout=150, after=DRAWN_AVERAGE)
def _(learner):
    """Property: on 2 gloo processes, every rank's .grad becomes the mean over the ranks, the parameters untouched."""
    runs = _spawn(learner, _rank_average)
    _broken_by_broadcast(runs)
    per_rank = _expected_grads()
    mean = [sum(gs) / WORLD for gs in zip(*per_rank)]
    total = [sum(gs) for gs in zip(*per_rank)]
    for rank, out in enumerate(runs):
        value, err = out["average"]
        if err:
            raise Wrong(f"average_gradients raised on rank {rank}: {err}")
        grads, params_moved = value
        if any(g is None for g in grads):
            raise Wrong("after average_gradients some .grad is None: reduce each gradient in place and keep it")
        if _diff(grads, per_rank[rank]) < 1e-7:
            if params_moved > 0:
                raise Wrong("the gradients are unchanged but the parameters moved: you reduced the parameters, "
                            "not their gradients (each rank keeps its own gradient, so the ranks drift apart)",
                            reveal=AVERAGE_CODE)
            raise Wrong("the .grad tensors came back unchanged: all_reduce works in place on the tensor you pass "
                        "it, so a copy would be reduced and then thrown away", reveal=AVERAGE_CODE)
        if params_moved > 0:
            raise Wrong(f"average_gradients changed the parameters themselves on rank {rank} (by {params_moved:.3g}): "
                        "it must only average .grad; the optimizer moves the parameters")
        if _diff(grads, mean) < 1e-6:
            continue
        if _diff(grads, total) < 1e-5:
            raise Wrong("the gradients are the SUM over ranks, not the mean: all_reduce sums by default (without "
                        "the mean every step is world_size times too large, as if the learning rate were "
                        "multiplied by the number of ranks)",
                        reveal="after dist.all_reduce(p.grad): p.grad /= dist.get_world_size()")
        raise AssertionError(f"rank {rank}'s gradients differ from the mean over ranks by {_diff(grads, mean):.3g}")
    return "the mean over 2 ranks, on both; parameters unchanged"


@average_ex.case("a frozen parameter (no .grad) is skipped",
                 hint="a parameter whose .grad is None has nothing to average: leave it alone", timeout=150,
                 after=DRAWN_AVERAGE)
def _(learner):
    """Property: on 2 gloo processes, a frozen parameter (no .grad) is left alone on every rank."""
    runs = _spawn(learner, _rank_average)
    _broken_by_broadcast(runs)
    for rank, out in enumerate(runs):
        grads, err = out["frozen"]
        if err and "NoneType" in err:
            raise Wrong(f"with a frozen parameter (requires_grad=False, so .grad is None) average_gradients raised "
                        f"on rank {rank}: {err}. Skip parameters whose .grad is None")
        if err:
            raise Wrong(f"with a frozen parameter average_gradients raised on rank {rank}: {err}")
        assert grads[0] is None, "a frozen parameter got a .grad: leave parameters without a gradient alone"
    return "parameters unchanged, frozen parameter skipped"


# --------------------------------------------------------------------------- 04.train_parity
def _data():
    return random_regression(n=32, dim=32, seed=3)


def _rank_train(rank: int, world_size: int, path: str, steps: int, lr: float):
    mod = load_module(path)
    x, y = _data()
    model = TinyMLP(seed=rank)        # independent processes build different models: the loop must broadcast
    losses = mod.train_data_parallel(model, x.clone(), y.clone(), steps, lr)
    losses = None if losses is None else [float(v) for v in losses]
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def train_single_process(x, y, steps: int = STEPS, lr: float = LR, seed: int = 0, zero_grad: bool = True):
    """The reference: one process, the full batch, plain SGD. Returns (per-step losses, final parameters)."""
    model = TinyMLP(seed=seed)
    losses = []
    for _ in range(steps):
        if zero_grad:
            model.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        with torch.no_grad():      # torch.optim.SGD without momentum, without importing torch._dynamo
            for p in model.parameters():
                p -= lr * p.grad
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


parity_ex = Exercise("04.train_parity", uses=["train_data_parallel", "sgd_step", "average_gradients", "broadcast_parameters"],
                     title="data-parallel training, step for step equal to one process")


def _train_runs(learner):
    runs = _spawn(learner, _rank_train, STEPS, LR)
    for rank, out in enumerate(runs):
        losses = out["losses"]
        if not isinstance(losses, list) or len(losses) != STEPS:
            n = "None" if losses is None else len(losses) if isinstance(losses, list) else type(losses).__name__
            raise Wrong(f"train_data_parallel(..., steps={STEPS}) on rank {rank} returned {n} losses: return a list "
                        "with this rank's loss.item() of every step")
    return runs


def _first_loss(seed: int, rows) -> float:
    x, y = _data()
    with torch.no_grad():
        return float(F.mse_loss(TinyMLP(seed=seed)(x[rows]), y[rows]))


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


SAME_PARAMS = "every rank ends with the same parameters"
LOOP_CODE = ("broadcast_parameters(model) once; then every step: model.zero_grad(); "
             "loss = F.mse_loss(model(x_shard), y_shard); loss.backward(); average_gradients(model); "
             "sgd_step(model, lr); losses.append(loss.item())")
DRAWN_PARITY = "drawn worlds: on 2, 3 and 4 ranks every rank takes one process's full-batch step"


def _draw_trainings(seed: int = 42, count: int = 6) -> list[tuple]:
    """``(world_size, rows per rank, dim, steps, lr)``: 3, 4 and 2 ranks in turn, 1 to 4 rows each, 1 to 3 steps."""
    rng = random.Random(seed)
    return [((3, 4, 2)[k % 3], rng.randint(1, 4), rng.randint(2, 5), rng.randint(1, 3), rng.choice((0.1, 0.2, 0.5)))
            for k in range(count)]


def _reference(x, y, steps, lr, dim):
    """One process on the full batch: TinyMLP(seed=0), plain SGD. Returns (losses, parameters)."""
    model = TinyMLP(dim=dim, hidden=dim + 1, layers=2, seed=0)
    losses = []
    for _ in range(steps):
        model.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _reference_no_zero_grad(x, y, steps, lr, dim):
    model = TinyMLP(dim=dim, hidden=dim + 1, layers=2, seed=0)
    for _ in range(steps):
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return [p.detach().clone() for p in model.parameters()]


def _parity_mistake(learner, case) -> str | None:
    world, rows, dim, steps, lr = case
    x, y = random_regression(n=world * rows, dim=dim, seed=7)
    net = lambda seed: TinyMLP(dim=dim, hidden=dim + 1, layers=2, seed=seed)     # noqa: E731

    def fn(rank):
        model = net(rank)                # each rank builds its own model, with its own seed
        losses = learner.train_data_parallel(model, x.clone(), y.clone(), steps, lr)
        return (None if losses is None else [float(v) for v in losses]), [p.detach().clone() for p in model.parameters()]

    results, errors = run_thread_ranks(world, fn)
    found = root_error(errors)
    if found is not None:
        rank, exc = found
        text = str(exc).strip().splitlines()
        line = f"rank {rank} raised {type(exc).__name__}: {text[-1] if text else ''}"
        if isinstance(exc, IndexError) and rank >= 2:
            return (f"{line}: there is no shard for rank {rank}, so the batch was cut into fewer pieces than there are "
                    f"ranks. Cut it into world_size pieces, dist.get_world_size(), whatever that is")
        return line
    for rank, (losses, _) in enumerate(results):
        if not isinstance(losses, list) or len(losses) != steps:
            return f"rank {rank} returned {losses!r:.40} for steps={steps}: return one loss per step"
        if any(v != v for v in losses):
            return (f"rank {rank}'s loss is nan: its shard of the batch was empty. The {world * rows} rows must be cut "
                    f"into {world} equal shards, one per rank (a cut into 2 leaves ranks 2 and up nothing)")
    with torch.no_grad():
        full = float(F.mse_loss(net(0)(x), y))

    def on_shard(seed, r):
        with torch.no_grad():
            return float(F.mse_loss(net(seed)(x.chunk(world)[r]), y.chunk(world)[r]))

    close = lambda a, b: abs(a - b) <= 1e-5 * max(1.0, abs(b))                                      # noqa: E731
    firsts = [losses[0] for losses, _ in results]
    if all(close(f, full) for f in firsts):
        return ("every rank reports the full batch's loss: either each rank trained on the whole batch (the same "
                "work on every rank: nothing is parallel) or you returned the averaged loss. Each rank computes "
                "its loss on its own shard and returns that")
    for rank, f in enumerate(firsts):
        if close(f, on_shard(0, rank)):
            continue
        if rank and close(f, on_shard(rank, rank)):
            return (f"rank {rank}'s first loss is its own model's: the ranks started from different weights (each "
                    f"rank builds its model with its own seed, as independent processes would). The weights must be "
                    f"made equal before the first step")
        return (f"rank {rank}'s first loss is {f:.5f}, but on its shard (rows {rank * rows} to {(rank + 1) * rows - 1} "
                f"of {world * rows}, the rank-th of {world} equal parts) rank 0's weights give "
                f"{on_shard(0, rank):.5f}: each rank's shard is the rank-th of world_size equal parts")
    params = [p for _, p in results]
    for rank in range(1, world):
        gap = _diff(params[rank], params[0])
        if gap > 1e-6:
            return (f"the ranks started from the same weights but drifted apart: rank {rank} differs from rank 0 by "
                    f"{gap:.3g} after {steps} step(s), so average_gradients did not leave the same gradient on every "
                    f"rank (reducing p.data, or a copy of p.grad, leaves each rank its own p.grad)")
    ref = _reference(x, y, steps, lr, dim)[1]
    gap = _diff(params[0], ref)
    if gap < 1e-5:
        return None
    times = "twice" if world == 2 else f"{world} times"
    if _diff(params[0], _reference(x, y, steps, lr * world, dim)[1]) < 1e-5:
        if _average_mistake(learner, (world, (2, 3), None, False, torch.float32)):
            return (f"your run matches one process at {times} the learning rate: the gradients were summed over the "
                    f"ranks, not averaged (04.average_gradients names where)")
        return (f"your run matches one process at {times} the learning rate: average_gradients already leaves the "
                f"mean, the full batch's gradient, so the step is the one process's; do not scale the learning rate "
                f"(or the loss) by the world size")
    if _diff(params[0], _reference(x, y, steps, lr / world, dim)[1]) < 1e-5:
        return (f"your run matches one process at lr / {world}: the gradient was divided by the world size twice, "
                f"once in the loss and once in the average")
    if steps > 1 and _diff(params[0], _reference_no_zero_grad(x, y, steps, lr, dim)) < 1e-5:
        return ("your run matches one process that never zeroes its gradients: backward adds to .grad, so each step "
                "must start from zero gradients")
    return f"rank 0's parameters differ from one process trained on the full batch by {gap:.3g}"


@parity_ex.case(DRAWN_PARITY,
                hint="whatever the number of ranks, each rank trains on its own 1/world_size of the batch and every "
                     "rank takes the step one process takes on the whole batch", reveal=LOOP_CODE, timeout=60)
def _(learner):
    """Property: on 2, 3 and 4 thread ranks, drawn batch sizes, widths, step counts and learning rates, every rank
    computes its first loss on its own shard (the rank-th of world_size equal parts) and ends with the parameters
    of one process trained on the full batch; the first rank that breaks it is named."""
    cases = _draw_trainings()

    def smaller(case):
        world, rows, dim, steps, lr = case
        for w in (2, 3):
            if w < world:
                yield (w, rows, dim, steps, lr)
        if steps > 1:
            yield (world, rows, dim, 1, lr)
        if rows > 1:
            yield (world, 1, dim, steps, lr)

    found = falsify(cases, lambda c: (None if (why := _parity_mistake(learner, c)) is None
                                      else f"{c[0]} ranks, {c[0] * c[1]} rows of {c[2]}, {c[3]} step(s) at lr {c[4]:g}: "
                                           f"{why}"),
                    smaller=smaller, budget=6, kind=after_colon)
    if found is None:
        return f"{len(cases)} drawn trainings on 2, 3 and 4 thread ranks"
    raise Wrong(str(found), reveal=LOOP_CODE)


@parity_ex.case(SAME_PARAMS,
                hint="the ranks must start from the same weights and take the same step every step",
                reveal=LOOP_CODE, timeout=150, after=DRAWN_PARITY)
def _(learner):
    """Property: on 2 gloo processes that built their models with different seeds, both ranks end equal."""
    runs = _train_runs(learner)
    gap = _diff(runs[0]["params"], runs[1]["params"])
    if gap < 1e-6:
        return f"ranks agree to {gap:.1g}"
    x, y = _data()
    for shard in (slice(0, 16), slice(0, None, 2)):
        _, alone = train_single_process(x[shard], y[shard])
        if _diff(runs[0]["params"], alone) < 1e-5:
            raise Wrong("rank 0 ended exactly where training on its own shard alone would: its steps used its own "
                        "gradient, never the other rank's. The gradients must be averaged over the ranks between "
                        "backward and the optimizer step, every step",
                        reveal="loss.backward(); average_gradients(model); sgd_step(model, lr)")
    # Rank 1's first loss tells where it started: from its own weights (no broadcast), or from
    # rank 0's (the broadcast happened, so the drift comes from the steps).
    l1 = runs[1]["losses"][0]
    half = x.shape[0] // WORLD
    if any(_close(l1, _first_loss(1, rows)) for rows in (slice(half, None), slice(None))) and \
            not any(_close(l1, _first_loss(0, rows)) for rows in (slice(half, None), slice(None))):
        raise Wrong(f"after {STEPS} steps the ranks' parameters differ by {gap:.3g}, and rank 1's first loss is its "
                    "own model's: they started from different weights (each rank builds its model with its own "
                    "seed, as independent processes would). The weights must be made equal before the first step",
                    reveal="broadcast_parameters(model) before the first step")
    if any(_close(l1, _first_loss(0, rows)) for rows in (slice(half, None), slice(None))):
        raise Wrong(f"the ranks started from the same weights (rank 1's first loss is rank 0's model's) but drifted "
                    f"apart, by {gap:.3g} after {STEPS} steps: their steps differ, so average_gradients did not "
                    "leave the same gradient on every rank (reducing p.data, or a copy of p.grad, leaves each rank "
                    "its own p.grad). Check 04.average_gradients: its cases name the mistake", reveal=AVERAGE_CODE)
    raise AssertionError(f"after {STEPS} steps the ranks' parameters differ by {gap:.3g}")


@parity_ex.case("each rank trains on its own shard of the batch",
                hint="rank r's shard is the r-th of world_size equal, disjoint parts of the batch (rank 0: the "
                     "first rows), of x and of y alike", reveal="x.chunk(world_size)[rank], y.chunk(world_size)[rank]",
                after=SAME_PARAMS, timeout=150)
def _(learner):
    """Property: on 2 gloo processes, the mean of the ranks' first losses is the full batch's first loss."""
    runs = _train_runs(learner)
    x, y = _data()
    ref_losses, _ = train_single_process(x, y)
    l0, l1 = runs[0]["losses"][0], runs[1]["losses"][0]
    full = ref_losses[0]
    if abs(l0 - full) < 1e-6 * max(1.0, full) and abs(l1 - full) < 1e-6 * max(1.0, full):
        raise Wrong("both ranks report the full batch's loss: either each rank trained on the whole batch (the same "
                    "work twice: nothing is parallel) or you returned the averaged loss. Each rank computes its "
                    "loss on its own shard and returns that", reveal="x.chunk(world_size)[rank], y.chunk(world_size)[rank]")
    if abs((l0 + l1) / 2 - full) > 1e-4 * max(1.0, full):
        raise Wrong(f"the mean of the ranks' first losses ({(l0 + l1) / 2:.5f}) is not the full batch's loss "
                    f"({full:.5f}): the shards must split the batch into world_size equal, disjoint parts",
                    reveal="x.chunk(world_size)[rank], y.chunk(world_size)[rank]")
    return f"first losses {l0:.4f} and {l1:.4f}, mean {(l0 + l1) / 2:.4f} = full batch {full:.4f}"


@parity_ex.case("the parameters match one process trained on the full batch",
                hint="each step must take the step one process takes on the full batch: gradients from zero, the "
                     "shard's loss, its gradient averaged over the ranks, then the SGD step",
                reveal=LOOP_CODE, after=[SAME_PARAMS, "each rank trains on its own shard of the batch"], timeout=150)
def _(learner):
    """Property: on 2 gloo processes, every rank's parameters after 8 steps are one process's on the full batch."""
    runs = _train_runs(learner)
    x, y = _data()
    _, ref = train_single_process(x, y)
    gaps = [_diff(run["params"], ref) for run in runs]          # every rank read
    rank = max(range(len(runs)), key=lambda r: gaps[r])
    gap = gaps[rank]
    if gap < 1e-5:
        return f"max |difference| {gap:.1g} after {STEPS} steps, on every rank"
    if _diff(runs[rank]["params"], train_single_process(x, y, lr=LR * WORLD)[1]) < 1e-5:
        raise Wrong("your run matches one process at twice the learning rate: the gradients were summed over the "
                    "ranks, not averaged", reveal="after dist.all_reduce(p.grad): p.grad /= dist.get_world_size()")
    if _diff(runs[rank]["params"], train_single_process(x, y, zero_grad=False)[1]) < 1e-5:
        raise Wrong("your run matches one process that never zeroes its gradients: backward adds to .grad, so "
                    "each step must start from zero gradients", reveal="model.zero_grad() at the start of every step")
    raise AssertionError(f"after {STEPS} steps rank {rank}'s parameters differ from the single-process reference by "
                         f"{gap:.3g}")
