"""`python -m dev.gpu_check` (the package dev/gpu_check/) without a GPU: it
skips in one line with exit code 0; its table, JSON, time boxes and bookkeeping work (on fakes);
and each of its modules imports only what the GPU machine has.

Nothing here needs a GPU. The parts themselves run on a GPU (`make gpu-check`); the slow test
at the end runs them on CPU (`--on-cpu`), CUDA-only checks left out.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from dev.gpu_check.checks import Checks
from dev.gpu_check.gpu_tests import gpu_test_files, parse_pytest_summary, pytest_part
from dev.gpu_check.procs import run_child
from dev.gpu_check.runner import MIN_PART_S, PARTS, RUN_ORDER, TIMEOUTS, TITLES, main, run_all
from dev.gpu_check.syncdebug import SyncRecorder
from dev.gpu_check.table import format_table, overall_status, write_json

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "dev" / "gpu_check"


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


# -- without a GPU ---------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU this would run the whole check")
def test_without_a_gpu_it_skips_in_one_line_with_exit_code_0(tmp_path):
    out = tmp_path / "gpu_check.json"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "dev.gpu_check", "--json", str(out)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: skipped:") and "no CUDA GPU" in lines[0], proc.stdout
    assert not out.exists()             # a skip never overwrites a real result
    assert time.monotonic() - t0 < 60


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU this would run the whole check")
def test_a_run_that_requires_a_gpu_and_finds_none_fails_and_says_why_in_the_json(tmp_path):
    # A machine lent for the check whose GPU torch cannot use must not look like a clean skip.
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "-m", "dev.gpu_check", "--require-gpu", "--json", str(out)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert "no CUDA GPU" in doc["header"]["no_gpu"] and doc["parts"] == []


def _imported_modules(path: Path) -> set[str]:
    """Every module a file of the package imports, at the top or inside a function, as absolute names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = "dev.gpu_check".split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
    return names


def test_the_package_imports_nothing_heavy_and_never_datasets():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert {"__main__", "runner", "table"} <= set(modules)
    script = ("import sys, dev.gpu_check\n"
              "heavy = lambda: {'torch', 'transformers', 'datasets'} & set(sys.modules)\n"
              "assert not heavy(), sorted(sys.modules)\n"
              + "".join(f"import dev.gpu_check.{m}\n" for m in modules)
              + "assert not heavy(), sorted(sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    # Nor lazily, inside a part: the GPU machine has no `datasets` (hfstream.cli.data imports it).
    for path in PACKAGE.glob("*.py"):
        names = _imported_modules(path)
        assert not {n for n in names if n.split(".")[0] == "datasets"
                    or (n.startswith(("hfstream.cli", "hfstream.plan", "hfstream.testing.link", "dev."))
                        and not n.startswith("dev.gpu_check"))}, path.name


# -- the table and the JSON ------------------------------------------------------------------

HEADER = {"date": "2026-05-10T12:00:00+00:00", "device": "NVIDIA H200 (sm_90, 140 GiB, 1 visible)",
          "torch": "2.11.0+cu128", "cuda": "12.8", "transformers": "5.2.0", "accelerate": "1.10.0",
          "python": "3.12.3", "mode": "gpu, full", "git": "", "seconds": 101.5}


def fake_results():
    return [
        {"name": "pytest", "title": TITLES["pytest"], "status": "skip", "seconds": 0.4,
         "summary": ["pytest is not installed here: the tests marked gpu did not run"]},
        {"name": "gradsync", "title": TITLES["gradsync"], "status": "pass", "seconds": 18.25,
         "summary": ["grads = single-process mean over 5 steps", "6/6 buckets launched in backward " + "x" * 150],
         "numbers": {"comm_busy_ms": float("nan"), "spans": (1, 2)}},
        {"name": "prefetch", "title": TITLES["prefetch"], "status": "fail", "seconds": 7.0,
         "summary": ["step ms: sync 5.10, pinned 2.62, prefetch 2.90"],
         "failed": ["prefetch is not slower than the plain pinned loop: 2.90 vs 2.62 ms"],
         "detail": "Traceback (most recent call last):\nRuntimeError: boom"},
        {"name": "trainer", "title": TITLES["trainer"], "status": "fail", "seconds": None,
         "failed": ["timed out after 90 s (killed)"]},
    ]


def test_format_table_on_fake_results():
    text = format_table(HEADER, fake_results())
    lines = text.splitlines()
    assert lines[0].startswith("hfstream gpu-check")
    top = lines.index(next(l for l in lines if l.startswith("part ")))
    head = " ".join(l.strip() for l in lines[:top])               # the header, wrapped to the table's width
    for word in ("2026-05-10T12:00:00+00:00", "NVIDIA H200 (sm_90, 140 GiB, 1 visible)", "torch 2.11.0+cu128",
                 "cuda 12.8", "transformers 5.2.0", "mode gpu, full"):
        assert word in head
    assert "git" not in head                                       # empty fields are left out
    assert lines[top].split() == ["part", "status", "secs", "key", "numbers"]
    rows = {r["title"]: next(l for l in lines if l.startswith(r["title"])) for r in fake_results()}
    assert " pass " in rows[TITLES["gradsync"]] and "18.2" in rows[TITLES["gradsync"]]
    assert " skip " in rows[TITLES["pytest"]] and " fail " in rows[TITLES["prefetch"]]
    assert "   -  " in rows[TITLES["trainer"]]                 # no time known
    assert "FAILED prefetch is not slower than the plain pinned loop" in text
    assert "FAILED timed out after 90 s (killed)" in text
    assert max(len(l) for l in lines) <= 118                       # long numbers wrap
    key_col = lines[top].index("key numbers")
    continuation = [l for l in lines if l.startswith(" " * key_col) and l.strip()]
    assert continuation, "the second summary line and the wrapped tail sit under the key column"
    assert "overall: fail (1 pass, 2 fail, 1 skip) in 101.5 s" in text
    assert text.index("--- 3 prefetch copy-heavy: details ---") > text.index("overall:")
    assert "RuntimeError: boom" in text


def test_json_is_strict_and_round_trips(tmp_path):
    path = tmp_path / "runs" / "gpu_check.json"               # the folder is created
    write_json(path, HEADER, fake_results())
    doc = json.loads(path.read_text())
    assert doc["overall"] == "fail" and doc["header"]["device"].startswith("NVIDIA H200")
    assert [p["name"] for p in doc["parts"]] == ["pytest", "gradsync", "prefetch", "trainer"]
    assert doc["parts"][1]["numbers"] == {"comm_busy_ms": None, "spans": [1, 2]}    # NaN -> null
    assert "NaN" not in path.read_text()


def test_an_unknown_part_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--parts", "gradsync,nope"])
    assert exc.value.code == 2 and "unknown part(s) ['nope']" in capsys.readouterr().err


def test_overall_status():
    assert overall_status([{"status": "pass"}, {"status": "skip"}]) == "pass"
    assert overall_status([{"status": "pass"}, {"status": "fail"}]) == "fail"
    assert overall_status([{"status": "skip"}]) == "skip"
    # A part that should have run and did not (no time left, no pytest on the GPU machine): never a pass.
    assert overall_status([{"status": "pass"}, {"status": "skip", "incomplete": True}]) == "incomplete"
    assert overall_status([{"status": "fail"}, {"status": "skip", "incomplete": True}]) == "fail"


# -- running the parts: failures recorded, time boxes, the budget ------------------------------

def test_run_all_records_each_failure_and_runs_the_rest():
    ran = []

    def runner(name, timeout_s):
        ran.append((name, timeout_s))
        if name == "gradsync":
            raise RuntimeError("the runner broke")
        if name == "prefetch":
            return {"status": "fail", "failed": ["batches differ"]}
        return {"status": "pass", "summary": [name]}

    seen = []
    results = run_all(list(PARTS), runner, budget_s=10_000, quick=False,
                      on_result=lambda so_far: seen.append([r["name"] for r in so_far]))
    assert [n for n, _ in ran] == list(RUN_ORDER)              # every part ran, the gpu tests last
    # After each part, what is done so far (the JSON is written there: a run killed later keeps it).
    assert [len(names) for names in seen] == list(range(1, len(PARTS) + 1)) and seen[0] == [RUN_ORDER[0]]
    assert [r["name"] for r in results] == list(PARTS)         # the table keeps the numbering
    by = {r["name"]: r for r in results}
    assert by["gradsync"]["status"] == "fail" and "the runner broke" in by["gradsync"]["failed"][0]
    assert by["prefetch"]["status"] == "fail" and by["trainer"]["status"] == "pass"
    assert dict(ran) == {n: TIMEOUTS[n][0] for n in PARTS}  # each its own time box
    assert all(r["title"] == TITLES[r["name"]] and r["seconds"] >= 0 for r in results)


@pytest.mark.parametrize("overhead", [0, 30])
def test_run_all_holds_the_whole_run_to_the_budget(overhead):
    now = [0.0]
    boxes = {}

    def runner(name, timeout_s):
        boxes[name] = timeout_s
        now[0] += timeout_s + overhead                          # every part uses its whole box, and more
        return {"status": "pass"}

    budget = 200
    results = run_all(["gradsync", "prefetch", "ws1", "trainer"], runner, budget_s=budget, quick=False,
                      clock=lambda: now[0])
    by = {r["name"]: r for r in results}
    assert by["gradsync"]["status"] == "pass" and by["prefetch"]["status"] == "pass"
    if overhead == 0:        # the boxes shrink so that every part still gets its minimum, within the budget
        assert all(r["status"] == "pass" for r in results) and now[0] <= budget
        assert boxes["trainer"] >= MIN_PART_S
    else:                    # parts that overran leave no time: the rest are skipped, said so
        skipped = [r for r in results if r["status"] == "skip"]
        assert skipped and all("budget" in r["summary"][0] and r["incomplete"] for r in skipped)
        assert overall_status(results) == "incomplete"
        assert now[0] <= budget + overhead * (len(results) - len(skipped))


def test_run_child_kills_the_whole_session_at_its_time_box():
    script = ("import subprocess, sys, time\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "print('grandchild', p.pid, flush=True)\n"
              "time.sleep(60)\n")
    t0 = time.monotonic()
    rc, text, secs = run_child([sys.executable, "-c", script], timeout_s=3)
    assert rc is None and secs < 20 and time.monotonic() - t0 < 20
    pid = int(text.split("grandchild")[1].split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the rank-like grandchild {pid} survived its parent's time box")


def test_run_child_reports_exit_code_and_output():
    rc, text, _ = run_child([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], timeout_s=30)
    assert rc == 3 and "boom" in text


# -- part 1, the gpu tests: counts and verdicts ------------------------------------------------

@pytest.mark.parametrize("line,expected", [
    ("=== 12 passed, 3 skipped, 40 deselected in 20.51s ===", dict(passed=12, skipped=3, deselected=40)),
    ("1 failed, 11 passed, 2 warnings in 9.00s", dict(failed=1, passed=11)),
    ("2 errors in 1.2s", dict(errors=2)),
    ("14 skipped, 1 warning in 0.40s", dict(skipped=14)),
    ("===== no tests ran in 0.01s =====", {}),
])
def test_parse_pytest_summary(line, expected):
    counts = parse_pytest_summary("collecting ...\n.....s\n" + line + "\n")
    assert counts == {**dict.fromkeys(counts, 0), **expected}


def test_gpu_test_files_are_the_ones_that_mark_a_test(tmp_path):
    marker = "mark." + "gpu"                                   # not spelled out: this file marks nothing
    (tmp_path / "test_a.py").write_text(f"import pytest\n@pytest.{marker}\ndef test_x(): pass\n")
    (tmp_path / "test_b.py").write_text(f"import pytest\npytestmark = pytest.{marker}_something\n")
    (tmp_path / "test_c.py").write_text("def test_y(): pass\n")
    assert [p.name for p in gpu_test_files(tmp_path)] == ["test_a.py"]
    found = [p.name for p in gpu_test_files(REPO / "tests")]
    assert "test_prefetch_gpu.py" in found and Path(__file__).name not in found


def _canned(text, rc=0):
    def runner(cmd, timeout_s, cwd=None, env=None):
        assert cmd[1:4] == ["-m", "pytest", "-m"] and "gpu" in cmd and "-p" in cmd and "no:cacheprovider" in cmd
        return rc, text, 1.5
    return runner


def test_pytest_part_verdicts(monkeypatch):
    ok = pytest_part(100, gpu_present=True, runner=_canned("14 passed in 3.0s\n"))
    assert ok["status"] == "pass" and ok["summary"][1].startswith("14 passed, 0 failed")
    bad = pytest_part(100, True, runner=_canned("FAILED tests/test_prefetch_gpu.py::test_x - assert 0\n"
                                                "1 failed, 13 passed in 3.0s\n", rc=1))
    assert bad["status"] == "fail" and bad["failed"] == ["FAILED tests/test_prefetch_gpu.py::test_x - assert 0"]
    all_skipped = "14 skipped in 0.4s\n"
    assert pytest_part(100, True, runner=_canned(all_skipped))["status"] == "fail"   # a GPU, yet nothing ran
    assert pytest_part(100, False, runner=_canned(all_skipped))["status"] == "skip"
    timed_out = pytest_part(100, True, runner=_canned("....", rc=None))
    assert timed_out["status"] == "fail" and "timed out" in timed_out["failed"][0]

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pytest" else real_find_spec(name, *a))
    missing = pytest_part(100, True, runner=_canned("unused"))
    assert missing["status"] == "skip" and "pytest is not installed" in missing["summary"][0]
    assert missing["incomplete"] and not pytest_part(100, False, runner=_canned("unused"))["incomplete"]


# -- the sync recorder's bookkeeping (the CUDA switch faked) ---------------------------------

def test_sync_recorder_tags_each_sync_with_its_phase_and_line(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def sync_here():
        warnings.warn("called a synchronizing CUDA operation", UserWarning)

    with SyncRecorder() as rec:
        rec.phase("forward")
        warnings.warn("something else", UserWarning)              # not a sync: not counted
        rec.phase("backward")
        t = threading.Thread(target=sync_here)                   # as from a hook on the autograd thread
        t.start()
        t.join()
        rec.phase("finish")
        sync_here()
        sync_here()
    assert modes == ["warn", 0]                                   # switched on, then restored
    syncs = rec.syncs()
    assert list(syncs) == ["forward", "backward", "finish"]
    assert syncs["forward"] == [] and len(syncs["backward"]) == 1 and len(syncs["finish"]) == 2
    assert all(s.startswith(f"{Path(__file__).name}:") for s in syncs["finish"])


def test_checks_pass_only_when_every_check_holds():
    c = Checks()
    c.compare("a", 3, "tensors", True)
    assert c.result(["s"], {})["status"] == "pass"
    c.add("b", False, "why")
    r = c.result(["s"], {"x": 1})
    assert r["status"] == "fail" and r["failed"] == ["b: why"] and r["numbers"] == {"x": 1}


# -- every part end to end, on CPU -----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.multiprocess
def test_cpu_dry_run_of_every_part(tmp_path):
    # As on the GPU machine's image: no datasets, peft, trl, hypothesis or pytest (blocked in every process
    # the run starts, by a sitecustomize on its path), so a lazy import of one of them fails here too.
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        "import sys\nfor name in ('datasets', 'peft', 'trl', 'hypothesis', 'pytest'):\n    sys.modules[name] = None\n")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(block), env.get("PYTHONPATH", "")])
    out = tmp_path / "dry.json"
    proc = subprocess.run([sys.executable, "-m", "dev.gpu_check", "--on-cpu", "--quick", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["header"]["mode"].startswith("cpu dry run")
    status = {p["name"]: p["status"] for p in doc["parts"]}
    assert status == {"pytest": "skip", "gradsync": "pass", "prefetch": "pass", "ws1": "pass", "trainer": "pass",
                      "onerank": "pass", "multirank": "pass"}, \
        proc.stdout
    assert "overall: pass" in proc.stdout
