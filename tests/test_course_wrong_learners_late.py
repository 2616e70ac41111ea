"""The grader's wrong learners for lessons 07, 08 and 10 (issue 46): for every exercise graded on drawn cases
there, at least three plausible wrong answers (a loss divided by a hard-coded 4, a world size hard-coded as 2, a
zero gradient made in float32, a norm taken over every parameter when one is frozen, slices cut for sizes the
world divides, a gather waited for on the wrong handle, the local norm clipped with). Each is shown wrong on a
drawn input the old fixed checks never used (2, 3 or 4 ranks, float64, a frozen layer, an accumulation length
other than 4, a size N does not divide), and each test asserts that the check fails it with a first message that
names the mistake, not the answer; the right answers pass the same cases.

Only in-process cases run by default (drawn cases on thread ranks, stand-ins); the whole checks with their gloo
cases are marked slow."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from course.grading import LEARNER_PREAMBLE, Learner, check, get_exercise, run_case, run_cell

SRC = Path(__file__).resolve().parents[1] / "course" / "src"


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSTREAM_COURSE_PROGRESS", str(tmp_path / "progress.json"))


def _changed(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old
    return source.replace(old, new)


def _cell(lesson: str, marker: str) -> str:
    """The lesson's provided cell that contains ``marker``, as the learner's notebook has it."""
    cells = re.split(r"^# %%.*$", (SRC / lesson).read_text(), flags=re.M)
    return next(c for c in cells if marker in c).strip() + "\n"


def _namespace(source: str, provided: str = "") -> dict:
    return run_cell(LEARNER_PREAMBLE + provided + textwrap.dedent(source))


def _run(exercise: str, ns: dict, titles: list[str] | None = None) -> list:
    """The results of ``exercise``'s cases (only those whose title starts with one of ``titles``) on the namespace
    ``ns``; a case whose ``after=`` failed above is skipped as in a real check."""
    if titles is None:
        return list(check(exercise, namespace=ns, quiet=True))
    ex = get_exercise(exercise)
    learner, out, failed = Learner(ns, ex), [], {}
    for case in ex.cases:
        if not any(case.title.startswith(t) for t in titles):
            continue
        above = next((t for t in failed if t in case.after), None)
        r = run_case(ex, case, learner, 0, above, failed.get(above, ""))
        if not r.passed:
            failed[case.title] = r.message
        out.append(r)
    return out


def _first(exercise: str, ns: dict, titles: list[str] | None = None) -> str:
    failing = [r for r in _run(exercise, ns, titles) if not r.passed]
    assert failing, f"{exercise}: the wrong answer passed every case"
    return failing[0].message


def _passes(exercise: str, ns: dict, titles: list[str] | None = None) -> None:
    results = _run(exercise, ns, titles)
    assert results and all(r.passed for r in results), [(r.case, r.message) for r in results if not r.passed]


# =============================================================================================
# Lesson 07: thread ranks, drawn worlds, dtypes, accumulation lengths, skipping ranks
# =============================================================================================
MINISYNC = _cell("07_hard_cases.py", "class MiniSync")
IN_PROCESS_07 = ["no_sync()", "drawn:", "each trainable tensor once", "finish(), then clip", "the step leaves"]


def _ns07(source: str) -> dict:
    return _namespace(source, MINISYNC)


ACCUM_RIGHT = """
class AccumSync(MiniSync):
    def _on_grad_ready(self, i, p):
        if not self.require_backward_grad_sync:
            return
        super()._on_grad_ready(i, p)

    @contextlib.contextmanager
    def no_sync(self):
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous


def accumulation_step(model, sync, optimizer, micro_batches, loss_fn):
    n = len(micro_batches)
    for k, batch in enumerate(micro_batches):
        with sync.no_sync() if k < n - 1 else contextlib.nullcontext():
            (loss_fn(model, batch) / n).backward()
    sync.finish()
    optimizer.step()
    optimizer.zero_grad()
"""
# The loss divided by the lesson's 4 micro-batches, not by len(micro_batches): right on the old check's 4.
ACCUM_BY_FOUR = _changed(ACCUM_RIGHT, "(loss_fn(model, batch) / n)", "(loss_fn(model, batch) / 4)")
# The last micro-step found as index 3: right on the old check's 4; with 5, sync comes one micro-step early.
ACCUM_LAST_IS_3 = _changed(ACCUM_RIGHT, "if k < n - 1 else", "if k != 3 else")
# Divided by the world size as well, though finish() already turns the sum into the mean.
ACCUM_BY_WORLD = _changed(ACCUM_RIGHT, "(loss_fn(model, batch) / n)",
                          "(loss_fn(model, batch) / (n * dist.get_world_size()))")


def _accum_mistake(source: str, case) -> str | None:
    from course.checks.lesson07 import _accum_mistake as mistake
    from course.grading import get_exercise

    return mistake(Learner(_ns07(source), get_exercise("07.accumulation")), case)


def test_the_drawn_accumulation_cases_cover_worlds_lengths_and_dtypes():
    import torch

    from course.checks.lesson07 import draw_accumulation

    cases = draw_accumulation()
    assert {c.world_size for c in cases} == {2, 3, 4} and {c.dtype for c in cases} == {torch.float32, torch.float64}
    assert 4 not in {c.accum for c in cases} and all(c.accum != c.world_size for c in cases)
    assert _accum_mistake(ACCUM_RIGHT, cases[0]) is None


def test_accumulation_divided_by_a_hard_coded_four_is_named():
    first = _first("07.accumulation", _ns07(ACCUM_BY_FOUR), IN_PROCESS_07)
    assert "divided by 4 whatever the number of micro-batches" in first and "len(micro_batches)" in first, first
    assert "nullcontext" not in first, first


def test_accumulation_synced_at_a_hard_coded_index_is_named():
    first = _first("07.accumulation", _ns07(ACCUM_LAST_IS_3), IN_PROCESS_07)
    assert "the all-reduces ran during micro-step 4's backward, not the last one's" in first, first


def test_accumulation_divided_by_the_world_size_too_is_named_on_three_ranks():
    from course.checks.lesson07 import draw_accumulation

    case = draw_accumulation()[0]
    assert case.world_size == 3
    assert "1/N for 3 ranks" in _accum_mistake(ACCUM_BY_WORLD, case)


ROBUST_RIGHT = """
class RobustSync(MiniSync):
    def hooked_parameters(self, model):
        return [p for p in reversed(list(model.parameters())) if p.requires_grad]

    def finish(self):
        while self.next < len(self.params):
            p = self.params[self.next]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._launch(self.next)
        for p, work in zip(self.params, self.works):
            work.wait()
            p.grad.div_(self.world_size)
        self._reset()
"""
# torch.zeros(p.shape): float32 whatever the model; right on the old check's float32 model.
ROBUST_ZEROS_FLOAT32 = _changed(ROBUST_RIGHT, "torch.zeros_like(p)", "torch.zeros(p.shape)")
# The world size hard-coded as 2: right on the old check's 2 ranks.
ROBUST_HALF = _changed(ROBUST_RIGHT, "p.grad.div_(self.world_size)", "p.grad.div_(2)")
# Zeros for every parameter not launched yet, also those whose gradient had arrived behind the unused one.
ROBUST_ZEROS_OVER_ARRIVED = _changed(ROBUST_RIGHT, """            if p.grad is None:
                p.grad = torch.zeros_like(p)
""", """            p.grad = torch.zeros_like(p)
""")


def test_unused_and_tied_right_answer_passes_the_drawn_cases():
    _passes("07.unused_and_tied", _ns07(ROBUST_RIGHT), IN_PROCESS_07)


def test_a_float32_zero_gradient_is_named_on_a_float64_model():
    first = _first("07.unused_and_tied", _ns07(ROBUST_ZEROS_FLOAT32), IN_PROCESS_07)
    assert "float64 model" in first and "torch.zeros(p.shape) is float32" in first, first


def test_a_world_size_hard_coded_as_two_is_named_on_three_ranks():
    first = _first("07.unused_and_tied", _ns07(ROBUST_HALF), IN_PROCESS_07)
    assert first.startswith("3 ranks") and "the sum over the 3 ranks divided by 2" in first, first


def test_zeros_written_over_an_arrived_gradient_are_named():
    first = _first("07.unused_and_tied", _ns07(ROBUST_ZEROS_OVER_ARRIVED), IN_PROCESS_07)
    assert "the mean without the gradient of rank" in first and "overwritten with zeros" in first, first


CLIP_RIGHT = """
def synced_clip_step(sync, model, optimizer, max_norm):
    sync.finish()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return float(norm)
"""
# The norm by hand over every parameter, as the lesson's total_norm: right while no parameter is frozen.
CLIP_BY_HAND = """
def synced_clip_step(sync, model, optimizer, max_norm):
    sync.finish()
    params = list(model.parameters())
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    for p in params:
        p.grad.mul_(min(1.0, max_norm / (float(norm) + 1e-6)))
    optimizer.step()
    optimizer.zero_grad()
    return float(norm)
"""
# Clipped before the sync: each rank by its own norm.
CLIP_BEFORE_SYNC = """
def synced_clip_step(sync, model, optimizer, max_norm):
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    sync.finish()
    optimizer.step()
    optimizer.zero_grad()
    return float(norm)
"""
# Always scaled to max_norm: right whenever the gradient is above it.
CLIP_ALWAYS = """
def synced_clip_step(sync, model, optimizer, max_norm):
    sync.finish()
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    for p in params:
        p.grad.mul_(max_norm / (norm + 1e-6))
    optimizer.step()
    optimizer.zero_grad()
    return float(norm)
"""


def _clip_mistake(source: str, case) -> str | None:
    from course.checks.lesson07 import _clip_mistake as mistake

    return mistake(Learner(_namespace(source), get_exercise("07.clip_after_sync")), case)


def test_clip_right_answer_passes_the_drawn_cases():
    _passes("07.clip_after_sync", _namespace(CLIP_RIGHT))


def test_a_norm_by_hand_over_a_frozen_layer_is_named():
    first = _first("07.clip_after_sync", _namespace(CLIP_BY_HAND))
    assert "its first layer frozen" in first and "a frozen parameter has no .grad" in first, first


def test_clipping_before_the_sync_is_named_on_every_drawn_world():
    from course.checks.lesson07 import draw_clip

    assert "clipped before finish()" in _first("07.clip_after_sync", _namespace(CLIP_BEFORE_SYNC))
    for case in draw_clip()[:3]:              # max_norm below the norm: 3, 2 and 4 ranks
        why = _clip_mistake(CLIP_BEFORE_SYNC, case)
        assert why and "clipped its own gradient by its own norm" in why, (case, why)


def test_a_clip_that_scales_up_is_named_on_a_drawn_case():
    from course.checks.lesson07 import draw_clip

    assert "clipping only ever shrinks a gradient" in _first("07.clip_after_sync", _namespace(CLIP_ALWAYS))
    case = draw_clip()[3]
    assert case.scale > 1 and "scaled up" in _clip_mistake(CLIP_ALWAYS, case)


@pytest.mark.slow
@pytest.mark.parametrize("exercise, source, first", [
    ("07.accumulation", ACCUM_BY_FOUR, "2 ranks, 1 micro-batch"),
    ("07.accumulation", ACCUM_LAST_IS_3, "2 ranks, 5 micro-batches"),
    ("07.unused_and_tied", ROBUST_HALF, "3 ranks"),
], ids=["accum_by_four", "accum_last_is_3", "robust_half"])
def test_the_whole_lesson_07_check_fails_first_with_the_mistake(exercise, source, first):
    # Every case, the 2-process gloo ones included: those pass these answers; the first failure is the drawn one.
    messages = [r.message for r in check(exercise, namespace=_ns07(source), quiet=True) if not r.passed]
    assert messages and messages[0].startswith(first), messages


# =============================================================================================
# Lesson 10: drawn worlds (2, 3, 4 ranks), sizes N does not divide, float64
# =============================================================================================
STEP_RIGHT = """
def sharded_sgd_step(flat_params, grad_buffer, lr, max_norm):
    n, rank = dist.get_world_size(), dist.get_rank()
    size = flat_params.numel() // n
    mine = slice(rank * size, (rank + 1) * size)
    g = grad_buffer[mine]
    squares = g.double().pow(2).sum().reshape(1)
    dist.all_reduce(squares)
    norm = squares.sqrt().item()
    coef = min(1.0, max_norm / (norm + 1e-6))
    flat_params[mine].add_(g, alpha=-lr * coef)
    return norm
"""
# Clipped by the local norm (this rank's slice) while returning the global one.
STEP_LOCAL_CLIP = _changed(STEP_RIGHT, "coef = min(1.0, max_norm / (norm + 1e-6))",
                           "coef = min(1.0, max_norm / (float(g.norm()) + 1e-6))")
# The slice found as half the buffer: right at 2 ranks only.
STEP_HALVES = _changed(STEP_RIGHT, "size = flat_params.numel() // n", "size = flat_params.numel() // 2")
# The norms all-reduced with MAX: the largest slice's norm.
STEP_MAX = _changed(STEP_RIGHT, "dist.all_reduce(squares)", "dist.all_reduce(squares, op=dist.ReduceOp.MAX)")


def _step_mistake(source: str, case) -> str | None:
    from course.checks.lesson10.sharded_step import _step_drawn_mistake

    return _step_drawn_mistake(Learner(_namespace(source), get_exercise("10.sharded_step")), case)


def test_sharded_step_right_answer_passes_the_drawn_cases():
    from course.checks.lesson10.sharded_step import draw_step

    cases = draw_step()
    assert {c.world_size for c in cases} == {2, 3, 4} and {c.big for c in cases} - {0}
    _passes("10.sharded_step", _namespace(STEP_RIGHT))


def test_clipping_by_the_local_norm_is_named_on_three_ranks():
    from course.checks.lesson10.sharded_step import draw_step

    assert "clipped with the local norm" in _first("10.sharded_step", _namespace(STEP_LOCAL_CLIP))
    why = _step_mistake(STEP_LOCAL_CLIP, draw_step()[0])
    assert why and why.startswith("rank ") and "clipped with its own slice's norm" in why, why


def test_a_slice_found_as_half_the_buffer_is_named_on_three_ranks():
    from course.checks.lesson10.sharded_step import draw_step

    case = draw_step()[0]
    assert case.world_size == 3
    why = _step_mistake(STEP_HALVES, case)
    assert why and "its slice is elements" in why and "whatever the world size" in why, why


def test_a_max_over_the_ranks_is_named_on_a_drawn_case():
    from course.checks.lesson10.sharded_step import draw_step

    assert "the all-reduce took the maximum" in _first("10.sharded_step", _namespace(STEP_MAX))
    why = _step_mistake(STEP_MAX, draw_step()[1])
    assert why and "the largest slice's norm" in why, why


GATHER_RIGHT = """
class ParamGather:
    def __init__(self, model):
        n, rank = dist.get_world_size(), dist.get_rank()
        self.layers = [m for m in model.modules() if list(m.parameters(recurse=False))]
        self.full, self.mine, self.views = [], [], []
        for m in self.layers:
            params = list(m.parameters(recurse=False))
            size = -(-sum(p.numel() for p in params) // n)
            full = torch.zeros(size * n, dtype=params[0].dtype)
            views, offset = [], 0
            for p in params:
                views.append(full[offset:offset + p.numel()].view(p.shape))
                offset += p.numel()
            self.full.append(full)
            self.views.append(views)
            self.mine.append(full[rank * size:(rank + 1) * size].clone())
        self.works = [None] * len(self.layers)
        self.handles = []
        for i, m in enumerate(self.layers):
            self.handles.append(m.register_forward_pre_hook(lambda module, args, i=i: self.wait_for(i)))

    def launch(self):
        for i in range(len(self.layers)):
            self.works[i] = dist.all_gather_single(self.full[i], self.mine[i], async_op=True)

    def wait_for(self, i):
        work, self.works[i] = self.works[i], None
        if work is None:
            return
        work.wait()
        with torch.no_grad():
            for p, v in zip(self.layers[i].parameters(recurse=False), self.views[i]):
                p.copy_(v)

    def close(self):
        for h in self.handles:
            h.remove()
"""
# The buffer made without dtype=: float32 whatever the model; right on the old check's float32 model.
GATHER_FLOAT32 = _changed(GATHER_RIGHT, "torch.zeros(size * n, dtype=params[0].dtype)", "torch.zeros(size * n)")
# Rounded up by adding one: ceil(numel / 2) at 2 ranks, too few values at 3 when N does not divide numel + 1.
GATHER_PLUS_ONE = _changed(GATHER_RIGHT, "size = -(-sum(p.numel() for p in params) // n)",
                           "size = (sum(p.numel() for p in params) + 1) // n")
# The pre-hook's lambda without i=i: every hook reads the loop's last i, and waits on the last layer's handle.
GATHER_LATE_BINDING = _changed(GATHER_RIGHT, "lambda module, args, i=i: self.wait_for(i)",
                               "lambda module, args: self.wait_for(i)")


def test_gather_right_answer_passes_the_drawn_cases():
    from course.checks.lesson10.gather_hook import draw_gather

    cases = draw_gather()
    assert {c.world_size for c in cases} == {2, 3, 4} and all(any(s % c.world_size for s in c.sizes) for c in cases)
    _passes("10.gather_hook", _namespace(GATHER_RIGHT))


def test_a_float32_gather_buffer_is_named_on_a_float64_model():
    first = _first("10.gather_hook", _namespace(GATHER_FLOAT32))
    assert "float64" in first and "rounded to float32" in first and "dtype=" in first, first


def test_slices_rounded_up_by_adding_one_are_named_on_three_ranks():
    first = _first("10.gather_hook", _namespace(GATHER_PLUS_ONE))
    assert first.startswith("3 ranks") and "did not fit in N slices of the size you chose" in first, first


def test_waiting_on_the_last_layers_handle_is_named():
    first = _first("10.gather_hook", _namespace(GATHER_LATE_BINDING))
    assert "every layer's pre-hook waited for layer 3's gather" in first and "i=i" in first, first
    from course.checks.lesson10.gather_hook import _gather_drawn_mistake, draw_gather

    why = _gather_drawn_mistake(Learner(_namespace(GATHER_LATE_BINDING), get_exercise("10.gather_hook")),
                                draw_gather()[1])
    assert why and "every layer's pre-hook waited for layer 3's gather" in why and "i=i" in why, why


PIPE_RIGHT = """
def pipelined_step(mine, gathered, step_slice):
    works = []
    for i in range(len(mine)):
        step_slice(i)
        works.append(dist.all_gather_single(gathered[i], mine[i], async_op=True))
    return works
"""
# The lesson's 4 buckets hard-coded: right on the old check's 4 buckets.
PIPE_FOUR = _changed(PIPE_RIGHT, "for i in range(len(mine)):", "for i in range(4):")
# Every slice stepped before any gather leaves.
PIPE_STEP_ALL_FIRST = """
def pipelined_step(mine, gathered, step_slice):
    for i in range(len(mine)):
        step_slice(i)
    return [dist.all_gather_single(g, m, async_op=True) for g, m in zip(gathered, mine)]
"""
# The gather launched before its slice is stepped: it carries the old values.
PIPE_GATHER_FIRST = """
def pipelined_step(mine, gathered, step_slice):
    works = []
    for i in range(len(mine)):
        works.append(dist.all_gather_single(gathered[i], mine[i], async_op=True))
        step_slice(i)
    return works
"""


def _pipe_mistake(source: str, case) -> str | None:
    from course.checks.lesson10.pipelined import _pipe_drawn_mistake

    return _pipe_drawn_mistake(Learner(_namespace(source), get_exercise("10.pipelined_step")), case)


def test_pipelined_right_answer_passes_the_drawn_cases():
    _passes("10.pipelined_step", _namespace(PIPE_RIGHT))


def test_four_buckets_hard_coded_are_named():
    first = _first("10.pipelined_step", _namespace(PIPE_FOUR))
    assert first.startswith("2 ranks, 1 bucket") and "IndexError" in first, first
    assert "this case has 1 bucket; the buckets are those of mine, however many" in first, first


def test_stepping_everything_first_is_named_on_a_drawn_world():
    from course.checks.lesson10.pipelined import draw_pipelined

    assert "before launching any gather" in _first("10.pipelined_step", _namespace(PIPE_STEP_ALL_FIRST))
    why = _pipe_mistake(PIPE_STEP_ALL_FIRST, draw_pipelined()[0])
    assert why and "stepped all 3 slices before launching any gather" in why, why


def test_a_gather_before_its_step_is_named_on_a_drawn_world():
    from course.checks.lesson10.pipelined import draw_pipelined

    assert "values from before the step" in _first("10.pipelined_step", _namespace(PIPE_GATHER_FIRST))
    why = _pipe_mistake(PIPE_GATHER_FIRST, draw_pipelined()[2])
    assert why and why.startswith("rank 0's steps and gathers ran as"), why


# =============================================================================================
# Lesson 08: drawn reports (2, 3 and 4 ranks, each cost the largest in turn), the migration
# =============================================================================================
READ_RIGHT = """
def read_report(report):
    m = report["mean"]
    other = m["step_ms"] - sum(m[k] for k in ("data_wait_ms", "forward_ms", "backward_ms", "exposed_comm_ms",
                                              "optimizer_ms"))
    costs = {"data_wait_ms": m["data_wait_ms"], "exposed_comm_ms": m["exposed_comm_ms"], "other": other}
    steps = [r["step_ms"] for r in report["per_rank"]]
    return {"efficiency": m["ideal_ms"] / m["step_ms"], "headroom_ms": m["step_ms"] - m["ideal_ms"],
            "biggest": max(costs, key=costs.get), "slowest_rank": steps.index(max(steps))}
"""
# The slowest rank taken as the one with the most exposed communication: on the recorded reports the same rank.
READ_MOST_EXPOSED = _changed(READ_RIGHT, 'steps = [r["step_ms"] for r in report["per_rank"]]',
                             'steps = [r["exposed_comm_ms"] for r in report["per_rank"]]')
# 'other' without the optimizer step: on the recorded reports still far below the largest cost.
READ_OTHER_WITHOUT_OPTIMIZER = _changed(READ_RIGHT, '"exposed_comm_ms",\n                                              "optimizer_ms"))',
                                        '"exposed_comm_ms"))')
# The efficiency as the mean of the ranks' efficiencies: on the recorded reports within 0.1 % of the mean row's.
READ_MEAN_OF_EFFICIENCIES = _changed(
    READ_RIGHT, '"efficiency": m["ideal_ms"] / m["step_ms"]',
    '"efficiency": sum(r["efficiency"] for r in report["per_rank"]) / len(report["per_rank"])')


def test_the_drawn_reports_cover_ranks_costs_and_slowest_ranks():
    from course.checks.lesson08 import CHOICES, draw_reports, drawn_report, report_truth

    cases = draw_reports()
    truths = [report_truth(drawn_report(c)) for c in cases]
    assert {c.ranks for c in cases} == {2, 3, 4} and {t["biggest"] for t in truths} == set(CHOICES)
    assert [t["biggest"] for t in truths] == [c.biggest for c in cases]
    assert [t["slowest_rank"] for t in truths] == [c.slowest for c in cases]
    assert any(0 < c.slowest < c.ranks - 1 for c in cases), "the slowest rank is drawn, not always the first or last"
    _passes("08.read_report", _namespace(READ_RIGHT))


def test_the_rank_with_the_most_exposed_communication_is_named_not_slowest():
    first = _first("08.read_report", _namespace(READ_MOST_EXPOSED))
    assert "the rank with the most exposed communication" in first and "waits" in first, first


def test_an_other_without_the_optimizer_is_named():
    first = _first("08.read_report", _namespace(READ_OTHER_WITHOUT_OPTIMIZER))
    assert "your 'other' left optimizer_ms" in first, first


def test_the_mean_of_the_ranks_efficiencies_is_named():
    first = _first("08.read_report", _namespace(READ_MEAN_OF_EFFICIENCIES))
    assert "the mean of the ranks' efficiencies" in first, first


MIGRATE_RIGHT = """
from transformers import Trainer, TrainingArguments
from hfstream import StreamTrainer, StreamTrainingArguments


def stream_trainer(model, train_dataset, output_dir):
    args = StreamTrainingArguments(
        output_dir=output_dir, max_steps=6, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=3, seed=0, ddp_bucket_cap_mb=1,
        report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
        prefetch_depth=2, grad_sync="overlap",
    )
    return StreamTrainer(model=model, args=args, train_dataset=train_dataset)
"""
# "Tuned while migrating": clipping tightened (lesson 07's clip), not one of the settings the old check compared.
MIGRATE_CLIPPED = _changed(MIGRATE_RIGHT, 'grad_sync="overlap",', 'grad_sync="overlap", max_grad_norm=0.5,')
# The lesson's dataset built again inside: the old check's 64 examples, whatever was passed in.
MIGRATE_OWN_DATA = _changed(MIGRATE_RIGHT, "train_dataset=train_dataset)",
                            "train_dataset=tiny_dataset(64))\n\n\nfrom course.checks.lesson08 import tiny_dataset")
# Weight decay added (a common Trainer-script default), again outside the compared settings.
MIGRATE_DECAY = _changed(MIGRATE_RIGHT, 'grad_sync="overlap",', 'grad_sync="overlap", weight_decay=0.01,')
DRAWN_MIGRATION = ["it builds a StreamTrainer", "drawn models"]


def test_the_migration_passes_the_drawn_cases():
    _passes("08.migrate", _namespace(MIGRATE_RIGHT), DRAWN_MIGRATION)


@pytest.mark.parametrize("source, words", [
    (MIGRATE_CLIPPED, "max_grad_norm is 0.5, the stock script's is 1.0"),
    (MIGRATE_OWN_DATA, "trains on a dataset of 64 examples, not the "),
    (MIGRATE_DECAY, "weight_decay is 0.01, the stock script's is 0.0"),
], ids=["clipped", "own_data", "weight_decay"])
def test_a_migration_that_changes_what_is_computed_is_named(source, words):
    first = _first("08.migrate", _namespace(source), DRAWN_MIGRATION)
    assert first.startswith("a tiny GPT-2 of ") and words in first, first
