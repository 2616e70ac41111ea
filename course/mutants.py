"""Mutation testing of the course's own checks: ``python -m course mutants 05 [--exercise 05.finish]``.

Each exercise's solution (the lines between ``# BEGIN SOLUTION`` and ``# END SOLUTION`` in
``course/src/NN_name.py``) is changed one small way at a time, and every mutant is graded with the
exercise's own cases, in this process, the way the tests play a learner (`run_cell` on the
lesson's code cells up to the check, each reduced to its definitions by `keep_definitions`, so
no measurement runs). A mutant is *killed* when a case fails; grading stops at the first
failure. A *survivor* passed every case: either the checks miss a wrong answer (strengthen
them), or the change is still a right answer (list it in `ALLOWED` with why).

The changes (`ast`, written back with `ast.unparse`):

- ``cmp``: a comparison operator swapped (``<`` / ``<=`` / ``>`` / ``>=``, ``==`` / ``!=``, ``is`` /
  ``is not``, ``in`` / ``not in``);
- ``arith``: an arithmetic operator swapped (``+`` / ``-``, ``*`` / ``/``, ``//`` / ``/``, ...);
- ``cond``: an ``if`` / ``while`` / conditional expression's test negated;
- ``index``: a constant index, slice bound or ``range()`` stop shifted by one;
- ``minmax``: ``min`` / ``max`` swapped;
- ``reduceop``: ``ReduceOp.SUM`` / ``MAX`` / ``AVG`` swapped;
- ``wait``: a statement that calls ``.wait()`` moved before or after its neighbour;
- ``drop``: a statement dropped (``pass`` instead);
- ``reverse``: a returned list reversed;
- ``dtype``: a dtype size assumed (``x.element_size()`` / ``.itemsize`` -> ``4``).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import io
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from course.build import BEGIN, CHECK_CALL, END, exercise_of_cells, lesson_sources
from course.grading import (LEARNER_PREAMBLE, NotWritten, Wrong, _strip_notebook_syntax, get_exercise,
                            keep_definitions, lesson_exercises, run_case, run_cell, Learner)

# 09.final_challenge: which caps to ask the planner about is the learner's choice (the exercise says so).
CAPS_WHY = ("one candidate cap becomes 2 to 48 MiB, which on the lab's 0.5 MiB model is one bucket, like math.inf "
            "already in the list: the list loses one candidate, the planner picks the best of the rest, and the "
            "check grades the run that choice measures (which reached the pass line)")

# Survivors that are still right answers: {exercise id: {mutant's line: why}}. The key is the
# mutant's description as `python -m course mutants` prints it after "line N: ".
ALLOWED: dict[str, dict[str, str]] = {
    "00.real_apis": {
        "obj = None  ->  (dropped)":
            "the lesson's claims end at a dataclass field; with obj left on the dataclass the loop ends there "
            "too and returns True, the same answer (only a name past a field, which no claim has, would differ)",
    },
    "00.predict": {
        "raise ValueError(f\"schedule={schedule!r}: expected 'serial' or 'overlapped'\")  ->  (dropped)":
            "the contract names two schedules and asks about those only; what a third returns is not part "
            "of the answer",
    },
    "03.prefetcher": {
        "return False  ->  (dropped)":
            "put() then returns None, as falsy as False: the thread stops at the same point",
        "return  ->  (dropped)":
            "(the return after putting the loader's error) the consumer raises at the error and never reads "
            "the end marker the thread then tries to put; once the generator is closed the put gives up",
    },
    "10.sharded_step": {
        "coef = min(1.0, max_norm / (norm + 1e-06))  ->  coef = min(1.0, max_norm / (norm - 1e-06))":
            "the 1e-6 only keeps a zero norm from dividing by zero: either sign moves the coefficient by "
            "2e-6 / norm, below float32's resolution at any norm that is clipped here (a norm of 1e-6 is "
            "the only place they part)",
    },
    "10.gather_hook": {
        "self.handles = []  ->  (dropped)":
            "the handles are removed just before; a removed handle's remove() does nothing, so keeping the "
            "list changes no hook",
    },
    "09.final_challenge": {
        "caps = [0, 1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 1 / 2, math.inf]  ->  caps = [0, 1 * 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 1 / 2, math.inf]":
            CAPS_WHY,
        "caps = [0, 1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 1 / 2, math.inf]  ->  caps = [0, 1 / 32, 1 * 16, 1 / 8, 3 / 16, 1 / 4, 1 / 2, math.inf]":
            CAPS_WHY,
        "caps = [0, 1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 1 / 2, math.inf]  ->  caps = [0, 1 / 32, 1 / 16, 1 * 8, 3 / 16, 1 / 4, 1 / 2, math.inf]":
            CAPS_WHY,
        "caps = [0, 1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 1 / 2, math.inf]  ->  caps = [0, 1 / 32, 1 / 16, 1 / 8, 3 * 16, 1 / 4, 1 / 2, math.inf]":
            CAPS_WHY,
        "caps = [0, 1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 1 / 2, math.inf]  ->  caps = [0, 1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 * 4, 1 / 2, math.inf]":
            CAPS_WHY,
        "caps = [0, 1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 1 / 2, math.inf]  ->  caps = [0, 1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 1 * 2, math.inf]":
            CAPS_WHY,
    },
    "09.scaling": {
        "if world_size <= 1:  ->  (dropped)":
            "the formula itself gives 0 at N = 1: 2(N-1)/N and 2(N-1) are both 0; the guard only says so",
        "if world_size <= 1:  ->  if world_size < 1:":
            "the same: at N = 1 the formula gives 0 (no world size is below 1)",
        "return 0.0  ->  (dropped)":
            "the same: at N = 1 the formula that follows gives 0",
    },
    "09.crossover": {
        "if n <= 1:  ->  (dropped)":
            "min_link_gbs at N = 1: no latency term (2(N-1) = 0) and a ring factor of 0, so the formula gives 0",
        "if n <= 1:  ->  if n < 1:":
            "the same: at N = 1 the formula gives 0 (no world size is below 1)",
        "return 0.0  ->  (dropped)":
            "the same: at N = 1 the formula that follows gives 0",
    },
}

# Exercises whose answer reads what one of the lesson's measurements returned (a measurement: an
# assignment that calls a name the lesson imports from `course.checks`, which the tool otherwise
# skips). For these the tool runs each such measurement once per process, the first time a
# namespace is built, and hands every later mutant a copy of what it bound: {exercise id: why}.
MEASURED_FOR: dict[str, str] = {
    "09.final_challenge":
        "final_run_config() asks overlap_step_ms about lab_buckets(cap) with lab_parts, lab_link_gbs and "
        "lab_latency_us, read from the `explore = run_lab(...)` run; lab_shape calls lab_tensors()",
}
_MEASURED: dict[str, dict] = {}    # a measurement's source -> the names it bound, in this process

CMP_SWAPS = {ast.Lt: [ast.LtE, ast.Gt], ast.LtE: [ast.Lt, ast.GtE], ast.Gt: [ast.GtE, ast.Lt],
             ast.GtE: [ast.Gt, ast.LtE], ast.Eq: [ast.NotEq], ast.NotEq: [ast.Eq], ast.Is: [ast.IsNot],
             ast.IsNot: [ast.Is], ast.In: [ast.NotIn], ast.NotIn: [ast.In]}
ARITH_SWAPS = {ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.Div], ast.Div: [ast.Mult],
               ast.FloorDiv: [ast.Div, ast.Mult], ast.Mod: [ast.FloorDiv], ast.Pow: [ast.Mult]}
REDUCE_OPS = ("SUM", "MAX", "AVG")


@dataclass
class Mutant:
    exercise: str
    kind: str
    line: int              # in the solution cell
    before: str            # the statement's first line, as written back by ast.unparse
    after: str             # the same line in the mutant
    source: str = field(repr=False, default="")

    @property
    def key(self) -> str:
        return f"{self.before.strip()}  ->  {self.after.strip()}"


@dataclass
class Outcome:
    mutant: Mutant
    killed: bool
    by: str = ""           # the case that failed (or "definition" when the cell did not run)
    message: str = ""
    seconds: float = 0.0


@dataclass
class CellSpec:
    source: str            # the solution notebook's source of the cell
    block_lines: set[int]  # 1-based lines of the source inside a solution block
    exercise: str | None   # the exercise of the next check() cell

    @property
    def forced(self) -> set[int]:
        """Indices of the cell's top-level statements that are the learner's answer yet not definitions
        `keep_definitions` keeps (``is_real = {spec: api_exists(spec) ...}`` in lesson 00): they run too."""
        tree = ast.parse(_strip_notebook_syntax(self.source))
        return {k for k, node in enumerate(tree.body)
                if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                and set(range(node.lineno, node.end_lineno + 1)) & self.block_lines}


def lesson_cells(lesson: str) -> list[tuple[CellSpec, list[str]]]:
    """The lesson's code cells in order (gpu and hidden-check cells left out), each with the
    exercise ids its check() calls name."""
    import jupytext

    path = next((p for p in lesson_sources() if p.stem.startswith(lesson + "_")), None)
    if path is None:
        raise SystemExit(f"no lesson {lesson!r}")
    cells = jupytext.reads(path.read_text(), fmt="py:percent").cells
    out, next_check = [], exercise_of_cells(cells)
    for i, cell in enumerate(cells):
        tags = cell.metadata.get("tags", [])
        if cell.cell_type != "code" or "gpu" in tags or "hidden-check" in tags:
            continue
        lines, inside, kept = [], False, set()
        for line in cell.source.splitlines():
            if line.strip() == BEGIN:
                inside = True
                continue
            if line.strip() == END:
                inside = False
                continue
            lines.append(line)
            if inside:
                kept.add(len(lines))
        out.append((CellSpec("\n".join(lines) + "\n", kept, next_check[i]), CHECK_CALL.findall(cell.source)))
    return out


# --------------------------------------------------------------------------- the mutations
def _sites(tree: ast.AST, lines: set[int]):
    """(node index in ast.walk order, kind, variant) of every change inside the solution lines."""
    lists = {t.id for a in ast.walk(tree) if isinstance(a, ast.Assign) and _is_list(a.value, set())
             for t in a.targets if isinstance(t, ast.Name)}
    for i, node in enumerate(ast.walk(tree)):
        if getattr(node, "lineno", None) not in lines:
            continue
        if isinstance(node, ast.Compare):
            for j, op in enumerate(node.ops):
                for k, _ in enumerate(CMP_SWAPS.get(type(op), [])):
                    yield i, "cmp", (j, k)
        elif isinstance(node, (ast.BinOp, ast.AugAssign)):
            for k, _ in enumerate(ARITH_SWAPS.get(type(node.op), [])):
                yield i, "arith", k
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            yield i, "cond", 0
        if isinstance(node, ast.Subscript):
            sl = node.slice
            if isinstance(sl, ast.Constant) and type(sl.value) is int:
                yield i, "index", ("at", 1)
                yield i, "index", ("at", -1)
            elif isinstance(sl, ast.Slice):
                for part in ("lower", "upper"):
                    if getattr(sl, part) is not None:
                        yield i, "index", (part, 1)
                        yield i, "index", (part, -1)
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == "range" and node.args:
                yield i, "index", ("range", 1)
                yield i, "index", ("range", -1)
            if isinstance(f, ast.Attribute) and f.attr == "element_size" and not node.args:
                yield i, "dtype", 0
        if isinstance(node, ast.Name) and node.id in ("min", "max"):
            yield i, "minmax", 0
        if isinstance(node, ast.Attribute):
            if node.attr in ("min", "max", "amin", "amax", "minimum", "maximum"):
                yield i, "minmax", 0
            if node.attr in REDUCE_OPS:
                for k, _ in enumerate(o for o in REDUCE_OPS if o != node.attr):
                    yield i, "reduceop", k
            if node.attr == "itemsize" and isinstance(node.ctx, ast.Load):
                yield i, "dtype", 0
        if isinstance(node, ast.Return) and _is_list(node.value, lists):
            yield i, "reverse", 0
        if isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Pass)):
            yield i, "drop", 0
            if any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "wait"
                   for c in ast.walk(node)) and not isinstance(node, (ast.For, ast.While, ast.If, ast.With)):
                yield i, "wait", -1
                yield i, "wait", 1


def _is_list(value, names: set[str]) -> bool:
    """A returned value that is a list (so reversing it changes the answer): a list display or
    comprehension, ``sorted``/``list``/``reversed`` of something, or a name assigned one."""
    if isinstance(value, (ast.List, ast.ListComp)):
        return True
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
        return value.func.id in ("sorted", "list", "reversed")
    return isinstance(value, ast.Name) and value.id in names


def _body_of(tree: ast.AST, stmt: ast.stmt):
    for parent in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            body = getattr(parent, name, None)
            if isinstance(body, list) and any(s is stmt for s in body):
                return body
        for h in getattr(parent, "handlers", []) or []:
            if any(s is stmt for s in h.body):
                return h.body
    return None


def _shift(expr: ast.expr, by: int) -> ast.expr:
    if isinstance(expr, ast.Constant) and type(expr.value) is int:
        return ast.Constant(expr.value + by)
    return ast.BinOp(expr, ast.Add() if by > 0 else ast.Sub(), ast.Constant(abs(by)))


def _apply(tree: ast.AST, index: int, kind: str, variant) -> tuple[ast.AST, ast.AST] | None:
    """A mutated copy of ``tree`` and the statement that changed (None: nothing to change)."""
    tree = copy.deepcopy(tree)
    nodes = list(ast.walk(tree))
    node = nodes[index]
    stmt = _statement_of(tree, node)
    if kind == "cmp":
        j, k = variant
        node.ops[j] = CMP_SWAPS[type(node.ops[j])][k]()
    elif kind == "arith":
        node.op = ARITH_SWAPS[type(node.op)][variant]()
    elif kind == "cond":
        node.test = ast.UnaryOp(ast.Not(), node.test)
    elif kind == "index":
        part, by = variant
        if part == "at":
            node.slice = ast.Constant(node.slice.value + by)
        elif part == "range":
            stop = 0 if len(node.args) == 1 else 1
            node.args[stop] = _shift(node.args[stop], by)
        else:
            setattr(node.slice, part, _shift(getattr(node.slice, part), by))
    elif kind == "minmax":
        swap = {"min": "max", "max": "min", "amin": "amax", "amax": "amin", "minimum": "maximum", "maximum": "minimum"}
        if isinstance(node, ast.Name):
            node.id = swap[node.id]
        else:
            node.attr = swap[node.attr]
    elif kind == "reduceop":
        node.attr = [o for o in REDUCE_OPS if o != node.attr][variant]
    elif kind == "dtype":
        replacement = ast.Constant(4)
        for parent in ast.walk(tree):
            for name, value in ast.iter_fields(parent):
                if value is node:
                    setattr(parent, name, replacement)
                elif isinstance(value, list):
                    for m, item in enumerate(value):
                        if item is node:
                            value[m] = replacement
    elif kind == "reverse":
        v = node.value
        node.value = ast.parse("(lambda _v: _v[::-1] if isinstance(_v, (list, tuple)) else _v)(0)", mode="eval").body
        node.value.args = [v]
    elif kind == "drop":
        body = _body_of(tree, node)
        if body is None:
            return None
        at = next(m for m, s in enumerate(body) if s is node)
        body[at] = ast.Pass()
        ast.copy_location(body[at], node)
        stmt = node
    elif kind == "wait":
        body = _body_of(tree, node)
        if body is None:
            return None
        at = next(m for m, s in enumerate(body) if s is node)
        other = at + variant
        if not 0 <= other < len(body):
            return None
        if isinstance(body[other], ast.Expr) and isinstance(body[other].value, ast.Constant):
            return None        # a docstring: moving past it changes nothing
        body[at], body[other] = body[other], body[at]
        stmt = node
    ast.fix_missing_locations(tree)
    return tree, stmt


def _statement_of(tree: ast.AST, node: ast.AST) -> ast.AST:
    if isinstance(node, ast.stmt):
        return node
    best = None
    for s in ast.walk(tree):
        if isinstance(s, ast.stmt) and any(n is node for n in ast.walk(s)):
            best = s          # ast.walk is breadth-first: the last hit is the innermost
    return best or node


def _first_line(node: ast.AST) -> str:
    return ast.unparse(node).splitlines()[0] if node is not None else ""


def mutants_of(cell: CellSpec) -> list[Mutant]:
    tree = ast.parse(cell.source)
    out, seen = [], set()
    original_lines = {}
    for i, kind, variant in _sites(tree, cell.block_lines):
        node = list(ast.walk(tree))[i]
        original_lines.setdefault(i, _first_line(_statement_of(tree, node)))
        applied = _apply(tree, i, kind, variant)
        if applied is None:
            continue
        new_tree, stmt = applied
        source = ast.unparse(new_tree)
        if source in seen or source == ast.unparse(tree):
            continue
        seen.add(source)
        if kind == "drop":
            after = "(dropped)"
        elif kind == "wait":
            after = f"(moved {'before' if variant < 0 else 'after'} its neighbour)"
        else:
            after = _first_line(stmt)
        out.append(Mutant(cell.exercise, kind, node.lineno, original_lines[i], after, source))
    return out


# --------------------------------------------------------------------------- grading
def _bound_names(node: ast.AST) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]


def _measure_once(node: ast.AST, ns: dict, filename: str) -> None:
    """Run a measurement assignment the first time, and bind a copy of what it bound since."""
    key = ast.unparse(node)
    if key not in _MEASURED:
        exec(compile(ast.Module([node], type_ignores=[]), filename, "exec"), ns)
        _MEASURED[key] = {name: ns[name] for name in _bound_names(node) if name in ns}
    for name, value in _MEASURED[key].items():
        try:
            ns[name] = copy.deepcopy(value)
        except Exception:
            ns[name] = value


def _namespace(cells: list[str], forced: list[set[int]] | None = None, measure: bool = False) -> dict:
    """The names the cells define, each cell kept in linecache as a notebook cell is (so
    `Learner.module_file` ships it whole). A statement that needs a name only a dropped call made
    (``x = model.weight`` after ``model = train(...)``) is skipped; a def, class or import that
    fails raises (the mutant broke it). With ``measure`` the lesson's measurements run too, once
    per process (`MEASURED_FOR`)."""
    import linecache

    ns = run_cell(LEARNER_PREAMBLE)
    measuring: set[str] = set()    # names imported from course.checks: the lesson's measurements
    for n, source in enumerate(cells):
        stripped = _strip_notebook_syntax(source)
        text = keep_definitions(stripped)
        must = (forced or [set()] * len(cells))[n]
        if must:   # the answer's own top-level assignments run, in their place among the definitions
            body = ast.parse(stripped).body
            text = "\n".join(ast.unparse(node) for k, node in enumerate(body)
                             if k in must or keep_definitions(ast.unparse(node)).strip()) + "\n"
        elif measure:   # the measurements too, in their place (keep_definitions drops those of a later cell)
            body = ast.parse(stripped).body
            imports = "\n".join(ast.unparse(node) for node in body if isinstance(node, (ast.Import, ast.ImportFrom)))
            here = measuring | {a.asname or a.name for node in body if isinstance(node, ast.ImportFrom)
                                and (node.module or "").startswith("course.checks") for a in node.names}
            text = "\n".join(ast.unparse(node) for node in body
                             if keep_definitions(ast.unparse(node), preamble=imports).strip()
                             or (isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
                                 isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in here
                                 for c in ast.walk(node)))) + "\n"
        filename = f"<course-mutant-cell-{id(ns)}-{n}>"
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        for node in ast.parse(text).body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course.checks"):
                measuring |= {a.asname or a.name for a in node.names}
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
                    isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in measuring
                    for c in ast.walk(node)):
                if measure:
                    with contextlib.suppress(Exception):
                        _measure_once(node, ns, filename)
                continue     # `rs = measure_reduce_scatter(globals())`: a measurement, not a definition
            try:
                exec(compile(ast.Module([node], type_ignores=[]), filename, "exec"), ns)
            except Exception:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
                    raise
    return ns


def grade(exercise_id: str, cells: list[str], case_timeout: float = 60.0,
          forced: list[set[int]] | None = None) -> tuple[bool, str, str]:
    """(passed, the first failing case's title, its message) of the exercise on these cells."""
    exercise = get_exercise(exercise_id)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            ns = _namespace(cells, forced, measure=exercise_id in MEASURED_FOR)
        except Exception as e:  # the mutant does not even define its names
            return False, "definition", f"{type(e).__name__}: {e}"
        learner = Learner(ns, exercise)
        for case in exercise.cases:
            case = dataclasses.replace(case, timeout=min(case.timeout, case_timeout))
            r = run_case(exercise, case, learner)
            if not r.passed:
                return False, case.title, r.message
    return True, "", ""


@contextlib.contextmanager
def _private_progress():
    saved = os.environ.get("HFSTREAM_COURSE_PROGRESS")
    with tempfile.TemporaryDirectory(prefix="course-mutants-") as d:
        os.environ["HFSTREAM_COURSE_PROGRESS"] = str(Path(d) / "progress.json")
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("HFSTREAM_COURSE_PROGRESS", None)
            else:
                os.environ["HFSTREAM_COURSE_PROGRESS"] = saved


def _sampled(mutants: list[Mutant], sample: int | None) -> list[Mutant]:
    """``sample`` mutants spread evenly over the list (every kind and every part of the solution gets
    its share), or all of them."""
    if sample is None or sample >= len(mutants):
        return mutants
    step = len(mutants) / sample
    return [mutants[int(k * step)] for k in range(sample)]


def run_exercise(lesson: str, exercise_id: str, kinds: set[str] | None = None, limit: int | None = None,
                 case_timeout: float = 60.0, report=None, sample: int | None = None) -> tuple[list[Outcome], bool]:
    """Grade every mutant of one exercise's solution (or ``sample`` of them, spread evenly); returns
    (outcomes, the unmutated solution passed)."""
    cells = lesson_cells(lesson)
    upto = next(k for k, (_, checks) in enumerate(cells) if exercise_id in checks)
    sources = [c.source for c, _ in cells[:upto]]
    forced = [c.forced for c, _ in cells[:upto]]
    with _private_progress():
        ok, by, message = grade(exercise_id, sources, case_timeout, forced)
        if not ok:
            if report:
                report(f"  {exercise_id}: the unmutated solution fails in-process ({by}: {message[:200]}); not mutated")
            return [], False
        outcomes = []
        for k, (cell, _) in enumerate(cells[:upto]):
            if cell.exercise != exercise_id or not cell.block_lines:
                continue
            for m in _sampled([m for m in mutants_of(cell) if not kinds or m.kind in kinds], sample):
                if limit is not None and len(outcomes) >= limit:
                    break
                start = time.perf_counter()
                mutated = sources[:k] + [m.source] + sources[k + 1:]
                passed, by, message = grade(exercise_id, mutated, case_timeout, forced)
                o = Outcome(m, not passed, by, message, time.perf_counter() - start)
                outcomes.append(o)
                if report and passed:
                    why = ALLOWED.get(exercise_id, {}).get(m.key)
                    tag = f"allowed: {why}" if why else "SURVIVED"
                    report(f"    {tag}  [{m.kind}] line {m.line}: {m.key}")
    return outcomes, True


def summary(exercise_id: str, outcomes: list[Outcome]) -> tuple[int, int, int]:
    """(mutants, killed, unlisted survivors)."""
    allowed = ALLOWED.get(exercise_id, {})
    unlisted = [o for o in outcomes if not o.killed and o.mutant.key not in allowed]
    return len(outcomes), sum(o.killed for o in outcomes), len(unlisted)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course mutants",
                                description="grade small changes of each solution with the course's own checks")
    p.add_argument("lesson", help="lesson number, e.g. 05")
    p.add_argument("--exercise", action="append", help="only this exercise id (repeatable)")
    p.add_argument("--kind", action="append", help="only these kinds of change (cmp, arith, cond, index, minmax, "
                                                    "reduceop, wait, drop, reverse, dtype)")
    p.add_argument("--limit", type=int, help="at most this many mutants per exercise (the first ones)")
    p.add_argument("--sample", type=int, help="this many mutants per solution cell, spread evenly over its "
                                                "mutants (for lessons whose cases spawn processes or measure)")
    p.add_argument("--case-timeout", type=float, default=60.0, help="seconds per case (default 60)")
    ns = p.parse_args(argv)
    lesson = ns.lesson[:2]
    ids = ns.exercise or [e.id for e in lesson_exercises(lesson)]
    total = [0, 0, 0]
    start = time.perf_counter()
    for ex_id in ids:
        print(f"{ex_id}:", flush=True)
        outcomes, ok = run_exercise(lesson, ex_id, set(ns.kind or []) or None, ns.limit, ns.case_timeout,
                                    report=lambda s: print(s, flush=True), sample=ns.sample)
        n, killed, unlisted = summary(ex_id, outcomes)
        print(f"  {ex_id}: {killed}/{n} mutants killed, {n - killed - unlisted} allowed, {unlisted} survive"
              + ("" if ok else " (not graded)"), flush=True)
        for k, v in zip(range(3), (n, killed, unlisted)):
            total[k] += v
    print(f"lesson {lesson}: {total[1]}/{total[0]} killed, {total[2]} unlisted survivors "
          f"({time.perf_counter() - start:.0f} s)")
    return 1 if total[2] else 0
