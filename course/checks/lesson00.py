"""Lesson 00 checks: real APIs, the ceiling formula, a communication prediction."""

from __future__ import annotations

import importlib
import math

from course.grading import Exercise, Wrong

# --------------------------------------------------------------------------- the truth
def api_exists(spec: str) -> bool:
    """Does ``spec`` exist in the installed packages?

    ``spec`` is a dotted name (``torch.Tensor.record_stream``), ``torchrun --flag`` (read from
    torchrun's own argument parser), or ``transformers.TrainingArguments.<field>`` (a dataclass
    field, which `getattr` on the class would miss when it has no default).
    """
    if spec.startswith("torchrun "):
        from torch.distributed.run import get_args_parser

        flag = spec.split(maxsplit=1)[1]
        return any(flag in action.option_strings for action in get_args_parser()._actions)
    if spec.startswith("transformers.TrainingArguments."):
        import dataclasses

        from transformers import TrainingArguments

        field = spec.rsplit(".", 1)[1]
        return field in {f.name for f in dataclasses.fields(TrainingArguments)}
    parts = spec.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


WHY = {
    "torch.distributed.stream": "there is no torch.distributed.stream: NCCL runs collectives on its own "
                                "internal stream; you order them with the Work that async_op=True returns",
    "torchrun --stream": "torchrun has no --stream flag (read `torchrun --help`); streams are a CUDA "
                         "concept inside your process, not a launcher option",
    "transformers.TrainingArguments.stream_scheduler": "TrainingArguments has no stream_scheduler field; "
                                                       "the real knobs are dataloader_pin_memory, "
                                                       "dataloader_prefetch_factor and ddp_bucket_cap_mb",
    "torch.Tensor.record_stream": "record_stream is real: it tells the caching allocator a tensor is in use "
                                  "on another stream, so its memory is not reused too early",
    "torch.Tensor.register_post_accumulate_grad_hook": "register_post_accumulate_grad_hook is real (torch >= 2.1): "
                                                       "it fires once .grad holds the accumulated gradient",
}

# --------------------------------------------------------------------------- 00.real_apis
real_apis = Exercise("00.real_apis", uses=["is_real"], title="sort real APIs from invented ones")


@real_apis.case("every name has an answer (True or False)",
                hint="replace each None in `is_real` with True or False")
def _(learner):
    answers = learner.is_real
    if not isinstance(answers, dict):
        raise Wrong("`is_real` should stay a dict from name to True/False")
    missing = [k for k, v in answers.items() if not isinstance(v, bool)]
    if missing:
        raise Wrong(f"{len(missing)} names still have no True/False answer, e.g. {missing[0]!r}")


@real_apis.case("the answers match the installed packages",
                hint="call api_exists(name) for any name you are unsure of")
def _(learner):
    answers = learner.is_real
    wrong = [k for k, v in answers.items() if v is not api_exists(k)]
    if wrong:
        name = wrong[0]
        why = WHY.get(name, f"api_exists({name!r}) returns {api_exists(name)}")
        raise Wrong(f"{len(wrong)} answer(s) disagree with the installed packages. First: {name!r}: {why}")
    return f"{len(answers)} names, all correct"


# --------------------------------------------------------------------------- 00.ceiling
ceiling = Exercise("00.ceiling", uses=["ceiling_ms", "efficiency"], title="the ceiling formula")

# (data_wait, forward, backward, comm_busy, optimizer)
_CASES = [(5.0, 10.0, 20.0, 8.0, 3.0), (0.0, 10.0, 20.0, 35.0, 3.0), (2.0, 1.0, 4.0, 4.0, 0.5)]


def _truth(d, f, b, c, o):
    return f + max(b, c) + o


@ceiling.case("communication hides behind backward only",
              hint="ideal = forward + max(backward, comm_busy) + optimizer")
def _(learner):
    for parts in _CASES:
        got = learner.ceiling_ms(*parts)
        want = _truth(*parts)
        if math.isclose(got, want, rel_tol=1e-9):
            continue
        d, f, b, c, o = parts
        if math.isclose(got, want + d):
            raise Wrong("you added data_wait: data can be fully hidden (prefetched during the previous step), "
                        "so it is not part of the ceiling")
        if math.isclose(got, f + b + c + o):
            raise Wrong("you added comm_busy to backward: reductions run *during* backward, so only "
                        "max(backward, comm_busy) counts")
        if math.isclose(got, max(f + b, c) + o):
            raise Wrong("communication cannot hide behind forward: gradients do not exist yet. "
                        "Use forward + max(backward, comm_busy) + optimizer")
        if math.isclose(got, f + b + o):
            raise Wrong("when comm_busy > backward the reductions outlast backward: use max(backward, comm_busy)")
        raise AssertionError(f"ceiling_ms{parts} returned {got}, expected {want}")
    return "3 breakdowns"


@ceiling.case("efficiency = ideal / step",
              hint="divide the ceiling by the measured step (a value <= 1 for a real step)")
def _(learner):
    if not math.isclose(learner.ceiling_ms(*_CASES[0]), _truth(*_CASES[0]), rel_tol=1e-9):
        raise Wrong("efficiency uses ceiling_ms, which is not right yet: fix the case above first")
    got = learner.efficiency(50.0, *_CASES[0])
    want = _truth(*_CASES[0]) / 50.0
    if math.isclose(got, 1 / want):
        raise Wrong("you divided step by ideal: efficiency is ideal / step, so 1.0 means at the ceiling")
    assert math.isclose(got, want, rel_tol=1e-9), f"efficiency(50, ...) returned {got}, expected {want:.3f}"


# --------------------------------------------------------------------------- 00.predict
predict = Exercise("00.predict", uses=["predict_comm_ms"], title="predict the communication time")


@predict.case("ring all-reduce: 2(N-1)/N x bytes over the link",
              hint="ms = 2*(N-1)/N * bytes / (gbit/s * 1e9 / 8) * 1e3")
def _(learner):
    mib100 = 100 * 2**20
    for n, gbit in ((8, 10.0), (2, 100.0), (1024, 400.0)):
        want = 2 * (n - 1) / n * mib100 / (gbit * 1e9 / 8) * 1e3
        got = learner.predict_comm_ms(mib100, n, gbit)
        if math.isclose(got, want, rel_tol=1e-6):
            continue
        if math.isclose(got, want * 8, rel_tol=1e-6):
            raise Wrong("the link speed is in bits per second: divide by 8 to get bytes per second")
        if math.isclose(got, want / 1e3, rel_tol=1e-6):
            raise Wrong("return milliseconds, not seconds")
        if math.isclose(got, mib100 / (gbit * 1e9 / 8) * 1e3, rel_tol=1e-6):
            raise Wrong("a ring all-reduce sends each byte about twice (reduce-scatter, then all-gather): "
                        "multiply by 2(N-1)/N")
        raise AssertionError(f"predict_comm_ms(100 MiB, {n}, {gbit}) returned {got:.3f}, expected {want:.3f}")


@predict.case("one rank needs no communication",
              hint="with world_size 1 there is nobody to talk to: return 0")
def _(learner):
    got = learner.predict_comm_ms(10 * 2**20, 1, 10.0)
    assert got == 0, f"predict_comm_ms(..., world_size=1, ...) returned {got}"
