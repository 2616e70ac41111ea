"""The run: the parts, each in its own child process within its time box and the whole budget;
the header; the command line. See the package's docstring for what each part checks."""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

from dev.gpu_check.procs import REPO, child_env, run_child
from dev.gpu_check.table import TAIL_LINES, format_table, overall_status, strict_json, tail, write_json

# Table order (the numbering of the parts) and execution order: the tests marked gpu go last, so
# a slow test suite cannot eat the budget of the checks that exist only here.
PARTS = ("pytest", "gradsync", "prefetch", "ws1", "trainer", "onerank", "multirank")
RUN_ORDER = ("gradsync", "prefetch", "ws1", "onerank", "multirank", "trainer", "pytest")
TITLES = {
    "pytest": "1 gpu tests (pytest)",
    "gradsync": "2 GradSync 2 ranks gloo",
    "prefetch": "3 prefetch copy-heavy",
    "ws1": "4 GradSync world size 1",
    "trainer": "5 Trainer one rank NCCL",
    "onerank": "6 GradSync one rank NCCL",
    "multirank": "7 GradSync all GPUs NCCL",
}
# Seconds each part may take (full run, --quick): a cap, not an estimate. What holds the whole run
# to 6 minutes (--quick: 3) is the budget: a part is given at most what is left of it, less
# MIN_PART_S for each part still to run. The estimates, from the parts' sizes, are in docs/design.md.
TIMEOUTS = {"pytest": (120, 80), "gradsync": (50, 30), "prefetch": (35, 20), "ws1": (25, 20), "trainer": (90, 50),
            "onerank": (50, 30), "multirank": (100, 50)}
BUDGET_S = (340, 170)   # seconds: under 6 and 3 minutes with the start and the table
DRY_RUN_SCALE = 3.0      # --on-cpu: time boxes and budget this many times the GPU run's
MIN_PART_S = 20          # a part is not started with less; this much is kept for each part still to run
# The parts run in a child (``--part NAME``): module and function, imported only there.
PART_FUNCS = {"gradsync": ("gradsync", "part_gradsync"), "prefetch": ("prefetch", "part_prefetch"),
              "ws1": ("one_process", "part_ws1"), "trainer": ("one_rank_trainer", "part_trainer"),
              "onerank": ("one_rank", "part_one_rank"), "multirank": ("multi_rank", "part_multi_rank")}


def part_function(name: str) -> Callable[[bool, bool, float], dict]:
    module, func = PART_FUNCS[name]
    return getattr(importlib.import_module(f"dev.gpu_check.{module}"), func)


# ================================================================================ orchestration
def run_all(names: list[str], runner: Callable[[str, float], dict], budget_s: float, quick: bool,
            clock: Callable[[], float] = time.monotonic, progress: Callable[[str], None] | None = None,
            box_scale: float = 1.0, on_result: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Run each part through ``runner(name, timeout_s)`` within its time box and the whole budget.

    A part that raises is recorded as failed, one that no time is left for as skipped and
    ``incomplete`` (the run cannot pass); never fatal. ``on_result`` gets the results so far after
    each part (the JSON is written then: a run killed later keeps what it finished).
    Returns the results in table order.
    """
    order = [n for n in RUN_ORDER if n in names]
    start, results = clock(), {}
    for i, name in enumerate(order):
        left = budget_s - (clock() - start)
        timeout = min(box_scale * TIMEOUTS[name][1 if quick else 0], left - MIN_PART_S * (len(order) - i - 1))
        if timeout < MIN_PART_S:
            results[name] = {"status": "skip", "seconds": 0.0, "incomplete": True,
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
        if on_result is not None:
            on_result([results[n] for n in PARTS if n in results])
    return [results[n] for n in PARTS if n in results]


def subprocess_runner(quick: bool, on_cpu: bool) -> Callable[[str, float], dict]:
    """The real runner: each part in a child ``python -m dev.gpu_check --part NAME``."""

    def run(name: str, timeout_s: float) -> dict:
        if name == "pytest":
            from dev.gpu_check.gpu_tests import pytest_part

            return pytest_part(timeout_s, gpu_present=not on_cpu)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, "-m", "dev.gpu_check", "--part", name, "--part-out", str(out),
                   "--part-timeout", f"{timeout_s:.0f}"] + (["--quick"] if quick else []) + (["--on-cpu"] if on_cpu else [])
            rc, text, secs = run_child(cmd, timeout_s, cwd=REPO, env=child_env())
            result = json.loads(out.read_text()) if out.exists() else None
        if result is None:
            why = f"timed out after {timeout_s:.0f} s (killed)" if rc is None else f"exited with code {rc} without a result"
            result = {"status": "fail", "failed": [why], "detail": ""}
        elif rc is None:
            result.setdefault("summary", []).append(f"(its process did not exit after reporting; killed at {timeout_s:.0f} s)")
        if result.get("status") == "fail" and text.strip():
            result["detail"] = (str(result.get("detail") or "") + "\n--- its output, last lines ---\n" + tail(text, TAIL_LINES)).strip()
        result["seconds"] = secs
        return result

    return run


def child_main(name: str, out: str, quick: bool, on_cpu: bool, timeout_s: float) -> None:
    """One part in this process; its result goes to ``out`` as JSON. Never returns."""
    try:
        result = part_function(name)(quick, on_cpu, timeout_s)
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
    ap = argparse.ArgumentParser(prog="python -m dev.gpu_check",
                                 description="Everything that needs a GPU, in one run and one table; "
                                             "skips (exit 0) without a GPU.")
    ap.add_argument("--json", metavar="PATH", help="also write the table as JSON (after each part)")
    ap.add_argument("--require-gpu", action="store_true",
                    help="without a usable GPU exit 2 (and say why in the JSON), not 0: for a machine lent for this")
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
            if not args.require_gpu:
                return 0
            if args.json:
                write_json(args.json, {"no_gpu": reason}, [])
            return 2
    # The CPU dry run is for developing on a shared machine, not the GPU run's 6 minutes: its time
    # boxes and budget are DRY_RUN_SCALE times the GPU's, so a loaded CPU does not time a part out.
    scale = DRY_RUN_SCALE if args.on_cpu else 1.0
    budget = args.budget if args.budget is not None else scale * BUDGET_S[1 if args.quick else 0]
    t0 = time.monotonic()
    header = collect_header(args.quick, args.on_cpu, budget)
    def written(so_far: list[dict]) -> None:
        if args.json:
            write_json(args.json, dict(header, seconds=round(time.monotonic() - t0, 1)), so_far)

    results = run_all(names, subprocess_runner(args.quick, args.on_cpu), budget, args.quick, box_scale=scale,
                      progress=lambda line: print(line, file=sys.stderr, flush=True), on_result=written)
    header["seconds"] = round(time.monotonic() - t0, 1)
    print(format_table(header, results))
    if args.json:
        write_json(args.json, header, results)
        print(f"gpu-check: wrote {args.json}")
    return 1 if overall_status(results) in ("fail", "incomplete") else 0
