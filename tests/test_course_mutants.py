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


def test_an_answer_that_is_an_assignment_runs_and_a_sample_spreads_over_the_mutants():
    # 00.real_apis's answer is `is_real = {spec: api_exists(spec) ...}`: a call of a notebook function that
    # keep_definitions drops from a cell; the tool runs it because it lies inside the solution's lines.
    cell = mutants.CellSpec("def f(x):\n    return x + 1\nis_real = {k: f(k) for k in range(3)}\nprint(is_real)\n",
                            {2, 3}, "99.x")
    assert cell.forced == {1}
    ns = mutants._namespace([cell.source], [cell.forced])
    assert ns["is_real"] == {0: 1, 1: 2, 2: 3}
    assert "is_real" not in mutants._namespace([cell.source])      # what keep_definitions alone keeps
    found = mutants.mutants_of(cell)
    picked = mutants._sampled(found, 3)
    assert len(picked) == 3 and picked[0] is found[0] and len({id(m) for m in picked}) == 3
    assert mutants._sampled(found, None) == found == mutants._sampled(found, len(found) + 5)


def test_a_statement_is_never_moved_past_a_docstring():
    cell = mutants.CellSpec('def g(w):\n    """Doc."""\n    w.wait()\n    return 1\n', {3, 4}, "99.x")
    moved = [m for m in mutants.mutants_of(cell) if m.kind == "wait"]
    assert [m.after for m in moved] == ["(moved after its neighbour)"], moved


def test_an_exercise_that_reads_a_measurement_gets_it_run_once_per_process():
    # 09.final_challenge's answer reads lab_parts and lab_shape, which come from calls of names the lesson
    # imports from course.checks (measurements, skipped for every other exercise).
    cells = ["from course.checks.lesson09 import lab_tensors\n",
             "n = len(lab_tensors())\nm = n + 1\nprint(m)\n"]
    assert "n" not in mutants._namespace(cells) and "m" not in mutants._namespace(cells)
    ns = mutants._namespace(cells, measure=True)
    assert ns["n"] > 0 and ns["m"] == ns["n"] + 1
    assert "n = len(lab_tensors())" in mutants._MEASURED
    assert mutants._namespace(cells, measure=True)["n"] == ns["n"]      # from the cache the second time
    assert set(mutants.MEASURED_FOR) == {"09.final_challenge"}


def test_a_launch_loop_that_never_moves_on_is_stopped_and_named_before_any_rank_runs():
    # 06.bucketed_sync without `self.next += 1` launched until the machine ran out of memory (24 GB); the
    # all-reduce stand-ins stop at RUNAWAY_CALLS and the check names the loop from the in-process rehearsal.
    from course.checks.lesson05 import RUNAWAY, fake_ranks
    import pytest
    import torch

    with fake_ranks(2) as log, pytest.raises(RuntimeError, match="never moves on"):
        for _ in range(100_000):
            torch.distributed.all_reduce(torch.zeros(1), async_op=True)
    assert len(log) == 10_000
    cells = mutants.lesson_cells("06")
    upto = next(k for k, (_, checks) in enumerate(cells) if "06.bucketed_sync" in checks)
    sources, forced = [c.source for c, _ in cells[:upto]], [c.forced for c, _ in cells[:upto]]
    k, cell = next((k, c) for k, (c, _) in enumerate(cells[:upto]) if c.exercise == "06.bucketed_sync" and c.block_lines)
    dropped = [m for m in mutants.mutants_of(cell) if m.key == "self.next += 1  ->  (dropped)"]
    assert len(dropped) == 2                      # the hook's loop and finish()'s
    with mutants._private_progress():
        for m in dropped:
            passed, by, message = mutants.grade("06.bucketed_sync", sources[:k] + [m.source] + sources[k + 1:],
                                                60.0, forced)
            assert not passed and RUNAWAY in message and "kept launching" in message, (by, message)
