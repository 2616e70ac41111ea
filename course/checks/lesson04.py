"""Lesson 04 checks: data parallelism from scratch, run in two real gloo processes.

The learner's exercise cells are written to a file (`Learner.module_file`) that each rank imports;
top-level statements other than definitions, imports and plain assignments are left out of that
file, so a test call the learner left in a cell does not run (or spawn) again in every rank. The
results are compared in this process with a single-process reference trained on the full batch.

`on_ranks` gives the notebook the same machinery for its own functions.
"""

from __future__ import annotations

import traceback
import types

import torch
import torch.nn.functional as F

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


BROADCAST_CODE = "for p in model.parameters(): dist.broadcast(p.data, src=0)   # on every rank"
AVERAGE_CODE = ("for p in model.parameters(): if p.grad is not None: dist.all_reduce(p.grad); "
                "p.grad /= dist.get_world_size()")


@average_ex.case("broadcast_parameters: every rank starts from rank 0's weights",
                 hint="every rank must receive rank 0's values into each of its own parameter tensors",
                 reveal=BROADCAST_CODE, timeout=150)
def _(learner):
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
                      ".grad may change", reveal=AVERAGE_CODE, timeout=150)
def _(learner):
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
                 hint="a parameter whose .grad is None has nothing to average: leave it alone", timeout=150)
def _(learner):
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


@parity_ex.case(SAME_PARAMS,
                hint="the ranks must start from the same weights and take the same step every step",
                reveal=LOOP_CODE, timeout=150)
def _(learner):
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
    runs = _train_runs(learner)
    x, y = _data()
    _, ref = train_single_process(x, y)
    gap = _diff(runs[0]["params"], ref)
    if gap < 1e-5:
        return f"max |difference| {gap:.1g} after {STEPS} steps"
    if _diff(runs[0]["params"], train_single_process(x, y, lr=LR * WORLD)[1]) < 1e-5:
        raise Wrong("your run matches one process at twice the learning rate: the gradients were summed over the "
                    "ranks, not averaged", reveal="after dist.all_reduce(p.grad): p.grad /= dist.get_world_size()")
    if _diff(runs[0]["params"], train_single_process(x, y, zero_grad=False)[1]) < 1e-5:
        raise Wrong("your run matches one process that never zeroes its gradients: backward adds to .grad, so "
                    "each step must start from zero gradients", reveal="model.zero_grad() at the start of every step")
    raise AssertionError(f"after {STEPS} steps rank 0's parameters differ from the single-process reference by "
                         f"{gap:.3g}")
