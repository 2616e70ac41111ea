"""`python -m course mutants` grades one-change mutants of a solution with the course's own checks:
run on one exercise (06.plan_buckets, in-process, a few seconds) so the tool cannot rot, and so the
exercise's checks keep killing every wrong variant of its solution."""

from __future__ import annotations

import ast

from course import mutants


def test_the_tool_makes_every_kind_of_change_it_names_on_a_small_cell():
    source = ("def f(xs, work):\n"
              "    total = 0\n"
              "    for i in range(len(xs)):\n"
              "        if xs[i] < 3:\n"
              "            total += xs[0] * 2\n"
              "    work.wait()\n"
              "    n = xs.element_size()\n"
              "    op = dist.ReduceOp.SUM\n"
              "    return [max(total, n)]\n")
    cell = mutants.CellSpec(source, set(range(2, 10)), "99.x")
    found = mutants.mutants_of(cell)
    kinds = {m.kind for m in found}
    assert kinds == {"cmp", "arith", "cond", "index", "minmax", "reduceop", "wait", "drop", "reverse", "dtype"}, kinds
    for m in found:
        ast.parse(m.source)                       # every mutant is Python
        assert m.source != ast.unparse(ast.parse(source)), m
    assert any(m.kind == "dtype" and "* 4" not in m.after and "= 4" in m.after for m in found)
    # Only the solution's lines change: nothing is mutated on line 1 (the signature).
    assert all(m.line >= 2 for m in found)


def test_every_mutant_of_a_sample_exercise_is_killed_or_listed():
    outcomes, ok = mutants.run_exercise("06", "06.plan_buckets")
    assert ok, "the unmutated solution passes its own checks in-process"
    n, killed, unlisted = mutants.summary("06.plan_buckets", outcomes)
    survivors = [f"[{o.mutant.kind}] {o.mutant.key}" for o in outcomes if not o.killed]
    assert n >= 10 and killed > 0, (n, killed)
    assert unlisted == 0, survivors
    # The dtype mutant (every element 4 bytes) is among the killed ones, by the mixed-dtype case.
    dtype = [o for o in outcomes if o.mutant.kind == "dtype"]
    assert dtype and all(o.killed and "dtype" in o.by for o in dtype), [(o.by, o.message) for o in dtype]
