"""``python -m hfstream.tools.gpu_check``: everything that needs a GPU, in one run, one table.

Meant for a machine lent one NVIDIA GPU for a few minutes (``make gpu-check``): it runs with
the machine's own python and ``PYTHONPATH=.``, no install, no network, and imports only torch,
transformers, accelerate, the standard library and hfstream's training path (never ``datasets``
nor ``hfstream.tools.data``). Without a GPU it prints one line and exits 0.

    python -m hfstream.tools.gpu_check [--json runs/gpu_check.json] [--quick] [--parts gradsync,prefetch]

The parts (each in its own child process with its own time box, so a hang, a crash or a broken
CUDA context in one is recorded in the table and the others still run):

    1 pytest    the tests marked ``gpu`` (``pytest -m gpu`` on the test files that mark any)
    2 gradsync  GradSync on 2 ranks over gloo, both on cuda:0: gradients equal the
                single-process mean, buckets launched from the hooks on the side stream, and
                the host never waits for the device while forward, backward and the launches run
    3 prefetch  StreamPrefetcher on copy-heavy batches against a plain pinned
                ``.to(non_blocking=True)`` loop and a plain synchronous copy, a matmul per step
                as long as the copy; batches intact; the consume loop under
                ``set_sync_debug_mode("error")``
    4 ws1       GradSync on one process (no process group) costs nothing: step time with and
                without it
    5 trainer   a StreamTrainer run (tiny GPT-2 from a config, 20 steps): it trains, and its
                ``stream_report()``

What synchronises in a GradSync step (read from ``gradsync/sync.py`` and torch's gloo backend):
the gradient hooks and ``_launch`` only enqueue work (pack on the side stream, events,
``all_reduce(async_op=True)``); a ``.tolist()`` of the "used" flags in ``_unpack`` and the
``torch.tensor`` of them in ``_pack`` copy to and from the host, but only for a bucket with a
parameter unused on this rank (none here); ``finish()`` waits on the host for each bucket's
``Work`` (by design); reading ``GradSync.stats`` waits for its timing events (by design: the
Trainer reads them a step later). On CUDA tensors gloo's ``run()``, on its own worker thread,
calls ``cudaStreamSynchronize`` on its device-to-host copy before reducing on the host.
``set_sync_debug_mode`` is one process-wide switch, so ``"error"`` would fail that worker's
collective; the synchronised step is therefore checked with ``"warn"`` (every sync a Python
thread makes, the autograd thread's hooks included, is recorded with its phase and source line;
gloo's C++ worker only logs) and with a sleep kernel queued ahead of it (the host must get
through forward, backward and every launch while the device still sleeps). ``"error"`` itself
covers what has no collective in flight: a ``no_sync()`` micro-step, the prefetcher loop, the
world-size-1 step. Each detector is first shown a deliberate ``.item()`` it must catch.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]

# Table order (the numbering of the parts) and execution order: the tests marked gpu go last, so
# a slow test suite cannot eat the budget of the checks that exist only here.
PARTS = ("pytest", "gradsync", "prefetch", "ws1", "trainer")
RUN_ORDER = ("gradsync", "prefetch", "ws1", "trainer", "pytest")
TITLES = {
    "pytest": "1 gpu tests (pytest)",
    "gradsync": "2 GradSync 2 ranks gloo",
    "prefetch": "3 prefetch copy-heavy",
    "ws1": "4 GradSync world size 1",
    "trainer": "5 StreamTrainer smoke",
}
# Seconds each part may take (full run, --quick). The whole run is also held to --budget.
TIMEOUTS = {"pytest": (180, 120), "gradsync": (90, 60), "prefetch": (60, 45), "ws1": (45, 30), "trainer": (90, 60)}
BUDGET_S = (420, 270)
MIN_PART_S = 20          # a part is not started with less; this much is kept for each part still to run
SYNC_WARNING = "synchronizing CUDA operation"    # torch's sync-debug message
TAIL_LINES = 40


# ================================================================================ table and JSON
def format_table(header: dict, results: list[dict], width: int = 118) -> str:
    """The one table: a header line, one row per part (continuation lines for more numbers),
    the overall verdict, then what each failed part said."""
    keys = ("date", "device", "torch", "cuda", "transformers", "accelerate", "python", "mode", "git")
    head = "  ".join(f"{k} {header[k]}" for k in keys if header.get(k) not in (None, ""))
    lines = textwrap.wrap(f"hfstream gpu-check  {head}", width=width, subsequent_indent="  ")
    name_w = max([len("part")] + [len(r.get("title") or r.get("name", "?")) for r in results])
    indent = name_w + 2 + 6 + 1 + 7 + 2
    lines.append(f"{'part':<{name_w}}  {'status':<6} {'secs':>7}  key numbers")
    lines.append("-" * min(width, max(indent + 40, 60)))
    for r in results:
        title = r.get("title") or r.get("name", "?")
        secs = r.get("seconds")
        secs_s = f"{secs:7.1f}" if isinstance(secs, (int, float)) and not math.isnan(secs) else f"{'-':>7}"
        texts = [str(s) for s in (r.get("summary") or [])] + [f"FAILED {f}" for f in (r.get("failed") or [])]
        wrapped: list[str] = []
        for text in texts or [""]:
            wrapped += textwrap.wrap(text, width=max(width - indent, 30), subsequent_indent="  ") or [""]
        lines.append(f"{title:<{name_w}}  {str(r.get('status', '?')):<6} {secs_s}  {wrapped[0]}")
        lines += [" " * indent + w for w in wrapped[1:]]
    counts = {s: sum(1 for r in results if r.get("status") == s) for s in ("pass", "fail", "skip")}
    total = header.get("seconds")
    lines.append("-" * min(width, max(indent + 40, 60)))
    lines.append(f"overall: {overall_status(results)} ({counts['pass']} pass, {counts['fail']} fail, "
                 f"{counts['skip']} skip)" + (f" in {total:.1f} s" if isinstance(total, (int, float)) else ""))
    for r in results:
        if r.get("status") == "fail" and r.get("detail"):
            lines.append(f"--- {r.get('title') or r.get('name')}: details ---")
            lines += _tail(str(r["detail"]), TAIL_LINES).splitlines()
    return "\n".join(lines)


def overall_status(results: list[dict]) -> str:
    if any(r.get("status") == "fail" for r in results):
        return "fail"
    return "pass" if any(r.get("status") == "pass" for r in results) else "skip"


def strict_json(x: Any) -> Any:
    """NaN and infinities become null, tuples lists: what ``json.dumps(allow_nan=False)`` accepts."""
    if isinstance(x, dict):
        return {str(k): strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_json(path: str | os.PathLike, header: dict, results: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"header": header, "overall": overall_status(results), "parts": results}
    path.write_text(json.dumps(strict_json(doc), indent=2, allow_nan=False) + "\n")


def _tail(text: str, n: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


# ================================================================================ orchestration
def run_all(names: list[str], runner: Callable[[str, float], dict], budget_s: float, quick: bool,
            clock: Callable[[], float] = time.monotonic, progress: Callable[[str], None] | None = None) -> list[dict]:
    """Run each part through ``runner(name, timeout_s)`` within its time box and the whole budget.

    A part that raises, or that no time is left for, is recorded (fail / skip), never fatal.
    Returns the results in table order.
    """
    order = [n for n in RUN_ORDER if n in names]
    start, results = clock(), {}
    for i, name in enumerate(order):
        left = budget_s - (clock() - start)
        timeout = min(TIMEOUTS[name][1 if quick else 0], left - MIN_PART_S * (len(order) - i - 1))
        if timeout < MIN_PART_S:
            results[name] = {"status": "skip", "seconds": 0.0,
                             "summary": [f"not run: {max(left, 0):.0f} s of the {budget_s:.0f} s budget left"]}
        else:
            t0 = clock()
            try:
                r = runner(name, timeout)
            except Exception as exc:   # noqa: BLE001 - the runner itself broke: record it, go on
                r = {"status": "fail", "failed": [f"the check itself raised {type(exc).__name__}: {exc}"],
                     "detail": traceback.format_exc()}
            r.setdefault("seconds", clock() - t0)
            results[name] = r
        results[name]["name"], results[name]["title"] = name, TITLES[name]
        if progress is not None:
            progress(f"gpu-check: [{i + 1}/{len(order)}] {TITLES[name]}: {results[name]['status']} "
                     f"({results[name]['seconds']:.1f} s)")
    return [results[n] for n in PARTS if n in results]


def run_child(cmd: list[str], timeout_s: float, cwd: str | os.PathLike | None = None,
              env: dict | None = None) -> tuple[int | None, str, float]:
    """Run ``cmd`` in its own session; past ``timeout_s`` kill the whole session.

    Returns ``(exit code or None on timeout, stdout+stderr, seconds)``.
    """
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd, env=env, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        # Also after a normal exit: what the child started (rank processes) goes with it.
        _kill_session(proc.pid)
        if rc is None:
            proc.wait()
        log.seek(0)
        text = log.read().decode(errors="replace")
    return rc, text, time.monotonic() - t0


def _kill_session(pid: int) -> None:
    if not hasattr(os, "killpg"):
        return
    try:
        os.killpg(pid, signal.SIGKILL)   # the child was started with start_new_session: pgid == pid
    except (ProcessLookupError, PermissionError):
        pass


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def subprocess_runner(quick: bool, on_cpu: bool) -> Callable[[str, float], dict]:
    """The real runner: each part in a child ``python -m hfstream.tools.gpu_check --part NAME``."""

    def run(name: str, timeout_s: float) -> dict:
        if name == "pytest":
            return pytest_part(timeout_s, gpu_present=not on_cpu)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, "-m", "hfstream.tools.gpu_check", "--part", name, "--part-out", str(out),
                   "--part-timeout", f"{timeout_s:.0f}"] + (["--quick"] if quick else []) + (["--on-cpu"] if on_cpu else [])
            rc, text, secs = run_child(cmd, timeout_s, cwd=REPO, env=child_env())
            result = json.loads(out.read_text()) if out.exists() else None
        if result is None:
            why = f"timed out after {timeout_s:.0f} s (killed)" if rc is None else f"exited with code {rc} without a result"
            result = {"status": "fail", "failed": [why], "detail": ""}
        elif rc is None:
            result.setdefault("summary", []).append(f"(its process did not exit after reporting; killed at {timeout_s:.0f} s)")
        if result.get("status") == "fail" and text.strip():
            result["detail"] = (str(result.get("detail") or "") + "\n--- its output, last lines ---\n" + _tail(text, TAIL_LINES)).strip()
        result["seconds"] = secs
        return result

    return run


# ================================================================================ 1: pytest -m gpu
_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?)\b")


def parse_pytest_summary(text: str) -> dict[str, int]:
    """Counts from pytest's last summary line ("3 passed, 1 skipped, 2 deselected in 4.1s")."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "deselected": 0, "xfailed": 0, "xpassed": 0}
    for line in reversed(text.strip().splitlines()):
        found = _PYTEST_COUNT.findall(line)
        if found and (" in " in line or line.startswith("=") or "no tests ran" in line):
            for n, what in found:
                key = "errors" if what.startswith("error") else what
                if key in counts:
                    counts[key] = int(n)
            break
    return counts


def gpu_test_files(tests_dir: Path) -> list[Path]:
    """Test files that mark any test gpu. Only these are collected: a module that needs what the GPU
    machine lacks (``datasets``, the course's notebook tools) must not abort the collection."""
    mark = re.compile(r"mark\.gpu\b")
    return sorted(p for p in tests_dir.glob("test_*.py") if mark.search(p.read_text(errors="replace")))


def pytest_part(timeout_s: float, gpu_present: bool, runner=run_child) -> dict:
    if importlib.util.find_spec("pytest") is None:
        return {"status": "skip", "summary": ["pytest is not installed here: the tests marked gpu did not run"]}
    files = gpu_test_files(REPO / "tests")
    if not files:
        return {"status": "skip", "summary": ["no test file in tests/ marks a test gpu"]}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", *[str(p.relative_to(REPO)) for p in files]]
    rc, text, secs = runner(cmd, timeout_s, cwd=REPO, env=child_env())
    c = parse_pytest_summary(text)
    summary = [f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, {c['errors']} errors "
               f"({len(files)} files: {', '.join(p.name for p in files)})"]
    failed = [line.strip() for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))][:8]
    if rc is None:
        failed.insert(0, f"timed out after {timeout_s:.0f} s (killed)")
    elif c["failed"] or c["errors"] or rc not in (0, 5):
        failed = failed or [f"pytest exited with code {rc}"]
    elif c["passed"] == 0:
        if gpu_present:
            failed.append("no gpu test passed on a machine with a GPU (all skipped?)")
        else:
            return {"status": "skip", "summary": summary + ["no GPU: every gpu test skipped"], "seconds": secs}
    status = "fail" if failed else "pass"
    return {"status": status, "summary": summary, "failed": failed, "seconds": secs,
            "numbers": c, "detail": _tail(text, TAIL_LINES) if failed else ""}


# ================================================================================ shared helpers
class Checks:
    """The named checks of one part; it passes when every one holds."""

    def __init__(self):
        self.items: list[tuple[str, bool, str]] = []

    def add(self, name: str, ok: bool, info: str = "") -> bool:
        self.items.append((name, bool(ok), info))
        return bool(ok)

    def failed(self) -> list[str]:
        return [f"{n}" + (f": {i}" if i else "") for n, ok, i in self.items if not ok]

    def result(self, summary: list[str], numbers: dict, detail: str = "") -> dict:
        failed = self.failed()
        return {"status": "fail" if failed else "pass", "summary": summary, "failed": failed,
                "numbers": numbers, "checks": [list(c) for c in self.items], "detail": detail}


def sync_debug(mode, cuda: bool):
    """``torch.cuda.set_sync_debug_mode(mode)`` inside the block (nothing on CPU), restored after."""
    if not cuda:
        return contextlib.nullcontext()
    return _sync_debug(mode)


@contextlib.contextmanager
def _sync_debug(mode):
    import torch

    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class SyncRecorder:
    """``set_sync_debug_mode("warn")``, every warning a Python thread gets recorded, tagged by phase.

    torch turns a sync-debug warning raised inside an op called from Python (the main thread, or a
    gradient hook on the autograd thread) into a Python warning attributed to the calling line.
    A C++ thread of its own (gloo's worker) only logs it: it is not the training thread.
    """

    def __init__(self):
        self.records: list = []
        self.marks: list[tuple[str, int]] = []

    def __enter__(self) -> "SyncRecorder":
        import torch

        self._catch = warnings.catch_warnings(record=True)
        self.records = self._catch.__enter__()
        warnings.simplefilter("always")
        self._previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def phase(self, name: str) -> None:
        self.marks.append((name, len(self.records)))

    def __exit__(self, *exc) -> None:
        import torch

        torch.cuda.set_sync_debug_mode(self._previous)
        self._end = len(self.records)
        self._catch.__exit__(*exc)

    def syncs(self) -> dict[str, list[str]]:
        """Per phase, where each sync happened (``file.py:line``)."""
        out = {}
        bounds = [m[1] for m in self.marks[1:]] + [self._end]
        for (name, a), b in zip(self.marks, bounds):
            out[name] = [f"{Path(r.filename).name}:{r.lineno}" for r in self.records[a:b]
                         if SYNC_WARNING in str(r.message)]
        return out


def calibrate_sleep(dev) -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on this GPU."""
    import torch

    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / max(start.elapsed_time(end), 1e-3)


def device_sleep(ms: float, cycles_per_ms: float):
    """Keep the current stream busy for ``ms``; returns an event recorded after it."""
    import torch

    torch.cuda._sleep(int(ms * cycles_per_ms))
    done = torch.cuda.Event()
    done.record()
    return done


def mlp(width: int, layers: int):
    import torch

    mods = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            mods.append(torch.nn.Tanh())
    return torch.nn.Sequential(*mods)


def mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


def synchronize(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return math.nan if not n else (s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2]))


def _device(on_cpu: bool):
    import torch

    return torch.device("cpu") if on_cpu else torch.device("cuda", 0)


# ================================================================================ 2: GradSync, 2 ranks
def gradsync_sizes(quick: bool, on_cpu: bool) -> dict:
    if on_cpu:
        return dict(width=128, layers=4, batch=16, steps=3, bucket_mb=0.06)
    if quick:
        return dict(width=512, layers=4, batch=64, steps=3, bucket_mb=1.0)
    return dict(width=1024, layers=6, batch=64, steps=5, bucket_mb=4.0)   # one 4 MiB layer per bucket


def part_gradsync(quick: bool, on_cpu: bool, timeout_s: float) -> dict:
    from hfstream.testing import run_on_ranks

    size = gradsync_sizes(quick, on_cpu)
    ranks = run_on_ranks(_gradsync_rank, 2, size, on_cpu, timeout=max(timeout_s - 10, 20), pg_timeout_s=60)
    checks = Checks()
    for rank, out in enumerate(ranks):
        for name, ok, info in out["checks"]:
            checks.add(f"rank {rank}: {name}", ok, info)
    sums = [out["param_sum"] for out in ranks]
    checks.add("both ranks hold the same parameters after the steps", math.isclose(sums[0], sums[1], rel_tol=1e-9),
               f"parameter sums {sums[0]!r} vs {sums[1]!r}")
    n0 = ranks[0]["numbers"]
    summary = [
        f"grads = single-process mean over {n0['steps']} steps (max |diff| {max(o['numbers']['max_grad_diff'] for o in ranks):.1e}, "
        f"MLP {size['layers']}x{size['width']}, {n0['buckets']} buckets of {size['bucket_mb']:g} MiB)",
        f"{n0['launched_in_backward']}/{n0['num_collectives']} buckets launched in backward"
        + (", on the side stream" if n0.get("side_stream") else ("" if on_cpu else ", NOT on a side stream"))
        + f"; comm busy {n0['comm_busy_ms']:.2f} ms, exposed {n0['exposed_comm_ms']:.2f} ms",
    ]
    if on_cpu:
        summary.append("sync checks: n/a on CPU")
    else:
        syncs = n0["syncs"]
        summary.append(
            f"no host sync in forward/backward/launch: host ahead of a {n0['sleep_ms']:.0f} ms device sleep after "
            f"{n0['window_ms']:.1f} ms: {'yes' if n0['host_ahead'] else 'NO'}; "
            + "; ".join(f"{p} {len(v)} sync" + ("s" if len(v) != 1 else "") + (f" ({', '.join(sorted(set(v)))})" if v else "")
                        for p, v in syncs.items()))
        summary.append(f"finish() held the host {n0['finish_ms']:.1f} ms (waits for the reductions, by design; gloo's "
                       f"worker waits for its device-to-host copy); no_sync micro-step under 'error': "
                       f"{'clean' if n0['no_sync_error'] is None else 'RAISED'}")
    return checks.result(summary, {f"rank{r}": o["numbers"] for r, o in enumerate(ranks)})


def _gradsync_rank(rank: int, world_size: int, size: dict, on_cpu: bool) -> dict:
    import torch
    import torch.distributed as dist

    from hfstream import GradSync

    cuda = not on_cpu
    dev = _device(on_cpu)
    if cuda:
        torch.cuda.set_device(dev)
    checks = Checks()
    numbers: dict[str, Any] = {}
    width, batch = size["width"], size["batch"]

    torch.manual_seed(0)
    model = mlp(width, size["layers"]).to(dev)
    ref = mlp(width, size["layers"]).to(dev)
    sync = GradSync(model, bucket_mb=size["bucket_mb"], mode="overlap", timeout=60)
    ref.load_state_dict(model.state_dict())          # rank 0's weights, as GradSync broadcast them
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def data(step: int, r: int):
        g = torch.Generator().manual_seed(7919 * step + r)
        return torch.randn(batch, width, generator=g).to(dev), torch.randn(batch, width, generator=g).to(dev)

    # -- gradients against the single-process mean, stats of each step
    worst, bad, windows = 0.0, [], []
    stats = None
    for step in range(size["steps"]):
        x, y = data(step, rank)
        synchronize(cuda)
        t0 = time.perf_counter()
        mse(model, x, y).backward()
        windows.append((time.perf_counter() - t0) * 1e3)
        sync.finish()
        ref.zero_grad(set_to_none=True)
        for r in range(world_size):                     # one process, every rank's batch: the mean to expect
            mse(ref, *data(step, r)).backward()
        for (name, p), rp in zip(model.named_parameters(), ref.parameters()):
            want = rp.grad / world_size
            worst = max(worst, (p.grad - want).abs().max().item())
            if not torch.allclose(p.grad, want, rtol=1e-4, atol=1e-6):
                bad.append(f"step {step} {name}")
        stats = sync.stats
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.load_state_dict(model.state_dict())
    checks.add("gradients equal the single-process mean (allclose)", not bad, ", ".join(bad[:4]))
    numbers.update(steps=size["steps"], max_grad_diff=worst, buckets=len(sync.buckets),
                   num_collectives=stats.num_collectives, launched_in_backward=stats.launched_in_backward,
                   comm_busy_ms=stats.comm_busy_ms, exposed_comm_ms=stats.exposed_comm_ms,
                   bucket_spans=[[i, b - a] for i, a, b in stats.bucket_spans])
    checks.add("every bucket reduced once per step", stats.num_collectives == len(sync.buckets) >= 2
               and len(stats.bucket_spans) == stats.num_collectives,
               f"{stats.num_collectives} collectives, {len(stats.bucket_spans)} spans, {len(sync.buckets)} buckets")
    checks.add("buckets launched by the hooks while backward ran", stats.launched_in_backward >= 1,
               f"{stats.launched_in_backward} of {stats.num_collectives}")
    checks.add("bucket spans are well formed", all(b >= a for _, a, b in stats.bucket_spans))
    if cuda:
        side = dev in getattr(sync, "_streams", {})
        numbers["side_stream"] = side
        checks.add("buckets packed and launched on a side stream", side)

    if cuda:
        _gradsync_sync_checks(rank, model, sync, opt, data, dev, windows, checks, numbers)

    numbers["notes"] = list(sync.notes)
    param_sum = float(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().sum())
    sync.close()
    dist.barrier()
    return {"checks": checks.items, "numbers": numbers, "param_sum": param_sum}


def _gradsync_sync_checks(rank, model, sync, opt, data, dev, windows, checks: Checks, numbers: dict) -> None:
    """What synchronises the host in a GradSync step on CUDA (see the module docstring)."""
    import torch

    # The detectors must be able to fail: a deliberate .item() on the main thread and in a grad hook.
    with sync_debug("error", True):
        try:
            torch.ones((), device=dev).item()
            raised = False
        except RuntimeError:
            raised = True
    checks.add("control: set_sync_debug_mode('error') catches a deliberate .item()", raised)
    probe = torch.nn.Linear(4, 1).to(dev)

    def syncing_hook(param) -> None:     # a hook must return None
        param.grad.sum().item()

    handle = probe.weight.register_post_accumulate_grad_hook(syncing_hook)
    with SyncRecorder() as rec:
        rec.phase("main")
        torch.ones((), device=dev).item()
        rec.phase("hook")
        probe(torch.ones(2, 4, device=dev)).sum().backward()
    handle.remove()
    seen = rec.syncs()
    checks.add("control: the 'warn' recorder sees a deliberate .item() on the main thread and in a grad hook",
               len(seen["main"]) >= 1 and len(seen["hook"]) >= 1, f"{seen}")

    # "error" where no collective is in flight: a no_sync() micro-step (hooks only note the gradients).
    x, y = data(1000, rank)
    torch.cuda.synchronize()
    error = None
    with sync_debug("error", True):
        try:
            with sync.no_sync():
                mse(model, x, y).backward()
        except RuntimeError as exc:
            error = str(exc).splitlines()[0]
    numbers["no_sync_error"] = error
    checks.add("no_sync() micro-step (forward, backward, hooks) does not sync under 'error'", error is None, error or "")

    # The synchronised step: recorded per phase, behind a device sleep the host must not wait for.
    cycles_per_ms = calibrate_sleep(dev)
    sleep_ms = min(max(200.0, 20 * max(windows[1:] or windows)), 2000.0)
    x, y = data(1001, rank)
    torch.cuda.synchronize()
    with SyncRecorder() as rec:
        slept = device_sleep(sleep_ms, cycles_per_ms)
        t0 = time.perf_counter()
        rec.phase("forward")
        loss = mse(model, x, y)
        rec.phase("backward+launch")
        loss.backward()
        host_ahead = not slept.query()
        window_ms = (time.perf_counter() - t0) * 1e3
        rec.phase("finish")
        t1 = time.perf_counter()
        sync.finish()
        finish_ms = (time.perf_counter() - t1) * 1e3
        rec.phase("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec.phase("stats read")
        stats = sync.stats
    syncs = rec.syncs()
    numbers.update(sleep_ms=sleep_ms, window_ms=window_ms, host_ahead=host_ahead, finish_ms=finish_ms, syncs=syncs,
                   window_launched_in_backward=stats.launched_in_backward)
    checks.add("forward and backward (with every launch) do not sync the host (sync-debug 'warn')",
               not syncs["forward"] and not syncs["backward+launch"],
               f"forward {syncs['forward']}, backward {syncs['backward+launch']}")
    checks.add("the host got through forward/backward/launch while the device still slept", host_ahead,
               f"{window_ms:.1f} ms of host work behind a {sleep_ms:.0f} ms sleep")
    checks.add("buckets still launched in backward with the device behind", stats.launched_in_backward >= 1,
               f"{stats.launched_in_backward} of {stats.num_collectives}")


# ================================================================================ 3: prefetcher
def prefetch_sizes(quick: bool, on_cpu: bool) -> dict:
    if on_cpu:
        return dict(mib=4, distinct=2, steps=6, warmup=2, matmul=128)
    if quick:
        return dict(mib=16, distinct=3, steps=16, warmup=3, matmul=2048)
    return dict(mib=64, distinct=4, steps=40, warmup=4, matmul=2048)


def part_prefetch(quick: bool, on_cpu: bool, timeout_s: float) -> dict:
    import torch

    from hfstream import StreamPrefetcher

    size = prefetch_sizes(quick, on_cpu)
    cuda = not on_cpu
    dev = _device(on_cpu)
    checks = Checks()
    k_distinct, n = size["distinct"], size["steps"]
    nbytes = size["mib"] << 20
    nx = nbytes // 4 * 3 // 4
    ny = nbytes // 4 - nx
    g = torch.Generator().manual_seed(0)
    pageable = [{"x": torch.randn(nx, generator=g), "y": torch.randn(ny, generator=g), "k": k} for k in range(k_distinct)]
    pinned = [{"x": b["x"].pin_memory(), "y": b["y"].pin_memory(), "k": b["k"]} for b in pageable] if cuda else pageable
    ref = [{"x": b["x"].to(dev), "y": b["y"].to(dev)} for b in pageable]

    # Calibrate: the copy alone, and a matmul; the step computes about as long as its batch copies.
    def timed(fn, reps: int) -> float:
        if not cuda:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t0) * 1e3 / reps
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    copy_ms = timed(lambda: [pinned[0][k].to(dev, non_blocking=True) for k in ("x", "y")], 5)
    a = torch.randn(size["matmul"], size["matmul"], device=dev)
    c = torch.empty_like(a)
    mm_ms = timed(lambda: torch.matmul(a, a, out=c), 10)
    reps = max(1, round(copy_ms / max(mm_ms, 1e-6)))
    compute_ms = timed(lambda: [torch.matmul(a, a, out=c) for _ in range(reps)], 5)
    bad = torch.zeros((), dtype=torch.int64, device=dev)

    def step(b) -> None:
        for _ in range(reps):
            torch.matmul(a, a, out=c)
        r = ref[b["k"]]
        bad.add_((b["x"] != r["x"]).sum())                # checked on the device: no host sync per step
        bad.add_((b["y"] != r["y"]).sum())

    def plain(source, non_blocking: bool, count: int):
        for i in range(count):
            b = source[i % k_distinct]
            yield {"x": b["x"].to(dev, non_blocking=non_blocking), "y": b["y"].to(dev, non_blocking=non_blocking),
                   "k": b["k"]}

    def prefetched(source, count: int):
        return StreamPrefetcher([source[i % k_distinct] for i in range(count)], device=dev, depth=2, time_copies=True)

    variants = {
        "sync_copy": (lambda count: plain(pageable, False, count), False),   # stock: pageable, blocking .to(device)
        "pinned_to": (lambda count: plain(pinned, True, count), False),      # pinned .to(non_blocking) on the compute stream
        "prefetch": (lambda count: prefetched(pinned, count), True),       # StreamPrefetcher, pinned source
        "prefetch_pageable": (lambda count: prefetched(pageable, count), True),   # it pins them itself
    }
    rows: dict[str, dict] = {}
    for name, (make, under_error) in variants.items():
        for _ in make(size["warmup"]):                      # warm-up: allocator, pinned blocks, kernels
            pass
        synchronize(cuda)
        bad.zero_()
        order, waits, error = [], [], None
        source = make(n)
        t0 = time.perf_counter()
        with sync_debug("error" if under_error else 0, cuda):
            try:
                it = iter(source)
                for _ in range(n):
                    tw = time.perf_counter()
                    b = next(it)
                    waits.append(time.perf_counter() - tw)
                    step(b)
                    order.append(b["k"])
            except RuntimeError as exc:
                error = str(exc).splitlines()[0]
        synchronize(cuda)
        row = dict(step_ms=(time.perf_counter() - t0) * 1e3 / max(len(order), 1),
                   data_wait_ms=1e3 * sum(waits) / max(len(waits), 1), mismatches=int(bad),
                   order_ok=order == [i % k_distinct for i in range(n)], error=error)
        if isinstance(source, StreamPrefetcher):
            s = source.stats
            row.update(copies_timed=s.copies_timed, prefetch_data_wait_ms=s.mean_data_wait_ms,
                       copy_gbps=(nbytes / (s.copy_ms_total / s.copies_timed * 1e-3) / 1e9) if s.copies_timed else None)
            source.close()
        rows[name] = row
        checks.add(f"{name}: every batch equals its source, in order", row["mismatches"] == 0 and row["order_ok"],
                   f"{row['mismatches']} elements differ, order {'ok' if row['order_ok'] else 'wrong'}, error {error}")
        if under_error and cuda:
            checks.add(f"{name}: consume loop does not sync under set_sync_debug_mode('error')", error is None, error or "")
        if under_error and cuda:
            checks.add(f"{name}: copies timed on the side stream", row.get("copies_timed", 0) > 0)
    if cuda:
        checks.add("prefetch is not slower than the plain pinned loop", rows["prefetch"]["step_ms"] <= 1.10 * rows["pinned_to"]["step_ms"],
                   f"{rows['prefetch']['step_ms']:.2f} vs {rows['pinned_to']['step_ms']:.2f} ms per step")

    ideal = max(copy_ms, compute_ms)
    saved = rows["pinned_to"]["step_ms"] - rows["prefetch"]["step_ms"]
    hidden = saved / min(copy_ms, compute_ms) if min(copy_ms, compute_ms) > 0 else math.nan
    gbps = rows["prefetch"].get("copy_gbps")
    summary = [
        f"{size['mib']} MiB/batch, {n} steps: "
        + (f"copy alone {copy_ms:.2f} ms ({nbytes / (copy_ms * 1e-3) / 1e9:.1f} GB/s), " if cuda else "no device copy on CPU, ")
        + f"compute {compute_ms:.2f} ms/step ({reps} matmul{'s' if reps > 1 else ''} {size['matmul']}^2)"
        + (f"; ceiling {ideal:.2f} ms" if cuda else ""),
        "step ms: " + ", ".join(f"{k} {v['step_ms']:.2f}" for k, v in rows.items()),
        "data wait ms/step: " + ", ".join(f"{k} {v['data_wait_ms']:.3f}" for k, v in rows.items()),
        ((f"prefetch copy {gbps:.1f} GB/s on the side stream; " if gbps else "")
         + f"copy hidden {100 * hidden:.0f} % vs pinned loop; batches intact; no host sync under 'error'")
        if cuda else "batches intact (CPU: no copy, no sync checks)",
    ]
    numbers = dict(size, copy_ms=copy_ms, compute_ms=compute_ms, matmuls_per_step=reps, hidden_fraction=hidden,
                   variants=rows)
    return checks.result(summary, numbers)


# ================================================================================ 4: world size 1
def part_ws1(quick: bool, on_cpu: bool, timeout_s: float) -> dict:
    import torch

    from hfstream import GradSync

    cuda = not on_cpu
    dev = _device(on_cpu)
    checks = Checks()
    width, layers, batch = (128, 4, 16) if on_cpu else (1024, 6, 64)
    rounds, steps = (3, 40) if (quick or on_cpu) else (5, 100)
    torch.manual_seed(0)
    model = mlp(width, layers).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width, device=dev), torch.randn(batch, width, device=dev)
    errors: list[str] = []
    world_sizes = []

    def run_round(count: int, with_sync: bool) -> float:
        sync = GradSync(model, bucket_mb=25.0) if with_sync else None
        if sync is not None:
            world_sizes.append(sync.world_size)
        synchronize(cuda)
        t0 = time.perf_counter()
        with sync_debug("error", cuda):
            try:
                for _ in range(count):
                    mse(model, x, y).backward()
                    if sync is not None:
                        sync.finish()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            except RuntimeError as exc:
                errors.append(f"{'with' if with_sync else 'without'} GradSync: {str(exc).splitlines()[0]}")
        synchronize(cuda)
        ms = (time.perf_counter() - t0) * 1e3 / count
        if sync is not None:
            sync.close()
        return ms

    run_round(10, False)
    run_round(10, True)
    without, with_ = [], []
    for _ in range(rounds):
        without.append(run_round(steps, False))
        with_.append(run_round(steps, True))
    a, b = _median(without), _median(with_)
    checks.add("GradSync without a process group has world size 1", world_sizes and all(w == 1 for w in world_sizes),
               f"{world_sizes}")
    checks.add("no host sync in the step under set_sync_debug_mode('error')" if cuda else "steps ran", not errors,
               "; ".join(errors))
    if cuda:   # on a shared CPU the noise is larger than the difference: there it is only reported
        checks.add("step time with GradSync ~ without (within 10 %)", b <= 1.10 * a + 0.005, f"{b:.3f} vs {a:.3f} ms")
    summary = [f"step {a:.3f} ms without, {b:.3f} ms with GradSync ({100 * (b / a - 1):+.1f} %), median of {rounds} "
               f"rounds x {steps} steps, MLP {layers}x{width}" + ("; no host sync under 'error'" if cuda else "")]
    return checks.result(summary, dict(without_ms=without, with_ms=with_, median_without_ms=a, median_with_ms=b))


# ================================================================================ 5: StreamTrainer
def part_trainer(quick: bool, on_cpu: bool, timeout_s: float) -> dict:
    import logging

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from hfstream import StreamTrainer, StreamTrainingArguments

    checks = Checks()
    steps = 12 if quick else 20
    seq, vocab, batch = 32, 64, 16
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    # Arithmetic sequences (start, stride): predictable after two tokens, so the loss must fall.
    g = torch.Generator().manual_seed(1)
    n = steps * batch
    ids = (torch.randint(0, vocab, (n, 1), generator=g) + torch.randint(1, 4, (n, 1), generator=g)
           * torch.arange(seq)) % vocab
    dataset = [{"input_ids": row.clone(), "labels": row.clone()} for row in ids]
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as out:
        args = StreamTrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=3e-3,
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
            lr_scheduler_type="constant", seed=0, prefetch_depth=2, use_cpu=on_cpu)
        trainer = StreamTrainer(model=model, args=args, train_dataset=dataset)
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    report = trainer.stream_report()
    mean = dict(report.get("mean") or {}) if report else {}
    first, last = losses[:3], losses[-3:]
    drop = (sum(first) / len(first), sum(last) / len(last)) if losses else (math.nan, math.nan)
    on_device = next(model.parameters()).device
    checks.add(f"{steps} optimizer steps logged", len(losses) == steps, f"{len(losses)} losses")
    checks.add("it trains: mean of the last 3 losses < 0.9 x the first 3",
               all(math.isfinite(v) for v in losses) and drop[1] < 0.9 * drop[0], f"{drop[0]:.3f} -> {drop[1]:.3f}")
    checks.add("the model trained on the GPU" if not on_cpu else "the model trained on the CPU",
               on_device.type == ("cpu" if on_cpu else "cuda"), str(on_device))
    checks.add("stream_report() has a mean row with a step time", mean.get("step_ms", 0) > 0, f"{mean}")

    def ms(key):
        v = mean.get(key)
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"

    eff = mean.get("efficiency")
    summary = [
        f"loss {drop[0]:.3f} -> {drop[1]:.3f} in {len(losses)} steps (tiny GPT-2, batch {batch}x{seq}, "
        f"grad_sync {report.get('grad_sync') if report else '?'}, prefetch_depth {report.get('prefetch_depth') if report else '?'})",
        f"stream_report mean: data wait {ms('data_wait_ms')}, forward {ms('forward_ms')}, backward {ms('backward_ms')}, "
        f"optimizer {ms('optimizer_ms')}, step {ms('step_ms')}, ceiling {ms('ideal_ms')} ms, efficiency "
        + (f"{100 * eff:.0f} %" if isinstance(eff, float) and math.isfinite(eff) else "n/a"),
    ]
    return checks.result(summary, dict(losses=losses, mean=mean), detail=str(report) if report else "")


PART_FUNCS = {"gradsync": part_gradsync, "prefetch": part_prefetch, "ws1": part_ws1, "trainer": part_trainer}


def child_main(name: str, out: str, quick: bool, on_cpu: bool, timeout_s: float) -> None:
    """One part in this process; its result goes to ``out`` as JSON. Never returns."""
    try:
        result = PART_FUNCS[name](quick, on_cpu, timeout_s)
    except BaseException as exc:   # noqa: BLE001 - the table shows it; the other parts still run
        tb = traceback.format_exc()
        result = {"status": "fail", "summary": [], "failed": [f"raised {type(exc).__name__}: "
                                                            f"{(str(exc).strip().splitlines() or [''])[-1][:300]}"],
                  "detail": tb}
    Path(out).write_text(json.dumps(strict_json(result), allow_nan=False))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # no interpreter teardown: a lingering thread or CUDA context cannot hang the exit


# ================================================================================ entry point
def no_gpu_reason() -> str | None:
    """Why this machine cannot run the check (None: it can)."""
    try:
        import torch
    except Exception as exc:   # noqa: BLE001
        return f"torch is not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return f"no CUDA GPU here (torch {torch.__version__}, torch.cuda.is_available() is False)"
    return None


def collect_header(quick: bool, on_cpu: bool, budget_s: float) -> dict:
    import torch

    def version(pkg: str) -> str:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    header = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": version("transformers"),
        "accelerate": version("accelerate"),
        "pytest": version("pytest"),
        "mode": ("cpu dry run (NOT a GPU check)" if on_cpu else "gpu") + (", quick" if quick else ", full"),
        "budget_s": budget_s,
        "git": _git_describe(),
    }
    if on_cpu:
        header["device"] = "cpu"
    else:
        try:
            props = torch.cuda.get_device_properties(0)
            header["device"] = (f"{props.name} (sm_{props.major}{props.minor}, "
                                f"{props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible)")
        except Exception as exc:   # noqa: BLE001 - the parts will say what is wrong
            header["device"] = f"unreadable ({exc})"
    return header


def _git_describe() -> str:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""
    except Exception:   # noqa: BLE001 - no git on the machine, or no .git in the copy
        return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hfstream.tools.gpu_check",
                                 description="Everything that needs a GPU, in one run and one table; "
                                             "skips (exit 0) without a GPU.")
    ap.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer steps")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for the whole run (default {BUDGET_S[0]}, --quick {BUDGET_S[1]})")
    ap.add_argument("--on-cpu", action="store_true",
                    help="run the parts on CPU, CUDA-only checks left out: to develop this script without a GPU")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--part-out", help=argparse.SUPPRESS)
    ap.add_argument("--part-timeout", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.part:
        child_main(args.part, args.part_out, args.quick, args.on_cpu, args.part_timeout)
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {','.join(PARTS)}")
    if not args.on_cpu:
        reason = no_gpu_reason()
        if reason is not None:
            print(f"gpu-check: skipped: {reason}")
            return 0
    budget = args.budget if args.budget is not None else BUDGET_S[1 if args.quick else 0]
    t0 = time.monotonic()
    header = collect_header(args.quick, args.on_cpu, budget)
    results = run_all(names, subprocess_runner(args.quick, args.on_cpu), budget, args.quick,
                      progress=lambda line: print(line, file=sys.stderr, flush=True))
    header["seconds"] = round(time.monotonic() - t0, 1)
    print(format_table(header, results))
    if args.json:
        write_json(args.json, header, results)
        print(f"gpu-check: wrote {args.json}")
    return 1 if overall_status(results) == "fail" else 0


if __name__ == "__main__":
    sys.exit(main())
