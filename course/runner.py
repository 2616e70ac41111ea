"""Grade notebooks headless and show progress: ``python -m course grade|progress|start``.

``grade`` executes a lesson's notebook in a fresh kernel (nbclient), one cell at a time with a
per-cell timeout, keeps going past a failing cell (so one unfinished exercise does not hide the
others), and collects the results every ``check(...)`` call wrote to the file named by
``$HFSTREAM_COURSE_RESULTS``. An exercise whose check never ran counts as failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from course.build import SOLUTION_DIR, STUDENT_DIR, lesson_sources
from course.grading import COURSE_DIR, ROOT, lesson_exercises, load_progress, progress_path

WORK_DIR = COURSE_DIR / "work"


@dataclass
class ExerciseGrade:
    exercise: str
    passed: bool
    cases_passed: int
    cases: int
    messages: list[str] = field(default_factory=list)


@dataclass
class LessonGrade:
    lesson: str
    notebook: str
    exercises: list[ExerciseGrade]
    cell_errors: list[str]
    images: int
    seconds: float

    @property
    def passed(self) -> int:
        return sum(e.passed for e in self.exercises)


def lessons() -> list[str]:
    return [p.stem[:2] for p in lesson_sources()]


def notebook_for(lesson: str, which: str) -> Path:
    """The notebook to grade: ``which`` is "work" (the learner's copy, else the student one),
    "student" or "solution"."""
    name = next((p.stem for p in lesson_sources() if p.stem.startswith(lesson + "_")), None)
    if name is None:
        raise SystemExit(f"no lesson {lesson!r}; lessons are {', '.join(lessons())}")
    if which == "work" and (WORK_DIR / f"{name}.ipynb").exists():
        return WORK_DIR / f"{name}.ipynb"
    folder = SOLUTION_DIR if which == "solution" else STUDENT_DIR
    return folder / f"{name}.ipynb"


def execute(path: Path, cell_timeout: float = 300.0, save_to: Path | None = None) -> tuple[list[dict], list[str], int, float]:
    """Run a notebook headless; return (check results, cell errors, image outputs, seconds)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    fd, sink = tempfile.mkstemp(prefix="course-results-", suffix=".jsonl")
    os.close(fd)
    saved = {k: os.environ.get(k) for k in ("HFSTREAM_COURSE_RESULTS", "MPLBACKEND", "OMP_NUM_THREADS")}
    os.environ["HFSTREAM_COURSE_RESULTS"] = sink
    os.environ["MPLBACKEND"] = "Agg"
    # One compute thread in the kernel, as in every rank it spawns: on a small machine OpenMP
    # threads of the kernel and of the ranks otherwise fight over the cores (measured 10-30x
    # slower steps on 2 busy cores).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    try:
        client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3", allow_errors=True,
                                extra_arguments=["--Application.log_level=40"],
                                resources={"metadata": {"path": str(path.parent)}})
        client.execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    seconds = time.perf_counter() - start
    results = [json.loads(line) for line in Path(sink).read_text().splitlines() if line.strip()]
    os.unlink(sink)
    errors, images = [], 0
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                errors.append(f"cell {i}: {out.get('ename')}: {out.get('evalue', '')[:200]}")
            if "image/png" in out.get("data", {}):
                images += 1
    if save_to is not None:
        save_to.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, save_to)
    return results, errors, images, seconds


def grade_lesson(lesson: str, which: str = "work", cell_timeout: float = 300.0,
                 save_dir: Path | None = None) -> LessonGrade:
    path = notebook_for(lesson, which)
    save_to = save_dir / path.name if save_dir else None
    results, errors, images, seconds = execute(path, cell_timeout, save_to)
    grades = []
    for ex in lesson_exercises(lesson):
        mine = [r for r in results if r["exercise"] == ex.id]
        # A check cell run twice reports twice: its last run counts.
        mine = mine[-len(ex.cases):] if mine else []
        if not mine:
            grades.append(ExerciseGrade(ex.id, False, 0, len(ex.cases), ["the check cell did not run"]))
            continue
        ok = sum(r["passed"] for r in mine)
        grades.append(ExerciseGrade(ex.id, ok == len(mine), ok, len(mine),
                                    [_failure_line(r) for r in mine if not r["passed"]]))
    return LessonGrade(lesson, str(path.relative_to(ROOT)), grades, errors, images, seconds)


def _failure_line(r: dict) -> str:
    line = f"{r['case']}: {r['message']}"
    if r.get("reveal"):
        line += f" (more, after {r.get('failures', 0)} tries: {r['reveal']})"
    return line


def format_table(grades: list[LessonGrade], verbose: bool = False) -> str:
    rows = [f"{'lesson':<8}{'exercises':>10}{'cases':>9}{'cell errors':>13}{'figures':>9}{'time':>8}  notebook"]
    total_ex = total_pass = 0
    for g in grades:
        cases_ok = sum(e.cases_passed for e in g.exercises)
        cases = sum(e.cases for e in g.exercises)
        total_ex += len(g.exercises)
        total_pass += g.passed
        rows.append(f"{g.lesson:<8}{f'{g.passed}/{len(g.exercises)}':>10}{f'{cases_ok}/{cases}':>9}"
                    f"{len(g.cell_errors):>13}{g.images:>9}{g.seconds:>7.0f}s  {g.notebook}")
        if verbose:
            for e in g.exercises:
                if not e.passed:
                    for m in e.messages:
                        rows.append(f"    {e.exercise}  {m}")
    score = 100.0 * total_pass / total_ex if total_ex else 0.0
    rows.append(f"score: {total_pass}/{total_ex} exercises ({score:.0f}%)")
    return "\n".join(rows)


def wanted_lessons(asked: list[str], every: bool = False) -> list[str]:
    """The lessons ``grade`` runs: ``asked`` (e.g. ``["4", "05"]``) in order, once each, or every
    lesson when ``every`` is set or nothing is asked. An unknown lesson is an error naming it."""
    known = lessons()
    if every and asked:
        raise SystemExit(f"grade: give lesson numbers ({' '.join(asked)}) or --all, not both")
    if every or not asked:
        return known
    wanted = []
    for a in asked:
        lesson = a.strip().zfill(2)
        if not (len(lesson) == 2 and lesson.isdigit()) or lesson not in known:
            raise SystemExit(f"grade: no lesson {a!r}; give lesson numbers among {' '.join(known)} (or --all)")
        if lesson not in wanted:
            wanted.append(lesson)
    return wanted


def cmd_grade(ns: argparse.Namespace) -> int:
    wanted = wanted_lessons(ns.lesson, ns.all)
    if ns.progress_file:
        os.environ["HFSTREAM_COURSE_PROGRESS"] = ns.progress_file
    grades = []
    for lesson in wanted:
        print(f"grading lesson {lesson} ({notebook_for(lesson, ns.which).relative_to(ROOT)}) ...", flush=True)
        grades.append(grade_lesson(lesson, ns.which, ns.cell_timeout, Path(ns.save) if ns.save else None))
    print(format_table(grades, verbose=not ns.quiet))
    if ns.json:
        Path(ns.json).write_text(json.dumps([asdict(g) | {"passed": g.passed} for g in grades], indent=1))
        print(f"wrote {ns.json}")
    return 0 if all(g.passed == len(g.exercises) for g in grades) else 1


def cmd_progress(ns: argparse.Namespace) -> int:
    progress = load_progress()
    done = total = failing_now = 0
    print(f"progress file: {progress_path()}")
    for lesson in lessons():
        marks = []
        for ex in lesson_exercises(lesson):
            total += 1
            entry = progress.get(ex.id)
            if entry is None:
                marks.append(f"  {ex.id:<28} not tried")
            elif entry.get("passed"):
                done += 1
                first = entry.get("first_passed", entry.get("when", "?"))
                last = "" if entry.get("when", first) == first else f"; last checked {entry['when']}"
                marks.append(f"  {ex.id:<28} {'done':<12} (first passed {first}{last})")
            elif entry.get("passed_before"):
                # A pass is remembered: it counts as done, and says that it fails now.
                done += 1
                failing_now += 1
                marks.append(f"  {ex.id:<28} passed before (failing now: {entry.get('cases_passed', 0)}/"
                             f"{entry.get('cases', '?')} cases at {entry.get('when', '?')}; first passed at "
                             f"{entry.get('first_passed', entry['passed_before'])})")
            else:
                state = f"{entry.get('cases_passed', 0)}/{entry.get('cases', '?')} cases"
                marks.append(f"  {ex.id:<28} {state:<12} ({entry.get('when', '?')})")
        name = next(p.stem for p in lesson_sources() if p.stem.startswith(lesson))
        print(f"{name}")
        print("\n".join(marks))
    print(f"{done}/{total} exercises done" + (f" ({failing_now} of them passed before and fail now)" if failing_now else ""))
    return 0


def cmd_start(ns: argparse.Namespace) -> int:
    WORK_DIR.mkdir(exist_ok=True)
    for src in sorted(STUDENT_DIR.glob("*.ipynb")):
        target = WORK_DIR / src.name
        if target.exists() and not ns.force:
            print(f"kept   {target.relative_to(ROOT)} (yours; --force overwrites)")
        else:
            shutil.copy2(src, target)
            print(f"copied {target.relative_to(ROOT)}")
    print(f"open them with: jupyter lab {WORK_DIR.relative_to(ROOT)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course", description="the hfstream course: build, start, grade, progress")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="rebuild the notebooks from course/src (--check: fail if stale)", add_help=False)
    p_start = sub.add_parser("start", help="copy the student notebooks to course/work/, where you work")
    p_start.add_argument("--force", action="store_true", help="overwrite notebooks already in course/work/")
    p_grade = sub.add_parser("grade", help="execute notebooks headless and print a score table")
    p_grade.add_argument("lesson", nargs="*", help="lesson numbers, e.g. 04 05 06 (default: all)")
    p_grade.add_argument("--all", action="store_true", help="grade every lesson")
    p_grade.add_argument("--which", choices=("work", "student", "solution"), default="work",
                         help="your copy in course/work/ (default; the student notebook if you have none), "
                              "the untouched student notebook, or the solution")
    p_grade.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p_grade.add_argument("--cell-timeout", type=float, default=300.0, help="seconds per cell (default 300)")
    p_grade.add_argument("--save", metavar="DIR", help="save the executed notebooks (with outputs) here")
    p_grade.add_argument("--progress-file", metavar="FILE", help="record progress here instead of course/.progress.json")
    p_grade.add_argument("--quiet", action="store_true", help="the table only, no hints")
    sub.add_parser("progress", help="show which exercises you have passed")
    if argv is None:
        argv = sys.argv[1:]
    sub.add_parser("mutants", help="grade small changes of each solution with the checks (mutation testing)",
                   add_help=False)
    if argv and argv[0] == "mutants":
        from course.mutants import main as mutants_main

        return mutants_main(argv[1:])
    if argv and argv[0] == "build":
        from course.build import main as build_main

        return build_main(argv[1:])
    ns = parser.parse_args(argv)
    return {"grade": cmd_grade, "progress": cmd_progress, "start": cmd_start}[ns.command](ns)
