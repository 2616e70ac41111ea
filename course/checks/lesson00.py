"""Lesson 00 checks: the ceiling derived from a step's dependencies, a step-time prediction graded
against the measurement that follows it, and an API checker the learner writes.

The schedules lab (`measure_schedules`) times a tiny GPT-2's real forward, backward and optimizer
step inside four schedules (serial, prefetch, overlap, both). Data and communication in it are
stand-ins that sleep: a batch takes ``data_ms`` to produce and the reduction takes ``comm_ms``, and
neither uses the CPU (like a disk read, or a link that moves bytes without the host). Their
durations are set from this machine's measured compute, so the four schedules compare the same
parts on any laptop; the check's drawn cases reach the regimes the measurement does not.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import queue
import random
import statistics
import threading
import time

from course.checks.drawn import after_colon, common_reason, falsify, simpler_numbers
from course.grading import Exercise, Wrong


# =============================================================================================
# 00.real_apis: the learner's checker against the installed packages
# =============================================================================================

def _truth(spec: str) -> bool:
    """Does ``spec`` exist in the installed packages? (The course's own answer; the lesson has the
    learner write theirs.)

    ``spec`` is a dotted name (``torch.Tensor.record_stream``: the longest prefix that imports,
    then attributes), ``torchrun --flag`` (a flag of torchrun's own argument parser), and a field
    of a dataclass counts even when the class has no attribute of that name.
    """
    if spec.startswith("torchrun "):
        from torch.distributed.run import get_args_parser

        flag = spec.split(maxsplit=1)[1]
        return any(flag in action.option_strings for action in get_args_parser()._actions)
    parts = spec.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}:
                obj = None       # a field without a class-level default: real, and nothing to walk into
            else:
                return False
        return True
    return False


# Why a name is (not) real, for the learner who got it wrong.
WHY = {
    "torch.distributed.stream": "there is no torch.distributed.stream: NCCL runs collectives on its own "
                                "internal stream; you order them with the Work that async_op=True returns",
    "torchrun --stream": "torchrun has no --stream flag: streams are a CUDA concept inside your process, "
                         "not a launcher option",
    "transformers.TrainingArguments.stream_scheduler": "TrainingArguments has no stream_scheduler field; the "
                                                       "real knobs are dataloader_pin_memory, "
                                                       "dataloader_prefetch_factor and ddp_bucket_cap_mb",
    "torch.Tensor.record_stream": "record_stream is real: it tells the caching allocator a tensor is in use "
                                  "on another stream, so its memory is not reused too early",
    "torch.Tensor.register_post_accumulate_grad_hook": "register_post_accumulate_grad_hook is real (torch >= "
                                                       "2.1): it fires once .grad holds the accumulated gradient",
}

# (spec, what kind of trap it is); the truth comes from `_truth`, on this machine's packages.
DOTTED = [
    "torch.Tensor.record_stream",                           # a method of a class: not a module
    "torch.distributed.algorithms.join.Join",               # a class in a sub-sub-module
    "torch.nn.parallel.DistributedDataParallel.no_sync",
    "torch.Event.wait",
    "accelerate.Accelerator.accumulate",
    "torch.distributed.stream",                             # invented: the blog posts' favourite
    "torch.Tensor.stream_balance",                          # invented attribute of a real class
    "accelerate.Accelerator.stream_mode",
    "horovod.torch.allreduce_batch_size",                   # a package that is not installed
    "ncclStreamCreate",                                     # a C name, no Python module at all
]
TORCHRUN = [
    "torchrun --nproc-per-node", "torchrun --nproc_per_node", "torchrun --standalone", "torchrun --max-restarts",
    "torchrun --stream",                                    # invented
    "torchrun --num_processes",                             # accelerate launch's flag, not torchrun's
    "torchrun --nproc",                                     # only a piece of --nproc-per-node
]
FIELDS = [
    "transformers.TrainingArguments.dataloader_pin_memory",
    "transformers.TrainingArguments.ddp_bucket_cap_mb",
    "transformers.TrainingArguments.include_for_metrics",   # a field whose default comes from a factory
    "transformers.TrainingArguments.stream_scheduler",      # invented
    "transformers.TrainingArguments.evaluation_strategy",   # renamed eval_strategy, then removed
]

REVEAL_DOTTED = ("for cut in range(len(parts), 0, -1): try importlib.import_module('.'.join(parts[:cut])), "
                 "on ImportError try a shorter prefix; then walk parts[cut:] with hasattr/getattr; "
                 "no prefix imports -> False")
REVEAL_TORCHRUN = ("from torch.distributed.run import get_args_parser; flag in "
                   "{s for a in get_args_parser()._actions for s in a.option_strings}")
REVEAL_FIELDS = ("when hasattr(obj, attr) fails: dataclasses.is_dataclass(obj) and attr in "
                 "{f.name for f in dataclasses.fields(obj)}")


def _ask(learner, spec: str):
    """The learner's answer for one spec; a crash becomes a hint naming the spec."""
    try:
        got = learner.api_exists(spec)
    except Exception as e:
        raise Wrong(f"api_exists({spec!r}) raised {type(e).__name__}: {e}. A name that does not resolve "
                    f"(a package that is not installed, a module that is not there) is an answer, False, "
                    f"not an error: catch what the lookup raises") from None
    if not isinstance(got, bool):
        raise Wrong(f"api_exists({spec!r}) returned {got!r}; return True or False")
    return got


def _not_the_course_checker(learner):
    if learner.api_exists is _truth:
        raise Wrong("that is the course's own checker from course.checks; the exercise is to write yours")


def _resolve(spec: str):
    """``(owner, attribute name, value)`` of the last step of a dotted name the installed packages have, or
    None (a module itself, or no such name)."""
    parts = spec.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        owner, attr = None, None
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return None
            owner, obj = obj, getattr(obj, attr)
        return None if owner is None else (owner, attr, obj)
    return None


def _kind(spec: str) -> str:
    """What makes a real dotted name hard to find: "falsy" (its value is None, False, 0 or empty),
    "inherited" (a class gets it from a base: not in the class's own ``vars()``) or "plain"."""
    found = _resolve(spec)
    if found is None:
        return "plain"
    owner, attr, value = found
    try:
        falsy = not value
    except Exception:       # noqa: BLE001 - a value without a truth value is not falsy
        falsy = False
    if falsy:
        return "falsy"
    if isinstance(owner, type) and attr not in vars(owner):
        return "inherited"
    return "plain"


# One real name of each kind: the learner's answer on the plain one tells a missed kind from a wrong split.
PROBES = {"plain": "torch.nn.Linear.forward", "inherited": "torch.nn.Linear.register_forward_hook",
          "falsy": "torch.nn.Module.dump_patches"}


def _base_of(owner: type, attr: str) -> str:
    return next((b.__name__ for b in owner.__mro__[1:] if attr in vars(b)), "a base class")


def _why_missed(learner, spec: str) -> str | None:
    """Why the learner's checker answered False for a real dotted name, when its answers on the probes
    tell: a falsy value taken for a missing name, or an inherited attribute looked up in the class's own
    ``vars()``. None when the plain probe is missed too (the split into module and attributes is wrong)."""
    kind = _kind(spec)
    if kind == "plain" or not _ask(learner, PROBES["plain"]):
        return None
    owner, attr, value = _resolve(spec)
    if kind == "falsy":
        return (f"api_exists({spec!r}) returned False, but it exists: its value is {value!r}. A name whose value is "
                f"None, False, 0 or empty is still a name: ask whether the attribute is there (hasattr), not "
                f"whether its value is true")
    return (f"api_exists({spec!r}) returned False, but {owner.__name__} has `{attr}`: it inherits it from "
            f"{_base_of(owner, attr)}. vars() and __dict__ list only what a class defines itself; hasattr and "
            f"getattr follow the bases, as Python's attribute lookup does")


def _drawn_names(seed: int = 0, count: int = 12) -> list[str]:
    """Dotted names drawn from the installed packages: real ones of each kind (a falsy value, an inherited
    method, one a class defines itself) and invented ones built from them (a real owner, a made-up attribute)."""
    import torch

    rng = random.Random(seed)
    owners = {"torch.nn.Module": torch.nn.Module, "torch.nn.Linear": torch.nn.Linear,
              "torch.optim.AdamW": torch.optim.AdamW, "torch.utils.data.DataLoader": torch.utils.data.DataLoader,
              "torch.version": torch.version, "torch.Tensor": torch.Tensor}
    pools: dict[str, list[str]] = {"falsy": [], "inherited": [], "plain": []}
    for name, owner in owners.items():
        for attr in dir(owner):
            if not attr.startswith("_"):
                spec = f"{name}.{attr}"
                pools[_kind(spec)].append(spec)
    out = []
    for k in range(count):
        kind = ("falsy", "inherited", "plain", "invented")[k % 4]
        if kind == "invented":
            real = rng.choice(pools["plain"] + pools["inherited"])
            head, attr = real.rsplit(".", 1)
            made_up = rng.choice([f"{attr}_stream", f"stream_{attr}", f"{attr}_async", f"{attr}s"])
            spec = f"{head}.{made_up}"
            if _truth(spec):
                continue
        elif pools[kind]:
            spec = rng.choice(pools[kind])
        else:
            continue
        if spec not in out:
            out.append(spec)
    return out


def _drawn_flags(seed: int = 0) -> list[str]:
    """torchrun specs drawn from its parser: real flags (short and long, both spellings), the positional
    arguments written as flags (not flags), and real flags cut short (not flags)."""
    from torch.distributed.run import get_args_parser

    rng = random.Random(seed)
    actions = get_args_parser()._actions
    options = [s for a in actions for s in a.option_strings if s not in ("-h", "--help")]
    short = [s for s in options if not s.startswith("--")]
    positional = [f"--{a.dest.replace('_', '-')}" for a in actions if not a.option_strings]
    cut = [s[:s.index("-", 3)] for s in options if s.startswith("--") and "-" in s[3:]]
    picks = [rng.choice(short), *rng.sample(options, 2), *positional, rng.choice(cut)]
    return [f"torchrun {p}" for p in dict.fromkeys(picks)]


def _drawn_fields(seed: int = 0, count: int = 6) -> list[str]:
    """Fields of TrainingArguments and of its subclass Seq2SeqTrainingArguments (inherited fields, one whose
    default comes from a factory), and names neither declares."""
    import transformers

    rng = random.Random(seed)
    out = []
    for cls in (transformers.TrainingArguments, transformers.Seq2SeqTrainingArguments):
        names = [f.name for f in dataclasses.fields(cls)]
        factory = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        out += [f"transformers.{cls.__name__}.{n}" for n in rng.sample(names, 1) + factory[:1]]
        out.append(f"transformers.{cls.__name__}.{rng.choice(names)}_stream")
    return list(dict.fromkeys(out))[:count]


def _why_field_missed(spec: str) -> str | None:
    """A field a subclass inherits from a base dataclass, looked up in the class's own annotations."""
    import transformers

    head, attr = spec.rsplit(".", 1)
    cls = getattr(transformers, head.split(".")[-1], None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return None
    if attr in {f.name for f in dataclasses.fields(cls)} and attr not in cls.__dict__.get("__annotations__", {}):
        base = next((b.__name__ for b in cls.__mro__[1:] if attr in b.__dict__.get("__annotations__", {})), "its base")
        return (f"api_exists({spec!r}) returned False, but {cls.__name__} has that field: it inherits it from "
                f"{base}. A class's own __annotations__ hold only the fields it declares itself; "
                f"dataclasses.fields() lists every field, the inherited ones too")
    return None


real_apis = Exercise("00.real_apis", uses=["api_exists"], title="write the API checker, sort the claims")


@real_apis.case("dotted names: the longest prefix that imports, then attributes",
                hint="split the name at the dots; find the part that is a module and the part that is "
                     "attributes of it; a name nothing resolves is False, never an exception",
                reveal=REVEAL_DOTTED)
def _(learner):
    """Property: on the lesson's dotted names and on names drawn from the installed packages (values that
    are None or False, inherited methods, invented attributes of real classes), api_exists says what the
    packages say."""
    _not_the_course_checker(learner)
    drawn = _drawn_names()
    for spec in DOTTED + drawn:
        got, want = _ask(learner, spec), _truth(spec)
        if got == want:
            continue
        why = _why_missed(learner, spec) if want else None
        if why:
            raise Wrong(why, reveal=REVEAL_DOTTED)
        if want:
            raise Wrong(f"api_exists({spec!r}) returned False, but the installed packages have it. Which of its "
                        f"parts is a module and which are attributes? `import_module` of the whole name fails "
                        f"when the last parts are a class and its method", reveal=REVEAL_DOTTED)
        raise Wrong(f"api_exists({spec!r}) returned True, but the installed packages have no such name: every "
                    f"part must resolve, not just the package", reveal=REVEAL_DOTTED)
    return (f"{len(DOTTED)} dotted names, {sum(map(_truth, DOTTED))} of them real, and {len(drawn)} drawn from the "
            f"installed packages")


@real_apis.case("torchrun flags, read from torchrun's own argument parser",
                hint="torchrun is `python -m torch.distributed.run`; its flags are what that module's "
                     "argument parser defines", reveal=REVEAL_TORCHRUN)
def _(learner):
    """Property: for the lesson's flags and flags drawn from torchrun's parser (short flags, both spellings,
    positional arguments written as flags, flags cut short), api_exists answers as the parser defines them."""
    specs = TORCHRUN + [s for s in _drawn_flags() if s not in TORCHRUN]
    answers = {spec: _ask(learner, spec) for spec in specs}
    wrong = [s for s in specs if answers[s] != _truth(s)]
    if not wrong:
        return f"{len(specs)} flags ({len(specs) - len(TORCHRUN)} drawn from torchrun's parser)"
    if not any(answers.values()):
        raise Wrong("every torchrun flag came back False, even --nproc-per-node: a flag is not a Python "
                    "attribute. torchrun's flags are defined by an argparse parser in torch.distributed.run: "
                    "ask it", reveal=REVEAL_TORCHRUN)
    spec = wrong[0]
    if spec == "torchrun --nproc":
        raise Wrong("api_exists('torchrun --nproc') returned True: '--nproc' is only a piece of "
                    "'--nproc-per-node'. Compare whole flags, not substrings of the help text",
                    reveal=REVEAL_TORCHRUN)
    if spec == "torchrun --num_processes":
        raise Wrong("api_exists('torchrun --num_processes') returned True: that is `accelerate launch`'s flag; "
                    "torchrun's is --nproc-per-node. Read torchrun's parser, not a list of launch flags",
                    reveal=REVEAL_TORCHRUN)
    from torch.distributed.run import get_args_parser

    dests = {a.dest: bool(a.option_strings) for a in get_args_parser()._actions}
    for s in wrong:          # the positional argument taken for a flag names the mistake best
        name = s.split(maxsplit=1)[1].lstrip("-").replace("-", "_")
        if answers[s] and dests.get(name) is False:
            raise Wrong(f"api_exists({s!r}) returned True: `{name}` is one of torchrun's positional arguments (the "
                        f"script and its arguments), which no flag sets. Compare with the flags the parser declares "
                        f"(each action's option strings), not with the names it stores values under (its dest)",
                        reveal=REVEAL_TORCHRUN)
    flag = spec.split(maxsplit=1)[1]
    if not answers[spec] and not flag.startswith("--"):
        raise Wrong(f"api_exists({spec!r}) returned False, but {flag} is a real short flag of torchrun (one dash, "
                    f"one letter): the parser lists it among that action's option strings, beside its long form",
                    reveal=REVEAL_TORCHRUN)
    raise Wrong(f"api_exists({spec!r}) returned {answers[spec]}, torchrun's parser says {_truth(spec)}",
                reveal=REVEAL_TORCHRUN)


@real_apis.case("dataclass fields count, even those the class has no attribute for",
                hint="TrainingArguments is a dataclass: a field is real when the dataclass declares it",
                reveal=REVEAL_FIELDS)
def _(learner):
    """Property: a field of a dataclass exists however its default is made and whichever class declares it
    (TrainingArguments and its subclass Seq2SeqTrainingArguments, drawn); a name no dataclass declares does not."""
    specs = FIELDS + [s for s in _drawn_fields() if s not in FIELDS]
    for spec in specs:
        got, want = _ask(learner, spec), _truth(spec)
        if got == want:
            continue
        why = None if got else _why_field_missed(spec)
        if why:
            raise Wrong(why, reveal=REVEAL_FIELDS)
        if spec.endswith(".include_for_metrics"):
            raise Wrong("api_exists('transformers.TrainingArguments.include_for_metrics') returned False, but "
                        "it is a field of TrainingArguments: its default is made by a factory, so the class "
                        "itself has no attribute of that name. Ask the dataclass which fields it declares",
                        reveal=REVEAL_FIELDS)
        if spec.endswith(".evaluation_strategy"):
            raise Wrong("api_exists('transformers.TrainingArguments.evaluation_strategy') returned True: older "
                        "posts use it, but this transformers has eval_strategy only. Ask the installed "
                        "package, not what you remember", reveal=REVEAL_FIELDS)
        raise Wrong(f"api_exists({spec!r}) returned {got}, the installed TrainingArguments says {want}",
                    reveal=REVEAL_FIELDS)
    return f"{len(specs)} fields ({len(specs) - len(FIELDS)} drawn)"


@real_apis.case("`is_real` sorts the lesson's claims as the installed packages do",
                hint="build is_real from your api_exists: one True/False per claim",
                after=["dotted names: the longest prefix that imports, then attributes",
                       "torchrun flags, read from torchrun's own argument parser",
                       "dataclass fields count, even those the class has no attribute for"])
def _(learner):
    """Property: `is_real` holds one True or False per claim, each what the installed packages say."""
    answers = learner.is_real
    if not isinstance(answers, dict) or not answers:
        raise Wrong("`is_real` should be a dict from each claim to True/False")
    missing = [k for k, v in answers.items() if not isinstance(v, bool)]
    if missing:
        raise Wrong(f"{len(missing)} claims have no True/False answer, e.g. {missing[0]!r}")
    wrong = [k for k, v in answers.items() if v is not _truth(k)]
    if wrong:
        name = wrong[0]
        why = WHY.get(name, f"the installed packages say {_truth(name)}")
        raise Wrong(f"{len(wrong)} answer(s) disagree with the installed packages. First: {name!r}: {why}")
    real = sum(answers.values())
    return f"{len(answers)} claims: {real} real, {len(answers) - real} invented"


# =============================================================================================
# 00.ceiling: the best step, derived from what waits for what
# =============================================================================================

ceiling = Exercise("00.ceiling", uses=["ceiling_ms", "efficiency"], title="the ceiling, from a step's dependencies")

# (data_wait, forward, backward, comm_busy, optimizer)
_CASES = [(5.0, 10.0, 20.0, 8.0, 3.0), (0.0, 10.0, 20.0, 35.0, 3.0), (2.0, 1.0, 4.0, 4.0, 0.5)]
REVEAL_CEILING = "ideal = forward + max(backward, comm_busy) + optimizer (data_wait is not part of it)"


def ideal_ms(d, f, b, c, o):
    return f + max(b, c) + o


def _draw_breakdowns(seed: int = 0, count: int = 16) -> list[tuple]:
    """``count`` breakdowns (data_wait, forward, backward, comm_busy, optimizer), whole ms, drawn in turn from four
    regimes: comm shorter or longer than backward, a data wait shorter or longer than the whole rest of the step;
    the optimizer sometimes longer than comm. No two parts tie, so each side of every max is taken."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        k = len(out)
        f, b, o = rng.randint(2, 20), rng.randint(10, 60), rng.randint(1, 30)
        c = rng.randint(1, b - 1) if k % 2 == 0 else rng.randint(b + 1, 2 * b + 5)
        rest = f + max(b, c) + o
        d = rng.randint(0, rest - 1) if k % 4 < 2 else rng.randint(rest + 1, 2 * rest)
        parts = (float(d), float(f), float(b), float(c), float(o))
        if len({d, f, b, c, o, f + b, c + o}) == 7:
            out.append(parts)
    return out


def _ceiling_mistake(got: float, parts: tuple) -> str | None:
    """What a wrong ceiling did on ``parts``, when it is a known mistake; None otherwise."""
    d, f, b, c, o = parts
    want = ideal_ms(*parts)
    for value, why in (
        (want + d, "you added data_wait: the next batch can be produced while this step computes, so the best step "
                   "waits for no data at all"),
        (max(d, want), "you let a data wait longer than the step set the ceiling: the ceiling is the best schedule, "
                       "in which the batch was produced in time (rule 1), however long producing it takes today"),
        (f + b + c + o, "you added comm_busy to backward: the link works *while* backward runs, so the two overlap "
                        "and the step waits for the longer of them, max(backward, comm_busy), not their sum"),
        (max(f + b, c) + o, "you let communication hide behind forward too: no gradient exists before backward "
                            "starts, so forward cannot hide any of it"),
        (f + b + o, "you left communication out: when the reductions need longer than backward the optimizer waits "
                    "for them"),
        (f + max(b + o, c), "you let the optimizer run while the link still reduces: it updates the weights with the "
                            "averaged gradients, so it starts only once every reduction is done (rule 4)"),
        (f + max(b, c + o), "you let the optimizer run beside backward: it needs backward to have ended (rules 2 and "
                            "4), whatever the link is doing"),
    ):
        if math.isclose(got, value, rel_tol=1e-9) and not math.isclose(value, want, rel_tol=1e-9):
            return why
    return None


def _ceiling_prop(learner):
    def prop(parts):
        got = learner.ceiling_ms(*parts)
        if math.isclose(got, ideal_ms(*parts), rel_tol=1e-9):
            return None
        why = _ceiling_mistake(got, parts)
        shown = ", ".join(f"{v:g}" for v in parts)
        return f"ceiling_ms({shown}) returned {got:g}" + (f": {why}" if why else
                                                           ": replay the four rules on this breakdown")
    return prop


@ceiling.case("the earliest end of the optimizer, from the rules of the timeline",
              hint="draw the timeline: which parts must follow one another, which may run beside another, "
                   "and which need not be in the step at all", reveal=REVEAL_CEILING)
def _(learner):
    """Property: ceiling_ms(d, f, b, c, o) is the earliest end of the optimizer the four rules allow, on the
    lesson's breakdowns and on drawn ones where comm is shorter and longer than backward and the data wait
    shorter and longer than the rest of the step."""
    drawn = _draw_breakdowns()
    found = falsify(_CASES + drawn, _ceiling_prop(learner),
                    smaller=lambda parts: simpler_numbers(parts, keep=lambda p: all(v > 0 for v in p[1:])),
                    kind=after_colon)
    if found is None:
        return f"{len(_CASES)} breakdowns and {len(drawn)} drawn"
    message = str(found)
    if _ceiling_mistake(learner.ceiling_ms(*found.case), found.case):
        raise Wrong(message, reveal=REVEAL_CEILING)
    raise AssertionError(message)


def _efficiency_mistake(got: float, step: float, parts: tuple) -> str | None:
    d, f, b, c, o = parts
    want = ideal_ms(*parts) / step
    for value, why in (
        (1 / want, "you divided step by ideal: a step slower than its ceiling should score below 1"),
        ((f + b + o) / step, "you divided the compute (forward + backward + optimizer) by the step: when the link "
                             "needs longer than backward the ceiling is longer than the compute, and a step at its "
                             "ceiling must score 1.0"),
        ((d + f + b + c + o) / step, "you divided the sum of every part by the step: the ceiling overlaps the link "
                                     "with backward and leaves the data wait out"),
        (ideal_ms(f, b, c, o, d) / step, "you passed the parts to ceiling_ms in another order: its arguments are "
                                         "(data_wait_ms, forward_ms, backward_ms, comm_busy_ms, optimizer_ms), "
                                         "efficiency's after step_ms in that same order"),
    ):
        if math.isclose(got, value, rel_tol=1e-9) and not math.isclose(value, want, rel_tol=1e-9):
            return why
    return None


@ceiling.case("efficiency = ideal / step",
              hint="efficiency says how close a measured step came to its ceiling: 1.0 at the ceiling, "
                   "less for a slower step", reveal="efficiency = ceiling_ms(...) / step_ms",
              after="the earliest end of the optimizer, from the rules of the timeline")
def _(learner):
    """Property: efficiency(step, *parts) is the ceiling of those parts over the step, for drawn breakdowns and
    steps from the ceiling itself (1.0) to three times it."""
    rng = random.Random(1)
    cases = [(50.0, _CASES[0])] + [(float(round(ideal_ms(*p) * rng.choice((1.0, 1.25, 1.5, 2.0, 3.0)))), p)
                                   for p in _draw_breakdowns(seed=2, count=8)]

    def prop(case):
        step, parts = case
        got = learner.efficiency(step, *parts)
        if math.isclose(got, ideal_ms(*parts) / step, rel_tol=1e-9):
            return None
        why = _efficiency_mistake(got, step, parts)
        return (f"efficiency({step:g}, {', '.join(f'{v:g}' for v in parts)}) returned {got:.4g}"
                + (f": {why}" if why else ""))

    found = falsify(cases, prop)
    if found is None:
        return f"{len(cases)} steps, {len(cases) - 1} of them drawn"
    step, parts = found.case
    if _efficiency_mistake(learner.efficiency(step, *parts), step, parts):
        raise Wrong(str(found), reveal="efficiency = ceiling_ms(...) / step_ms")
    raise AssertionError(str(found))


# =============================================================================================
# 00.predict: predict a step from its parts, then measure it
# =============================================================================================

# The four schedules: the data produced ahead by a thread (prefetch) or not, the reduction beside backward
# (overlap) or after it.
SCHEDULES = ("serial", "prefetch", "overlap", "both")
PREFETCHED, OVERLAPPED = ("prefetch", "both"), ("overlap", "both")
# name: (schedule, data as a share of forward + backward + optimizer, comm as a share of backward). The same parts
# in all four, so that each schedule's gain shows; the drawn cases of the check reach the other regimes (data
# slower than the compute, a reduction longer than backward).
SCENARIOS = {
    "serial": ("serial", 0.5, 0.6),
    "prefetch": ("prefetch", 0.5, 0.6),
    "overlap": ("overlap", 0.5, 0.6),
    "both": ("both", 0.5, 0.6),
}
TOLERANCE = 0.15        # a prediction within 15 % (+ 2 ms) of the measured mean step passes
TOLERANCE_MS = 2.0
LAST_SCHEDULES: dict = {}   # the last measurement (the lesson's cell), graded by 00.predict


class _Lab:
    """A tiny GPT-2 (the lesson's) and the four schedules its step runs in."""

    def __init__(self, batch: int = 4, seq: int = 64):
        import torch

        from course.lib import tiny_gpt2

        self.model = tiny_gpt2(layers=4, width=128)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.ids = torch.randint(0, 257, (batch, seq), generator=torch.Generator().manual_seed(0))

    def compute(self, batch, comm_ms: float, overlapped: bool) -> tuple[float, float, float]:
        """One step's compute; the stand-in reduction sleeps ``comm_ms`` after backward (serial) or
        on a thread started as backward starts (overlapped). Returns forward, backward, optimizer ms."""
        t0 = time.perf_counter()
        loss = self.model(input_ids=batch, labels=batch).loss
        t1 = time.perf_counter()
        link = threading.Thread(target=time.sleep, args=(comm_ms / 1e3,)) if overlapped else None
        if link is not None:
            link.start()
        loss.backward()
        t2 = time.perf_counter()
        if link is not None:
            link.join()
        else:
            time.sleep(comm_ms / 1e3)
        t3 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t4 - t3) * 1e3

    def run(self, schedule: str, data_ms: float, comm_ms: float, steps: int, warmup: int) -> list[dict]:
        """Steps of one schedule: with prefetch a producer thread keeps up to two batches ready (else the step
        produces its batch itself); with overlap the reduction starts with backward (else it follows it)."""
        prefetched, overlapped = schedule in PREFETCHED, schedule in OVERLAPPED
        ready: queue.Queue = queue.Queue(maxsize=1)
        stop = threading.Event()

        def produce():
            while not stop.is_set():
                time.sleep(data_ms / 1e3)
                while not stop.is_set():
                    try:
                        ready.put(self.ids, timeout=0.05)
                        break
                    except queue.Full:
                        pass

        producer = threading.Thread(target=produce, daemon=True) if prefetched else None
        if producer is not None:
            producer.start()
        out, last = [], time.perf_counter()
        try:
            for _ in range(warmup + steps):
                if prefetched:
                    batch = ready.get(timeout=60)
                else:
                    time.sleep(data_ms / 1e3)
                    batch = self.ids
                f, b, o = self.compute(batch, comm_ms, overlapped)
                now = time.perf_counter()
                out.append({"forward_ms": f, "backward_ms": b, "optimizer_ms": o, "step_ms": (now - last) * 1e3})
                last = now
        finally:
            stop.set()
            if producer is not None:
                producer.join(timeout=5)
        return out[warmup:]


def _mean(steps: list[dict], key: str) -> float:
    return statistics.fmean(s[key] for s in steps)


def measure_schedules(steps: int = 6, warmup: int = 2, scenarios: dict | None = None, record: bool = True) -> dict:
    """Time the lesson's tiny GPT-2 in each scenario; return, per scenario, its schedule, the
    stand-ins' durations, every step's forward, backward, optimizer and step time (ms), and
    ``step_ms``, the mean step. ``record``: keep it as the measurement 00.predict grades.

    Compute runs on one thread while it is measured (a shared 2-core machine otherwise spends more
    time scheduling than computing); the number of threads is restored afterwards.
    """
    import torch

    scenarios = SCENARIOS if scenarios is None else scenarios
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lab = _Lab()
        for _ in range(3):                 # warm-up: the first steps allocate
            lab.compute(lab.ids, 0.0, False)
        cal = [lab.compute(lab.ids, 0.0, False) for _ in range(5)]
        fwd, bwd, opt = (statistics.median(c[k] for c in cal) for k in range(3))
        result = {"calibration": {"forward_ms": fwd, "backward_ms": bwd, "optimizer_ms": opt}, "scenarios": {}}
        for name, (schedule, data_share, comm_share) in scenarios.items():
            data_ms, comm_ms = data_share * (fwd + bwd + opt), comm_share * bwd
            result["scenarios"][name] = {"schedule": schedule, "data_ms": data_ms, "comm_ms": comm_ms,
                                         "steps": lab.run(schedule, data_ms, comm_ms, steps, warmup)}
    finally:
        torch.set_num_threads(threads)
    for s in result["scenarios"].values():
        # The mean step (the measured stretch over its steps): in steady state a step is as long as
        # the slowest chain, and a mean keeps what a median of jittery spacings would lose.
        s["step_ms"] = statistics.fmean(x["step_ms"] for x in s["steps"])
    if record:
        LAST_SCHEDULES.clear()
        LAST_SCHEDULES.update(result)
    return result


def _remeasure(name: str) -> dict:
    """One scenario once more (the check's second look when a prediction misses)."""
    return measure_schedules(scenarios={name: SCENARIOS[name]}, record=False)["scenarios"][name]


# What a learner might predict instead, each with what it gets wrong.
def _alternatives(schedule, d, f, b, c, o) -> list[tuple[float, str]]:
    prefetch, overlap = schedule in PREFETCHED, schedule in OVERLAPPED
    with_data = (lambda chain: max(d, chain)) if prefetch else (lambda chain: d + chain)   # noqa: E731
    out = []
    if schedule != "serial":
        out.append((d + f + b + c + o, "that adds every part, as in the serial schedule; here "
                    + ("the batch is produced on another thread" if prefetch else "")
                    + (" and " if prefetch and overlap else "")
                    + ("the reduction runs beside backward" if overlap else "")))
    if prefetch:
        out.append((d + f + (max(b, c) if overlap else b + c) + o,
                    "you added data_ms: the producer thread works ahead while the step computes, so the step waits "
                    "for data only when producing a batch takes longer than the rest of the step"))
    else:
        out.append((f + (max(b, c) if overlap else b + c) + o,
                    "you left out the data: in this schedule the step itself produces its batch before forward, so "
                    "data_ms is part of every step"))
        out.append((max(d, f + (max(b, c) if overlap else b + c) + o),
                    "in this schedule nothing produces the batch ahead: the step waits for it, then computes"))
    if overlap:
        out += [
            (with_data(f + b + c + o), "the reduction runs beside backward, not after it: the step waits only for "
                                       "whichever of backward and the reduction ends later"),
            (with_data(f + b + o), "the reduction can outlast backward, and the optimizer waits for it"),
            (with_data(f + c + o) if c < b else math.nan, "backward is compute: it takes its time even when the "
                                                          "reduction is shorter"),
        ]
    else:
        out.append((with_data(f + max(b, c) + o), "in this schedule the reduction runs after backward, not beside "
                                                  "it: nothing overlaps them"))
    if schedule == "both":
        out += [
            (f + max(b, c) + o, "that is the ceiling, which assumes the data keeps up; here a batch can take longer "
                                "to produce than a step to compute, and then the step waits for the producer"),
            (max(d, f + max(b, c)) + o, "you added the optimizer after the wait for data: the producer thread works "
                                        "through the optimizer too, so a step is as long as the longer of the two "
                                        "chains, producing a batch or the whole compute, optimizer included"),
            (max(d, f + b + o) + max(0.0, c - b), "you added the reduction's exposed part after the wait for data: "
                                                  "it belongs to the compute chain, and the producer works while it "
                                                  "runs"),
            (f + c + o if c > b else math.nan, "when the reduction outlasts backward you left out the data: the step "
                                               "still waits for the producer whenever a batch takes longer than the "
                                               "whole compute chain"),
            (max(d, f + b + o, c), "the reduction starts with backward, after forward, and the optimizer waits for "
                                   "it: it is not a chain of its own beside the whole compute"),
        ]
    if schedule == "prefetch":
        out.append((max(d, f + b + c) + o, "you added the optimizer after the wait for data: the producer thread works "
                                           "through the optimizer too"))
    return out


REVEAL_PREDICT = {"serial": "serial: data + forward + backward + comm + optimizer",
                  "prefetch": "prefetch: max(data, forward + backward + comm + optimizer)",
                  "overlap": "overlap: data + forward + max(backward, comm) + optimizer",
                  "both": "both: max(data, forward + max(backward, comm) + optimizer)"}


# Why each part of a step is on its critical path in every schedule: when one part takes much
# longer than all the others together, the step takes that much longer (the course's timeline).
PARTS = ("data_ms", "forward_ms", "backward_ms", "comm_ms", "optimizer_ms")
PART_IGNORED = {
    "data_ms": "you left out the data: a batch has to exist before its forward, produced by the step itself "
               "(serial) or by the producer thread, which the step waits for once producing takes longer than "
               "computing",
    "forward_ms": "you left out the forward: it runs in every step, before backward, and nothing runs beside it",
    "backward_ms": "you left out backward: it is compute, it takes its time whether or not a reduction runs "
                   "beside it",
    "comm_ms": "you left out the reduction: the optimizer needs the averaged gradients, so it waits for the "
               "reduction however long the link takes",
    "optimizer_ms": "you left out the optimizer step: it runs in every step, after backward and the reduction, "
                    "and the next step's forward waits for the parameters it updates",
}


def _call_predict(learner, schedule: str, parts) -> float:
    try:
        got = learner.predict_step_ms(schedule, *parts)
    except Exception as e:
        raise Wrong(f"predict_step_ms({schedule!r}, ...) raised {type(e).__name__}: {e}; it takes the "
                    f"schedule's name and five times in ms, and returns a time in ms") from None
    if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
        raise Wrong(f"predict_step_ms({schedule!r}, ...) returned {got!r}; return the step time in ms")
    return float(got)


def _probe_parts(learner, name: str, schedule: str, parts) -> None:
    """Each part, made far longer than all the others, must lengthen the predicted step by as much:
    a part the prediction ignores can hide inside the tolerance of a measured step (a 3 ms optimizer
    inside 15 % + 2 ms), but not here."""
    base = _call_predict(learner, schedule, parts)
    grow = 100.0 * (sum(parts) + 1.0)
    for k, part in enumerate(PARTS):
        longer = list(parts)
        longer[k] += grow
        want = _right(schedule, *longer) - _right(schedule, *parts)
        got = _call_predict(learner, schedule, longer) - base
        if abs(got - want) <= 0.05 * grow:
            continue
        where = (f"{name}; but with {part} {grow:.0f} ms longer, the step takes about {want:.0f} ms longer and "
                 f"your prediction grew by {got:.0f} ms")
        if abs(got) <= 0.05 * grow:
            raise Wrong(f"{where}. {PART_IGNORED[part]}", reveal=REVEAL_PREDICT[schedule])
        raise Wrong(f"{where}: you count {part} about {got / grow:.0f} times, the step only once",
                    reveal=REVEAL_PREDICT[schedule])


def _part_mistake(learner, schedule: str, parts) -> str | None:
    """`_probe_parts`' finding as a sentence without numbers (the same on every drawn case), or None."""
    base = _call_predict(learner, schedule, parts)
    grow = 100.0 * (sum(parts) + 1.0)
    for k, part in enumerate(PARTS):
        longer = list(parts)
        longer[k] += grow
        want = _right(schedule, *longer) - _right(schedule, *parts)
        got = _call_predict(learner, schedule, longer) - base
        if abs(got - want) <= 0.05 * grow:
            continue
        if abs(got) <= 0.05 * grow:
            return PART_IGNORED[part]
        return f"you count {part} about {got / grow:.0f} times, the step only once"
    return None


def _grade_scenario(learner, name: str) -> str:
    run = LAST_SCHEDULES.get("scenarios", {}).get(name)
    if run is None:
        run = measure_schedules()["scenarios"][name]
    schedule, d, c = run["schedule"], run["data_ms"], run["comm_ms"]

    def predict(steps):
        f, b, o = (_mean(steps, k) for k in ("forward_ms", "backward_ms", "optimizer_ms"))
        return _call_predict(learner, schedule, (d, f, b, c, o)), (f, b, o)

    got, (f, b, o) = predict(run["steps"])
    measured = run["step_ms"]
    if abs(got - measured) > TOLERANCE * measured + TOLERANCE_MS:
        again = _remeasure(name)           # a shared machine has slow seconds: look once more
        got2, (f2, b2, o2) = predict(again["steps"])
        if abs(got2 - again["step_ms"]) <= TOLERANCE * again["step_ms"] + TOLERANCE_MS:
            got, measured, (f, b, o) = got2, again["step_ms"], (f2, b2, o2)
        else:
            where = (f"{name} (data {d:.0f} ms, forward {f:.0f}, backward {b:.0f}, comm {c:.0f}, optimizer "
                     f"{o:.0f}): you predicted {got:.0f} ms, the step measured {measured:.0f} ms (and "
                     f"{got2:.0f} vs {again['step_ms']:.0f} ms measured again)")
            for value, why in _alternatives(schedule, d, f, b, c, o):
                if math.isclose(got, value, rel_tol=1e-9, abs_tol=1e-9):
                    raise Wrong(f"{where}. {why}", reveal=REVEAL_PREDICT[schedule])
            _probe_parts(learner, where, schedule, (d, f, b, c, o))     # a part left out, by name
            right = _right(schedule, d, f, b, c, o)
            if math.isclose(got, right, rel_tol=1e-9):
                raise AssertionError(f"{where}: your prediction is the course's, but this machine was too busy "
                                     f"for the measurement to agree twice; run the measurement cell again")
            raise AssertionError(where)
    _probe_parts(learner, f"{name} (predicted {got:.0f} ms, measured {measured:.0f} ms: within the tolerance)",
                 schedule, (d, f, b, c, o))
    return f"predicted {got:.0f} ms, measured {measured:.0f} ms"


def _right(schedule, d, f, b, c, o):
    chain = f + (max(b, c) if schedule in OVERLAPPED else b + c) + o
    return max(d, chain) if schedule in PREFETCHED else d + chain


predict = Exercise("00.predict", uses=["predict_step_ms"], title="predict a step, then measure it")

def _measured_case(name: str):
    def case(learner):
        return _grade_scenario(learner, name)

    case.__doc__ = (f"Property: for the {name} schedule measured in the lesson's cell, the prediction from that "
                    f"run's mean parts is within {TOLERANCE:.0%} (+ {TOLERANCE_MS:g} ms) of the mean step (measured "
                    f"twice before it fails), and each part, made far longer than the rest, lengthens it as much")
    return case


for _name in SCENARIOS:
    predict.case(f"{_name}: your prediction within {TOLERANCE:.0%} of the measured step",
                 hint="replay one step on the described timeline: what does each part wait for, and what "
                      "runs beside what? In steady state the step is as long as its slowest chain",
                 reveal=REVEAL_PREDICT[SCENARIOS[_name][0]], timeout=120.0)(_measured_case(_name))


def _draw_schedules(seed: int = 3, count: int = 16) -> list[tuple]:
    """``(schedule, data, forward, backward, comm, optimizer)`` in whole ms: each of the four schedules in each of
    four regimes (comm shorter than backward; comm longer than all the compute, the data shorter than comm; comm
    longer than backward and the data slower than the compute; comm shorter and the data slower), the optimizer
    sometimes the longest compute part; no ties between the chains, so every side of every max is taken."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        k = len(out)
        f, b, o = rng.randint(2, 20), rng.randint(10, 50), rng.choice((rng.randint(1, 5), rng.randint(30, 60)))
        regime = k // 4                     # the schedule is SCHEDULES[k % 4]: every pair of the two is drawn
        if regime == 1:                     # the reduction outlasts all the compute, the data does not
            c = f + b + o + rng.randint(1, b)
        elif regime == 2:
            c = rng.randint(b + 1, 2 * b)
        else:
            c = rng.randint(1, b - 1)
        chain = f + (max(b, c) if SCHEDULES[k % 4] in OVERLAPPED else b + c) + o       # this schedule's compute
        if regime >= 2:                     # the data slower than the compute
            d = rng.randint(chain + 1, 2 * chain)
        else:
            d = rng.randint(1, min(chain, c if regime == 1 else chain) - 1)
        if len({d, f + b + o, f + c + o, f + b, c + o, f + b + c + o}) == 6:
            out.append((SCHEDULES[k % 4], float(d), float(f), float(b), float(c), float(o)))
    return out


@predict.case("drawn schedules: your prediction is the step of the schedule you described",
              hint="replay one step on the described timeline: what does each part wait for, and what runs beside "
                   "what? In steady state the step is as long as its slowest chain", timeout=30.0)
def _(learner):
    """Property: predict_step_ms(schedule, d, f, b, c, o) is the steady-state step of that schedule, on drawn
    parts where the data is and is not the slowest chain, the reduction is shorter and longer than backward,
    and the optimizer is small or the longest compute part; the measured cases above cannot reach all four."""
    drawn = _draw_schedules()

    def reasons(case) -> tuple[float, list[str]]:
        schedule, *parts = case
        got = _call_predict(learner, schedule, parts)
        if math.isclose(got, _right(schedule, *parts), rel_tol=1e-9, abs_tol=1e-9):
            return got, []
        whys = [w for v, w in _alternatives(schedule, *parts) if math.isclose(got, v, rel_tol=1e-9)]
        part = _part_mistake(learner, schedule, parts)
        return got, whys + ([part] if part else []) + ["replay this step on its timeline"]

    failing = [r for r in (reasons(case)[1] for case in drawn) if r]
    why = common_reason(failing) or "replay this step on its timeline"

    def prop(case):
        got, whys = reasons(case)
        if not whys:
            return None
        schedule, d, f, b, c, o = case
        return (f"predict_step_ms({schedule!r}, data {d:g}, forward {f:g}, backward {b:g}, comm {c:g}, optimizer "
                f"{o:g}) returned {got:g}: " + (why if why in whys else "replay this step on its timeline"))

    found = falsify(drawn, prop, kind=after_colon,
                    smaller=lambda case: ((case[0], *p) for p in simpler_numbers(case[1:], keep=lambda p: min(p) > 0)))
    if found is None:
        return f"{len(drawn)} drawn schedules, each regime"
    if "replay this step" in found.message:
        raise AssertionError(str(found))
    raise Wrong(str(found), reveal=REVEAL_PREDICT[found.case[0]])
