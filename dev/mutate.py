"""Mutation testing, one change at a time: ``python -m dev.mutate MODULE --tests TEST...``.

Each mutant is one `ast` change to MODULE (a comparison, boolean or arithmetic operator swapped,
an ``if``/``while`` condition negated, a call statement dropped, a number constant +1, a return
value replaced by None). For each, the tree is copied to a temporary folder (the real one is
never left mutated), the mutated module is written there, and the given test files run in that
copy (``pytest -x -q``, a timeout per mutant). A mutant the tests fail on is killed; one they pass
is a survivor, printed with its line and change. The score is killed / all.

``--lines A-B`` limits the mutants to those lines; ``--max N`` takes at most N of them (spread
evenly over the candidates); ``--list`` only lists them.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_COMPARE = {ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq,
            ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_BINOP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
          ast.Mod: ast.FloorDiv}
_BOOL = {ast.And: ast.Or, ast.Or: ast.And}
_IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.pyc", ".pytest_cache", "node_modules")


@dataclass(frozen=True)
class Mutant:
    index: int     # the node's place in ast.walk order
    line: int
    what: str


def _candidates(node: ast.AST) -> list[str]:
    """The changes that apply to ``node`` (names for `_apply`)."""
    out = []
    if isinstance(node, ast.Compare) and type(node.ops[0]) in _COMPARE:
        out.append("compare")
    elif isinstance(node, ast.BoolOp):
        out.append("bool")
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP:
        out.append("binop")
    elif isinstance(node, (ast.If, ast.While)):
        out.append("negate")
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        out.append("drop-call")
    elif (isinstance(node, ast.Constant) and type(node.value) in (int, float)):
        out.append("const+1")
    elif isinstance(node, ast.Return) and node.value is not None and not (
            isinstance(node.value, ast.Constant) and node.value.value is None):
        out.append("return-None")
    return out


def _describe(node: ast.AST, kind: str) -> str:
    if kind == "compare":
        return f"{type(node.ops[0]).__name__} -> {_COMPARE[type(node.ops[0])].__name__}"
    if kind == "bool":
        return f"{type(node.op).__name__} -> {_BOOL[type(node.op)].__name__}"
    if kind == "binop":
        return f"{type(node.op).__name__} -> {_BINOP[type(node.op)].__name__}"
    if kind == "const+1":
        return f"{node.value!r} -> {node.value + 1!r}"
    return kind


def mutants(source: str, lines: tuple[int, int] | None = None) -> list[Mutant]:
    """Every single change the operators allow in ``source`` (within ``lines``, inclusive)."""
    found = []
    for i, node in enumerate(ast.walk(ast.parse(source))):
        line = getattr(node, "lineno", 0)
        if lines and not lines[0] <= line <= lines[1]:
            continue
        for kind in _candidates(node):
            found.append(Mutant(i, line, f"{kind}: {_describe(node, kind)}" if kind in
                                ("compare", "bool", "binop", "const+1") else kind))
    return found


def apply(source: str, mutant: Mutant) -> str:
    """``source`` with ``mutant``'s one change, unparsed."""
    tree = ast.parse(source)
    node = list(ast.walk(tree))[mutant.index]
    kind = mutant.what.split(":")[0]
    if kind == "compare":
        node.ops[0] = _COMPARE[type(node.ops[0])]()
    elif kind == "bool":
        node.op = _BOOL[type(node.op)]()
    elif kind == "binop":
        node.op = _BINOP[type(node.op)]()
    elif kind == "negate":
        node.test = ast.UnaryOp(op=ast.Not(), operand=node.test)
    elif kind == "drop-call":
        node.value = ast.Constant(value=None)
    elif kind == "const+1":
        node.value = node.value + 1
    elif kind == "return-None":
        node.value = ast.Constant(value=None)
    else:
        raise ValueError(f"unknown change {mutant.what!r}")
    return ast.unparse(ast.fix_missing_locations(tree))


def run_one(root: Path, module: Path, text: str, tests: list[str], timeout: float) -> str:
    """'killed', 'survived' or 'timeout' for the tree at ``root`` with ``module`` replaced by ``text``."""
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        copy_root = Path(tmp) / "tree"
        shutil.copytree(root, copy_root, ignore=_IGNORE, symlinks=True)
        (copy_root / module).write_text(text)
        env = dict(os.environ, PYTHONPATH=str(copy_root), PYTHONDONTWRITEBYTECODE="1")
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                                  cwd=copy_root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  timeout=timeout, start_new_session=True)
        except subprocess.TimeoutExpired:
            return "timeout"   # counted as killed: the change hung the tests
        return "survived" if proc.returncode == 0 else "killed"


def _module_path(root: Path, module: str) -> Path:
    if module.endswith(".py"):
        return Path(module)
    return Path(*module.split(".")).with_suffix(".py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dev.mutate", description=__doc__.splitlines()[0])
    parser.add_argument("module", help="a path (hfstream/gradsync/tune.py) or a dotted module, from --root")
    parser.add_argument("--tests", nargs="+", required=True, help="test files (or node ids) to run per mutant")
    parser.add_argument("--root", default=".", help="the tree to copy (default: the current folder)")
    parser.add_argument("--lines", help="A-B: only mutants on these lines")
    parser.add_argument("--max", type=int, default=0, help="at most this many mutants, spread evenly")
    parser.add_argument("--offset", type=int, default=0,
                        help="with --max: shift the even sample by this many mutants (a second, different sample)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant's test run")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    args = parser.parse_args(argv)
    if args.offset and not args.max:
        parser.error("--offset shifts the --max sample: give --max N too")
    if args.offset < 0 or args.max < 0:
        parser.error(f"--max and --offset count mutants: give numbers >= 0 (got --max {args.max}, --offset {args.offset})")
    root = Path(args.root).resolve()
    module = _module_path(root, args.module)
    source = (root / module).read_text()
    lines = tuple(int(x) for x in args.lines.split("-")) if args.lines else None
    todo = mutants(source, lines)
    if args.max and len(todo) > args.max:
        n = len(todo)
        todo = [todo[(round(k * (n - 1) / (args.max - 1)) + args.offset) % n] for k in range(args.max)] \
            if args.max > 1 else [todo[args.offset % n]]
    if args.list:
        for m in todo:
            print(f"{module}:{m.line}: {m.what}")
        return 0
    started = time.monotonic()
    if run_one(root, module, source, args.tests, args.timeout) != "survived":
        print("the tests do not pass on the unmutated tree: nothing to measure", file=sys.stderr)
        return 2
    survivors = []
    for n, m in enumerate(todo, 1):
        outcome = run_one(root, module, apply(source, m), args.tests, args.timeout)
        print(f"[{n}/{len(todo)}] {module}:{m.line}: {m.what}: {outcome}", flush=True)
        if outcome == "survived":
            survivors.append(m)
    killed = len(todo) - len(survivors)
    print(f"\n{killed}/{len(todo)} mutants killed ({100 * killed / max(len(todo), 1):.0f}%) "
          f"in {time.monotonic() - started:.0f} s; survivors:")
    for m in survivors:
        print(f"  {module}:{m.line}: {m.what}")
    return 0 if not survivors else 1


if __name__ == "__main__":
    sys.exit(main())
