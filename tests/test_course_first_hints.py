"""The first stage of every hint diagnoses; it never hands over the fix. For every exercise of every
lesson, neither its stub in the student notebook nor any first-stage text of its lesson's checks
(a case's ``hint=``, the message of a ``Wrong(...)``) holds the solution's key expressions: each
line of code between its ``# BEGIN SOLUTION`` markers, and the formulas named in `KEYS`. The code
comes from the third failure of a case (``reveal=``), never sooner. Fast: it reads files only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from course import build as course_build
from course.grading import lesson_exercises

CHECKS = Path(course_build.__file__).resolve().parent / "checks"

# The expression that *is* each exercise's answer, beyond its code lines (whitespace and case
# do not matter): what a first hint or a stub must leave for the learner to find.
KEYS = {
    "01.phases": ["it = iter(batches)"],
    "02.lifetime": ["comm.wait_stream(compute)"],
    "07.clip_after_sync": ["zero_grad() after"],
    "00.ceiling": ["forward_ms + max(backward_ms, comm_ms) + optimizer_ms"],
    "00.predict": ["max(data, forward + max(backward, comm) + optimizer)", "max(data_ms, forward_ms"],
    "09.scaling": ["2(N-1)/N", "2*(n-1)/n", "2(N-1) x latency", "sum ring_allreduce_ms over"],
    "09.crossover": ["(lo + hi) // 2", "backward - 2(N-1)"],
    "09.final_challenge": ["max(ready * backward", "end = max(", "bucket_mb': 0.125", "1/8 MiB"],
    "10.reduce_scatter": ["all_to_all_single(received", ".sum(0) / n", "send each peer the slice",
                          "adds up what it receives", "divide by N exactly once"],
    "10.sharded_step": ["all-reduce the sum of squares", "square root of the", "pow(2).sum()",
                        "min(1, max_norm", "max_norm / (norm + 1e-6)"],
    "08.check_advice": ["max(rest, wait)", "max(step_ms - wait", "rest + max(0", "- measured) / measured"],
    "10.pipelined_step": ["step_slice(i); works.append", "all_gather_single(gathered[i], mine[i]"],
    "10.gather_hook": ["-(-", "ceil(", "register_forward_pre_hook(lambda", "work.wait()", "p.copy_(v)",
                       "full[rank * size"],
}


def _norm(text: str) -> str:
    return re.sub(r"\s+", "", text).lower()


def _solution_lines(src: Path) -> dict[str, list[str]]:
    """Per exercise id: the code lines of its solution blocks (long enough to identify, and not also
    written outside the blocks, as a signature or a given helper is)."""
    text = src.read_text()
    outside = {_norm(ln) for ln in re.sub(r"# BEGIN SOLUTION\n.*?# END SOLUTION", "", text, flags=re.S).splitlines()}
    out: dict[str, list[str]] = {}
    current = None
    for cell in re.split(r"^# %%", text, flags=re.M):
        m = re.search(r"## Exercise (\d\d\.[a-z0-9_]+)", cell)
        if m:
            current = m.group(1)
        for block in re.findall(r"# BEGIN SOLUTION\n(.*?)# END SOLUTION", cell, re.S):
            for line in block.splitlines():
                s = line.split("#", 1)[0].strip()
                if len(_norm(s)) >= 20 and current and _norm(s) not in outside:
                    out.setdefault(current, []).append(s)
    return out


def _first_stage_texts(lesson: str) -> list[str]:
    """Every case hint of the lesson, and the literal parts of every Wrong(...) message in its checks."""
    texts = [c.hint for ex in lesson_exercises(lesson) for c in ex.cases]
    path = CHECKS / f"lesson{lesson}.py"
    files = [path] if path.exists() else sorted((CHECKS / f"lesson{lesson}").glob("*.py"))
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Wrong" and node.args:
                texts.append("".join(v.value for v in ast.walk(node.args[0])
                                     if isinstance(v, ast.Constant) and isinstance(v.value, str)))
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") in ("REFUSED", "PART_IGNORED")
                                                    for t in node.targets):
                texts += [v.value for v in ast.walk(node.value) if isinstance(v, ast.Constant)
                          and isinstance(v.value, str)]
    return texts


def _stub_cells(built) -> dict[str, str]:
    """Per exercise id: the code of its exercise cell in the student notebook (the one with its stub)."""
    out = {}
    for cell in built.student.cells:
        for m in re.finditer(r"Exercise (\d\d\.[a-z0-9_]+) is yours to write", cell.source):
            out[m.group(1)] = out.get(m.group(1), "") + cell.source
    return out


@pytest.mark.parametrize("src", course_build.lesson_sources(), ids=lambda p: p.stem)
def test_first_hints_and_stubs_hold_no_key_expression_of_the_solution(src):
    lesson = src.stem[:2]
    built = course_build.build_lesson(src)
    lines = _solution_lines(src)
    stubs = _stub_cells(built)
    texts = [_norm(t) for t in _first_stage_texts(lesson)]
    ids = [ex.id for ex in lesson_exercises(lesson)]
    assert set(ids) <= set(stubs), f"{src.name}: exercises without a stub cell: {set(ids) - set(stubs)}"
    for ex_id in ids:
        keys = [k for k in lines.get(ex_id, []) + KEYS.get(ex_id, [])]
        for key in keys:
            k = _norm(key)
            assert k not in _norm(stubs[ex_id]), f"{ex_id}: the stub cell holds {key!r}"
            hits = [t for t in texts if k in t]
            assert not hits, f"{ex_id}: a first-stage hint holds {key!r}: {hits[0][:160]}"
