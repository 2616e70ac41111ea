"""Part 1: the tests marked ``gpu`` (``pytest -m gpu`` on the test files that mark any)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

from dev.gpu_check.procs import REPO, child_env, run_child
from dev.gpu_check.table import TAIL_LINES, tail

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
    if importlib.util.find_spec("pytest") is None:   # on a GPU machine the run is then incomplete
        return {"status": "skip", "incomplete": gpu_present,
                "summary": ["pytest is not installed here: the tests marked gpu did not run"]}
    files = gpu_test_files(REPO / "tests")
    if not files:
        return {"status": "skip", "summary": ["no test file in tests/ marks a test gpu"]}
    # -v: a run killed at its time box still shows the test it was in.
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider",
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
    # What it compared is what passed: a gpu test compares what its own asserts say; none passed -> fail above.
    return {"status": status, "summary": [f"compared: {c['passed']} gpu tests passed"] + summary, "failed": failed,
            "seconds": secs, "numbers": c, "compared": [["gpu tests passed", c["passed"], "tests"]],
            "detail": tail(text, TAIL_LINES) if failed else ""}
