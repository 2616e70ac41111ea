"""Part 7: GradSync on every visible GPU, one rank each, over NCCL (gloo on 2 CPU processes with ``--on-cpu``).

What one rank cannot show (part 6: NCCL on one rank is a copy, a default-group collective a no-op):

    overlap     buckets all-reduced from the hooks on the gradient group: the parameters after a
                few steps equal the single-process mean's (within 1e-6), bitwise the same on every rank
    sharded     reduce-scatter in backward, slice step, all-gather into the next forward: the same;
                and the forward starts with the gathers launched and not yet waited for
                (``params_pending``, GradSync's own count, non-empty at the model's first forward
                pre-hook: nothing between the step and the forward waited for them); how many of
                them the device had not finished (``Work.is_completed()``) is recorded, not checked:
                without a sleep ahead of them small gathers may land before the host gets there
                (part 6 checks it behind one)
    host sync   no host read in a whole step (a counting ``TorchFunctionMode``), and on a GPU none
                under ``set_sync_debug_mode("error")``; each detector first catches a deliberate ``.item()``
    profiler    the report's all-reduce, reduce-scatter and all-gather times against
                ``torch.profiler``'s NCCL kernels (GPU only)
    two groups  sharded steps with the gradient group's all-gathers launched while the Trainer's own
                ``accelerator.gather`` (``num_items_in_batch``) runs on WORLD: no hang, every gathered
                value right, the parameters still the single-process mean's

The gradient group is `hfstream.trainer.data_parallel.gradient_group`'s, as the Trainer makes it (NCCL,
high priority); on CPU, where it makes none, a gloo ``new_group`` stands in, so two communicators
still run. WORLD is initialised by Accelerate (``Accelerator()``), as in a Trainer run.

Launch: with more than one GPU, ``torchrun --standalone --nproc_per_node <GPUs> -m
dev.gpu_check.multi_rank`` (the torchrun of this python), else ``torch.multiprocessing``
spawn; each rank writes its result to a file, the part merges them (a check holds when it holds on
every rank). With one GPU the part is a skip that says it needs two, never a pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

from dev.gpu_check.checks import Checks, compare_tensors, mlp, mse, synchronize
from dev.gpu_check.device_order import gathers_running
from dev.gpu_check.procs import REPO, child_env, run_child
from dev.gpu_check.table import TAIL_LINES, strict_json, tail

PG_TIMEOUT_S = 60          # a collective that never completes raises (gloo) / aborts (NCCL) after this
PARAM_ATOL = 1e-6          # parameters against the single-process mean's
LAUNCHER_ENV = "HFSTREAM_GPU_CHECK_LAUNCHER"   # "torchrun" or "spawn": a test's override of the choice


def multi_rank_sizes(quick: bool, on_cpu: bool) -> dict:
    if on_cpu:
        return dict(width=64, layers=3, batch=8, steps=3, soak=6, bucket_mb=0.02, profiled=0)
    if quick:
        return dict(width=1024, layers=4, batch=32, steps=3, soak=20, bucket_mb=2.0, profiled=3)
    return dict(width=2048, layers=6, batch=64, steps=5, soak=100, bucket_mb=8.0, profiled=5)


# ================================================================================ the part (parent)
def visible_ranks(on_cpu: bool) -> int:
    if on_cpu:
        return 2
    import torch

    return torch.cuda.device_count()


def part_multi_rank(quick: bool, on_cpu: bool, timeout_s: float, ranks: int | None = None) -> dict:
    world = visible_ranks(on_cpu) if ranks is None else ranks
    if world < 2:
        return {"status": "skip", "summary": [
            f"needs two GPUs: {world} visible. Not run (one rank cannot show it: NCCL on one rank copies instead "
            "of communicating, a default-group collective is a no-op)"]}
    with tempfile.TemporaryDirectory() as tmp:
        launcher, rc, text = launch(world, Path(tmp), quick, on_cpu, max(timeout_s - 5, 10))
        outs = [_read(Path(tmp) / f"rank{r}.json") for r in range(world)]
    result = merge_ranks(outs, world, quick, on_cpu, launcher)
    if result["status"] == "fail" and text.strip():
        result["detail"] = (str(result.get("detail") or "") + f"\n--- {launcher} (exit {rc}), last lines ---\n"
                            + tail(text, TAIL_LINES)).strip()
    return result


def launcher_command(world: int) -> list[str] | None:
    """``torchrun`` of this python (beside it, or on PATH with this python in its ``#!`` line); None: spawn."""
    choice = os.environ.get(LAUNCHER_ENV, "")
    if choice == "spawn":
        return None
    beside = Path(sys.executable).parent / "torchrun"
    on_path = shutil.which("torchrun")
    found = beside if beside.exists() else (Path(on_path) if on_path else None)
    if found is None or (choice != "torchrun" and found != beside and not _runs_this_python(found)):
        return None     # a torchrun of another python would run another torch
    return [str(found), "--standalone", "--nnodes", "1", "--nproc_per_node", str(world)]


def _runs_this_python(script: Path) -> bool:
    try:
        with open(script, "rb") as f:
            first = f.readline().decode(errors="replace").strip()
    except OSError:
        return False
    if not first.startswith("#!"):
        return False
    interpreter = first[2:].split()[0] if first[2:].split() else ""
    try:
        return Path(interpreter).resolve() == Path(sys.executable).resolve()
    except OSError:
        return False


def launch(world: int, out: Path, quick: bool, on_cpu: bool, timeout_s: float) -> tuple[str, int | None, str]:
    """Run `rank_main` on ``world`` ranks; each writes ``out/rank{r}.json``. Returns (launcher, exit code, output)."""
    flags = ["--out", str(out)] + (["--quick"] if quick else []) + (["--on-cpu"] if on_cpu else [])
    cmd = launcher_command(world)
    if cmd is not None:
        rc, text, _ = run_child(cmd + ["-m", "dev.gpu_check.multi_rank"] + flags, timeout_s, cwd=REPO,
                                env=child_env())
        return "torchrun", rc, text
    from hfstream.testing import RankFailure, run_on_ranks

    try:
        run_on_ranks(_spawned, world, str(out), quick, on_cpu, timeout=timeout_s, init_process_group=False)
        return "spawn", 0, ""
    except RankFailure as exc:
        return "spawn", 1, str(exc)


def _spawned(rank: int, world: int, out: str, quick: bool, on_cpu: bool) -> None:
    _write_rank(Path(out), rank, world, quick, on_cpu)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def merge_ranks(outs: list[dict | None], world: int, quick: bool, on_cpu: bool, launcher: str) -> dict:
    """One result from every rank's: a check holds when it holds on every rank; what a check compared is
    the least any rank compared (a rank that compared nothing fails it); a rank without a result fails."""
    checks = Checks()
    good = []
    for r, out in enumerate(outs):
        if out is None:
            checks.add(f"rank {r} reported", False, "no result (crashed, hung or killed)")
        elif out.get("error"):
            checks.add(f"rank {r} reported", False, str(out["error"]).strip().splitlines()[-1][:300])
        else:
            good.append((r, out))
    names: list[str] = []
    for _, out in good:
        names += [c[0] for c in out["checks"] if c[0] not in names]
    for name in names:
        rows = [(r, next((c for c in out["checks"] if c[0] == name), None)) for r, out in good]
        bad = [(r, c) for r, c in rows if c is None or not c[1]]
        info = next((f"rank {r}: {c[2] if c else 'not run'}" for r, c in bad), rows[0][1][2] if rows else "")
        checks.items.append((name, not bad and len(good) == world, info))
        counts = [next((c for c in out["compared"] if c[0] == name), None) for _, out in good]
        if any(c is not None for c in counts):
            kind = next(c[2] for c in counts if c is not None)
            checks.compared.append((name, min(c[1] if c else 0 for c in counts), kind))
    numbers = {"world": world, "launcher": launcher, "ranks_reported": len(good),
               **({"rank0": good[0][1]["numbers"]} if good else {})}
    summary = [f"{world} ranks ({launcher}, {'gloo on CPU' if on_cpu else 'NCCL'}), {len(good)} reported"]
    if good and good[0][0] == 0:
        try:
            summary += rank0_summary(good[0][1]["numbers"], on_cpu)
        except (KeyError, TypeError, ValueError) as exc:   # a rank's numbers incomplete: its checks say why
            summary.append(f"rank 0's numbers incomplete ({type(exc).__name__}: {exc})")
    return checks.result(summary, numbers)


def rank0_summary(n: dict, on_cpu: bool) -> list[str]:
    size = n["size"]
    lines = [
        f"overlap: parameters = single-process mean after {size['steps']} steps (max |diff| {n['overlap_diff']:.1e}), "
        f"{n['overlap_collectives']} all-reduces a step; sharded: (max |diff| {n['sharded_diff']:.1e}), "
        f"{n['sharded_collectives']} reduce-scatters + {n['sharded_gathers']} all-gathers a step; "
        f"gradient group: {n['grad_group']}",
        f"forward started with {n['pending_min']}..{n['pending_max']} of {n['sharded_buckets']} all-gathers pending "
        f"({n['pending_seen']} steps seen; running on the device {n['running_on_device']}); "
        f"host reads in a step: overlap {n['overlap_reads']}, sharded "
        f"{n['sharded_reads']}" + ("" if on_cpu else f"; sync-debug 'error': overlap {n['overlap_sync_error'] or 'clean'}, "
                                                     f"sharded {n['sharded_sync_error'] or 'clean'}"),
        f"two groups: {n['soak_steps']} sharded steps, accelerator.gather on WORLD with gathers pending in "
        f"{n['soak_under_load']}, {n['soak_s']:.1f} s, max |diff| {n['soak_diff']:.1e}",
    ]
    if not on_cpu:
        lines.append("report vs NCCL kernels (ms a step): " + ", ".join(
            f"{op} {n.get(f'report_{op}_ms', float('nan')):.3f} vs {n.get(f'kernel_{op}_ms') or float('nan'):.3f}"
            for op in ("allreduce", "reducescatter", "allgather")))
    else:
        lines.append("profiler and sync-debug: n/a on CPU (gloo runs no device kernel)")
    return lines


# ================================================================================ one rank
def _write_rank(out: Path, rank: int, world: int, quick: bool, on_cpu: bool) -> None:
    try:
        result = rank_main(rank, world, quick, on_cpu)
    except BaseException:   # noqa: BLE001 - the merged table names the rank and its error
        result = {"error": traceback.format_exc()}
    (out / f"rank{rank}.json").write_text(json.dumps(strict_json(result), allow_nan=False))


def rank_main(rank: int, world: int, quick: bool, on_cpu: bool) -> dict:
    import datetime

    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cuda = not on_cpu
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
    accelerator = Accelerator(cpu=on_cpu, kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)])
    try:
        return run_rank(accelerator, multi_rank_sizes(quick, on_cpu), cuda, timeout)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def gradient_group(cuda: bool, timeout):
    """The Trainer's gradient group (`data_parallel.gradient_group`); on CPU a gloo group stands in."""
    import types

    import torch.distributed as dist

    from hfstream.trainer.data_parallel import gradient_group as trainers_group

    args = types.SimpleNamespace(comm_stream_priority="high", grad_sync="sharded",
                                 ddp_timeout=int(timeout.total_seconds()))
    group = trainers_group(args)
    if group is not None:
        return group, "NCCL, high priority (data_parallel.gradient_group)"
    if cuda:
        return None, "WORLD (data_parallel.gradient_group made none)"
    return dist.new_group(backend="gloo", timeout=timeout), "gloo new_group (CPU stand-in)"


def run_rank(accelerator, size: dict, cuda: bool, timeout) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    group, how = gradient_group(cuda, timeout)
    ctx = dict(rank=rank, world=world, dev=accelerator.device, cuda=cuda, size=size, group=group,
               accelerator=accelerator)
    checks = Checks()
    numbers: dict = {"size": size, "grad_group": how}
    checks.add("the gradient group is not WORLD (two communicators)", group is not None and group != dist.group.WORLD,
               how)
    _host_read_controls(ctx, checks)
    _overlap(ctx, checks, numbers)
    _sharded(ctx, checks, numbers)
    _two_groups(ctx, checks, numbers)
    return {"checks": checks.items, "compared": checks.compared, "numbers": numbers}


def _data(step: int, r: int, size: dict, dev):
    import torch

    g = torch.Generator().manual_seed(7919 * step + r)
    x = torch.randn(size["batch"], size["width"], generator=g)
    return x.to(dev), torch.randn(size["batch"], size["width"], generator=g).to(dev)


def _models(ctx):
    import copy

    import torch

    torch.manual_seed(0)
    model = mlp(ctx["size"]["width"], ctx["size"]["layers"]).to(ctx["dev"])
    return model, copy.deepcopy(model)


def _sgd(params):
    import torch

    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _reference_step(ref, ref_opt, step: int, ctx) -> None:
    """One process, every rank's batch: the mean gradient, the plain optimizer's step."""
    for r in range(ctx["world"]):
        mse(ref, *_data(step, r, ctx["size"], ctx["dev"])).backward()
    for p in ref.parameters():
        p.grad.div_(ctx["world"])
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)


def _train_step(model, sync, opt, x, y) -> None:
    mse(model, x, y).backward()
    sync.finish()
    opt.step()
    opt.zero_grad(set_to_none=True)


def same_on_every_rank(checks: Checks, name: str, tensors) -> None:
    """Bitwise: this rank's tensors against every other rank's (gathered on WORLD)."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    others = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(others, flat)
    me = dist.get_rank()
    differ = [r for r, o in enumerate(others) if r != me and not torch.equal(o, flat)]
    checks.compare(name, len(others) - 1, "other ranks' parameters (bitwise)", not differ,
                   f"{flat.numel()} elements each" + (f"; rank(s) {differ} differ" if differ else ""))


# -- host syncs ------------------------------------------------------------------------------------
def _host_read_controls(ctx, checks: Checks) -> None:
    """Each detector must catch a deliberate ``.item()`` before its silence means anything."""
    import torch

    from dev.gpu_check.syncdebug import host_reads, sync_debug

    with host_reads(ctx["dev"].type) as watch:
        torch.ones((), device=ctx["dev"]).add(1).item()
    checks.add("control: the host-read counter catches a deliberate .item()", len(watch.reads) == 1, f"{watch.reads}")
    if ctx["cuda"]:
        with sync_debug("error", True):
            try:
                torch.ones((), device=ctx["dev"]).item()
                raised = False
            except RuntimeError:
                raised = True
        checks.add("control: set_sync_debug_mode('error') catches a deliberate .item()", raised)


def watched_step(step, mode: str, ctx, checks: Checks, numbers: dict) -> None:
    """Run ``step()`` once under the host-read counter (and on a GPU under sync-debug 'error')."""
    from dev.gpu_check.syncdebug import host_reads, sync_debug

    synchronize(ctx["cuda"])
    error = None
    with sync_debug("error", ctx["cuda"]):
        with host_reads(ctx["dev"].type) as watch:
            try:
                step()
            except RuntimeError as exc:
                error = str(exc).splitlines()[0][:200]
    synchronize(ctx["cuda"])
    numbers[f"{mode}_reads"] = len(watch.reads)
    numbers[f"{mode}_sync_error"] = error
    checks.compare(f"{mode}: no host read in a whole step (forward, backward, finish, optimizer step)",
                   watch.calls, "torch calls watched", not watch.reads and error is None,
                   "; ".join(watch.reads[:4]) + (f"; {error}" if error else ""))
    if ctx["cuda"]:
        checks.add(f"{mode}: no host sync in the step under set_sync_debug_mode('error')", error is None, error or "")


# -- overlap ---------------------------------------------------------------------------------------
def _train_steps(model, sync, opt, ref, ref_opt, mode: str, ctx, checks: Checks, numbers: dict):
    """The part's training steps beside the single-process reference's, the last one watched; the last stats."""
    size, dev = ctx["size"], ctx["dev"]
    stats = None
    for step in range(size["steps"]):
        x, y = _data(step, ctx["rank"], size, dev)
        if step == size["steps"] - 1:
            watched_step(lambda: _train_step(model, sync, opt, x, y), mode, ctx, checks, numbers)
        else:
            _train_step(model, sync, opt, x, y)
        stats = sync.stats
        _reference_step(ref, ref_opt, step, ctx)
    return stats


def _overlap(ctx, checks: Checks, numbers: dict) -> None:
    from hfstream import GradSync

    size = ctx["size"]
    model, ref = _models(ctx)
    sync = GradSync(model, bucket_mb=size["bucket_mb"], mode="overlap", process_group=ctx["group"], timeout=60)
    opt, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    stats = _train_steps(model, sync, opt, ref, ref_opt, "overlap", ctx, checks, numbers)
    numbers["overlap_diff"] = compare_tensors(
        checks, f"overlap: parameters equal the single-process mean's after {size['steps']} steps",
        list(model.parameters()), list(ref.parameters()), PARAM_ATOL, "parameter tensors")
    same_on_every_rank(checks, "overlap: every rank holds bitwise the same parameters", list(model.parameters()))
    numbers.update(overlap_collectives=stats.num_collectives, overlap_buckets=len(sync.buckets))
    checks.compare("overlap: every bucket all-reduced once a step, launched in backward", stats.num_collectives,
                   "all-reduces", stats.num_collectives == len(sync.buckets) >= 2 and stats.launched_in_backward >= 1,
                   f"{len(sync.buckets)} buckets, {stats.launched_in_backward} launched in backward")
    if ctx["cuda"] and size["profiled"]:
        _profile(ctx, model, sync, opt, 2000, checks, numbers, {"allreduce": ("comm_busy_ms", len(sync.buckets))})
    sync.close()


def _profile(ctx, model, sync, opt, seed: int, checks: Checks, numbers: dict, ops: dict) -> None:
    """``size["profiled"]`` steps under torch.profiler: each op's report time against its NCCL kernels."""
    import math

    from torch.profiler import ProfilerActivity, profile

    from dev.gpu_check.comm_kernels import compare_comm_times, device_events

    steps = ctx["size"]["profiled"]
    reported: dict[str, list[float]] = {op: [] for op in ops}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx["cuda"] else [])
    with profile(activities=activities) as prof:
        for k in range(steps):
            _train_step(model, sync, opt, *_data(seed + k, ctx["rank"], ctx["size"], ctx["dev"]))
            stats = sync.stats
            for op, (field, _) in ops.items():
                reported[op].append(getattr(stats, field))
        if sync.mode == "sharded":
            sync.wait_for_params()
        synchronize(ctx["cuda"])
    events = device_events(prof)
    for op, (field, per_step) in ops.items():
        values = [v for v in reported[op] if math.isfinite(v)]
        report = sum(values) / max(len(values), 1) if values else math.nan
        numbers[f"report_{op}_ms"] = report
        numbers[f"kernel_{op}_ms"] = compare_comm_times(
            checks, f"{sync.mode}: the report's {op} time is the profiler's NCCL kernel time", report, events, op,
            per_step, steps)


# -- sharded ---------------------------------------------------------------------------------------
def _sharded_pair(ctx):
    from hfstream import GradSync

    model, ref = _models(ctx)
    sync = GradSync(model, bucket_mb=ctx["size"]["bucket_mb"], mode="sharded", process_group=ctx["group"], timeout=60)
    opt = sync.shard_optimizer(_sgd(model.parameters()))
    return model, ref, sync, opt, _sgd(ref.parameters())


def _sharded(ctx, checks: Checks, numbers: dict) -> None:
    size = ctx["size"]
    model, ref, sync, opt, ref_opt = _sharded_pair(ctx)
    pending: list[int] = []
    running: list[int] = []

    def at_forward(_m, _a):   # before every other pre-hook (GradSync's waits included)
        launched, unfinished = gathers_running(sync)
        pending.append(launched)
        running.append(len(unfinished))

    handle = model.register_forward_pre_hook(at_forward, prepend=True)
    stats = _train_steps(model, sync, opt, ref, ref_opt, "sharded", ctx, checks, numbers)
    handle.remove()
    sync.wait_for_params()
    numbers["sharded_diff"] = compare_tensors(
        checks, f"sharded: parameters equal the single-process mean's after {size['steps']} steps",
        list(model.parameters()), list(ref.parameters()), PARAM_ATOL, "parameter tensors")
    same_on_every_rank(checks, "sharded: every rank holds bitwise the same parameters", list(model.parameters()))
    buckets = len(sync.buckets)
    seen = pending[1:]           # the first forward follows no step: nothing can be pending there
    numbers.update(sharded_collectives=stats.num_collectives, sharded_gathers=stats.num_all_gathers,
                   sharded_buckets=buckets, pending_seen=len(seen), pending_min=min(seen, default=0),
                   pending_max=max(seen, default=0), running_on_device=running[1:])
    checks.compare("sharded: every bucket reduce-scattered and all-gathered once a step", stats.num_collectives,
                   "reduce-scatters", stats.num_collectives == stats.num_all_gathers == buckets >= 2,
                   f"{stats.num_all_gathers} all-gathers, {buckets} buckets")
    checks.compare("sharded: the forward starts with the all-gathers launched and not waited for (params_pending "
                   "at its first pre-hook)", len(seen), "forwards after a step", bool(seen) and min(seen) >= 1,
                   f"pending {seen} of {buckets} buckets; still running on the device {running[1:]} (recorded)")
    if ctx["cuda"] and size["profiled"]:
        _profile(ctx, model, sync, opt, 3000, checks, numbers,
                 {"reducescatter": ("comm_busy_ms", buckets), "allgather": ("all_gather_busy_ms", buckets)})
    sync.close()


# -- two communicators -----------------------------------------------------------------------------
def _two_groups(ctx, checks: Checks, numbers: dict) -> None:
    """The Trainer's step order: ``accelerator.gather(num_items_in_batch)`` on WORLD before the forward,
    while the last step's all-gathers are launched on the gradient group and not waited for."""
    import time

    import torch

    size, dev, rank, world = ctx["size"], ctx["dev"], ctx["rank"], ctx["world"]
    model, ref, sync, opt, ref_opt = _sharded_pair(ctx)
    gathered, under_load, errors = [], [], []
    done = 0
    t0 = time.perf_counter()
    for step in range(size["soak"]):
        x, y = _data(20_000 + step, rank, size, dev)
        try:
            under_load.append(len(sync.params_pending))
            gathered.append(ctx["accelerator"].gather(torch.tensor([1000 * rank + step], device=dev)))
            _train_step(model, sync, opt, x, y)
        except Exception as exc:   # noqa: BLE001 - the table says where it broke
            errors.append(f"step {step}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            break
        _reference_step(ref, ref_opt, 20_000 + step, ctx)
        done += 1
    synchronize(ctx["cuda"])
    numbers.update(soak_steps=done, soak_s=time.perf_counter() - t0, soak_errors=errors,
                   soak_under_load=sum(1 for p in under_load if p))
    checks.add(f"two groups: {size['soak']} sharded steps with accelerator.gather on WORLD, no error or hang",
               not errors and done == size["soak"], "; ".join(errors))
    want = [torch.tensor([1000 * r + s for r in range(world)], device=dev) for s in range(len(gathered))]
    compare_tensors(checks, "two groups: every accelerator.gather result right", gathered, want, 0.0,
                    "gathered tensors")
    checks.compare("two groups: WORLD's gather ran while the gradient group's all-gathers were launched and not "
                   "waited for (params_pending)",
                   sum(1 for p in under_load if p), "steps under load", all(under_load[1:]),
                   f"pending at each gather {under_load[:8]}{'...' if len(under_load) > 8 else ''}")
    if not errors:
        sync.wait_for_params()
        numbers["soak_diff"] = compare_tensors(
            checks, "two groups: parameters still equal the single-process mean's", list(model.parameters()),
            list(ref.parameters()), 10 * PARAM_ATOL, "parameter tensors")
    else:
        numbers["soak_diff"] = float("nan")
    sync.close()


# ================================================================================ a rank under torchrun
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dev.gpu_check.multi_rank",
                                 description="One rank of gpu-check's multi-rank part (started by torchrun).")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--on-cpu", action="store_true")
    args = ap.parse_args(argv)
    _write_rank(Path(args.out), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.quick, args.on_cpu)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # no interpreter teardown: a lingering communicator thread cannot hang the exit


if __name__ == "__main__":
    main()
