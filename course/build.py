"""Build the notebooks from the lesson sources: ``python -m course build [--check]``.

A lesson source is a jupytext ``py:percent`` file, ``course/src/NN_name.py``. Three markers:

- ``# BEGIN SOLUTION`` ... ``# END SOLUTION`` inside a code cell: the learner's part. The
  student notebook gets ``raise NotImplementedError("Exercise NN.x is yours to write ...")`` at
  the marker's indentation; the solution notebook gets the code without the markers. The
  exercise id is the one named by the next ``check("NN.x")`` cell.
- a cell tagged ``hidden-check`` (``# %% tags=["hidden-check"]``): assertions only the solution
  notebook carries (an author's proof that the solution's measured figure is sane).
- a cell tagged ``gpu``: its first line must be ``# GPU: <what a GPU would show>``; on a machine
  without an accelerator the notebook prints that sentence instead of running the cell
  (`course.lib.setup_notebook` installs the input transformer that does it).

Output: ``course/notebooks/NN_name.ipynb`` (student) and ``course/solutions/NN_name.ipynb``,
without outputs and with stable cell ids, so a rebuild of unchanged sources is byte-identical
and a test can say when the committed notebooks are stale.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from course.grading import COURSE_DIR, stub_message

SRC_DIR = COURSE_DIR / "src"
STUDENT_DIR = COURSE_DIR / "notebooks"
SOLUTION_DIR = COURSE_DIR / "solutions"

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
CHECK_CALL = re.compile(r"""^\s*check\(\s*["'](\d\d\.[a-z0-9_]+)["']""", re.M)
GPU_LINE = re.compile(r"^# GPU: \S")

SETUP_CELL = """\
# Course setup: make `course` and `hfstream` importable from this folder, and skip GPU cells on CPU.
import sys, pathlib
for _root in (pathlib.Path.cwd(), *pathlib.Path.cwd().parents):
    if (_root / "course" / "grading.py").exists():
        sys.path.insert(0, str(_root))
        break
from course import check, setup_notebook
setup_notebook()"""


class BuildError(ValueError):
    """A lesson source breaks a marker rule; the message names the file and cell."""


@dataclass
class Built:
    lesson: str          # "05"
    name: str            # "05_overlap"
    student: dict
    solution: dict
    exercises: list[str]
    solution_blocks: list[str]


def lesson_sources() -> list[Path]:
    return sorted(SRC_DIR.glob("[0-9][0-9]_*.py"))


def _split_solution(source: str, exercise_id: str | None, where: str) -> tuple[str, str, list[str]]:
    """(student source, solution source, solution blocks) of one code cell."""
    student, solution, blocks = [], [], []
    block: list[str] | None = None
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            if block is not None:
                raise BuildError(f"{where}: nested {BEGIN}")
            if exercise_id is None:
                raise BuildError(f"{where}: a solution block needs a later check(\"NN.name\") cell")
            indent = line[: len(line) - len(line.lstrip())]
            student.append(f"{indent}raise NotImplementedError({stub_message(exercise_id)!r})")
            block = []
        elif stripped == END:
            if block is None:
                raise BuildError(f"{where}: {END} without {BEGIN}")
            blocks.append("\n".join(block))
            block = None
        elif block is not None:
            block.append(line)
            solution.append(line)
        else:
            student.append(line)
            solution.append(line)
    if block is not None:
        raise BuildError(f"{where}: {BEGIN} without {END}")
    return "\n".join(student), "\n".join(solution), blocks


def exercise_of_cells(cells) -> list[str | None]:
    """Each cell's exercise id: the next ``check("...")`` at or after it (None after the last)."""
    next_check: list[str | None] = [None] * len(cells)
    upcoming = None
    for i in range(len(cells) - 1, -1, -1):
        if cells[i].cell_type == "code":
            found = CHECK_CALL.findall(cells[i].source)
            if found:
                upcoming = found[0]
        next_check[i] = upcoming
    return next_check


def build_lesson(path: Path) -> Built:
    import jupytext
    import nbformat

    lesson, name = path.stem[:2], path.stem
    nb = jupytext.reads(path.read_text(), fmt="py:percent")
    cells = nb.cells
    next_check = exercise_of_cells(cells)

    student_cells, solution_cells, exercises, blocks = [], [], [], []
    setup = nbformat.v4.new_code_cell(SETUP_CELL)
    setup.metadata["tags"] = ["setup"]
    for i, cell in enumerate(cells):
        where = f"{path.name}, cell {i + 1}"
        tags = list(cell.metadata.get("tags", []))
        meta = {"tags": tags} if tags else {}
        if cell.cell_type == "markdown":
            md = nbformat.v4.new_markdown_cell(cell.source, metadata=meta)
            student_cells.append(md)
            solution_cells.append(copy.deepcopy(md))
            continue
        if "gpu" in tags and not GPU_LINE.match(cell.source):
            raise BuildError(f"{where}: a gpu cell starts with '# GPU: <what a GPU would show>'")
        for found in CHECK_CALL.findall(cell.source):
            if found[:2] != lesson:
                raise BuildError(f"{where}: check({found!r}) belongs to lesson {found[:2]}, not {lesson}")
            if found not in exercises:
                exercises.append(found)
        stu, sol, cell_blocks = _split_solution(cell.source, next_check[i], where)
        blocks += cell_blocks
        solution_cells.append(nbformat.v4.new_code_cell(sol, metadata=copy.deepcopy(meta)))
        if "hidden-check" not in tags:
            student_cells.append(nbformat.v4.new_code_cell(stu, metadata=copy.deepcopy(meta)))

    def finish(cell_list):
        # The setup cell goes after the title (the first markdown cell).
        at = 1 if cell_list and cell_list[0].cell_type == "markdown" else 0
        cell_list = cell_list[:at] + [copy.deepcopy(setup)] + cell_list[at:]
        out = nbformat.v4.new_notebook(cells=cell_list)
        out.metadata = {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
            "hfstream_course": {"lesson": lesson, "exercises": exercises},
        }
        for k, c in enumerate(out.cells):
            c.id = f"l{lesson}-{k:03d}"
        nbformat.validate(out)
        return out

    if not exercises:
        raise BuildError(f"{path.name}: no check(\"{lesson}.name\") cell; every lesson is graded")
    return Built(lesson, name, finish(student_cells), finish(solution_cells), exercises, blocks)


def render(nb: dict) -> str:
    import nbformat

    return nbformat.writes(nb) + "\n"


def build(check_only: bool = False, lesson: str | None = None) -> list[Path]:
    """Write every student and solution notebook (or one lesson's); return the paths that changed."""
    changed = []
    for src in lesson_sources():
        if lesson is not None and not src.stem.startswith(lesson):
            continue
        built = build_lesson(src)
        for folder, nb in ((STUDENT_DIR, built.student), (SOLUTION_DIR, built.solution)):
            target = folder / f"{built.name}.ipynb"
            text = render(nb)
            if not target.exists() or target.read_text() != text:
                changed.append(target)
                if not check_only:
                    folder.mkdir(parents=True, exist_ok=True)
                    target.write_text(text)
    if lesson is not None:
        return changed
    # A notebook whose source is gone is stale too.
    names = {f"{s.stem}.ipynb" for s in lesson_sources()}
    for folder in (STUDENT_DIR, SOLUTION_DIR):
        for nb_path in folder.glob("*.ipynb"):
            if nb_path.name not in names:
                changed.append(nb_path)
                if not check_only:
                    nb_path.unlink()
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course build", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a built notebook is stale; write nothing")
    parser.add_argument("--lesson", metavar="NN", help="only this lesson (e.g. 05)")
    ns = parser.parse_args(argv)
    try:
        changed = build(check_only=ns.check, lesson=ns.lesson)
    except BuildError as e:
        print(f"build error: {e}", file=sys.stderr)
        return 2
    for p in changed:
        print(("stale: " if ns.check else "wrote: ") + str(p.relative_to(COURSE_DIR.parent)))
    if ns.check and changed:
        print("run `python -m course build` and commit the notebooks", file=sys.stderr)
        return 1
    if not changed:
        print("notebooks are up to date")
    return 0
