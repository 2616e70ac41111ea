"""Lesson 08 checks: migrating a stock Trainer script to StreamTrainer, reading a step report;
and the helpers the lesson's launches use (the tiny dataset, the learner's migration as a file).

The migration is graded by building and training the learner's trainer in this process (a
single process: cheap); the notebook then launches the same function under `accelerate launch`.
The report exercise is graded on real reports recorded from `course/scripts/08_train_tiny.py`
runs (two processes on one machine, and two one-process "nodes"), on variants of them in which
another part dominates, and on the report the learner's own launch produced. The advice exercise is
graded on made-up data-bound reports with a stand-in for the rerun that records what it was asked;
the notebook then runs it for real (`data_bound_run`: one process, a loader that waits per batch).
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import random
import tempfile
from dataclasses import dataclass, replace

import torch

from course.checks.drawn import after_colon, falsify
from course.grading import Exercise, Learner, Wrong, get_exercise

# The stock script's settings (the notebook's `stock_trainer` writes them out literally).
STOCK = dict(max_steps=6, per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=3e-3,
             lr_scheduler_type="constant", logging_steps=3, seed=0, ddp_bucket_cap_mb=1,
             report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True)
KEPT = ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
        "lr_scheduler_type", "seed", "use_cpu")


def tiny_dataset(n: int = 128, seq: int = 32, vocab: int = 257, seed: int = 1) -> list[dict]:
    """Random token ids as a causal-LM dataset (a list of dicts works as a Trainer dataset)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


@contextlib.contextmanager
def one_thread():
    """Train with one intra-op thread: on a busy 2-core laptop, two OpenMP threads in the notebook's
    kernel wait for each other and a tiny step takes 10-30x longer."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def migration_file(namespace: dict) -> str:
    """The learner's `stream_trainer` cell as a module file, for `08_train_tiny.py --builder`."""
    return Learner(namespace, get_exercise("08.migrate")).module_file()


# --------------------------------------------------------------------------- 08.migrate
migrate = Exercise("08.migrate", uses=["stream_trainer"], title="from Trainer to StreamTrainer",
                   preamble="from transformers import Trainer, TrainingArguments\n"
                            "from hfstream import StreamTrainer, StreamTrainingArguments\n")


def _build(learner):
    """The learner's trainer on a tiny GPT-2 and 64 examples, built once per check for the cases that only read it
    (a trainer to train is built fresh: another TrainingArguments made since resets the accelerator state it holds)."""
    return learner.once("08.migrate-built", lambda: _build_fresh(learner))


def _build_fresh(learner):
    from course.lib import tiny_gpt2

    model = tiny_gpt2(layers=1, width=32, positions=32)
    out = tempfile.mkdtemp(prefix="hfstream-l08-")
    try:
        trainer = learner.stream_trainer(model, tiny_dataset(64), out)
    except TypeError as e:
        if "StreamTrainingArguments" in str(e):
            raise Wrong("StreamTrainer refused plain TrainingArguments: build the arguments with "
                        "hfstream.StreamTrainingArguments (the same fields, plus hfstream's)") from None
        raise
    return trainer, model


@migrate.case("it builds a StreamTrainer with StreamTrainingArguments, on the model and data given",
              hint="the migration changes two names of a stock Trainer script and nothing else: the model, "
                   "the data and the settings you were given stay as they are",
              reveal="StreamTrainer(model=..., args=StreamTrainingArguments(...), train_dataset=...)")
def _(learner):
    """Property: stream_trainer() returns a StreamTrainer whose args are StreamTrainingArguments, on the model given
    and its 64-example dataset."""
    from transformers import Trainer

    from hfstream import StreamTrainer, StreamTrainingArguments

    trainer, model = _build(learner)
    if trainer is None:
        raise Wrong("stream_trainer returned None: return the trainer you built")
    if not isinstance(trainer, StreamTrainer):
        if isinstance(trainer, Trainer):
            raise Wrong(f"this is still {type(trainer).__name__}: use hfstream.StreamTrainer (the mixin over Trainer)")
        raise AssertionError(f"stream_trainer returned a {type(trainer).__name__}")
    assert isinstance(trainer.args, StreamTrainingArguments)
    if trainer.model is not model:
        raise Wrong("the trainer trains another model than the one passed in: pass model=model")
    if trainer.train_dataset is None or len(trainer.train_dataset) != 64:
        raise Wrong("pass the given train_dataset to the trainer")


@migrate.case("every stock setting survives the migration",
              hint="every setting of the stock TrainingArguments must reach the new arguments unchanged",
              reveal="copy each TrainingArguments setting of stock_trainer into StreamTrainingArguments unchanged")
def _(learner):
    """Property: every stock TrainingArguments setting of the script (KEPT) has the same value in the migrated
    arguments."""
    from transformers import TrainingArguments

    trainer, _ = _build(learner)
    stock = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="hfstream-l08-"), **STOCK)
    for name in KEPT:
        got, want = getattr(trainer.args, name), getattr(stock, name)
        if got != want:
            extra = (" (gradient accumulation is why StreamTrainer turns sync off on every micro-step but the "
                     "last: lesson 07's no_sync)") if name == "gradient_accumulation_steps" else ""
            raise Wrong(f"{name} is {got!r}, the stock script has {want!r}: a migration changes how the step runs, "
                        f"never what it computes{extra}")
    return f"{len(KEPT)} settings kept"


@migrate.case("hfstream's settings: prefetch 2 batches, overlap, 1 MiB buckets",
              hint="the exercise names three hfstream settings: the prefetch depth, the sync mode and the bucket "
                   "size",
              reveal="prefetch_depth=2, grad_sync='overlap'; keep ddp_bucket_cap_mb=1 (hfstream reads it) or set "
                     "grad_bucket_mb=1")
def _(learner):
    """Property: the migrated arguments set prefetch_depth 2, grad_sync 'overlap' and an effective bucket cap of
    1 MiB."""
    trainer, _ = _build(learner)
    args = trainer.args
    if args.prefetch_depth != 2:
        raise Wrong(f"prefetch_depth is {args.prefetch_depth}: set 2 (0 is the stock behaviour, no batch in flight)")
    if args.grad_sync != "overlap":
        raise Wrong(f"grad_sync is {args.grad_sync!r}: ask for 'overlap' (hfstream's buckets, launched during "
                    "backward). 'auto' resolves to it only under several processes, and 'native' means DDP")
    if args.effective_bucket_mb != 1.0:
        raise Wrong(f"hfstream's buckets would be {args.effective_bucket_mb!r} MiB: the stock script asked DDP for "
                    "1 MiB (ddp_bucket_cap_mb=1). Keep that line, hfstream uses it when grad_bucket_mb is left "
                    "at its default, or set grad_bucket_mb=1")
    return "prefetch 2, overlap, 1 MiB"


@migrate.case("it trains (one process here) and produces the step report",
              hint="once the two names are swapped nothing else changes: it trains, and the step report exists",
              reveal="nothing else to change: StreamTrainer.train() then stream_report()", timeout=120)
def _(learner):
    """Property: the migrated trainer trains in one process for the stock max_steps, and stream_report() has a mean
    with measured steps."""
    trainer, _ = _build_fresh(learner)
    with one_thread(), contextlib.redirect_stdout(io.StringIO()):   # the Trainer's log lines: not ours to show
        trainer.train()
    assert trainer.state.global_step == STOCK["max_steps"], (
        f"trained {trainer.state.global_step} optimizer steps, the stock script trains {STOCK['max_steps']}")
    report = trainer.stream_report()
    mean = report.get("mean", {})
    if not mean or not mean.get("steps"):
        raise Wrong("stream_report() is empty: leave stream_report=True (the default)")
    return (f"{trainer.state.global_step} steps, {mean['step_ms']:.1f} ms per step, "
            f"efficiency {mean['efficiency']:.0%}")


# Drawn cases (course/checks/drawn.py): tiny GPT-2s of drawn depth and width, datasets of drawn sizes. The property:
# stream_trainer trains the model and the data it is given, every TrainingArguments field that decides what the run
# computes is the stock script's (hfstream's own changes aside), and its run gives the stock Trainer's weights, step
# for step the same (one process: nothing is communicated, so nothing may differ).
@dataclass(frozen=True)
class MigrationDraw:
    layers: int
    width: int
    examples: int
    seed: int

    def __str__(self) -> str:
        return (f"a tiny GPT-2 of {self.layers} layer{'s' if self.layers != 1 else ''}, width {self.width}, on "
                f"{self.examples} examples")


# Fields that say where and how a run is shown, not what it computes.
SHOWN_ONLY = {"output_dir", "logging_dir", "logging_steps", "logging_strategy", "logging_first_step", "report_to",
              "disable_tqdm", "save_strategy", "save_steps", "run_name", "overwrite_output_dir", "ddp_bucket_cap_mb"}


def draw_migrations(seed: int = 29, count: int = 2) -> list[MigrationDraw]:
    rng = random.Random(seed)
    return [MigrationDraw(1 + k % 2, rng.choice((16, 24)), rng.randint(24, 60), rng.randrange(1000))
            for k in range(count)]


def _stock_fields(args) -> dict:
    import dataclasses

    from transformers import TrainingArguments

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainingArguments)
            if f.init and f.name not in SHOWN_ONLY}


def _migration_mistake(learner, case: MigrationDraw, run: bool = True) -> str | None:
    """None when the property above holds on ``case`` (its run compared with the stock run when ``run``); else what
    the learner's trainer did."""
    from transformers import Trainer, TrainingArguments

    from hfstream import StreamTrainer, StreamTrainingArguments

    from course.lib import tiny_gpt2

    model = tiny_gpt2(seed=case.seed, layers=case.layers, width=case.width, positions=32)
    stock_model = copy.deepcopy(model)
    data = tiny_dataset(case.examples, seq=16, seed=case.seed)
    trainer = learner.stream_trainer(model, data, tempfile.mkdtemp(prefix="hfstream-l08-"))
    if not isinstance(trainer, StreamTrainer):
        return f"stream_trainer returned a {type(trainer).__name__}, not a StreamTrainer"
    if trainer.model is not model:
        return "the trainer trains another model than the one passed in"
    if trainer.train_dataset is not data:
        size = len(trainer.train_dataset) if trainer.train_dataset is not None else 0
        return (f"the trainer trains on a dataset of {size} examples, not the {case.examples} passed in: pass "
                f"train_dataset on as it is given")
    migrated = StreamTrainingArguments(output_dir=tempfile.mkdtemp(prefix="hfstream-l08-"), **STOCK,
                                       prefetch_depth=2, grad_sync="overlap")
    want, got = _stock_fields(migrated), _stock_fields(trainer.args)
    changed = [name for name in want if got[name] != want[name]]
    if changed:
        name = changed[0]
        return (f"{name} is {got[name]!r}, the stock script's is {want[name]!r}: a migration changes how the step "
                f"runs, never what it computes")
    if not run:
        return None
    stock = Trainer(model=stock_model, args=TrainingArguments(output_dir=tempfile.mkdtemp(prefix="hfstream-l08-"),
                                                              **STOCK), train_dataset=data)
    with one_thread(), contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
        stock.train()
    diff = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), stock_model.parameters()))
    if diff > 1e-6:
        return (f"after {STOCK['max_steps']} steps the weights differ from the stock Trainer's by {diff:.3g}: in one "
                f"process nothing is communicated, so the run must be the stock run")
    return None


@migrate.case("drawn models and datasets: the data given, every computing setting stock's, the stock run",
              hint="the migration swaps two names and adds hfstream's three settings; everything else, the data "
                   "included, stays as the stock script has it, so one process trains exactly as the stock Trainer",
              reveal="StreamTrainer(model=model, args=StreamTrainingArguments(<the stock settings, unchanged>, "
                     "prefetch_depth=2, grad_sync='overlap'), train_dataset=train_dataset)",
              timeout=120, after="it builds a StreamTrainer with StreamTrainingArguments, on the model and data given")
def _(learner):
    """Property: on drawn tiny GPT-2s (1 or 2 layers, drawn widths) and datasets (24 to 60 examples), stream_trainer
    trains the model and dataset given, every TrainingArguments field that decides what the run computes equals the
    stock script's (hfstream's own changes aside), and one process's run (of the first case) ends with the stock
    Trainer's weights."""
    cases = draw_migrations()
    # Every case's data and settings; the first case's run too (a run of each: a second per lesson for no new property)
    found = falsify(cases, lambda c: None if (why := _migration_mistake(learner, c, run=c is cases[0])) is None
                    else f"{c}: {why}")
    if found is not None:
        raise Wrong(str(found), reveal="StreamTrainer(model=model, args=StreamTrainingArguments(<the stock settings, "
                                       "unchanged>, prefetch_depth=2, grad_sync='overlap'), "
                                       "train_dataset=train_dataset)")
    return f"{len(cases)} drawn models and datasets, the first one's run equal to the stock Trainer's"


# --------------------------------------------------------------------------- 08.read_report
read = Exercise("08.read_report", uses=["read_report"], title="read a step report")

# Recorded from `08_train_tiny.py` (tiny GPT-2, 8 steps, grad_bucket_mb=0.25) on a 2-core laptop:
# two processes under one `accelerate launch`, and two one-process "nodes".
RECORDED = {
    "one machine, 2 processes": {
        "mean": {"data_wait_ms": 3.717, "forward_ms": 2.381, "backward_ms": 3.109, "comm_busy_ms": 9.693,
                 "exposed_comm_ms": 8.085, "optimizer_ms": 1.371, "step_ms": 18.826, "ideal_ms": 13.445,
                 "efficiency": 0.714, "overlap": 0.166, "steps": 7.0},
        "per_rank": [{"data_wait_ms": 3.442, "forward_ms": 2.672, "backward_ms": 2.465, "comm_busy_ms": 9.934,
                      "exposed_comm_ms": 8.861, "optimizer_ms": 1.448, "step_ms": 19.062, "ideal_ms": 14.054,
                      "efficiency": 0.737, "overlap": 0.108, "steps": 7.0},
                     {"data_wait_ms": 3.992, "forward_ms": 2.09, "backward_ms": 3.753, "comm_busy_ms": 9.453,
                      "exposed_comm_ms": 7.309, "optimizer_ms": 1.293, "step_ms": 18.589, "ideal_ms": 12.836,
                      "efficiency": 0.691, "overlap": 0.227, "steps": 7.0}],
        "grad_sync": "overlap", "prefetch_depth": 2},
    "two nodes, 1 process each": {
        "mean": {"data_wait_ms": 1.249, "forward_ms": 2.244, "backward_ms": 2.996, "comm_busy_ms": 3.185,
                 "exposed_comm_ms": 2.009, "optimizer_ms": 1.173, "step_ms": 9.789, "ideal_ms": 6.603,
                 "efficiency": 0.674, "overlap": 0.369, "steps": 7.0},
        "per_rank": [{"data_wait_ms": 1.256, "forward_ms": 2.219, "backward_ms": 3.173, "comm_busy_ms": 3.255,
                      "exposed_comm_ms": 1.769, "optimizer_ms": 1.126, "step_ms": 9.651, "ideal_ms": 6.6,
                      "efficiency": 0.684, "overlap": 0.457, "steps": 7.0},
                     {"data_wait_ms": 1.241, "forward_ms": 2.27, "backward_ms": 2.819, "comm_busy_ms": 3.116,
                      "exposed_comm_ms": 2.25, "optimizer_ms": 1.22, "step_ms": 9.928, "ideal_ms": 6.605,
                      "efficiency": 0.665, "overlap": 0.278, "steps": 7.0}],
        "grad_sync": "overlap", "prefetch_depth": 2},
}

PARTS = ("data_wait_ms", "forward_ms", "backward_ms", "exposed_comm_ms", "optimizer_ms")
CHOICES = ("data_wait_ms", "exposed_comm_ms", "other")


def _with(report: dict, **mean_changes) -> dict:
    """A copy of ``report`` whose mean row has other times; step grows by what the parts grew."""
    out = copy.deepcopy(report)
    m = out["mean"]
    grow = mean_changes.pop("other_ms", 0.0)
    for key, value in mean_changes.items():
        if key in PARTS:          # comm_busy_ms overlaps backward: it is not a part of the step's sum
            grow += value - m[key]
        m[key] = value
    m["step_ms"] += grow
    m["ideal_ms"] = m["forward_ms"] + max(m["backward_ms"], m["comm_busy_ms"]) + m["optimizer_ms"]
    m["efficiency"] = m["ideal_ms"] / m["step_ms"]
    return out


def report_truth(report: dict) -> dict:
    m = report["mean"]
    other = m["step_ms"] - sum(m[k] for k in PARTS)
    costs = {"data_wait_ms": m["data_wait_ms"], "exposed_comm_ms": m["exposed_comm_ms"], "other": other}
    ranks = report.get("per_rank") or [m]
    return {"efficiency": m["ideal_ms"] / m["step_ms"], "headroom_ms": m["step_ms"] - m["ideal_ms"],
            "biggest": max(costs, key=costs.get),
            "slowest_rank": max(range(len(ranks)), key=lambda i: ranks[i]["step_ms"])}


def _cases(learner) -> list[tuple[str, dict]]:
    a, b = RECORDED["one machine, 2 processes"], RECORDED["two nodes, 1 process each"]
    swapped = copy.deepcopy(b)
    swapped["per_rank"].reverse()
    cases = [(name, r) for name, r in RECORDED.items()]
    cases += [("a data-bound step", _with(a, data_wait_ms=15.0)),
              ("a step whose communication is mostly hidden", _with(a, comm_busy_ms=5.0, exposed_comm_ms=2.0)),
              ("a step with 12 ms outside every measured part", _with(b, other_ms=12.0)),
              ("the two nodes with the ranks' rows swapped", swapped)]
    live = learner.get("report")
    if isinstance(live, dict) and live.get("mean") and live.get("per_rank"):
        cases.append(("the report your launch produced", live))
    return cases


def _answers(learner, report) -> dict:
    got = learner.read_report(copy.deepcopy(report))
    if not isinstance(got, dict):
        raise Wrong("read_report must return a dict with keys efficiency, headroom_ms, biggest, slowest_rank")
    missing = [k for k in ("efficiency", "headroom_ms", "biggest", "slowest_rank") if k not in got]
    if missing:
        raise Wrong(f"read_report's dict lacks {missing}")
    return got


@read.case("efficiency and headroom come from the mean over ranks",
           hint="both come from the mean over ranks, not from one rank; efficiency is a ratio below 1, headroom a "
                "time in ms",
           reveal="m = report['mean']; efficiency = m['ideal_ms'] / m['step_ms']; headroom_ms = m['step_ms'] - m['ideal_ms']")
def _(learner):
    """Property: efficiency is the mean's ideal_ms / step_ms and headroom_ms its step_ms - ideal_ms, on the recorded
    reports, four made from them (data-bound, communication mostly hidden, 12 ms untracked, ranks swapped) and the
    learner's own launch's report when there is one."""
    for name, report in _cases(learner):
        got, want = _answers(learner, report), report_truth(report)
        rank0 = {"mean": report["per_rank"][0], "per_rank": report["per_rank"]}
        eff = float(got["efficiency"])
        if math.isclose(eff, want["efficiency"], rel_tol=1e-3):
            pass
        elif math.isclose(eff, 1 / want["efficiency"], rel_tol=1e-3):
            raise Wrong("you divided step by ceiling: efficiency = ideal_ms / step_ms (1.0 = at the ceiling)")
        elif math.isclose(eff, report_truth(rank0)["efficiency"], rel_tol=1e-3):
            raise Wrong("you read rank 0's row: report['mean'] is the mean over ranks, report['per_rank'][i] one rank")
        elif math.isclose(eff, sum(r["efficiency"] for r in report["per_rank"]) / len(report["per_rank"]), rel_tol=1e-4):
            raise Wrong(f"{name}: efficiency {eff:.3f} is the mean of the ranks' efficiencies; the efficiency is the mean "
                        f"step's, from the mean row ({want['efficiency']:.3f}): a mean of ratios is not the ratio of "
                        f"the means")
        else:
            raise AssertionError(f"{name}: efficiency {eff:.3f}, the report says {want['efficiency']:.3f}")
        head = float(got["headroom_ms"])
        if math.isclose(head, -want["headroom_ms"], rel_tol=1e-3):
            raise Wrong("headroom is step_ms - ideal_ms: what the step could still win, a positive number")
        assert math.isclose(head, want["headroom_ms"], rel_tol=1e-3, abs_tol=1e-6), (
            f"{name}: headroom {head:.3f} ms, the report gives {want['headroom_ms']:.3f} ms")
    return f"{len(_cases(learner))} reports"


@read.case("the biggest cost above the ceiling: data wait, exposed communication or the untracked rest",
           hint="what sits above the ceiling is the data wait, the exposed communication, or time no phase accounts "
                "for",
           reveal="other = step_ms - (data_wait + forward + backward + exposed_comm + optimizer); pick the largest "
                  "of data_wait_ms, exposed_comm_ms, other")
def _(learner):
    """Property: biggest names the largest of the mean's data wait, exposed communication and untracked rest (the step
    minus every measured part), on the same reports."""
    for name, report in _cases(learner):
        got, want = _answers(learner, report), report_truth(report)
        b = got["biggest"]
        if b == want["biggest"]:
            continue
        if b in ("forward_ms", "backward_ms", "optimizer_ms"):
            raise Wrong(f"{b} is the work itself: it is inside the ceiling. Choose among what the ceiling leaves "
                        "out: data_wait_ms, exposed_comm_ms, and 'other' (step time no part accounts for)")
        busy = copy.deepcopy(report)
        busy["mean"]["exposed_comm_ms"] = busy["mean"]["comm_busy_ms"]
        if b == "comm_busy_ms" or (b == "exposed_comm_ms" and report_truth(busy)["biggest"] == b):
            raise Wrong("comm_busy_ms is how long reductions ran, mostly hidden behind backward: only "
                        "exposed_comm_ms costs step time")
        if b not in CHOICES:
            raise Wrong(f"biggest must be one of {CHOICES}, got {b!r}")
        if want["biggest"] == "other":
            raise Wrong(f"{name}: the parts add up to much less than step_ms; that gap ('other': Python and "
                        "Trainer work between the measured phases) is the biggest cost here")
        raise AssertionError(f"{name}: biggest is {want['biggest']!r}, you said {b!r}")


@read.case("the slowest rank: the one every all-reduce waits for",
           hint="the slowest rank is the one whose step is longest",
           reveal="the index i of report['per_rank'] with the largest step_ms")
def _(learner):
    """Property: slowest_rank is the index in per_rank of the largest step_ms, on the same reports (one with the ranks'
    rows swapped)."""
    for name, report in _cases(learner):
        got, want = _answers(learner, report), report_truth(report)
        if int(got["slowest_rank"]) != want["slowest_rank"]:
            effs = [r["efficiency"] for r in report["per_rank"]]
            if int(got["slowest_rank"]) == min(range(len(effs)), key=effs.__getitem__):
                raise Wrong("you picked the least efficient rank: efficiency compares a rank with its own "
                            "ceiling. The rank the others wait for is the one with the longest step_ms")
            raise AssertionError(f"{name}: the slowest rank is {want['slowest_rank']}, you said {got['slowest_rank']}")


# Drawn reports (course/checks/drawn.py): 2, 3 and 4 ranks, the mean row the mean of the ranks' rows, each of the
# three costs above the ceiling the largest in turn, a drawn rank the slowest (its peers wait for it in their exposed
# communication, so it has the least of it), an optimizer step large enough that an 'other' which leaves it out
# changes the answer. The property: read_report's four answers equal what the mean row and the rows say.
@dataclass(frozen=True)
class ReportDraw:
    ranks: int
    biggest: str         # which cost above the ceiling is drawn the largest
    slowest: int
    seed: int

    def __str__(self) -> str:
        return (f"a drawn report of {self.ranks} ranks whose largest cost above the ceiling is {self.biggest}, rank "
                f"{self.slowest} the slowest")


def draw_reports(seed: int = 17, count: int = 6) -> list[ReportDraw]:
    rng = random.Random(seed)
    out = []
    for k in range(count):
        n = (3, 4, 2)[k % 3]
        out.append(ReportDraw(n, CHOICES[k % 3], rng.randrange(n), rng.randrange(1000)))
    return out


def drawn_report(case: ReportDraw) -> dict:
    """The report of ``case``: per-rank rows, and their mean as the mean row."""
    rng = random.Random(case.seed)
    big = {c: 6.0 + 2 * rng.random() if c == case.biggest else 1.0 + rng.random() for c in CHOICES}
    compute = [3.0 + rng.random() for _ in range(case.ranks)]
    compute[case.slowest] = max(compute) + 1.5          # the slowest rank computes longest ...
    rows = []
    for r in range(case.ranks):
        fwd, opt = 0.3 * compute[r], 0.9 * big[case.biggest]      # an optimizer close to the largest cost
        bwd = compute[r] - fwd
        exposed = big["exposed_comm_ms"] + 0.6 * (compute[case.slowest] - compute[r])   # ... and the others wait
        row = {"data_wait_ms": big["data_wait_ms"] * (0.98 + 0.04 * rng.random()), "forward_ms": fwd, "backward_ms": bwd,
               "comm_busy_ms": exposed + 0.5 * bwd, "exposed_comm_ms": exposed, "optimizer_ms": opt, "steps": 7.0}
        row["step_ms"] = sum(row[k] for k in PARTS) + big["other"] * (0.98 + 0.04 * rng.random())
        row["ideal_ms"] = fwd + max(bwd, row["comm_busy_ms"]) + opt
        row["efficiency"] = row["ideal_ms"] / row["step_ms"]
        rows.append(row)
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    mean["efficiency"] = mean["ideal_ms"] / mean["step_ms"]
    return {"mean": mean, "per_rank": rows, "grad_sync": "overlap", "prefetch_depth": 2}


def _report_mistake(learner, case: ReportDraw) -> str | None:
    """None when read_report's answers on the drawn report equal the truth; else what the learner's answer is."""
    report = drawn_report(case)
    got, want = _answers(learner, report), report_truth(report)
    m, rows = report["mean"], report["per_rank"]
    eff = float(got["efficiency"])
    if not math.isclose(eff, want["efficiency"], rel_tol=1e-6):
        if math.isclose(eff, sum(r["efficiency"] for r in rows) / len(rows), rel_tol=1e-6):
            return (f"efficiency {eff:.4f} is the mean of the ranks' efficiencies; the mean step's is "
                    f"ideal_ms / step_ms of the mean row, {want['efficiency']:.4f} (a mean of ratios is not the ratio "
                    f"of the means)")
        return f"efficiency {eff:.4f}; the mean row gives {want['efficiency']:.4f}"
    if not math.isclose(float(got["headroom_ms"]), want["headroom_ms"], rel_tol=1e-6):
        return f"headroom {float(got['headroom_ms']):.3f} ms; the mean row gives {want['headroom_ms']:.3f} ms"
    if got["biggest"] != want["biggest"]:
        for left_out in PARTS:
            other = m["step_ms"] - sum(m[k] for k in PARTS if k != left_out)
            costs = {"data_wait_ms": m["data_wait_ms"], "exposed_comm_ms": m["exposed_comm_ms"], "other": other}
            if left_out not in CHOICES and max(costs, key=costs.get) == got["biggest"]:
                return (f"biggest is {got['biggest']!r}, the report's is {want['biggest']!r}: your 'other' left "
                        f"{left_out} ({m[left_out]:.2f} ms) out of the measured parts, so it counted measured work "
                        f"as untracked time")
        return f"biggest is {got['biggest']!r}; the mean row's largest cost above the ceiling is {want['biggest']!r}"
    slow = int(got["slowest_rank"])
    if slow != want["slowest_rank"]:
        if slow == max(range(len(rows)), key=lambda i: rows[i]["exposed_comm_ms"]):
            return (f"slowest_rank is {slow}, the rank with the most exposed communication: that is a rank that waits "
                    f"in every all-reduce for the slowest one, rank {want['slowest_rank']} (the longest step_ms)")
        return f"slowest_rank is {slow}; the longest step_ms is rank {want['slowest_rank']}'s"
    return None


def _smaller_report(case: ReportDraw):
    for n in (2, 3):
        if n < case.ranks:
            yield replace(case, ranks=n, slowest=min(case.slowest, n - 1))


@read.case("drawn reports: 2, 3 and 4 ranks, each cost the largest in turn, a drawn rank the slowest",
           hint="every answer comes from the report: efficiency and headroom from the mean row, the biggest cost "
                "from the mean row's parts, the slowest rank from the rows' step times",
           reveal="m = report['mean']; other = m['step_ms'] - sum of the five parts; biggest = the largest of "
                  "data_wait_ms, exposed_comm_ms, other; slowest_rank = the index of the largest per_rank step_ms",
           after="efficiency and headroom come from the mean over ranks")
def _(learner):
    """Property: on drawn reports (2, 3 and 4 ranks whose rows average to the mean row, each of data wait, exposed
    communication and the untracked rest the largest in turn, a drawn rank the slowest), read_report's efficiency,
    headroom, biggest and slowest_rank are what the report says."""
    cases = draw_reports()
    found = falsify(cases, lambda c: None if (why := _report_mistake(learner, c)) is None else f"{c}: {why}",
                    smaller=_smaller_report, kind=after_colon)
    if found is not None:
        raise Wrong(str(found), reveal="m = report['mean']; other = m['step_ms'] - (data_wait + forward + backward + "
                                       "exposed_comm + optimizer); slowest_rank = the index of the largest "
                                       "per_rank step_ms")
    return f"{len(cases)} drawn reports"


# --------------------------------------------------------------------------- 08.check_advice
LOADER_WAIT_MS = 40.0          # what each batch costs the loader: a read from slow storage, say
ADVICE_STEPS = 12


class SlowStorage:
    """A collate that waits ``wait_ms`` per batch before stacking it, as a loader reading each batch
    from a slow disk or a remote bucket would: the time passes without a core, so prefetching it
    needs no core of its own (a decoding collate would need one)."""

    def __init__(self, wait_ms: float = LOADER_WAIT_MS):
        self.wait_ms = wait_ms

    def __call__(self, rows):
        import time

        time.sleep(self.wait_ms / 1e3)
        ids = torch.stack([torch.as_tensor(r["input_ids"]) for r in rows])
        return {"input_ids": ids, "labels": ids.clone()}


def data_bound_run(**changes) -> dict:
    """Train a tiny GPT-2 in this process (one process, `ADVICE_STEPS` steps) behind a loader that
    waits `LOADER_WAIT_MS` per batch, with no prefetching unless ``changes`` say otherwise; returns
    the step report as a dict (``mean``, ``advice``, ...). ``changes`` are `StreamTrainingArguments`
    fields, as a piece of advice names them (``data_bound_run(prefetch_depth=2)``)."""
    from course.lib import tiny_gpt2
    from hfstream import StreamTrainer, StreamTrainingArguments

    settings = dict(output_dir=tempfile.mkdtemp(prefix="hfstream-l08-advice-"), max_steps=ADVICE_STEPS,
                    per_device_train_batch_size=4, learning_rate=3e-3, lr_scheduler_type="constant",
                    logging_steps=ADVICE_STEPS, seed=0, report_to="none", save_strategy="no", disable_tqdm=True,
                    use_cpu=True, prefetch_depth=0)
    settings.update(changes)
    trainer = StreamTrainer(model=tiny_gpt2(layers=2, width=64, positions=32), args=StreamTrainingArguments(**settings),
                            train_dataset=tiny_dataset(4 * (ADVICE_STEPS + 2)), data_collator=SlowStorage())
    with one_thread(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer.train()
    report = copy.deepcopy(dict(trainer.stream_report()))
    report["settings"] = {k: settings[k] for k in ("prefetch_depth", *changes)}
    return report


check_ex = Exercise("08.check_advice", uses=["check_advice"], title="the report's advice, checked by measurement")

ADVICE_REVEAL = ("a = report['advice'][0]; applied = {a['setting']: a['value']}; after = rerun(**applied); "
                 "wait = report['mean']['data_wait_ms']; rest = report['mean']['step_ms'] - wait; mine_ms = "
                 "max(rest, wait); measured = after['mean']['step_ms']; error = (a['predicted_step_ms'] - measured) / "
                 "measured")
KEYS_OUT = ("applied", "mine_ms", "predicted_ms", "measured_ms", "error")


def _advised(step: float, wait: float, predicted: float) -> dict:
    """A data-bound report: its mean and two pieces of advice, prefetching first."""
    rest = step - wait
    return {"mean": {"data_wait_ms": wait, "forward_ms": 0.35 * rest, "backward_ms": 0.45 * rest,
                     "exposed_comm_ms": 0.0, "optimizer_ms": 0.15 * rest, "step_ms": step, "comm_busy_ms": math.nan,
                     "ideal_ms": 0.95 * rest, "efficiency": 0.95 * rest / step, "overlap": math.nan, "steps": 7.0},
            "advice": [{"setting": "prefetch_depth", "value": 2, "predicted_step_ms": predicted,
                        "reason": "the step waited for its batch", "changes_results": False},
                       {"setting": "gradient_accumulation_steps", "value": 2, "predicted_step_ms": step * 0.9,
                        "reason": "changes the results", "changes_results": True}],
            "grad_sync": None, "prefetch_depth": 0}


class _Rerun:
    """A stand-in for `data_bound_run`: records what it was asked, returns a report measured at ``after_ms``."""

    def __init__(self, after_ms: float):
        self.after_ms, self.calls = after_ms, []

    def __call__(self, *args, **changes):
        self.calls.append((args, changes))
        report = _advised(self.after_ms, 0.2 * self.after_ms, self.after_ms)
        report["advice"] = []
        return report


# Drawn reports: the property is "apply the first advice, whatever the others promise; predict before
# the run". Each draw's first advice is *not* the lowest prediction (a later one, which changes the
# results, promises a faster step), and the rerun measures a step that is neither prediction, so a
# learner who takes the lowest prediction, or calls the measurement a prediction, is seen.
ADVICE_DRAWS = 4
ADVICE_SEED = 8


def advice_draws(n: int = ADVICE_DRAWS, seed: int = ADVICE_SEED) -> list[tuple[dict, float]]:
    """``n`` (report, measured step after the change) pairs drawn from a seeded generator: loaders
    slower and faster than the rest of the step (alternately), 2 or 3 pieces of advice whose first is
    not the fastest."""
    rng = random.Random(seed)
    draws = []
    for i in range(n):
        step = round(rng.uniform(60.0, 240.0), 1)
        share = rng.uniform(0.55, 0.8) if i % 2 == 0 else rng.uniform(0.2, 0.45)      # slower / faster loader
        wait = round(share * step, 1)
        want = max(step - wait, wait)
        predicted = round(want * rng.uniform(1.01, 1.08), 1)              # the advice's model: bookkeeping on top
        report = _advised(step, wait, predicted)
        report["advice"][1]["predicted_step_ms"] = round(predicted * rng.uniform(0.55, 0.9), 1)  # faster, changes results
        report["advice"][1]["value"] = rng.choice((2, 4, 8))
        if rng.random() < 0.5:
            report["advice"].insert(1, {"setting": "dataloader_num_workers", "value": rng.choice((1, 2)),
                                        "predicted_step_ms": round(predicted * rng.uniform(0.92, 0.99), 1),
                                        "reason": "the collate holds a core", "changes_results": False})
        after = round(want * rng.uniform(1.04, 1.15), 1)                  # a measurement, not a prediction
        draws.append((report, after))
    return draws


def _run_check_advice(learner, report: dict, after_ms: float) -> tuple[dict, _Rerun]:
    rerun = _Rerun(after_ms)
    got = learner.check_advice(copy.deepcopy(report), rerun)
    if not isinstance(got, dict):
        raise Wrong(f"check_advice returned {type(got).__name__}: return a dict with keys {', '.join(KEYS_OUT)}", reveal=ADVICE_REVEAL)
    missing = [k for k in KEYS_OUT if k not in got]
    if missing:
        raise Wrong(f"check_advice's dict lacks {missing}", reveal=ADVICE_REVEAL)
    return got, rerun


@check_ex.case("it applies the first piece of advice, and only that, and measures the run it gets back",
               hint="the advice is a list, best first; each piece names one setting and its value, and rerun takes "
                    "settings as StreamTrainingArguments takes them",
               reveal=ADVICE_REVEAL)
def _(learner):
    """Property: check_advice reruns once with the first advice's setting and value only, and returns that change as
    applied, the first advice's prediction and the rerun's measured step, on a fixed report and 4 drawn ones whose
    first advice is not the lowest prediction."""
    report = _advised(100.0, 60.0, 60.0)
    got, rerun = _run_check_advice(learner, report, 64.0)
    if not rerun.calls:
        raise Wrong("check_advice never called rerun: the measurement after the change is a new run, and the "
                    "report you were given is the run before it", reveal=ADVICE_REVEAL)
    if len(rerun.calls) > 1:
        raise Wrong(f"rerun was called {len(rerun.calls)} times: apply one piece of advice, one new run (each run "
                    f"trains again)", reveal=ADVICE_REVEAL)
    args, changes = rerun.calls[0]
    if args or set(changes) == {"setting", "value"}:
        raise Wrong("rerun takes the changed settings by name, as StreamTrainingArguments does "
                    "(rerun(some_field=its_value)); the advice's 'setting' is that name and 'value' its value", reveal=ADVICE_REVEAL)
    if changes == {"gradient_accumulation_steps": 2}:
        raise Wrong("you applied the last piece of advice: the list is best first, and that one changes the "
                    "results (its changes_results is True)", reveal=ADVICE_REVEAL)
    if changes != {"prefetch_depth": 2}:
        raise Wrong(f"rerun got {changes}: apply the first piece of advice, its setting set to its value", reveal=ADVICE_REVEAL)
    if got["applied"] != changes:
        raise Wrong(f"'applied' is {got['applied']!r}, but rerun got {changes}: return the settings you changed", reveal=ADVICE_REVEAL)
    if got["measured_ms"] == report["mean"]["step_ms"]:
        raise Wrong("measured_ms is the step before the change: the measurement is the new run's mean step", reveal=ADVICE_REVEAL)
    if not math.isclose(float(got["measured_ms"]), 64.0, rel_tol=1e-9):
        raise Wrong(f"measured_ms is {got['measured_ms']!r}; the new run's report says its mean step was 64.0 ms", reveal=ADVICE_REVEAL)
    if not math.isclose(float(got["predicted_ms"]), 60.0, rel_tol=1e-9):
        raise Wrong(f"predicted_ms is {got['predicted_ms']!r}: the first piece of advice predicted 60.0 ms "
                    f"(its predicted_step_ms)", reveal=ADVICE_REVEAL)
    for k, (report, after_ms) in enumerate(advice_draws(), 1):
        first, lowest = report["advice"][0], min(report["advice"], key=lambda a: a["predicted_step_ms"])
        got, rerun = _run_check_advice(learner, report, after_ms)
        asked = rerun.calls[0][1] if len(rerun.calls) == 1 else None
        said = (f"drawn report {k} (advice: " + ", ".join(f"{a['setting']}={a['value']!r} predicting "
                                                           f"{a['predicted_step_ms']} ms" for a in report["advice"]) + ")")
        if asked == {lowest["setting"]: lowest["value"]} or math.isclose(float(got["predicted_ms"]),
                                                                          lowest["predicted_step_ms"]):
            raise Wrong(f"you applied the advice that promised the fastest step, not the first: {said}. The list "
                        f"is the report's order of preference; a faster promise further down has a cost the first "
                        f"has not (it changes the results, or needs cores the step uses). Apply the first piece",
                        reveal=ADVICE_REVEAL)
        if asked != {first["setting"]: first["value"]}:
            raise Wrong(f"{said}: rerun got {asked if asked is not None else rerun.calls}: apply the first piece of "
                        f"advice, its setting set to its value, in one call", reveal=ADVICE_REVEAL)
        if not math.isclose(float(got["predicted_ms"]), first["predicted_step_ms"], rel_tol=1e-9):
            raise Wrong(f"{said}: predicted_ms is {got['predicted_ms']!r}, the first advice predicted "
                        f"{first['predicted_step_ms']} ms", reveal=ADVICE_REVEAL)
        if not math.isclose(float(got["measured_ms"]), after_ms, rel_tol=1e-9):
            raise Wrong(f"{said}: measured_ms is {got['measured_ms']!r}; the new run's report says {after_ms} ms",
                        reveal=ADVICE_REVEAL)
    return f"prefetch_depth=2 applied, one new run, its step measured; the first advice on {ADVICE_DRAWS} drawn reports"


@check_ex.case("the prediction error: a fraction of the measured step, negative when the advice promised too much",
               hint="the error compares the advice's prediction with what was measured, as a fraction of the "
                    "measurement, and its sign says which way the advice was wrong",
               reveal=ADVICE_REVEAL, after="it applies the first piece of advice, and only that, and measures the "
                                           "run it gets back")
def _(learner):
    """Property: error is (predicted - measured) / measured, a fraction of the measured step: -4/64 for an advice
    predicting 60 ms whose rerun measures 64 ms."""
    got, _ = _run_check_advice(learner, _advised(100.0, 60.0, 60.0), 64.0)
    err, want = float(got["error"]), (60.0 - 64.0) / 64.0
    if math.isclose(err, want, abs_tol=1e-9):
        return f"predicted 60 ms, measured 64 ms: error {want:+.1%}"
    if math.isclose(err, -want, abs_tol=1e-9):
        raise Wrong(f"error is {err:+.4f}: the advice promised 60 ms and the run took 64, it promised a faster step "
                    f"than it gave, so the error is negative (prediction minus measurement)", reveal=ADVICE_REVEAL)
    if math.isclose(err, (60.0 - 64.0) / 60.0, abs_tol=1e-9) or math.isclose(err, (64.0 - 60.0) / 60.0, abs_tol=1e-9):
        raise Wrong(f"error is {err:+.4f}, a fraction of the prediction: take it as a fraction of the measured step, "
                    f"as dev.bench.advice reports it", reveal=ADVICE_REVEAL)
    if math.isclose(abs(err), 4.0, abs_tol=1e-9):
        raise Wrong("error is in milliseconds: give it as a fraction of the measured step (0.05 for 5 %)", reveal=ADVICE_REVEAL)
    if math.isclose(err, (100.0 - 64.0) / 64.0, abs_tol=1e-9) or math.isclose(err, (64.0 - 100.0) / 64.0,
                                                                              abs_tol=1e-9):
        raise Wrong(f"error is {err:+.4f}: that compares the step before the change with the step after it; the "
                    f"error is the advice's prediction against the step after", reveal=ADVICE_REVEAL)
    raise AssertionError(f"error is {err!r}: the advice predicted 60 ms, the new run measured 64 ms")


YOURS_CASE = "your own prediction, from the report's mean alone (a loader slower and faster than the rest of the step)"


@check_ex.case(YOURS_CASE,
               hint="prefetching moves the loader beside the step (lesson 03): it hides what it can of the wait, and "
                    "a step still needs both its batch and the rest of its own work",
               reveal=ADVICE_REVEAL)
def _(learner):
    """Property: mine_ms is max(step - data wait, data wait) from the report's mean alone, for a loader slower and one
    faster than the rest of the step and on the 4 drawn reports, whatever the advice predicts or the rerun measures."""
    cases = ((100.0, 60.0), (100.0, 30.0))
    answers = []
    for step, wait in cases:
        want = max(step - wait, wait)
        # the advice's own model differs (+3 ms), and the run measures neither prediction (+7 ms)
        got, _ = _run_check_advice(learner, _advised(step, wait, want + 3.0), want + 7.0)
        answers.append((step, wait, want, got))
    for report, after_ms in advice_draws():
        step, wait = report["mean"]["step_ms"], report["mean"]["data_wait_ms"]
        got, _ = _run_check_advice(learner, report, after_ms)
        answers.append((step, wait, max(step - wait, wait), got))
    if all(math.isclose(float(g["mine_ms"]), min(st - w, w), rel_tol=1e-6) for st, w, _, g in answers):
        raise Wrong("you predicted the shorter of the data wait and the rest of the step, in both reports: the step "
                    "cannot be shorter than its own work, nor than the time its batch takes to make", reveal=ADVICE_REVEAL)
    for step, wait, want, got in answers:
        rest = step - wait
        mine = float(got["mine_ms"])
        if math.isclose(mine, want, rel_tol=1e-6):
            continue
        said = f"step {step:.0f} ms, data wait {wait:.0f} ms: you predicted {mine:.1f} ms"
        if math.isclose(mine, float(got["measured_ms"]), rel_tol=1e-6):
            raise Wrong(f"your prediction is the step measured after the change: {said}, what the new run took. A "
                        f"prediction is made before the run, from the report's mean alone (its data wait and the "
                        f"rest of its step); the measurement is what it is compared with", reveal=ADVICE_REVEAL)
        if math.isclose(mine, rest, rel_tol=1e-6):
            raise Wrong(f"{said}, as if the wait disappeared entirely. The loader still takes {wait:.0f} ms to make "
                        f"each batch, and the rest of the step takes {rest:.0f}: a batch cannot come faster than "
                        f"it is made", reveal=ADVICE_REVEAL)
        if math.isclose(mine, step, rel_tol=1e-6):
            raise Wrong(f"{said}, the step as it was: prefetching runs the loader beside the rest of the step, so "
                        f"the two overlap", reveal=ADVICE_REVEAL)
        if math.isclose(mine, wait, rel_tol=1e-6) or math.isclose(mine, min(rest, wait), rel_tol=1e-6):
            raise Wrong(f"{said}, the shorter of the two: the step still does its own {rest:.0f} ms of work "
                        f"and still needs a batch that takes {wait:.0f} ms to make", reveal=ADVICE_REVEAL)
        if math.isclose(mine, float(got["predicted_ms"]), rel_tol=1e-6):
            raise Wrong(f"{said}, the advice's own number: predict it yourself, from the report's mean only", reveal=ADVICE_REVEAL)
        raise AssertionError(f"{said}")
    return (f"a loader slower than the rest of the step, and one faster, both predicted; {ADVICE_DRAWS} drawn reports "
            f"too")


def advice_sentences(before: dict, result: dict, after: dict | None = None) -> list[str]:
    """What the check of the advice measured, in sentences computed from the numbers."""
    m = before["mean"]
    first = before["advice"][0]
    err = result["error"]
    applied = ", ".join(f"{k}={v!r}" for k, v in result["applied"].items())
    lines = [f"before: step {m['step_ms']:.1f} ms, of which data wait {m['data_wait_ms']:.1f} ms; the first advice "
             f"was {first['setting']}={first['value']!r}, predicted {result['predicted_ms']:.1f} ms; yours "
             f"{result['mine_ms']:.1f} ms;",
             f"after {applied}: step {result['measured_ms']:.1f} ms, "
             f"{m['step_ms'] / result['measured_ms']:.2f} x faster than before;"]
    verdict = ("within the 25 % that dev.bench.advice aims for" if abs(err) <= 0.25
               else "outside the 25 % that dev.bench.advice aims for")
    direction = ("the advice promised a faster step than this run gave" if err < 0 else
                 "the run was faster than the advice promised" if err > 0 else "exactly as promised")
    lines.append(f"the advice's prediction was off by {err:+.1%} of the measured step ({direction}), {verdict}.")
    if after is not None:
        wait = after["mean"]["data_wait_ms"]
        nxt = after.get("advice") or []
        tail = (f" its first advice now: {nxt[0]['setting']}={nxt[0]['value']!r}, predicted "
                f"{nxt[0]['predicted_step_ms']:.1f} ms" if nxt else " it has no advice worth 5 % of its step")
        lines.append(f"the new run still waited {wait:.1f} ms per step for its batch;{tail}.")
    return lines


def advice_figure(before: dict, result: dict, path):
    """Before, the two predictions, and the measured step after the change."""
    from course.lib import bar_chart

    values = {"before": before["mean"]["step_ms"], "advice predicted": result["predicted_ms"],
              "you predicted": result["mine_ms"], "measured after": result["measured_ms"]}
    return bar_chart(values, path, ylabel="step (ms)",
                     title=f"{', '.join(f'{k}={v!r}' for k, v in result['applied'].items())}: predicted and measured")
