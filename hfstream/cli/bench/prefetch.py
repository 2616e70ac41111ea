"""Does prefetching hide data preparation? Stock Trainer vs StreamTrainer with a costly collate.

On CPU the prefetcher's background thread prepares the next batches while the current step
computes, so a step should cost max(collate, compute) instead of collate + compute. This
measures the three numbers it takes to check that, in one process with one compute thread
(the second core is the prefetch thread's):

    python -m hfstream.cli.bench.prefetch --steps 40 --json prefetch.json
    python -m hfstream.cli.bench.prefetch --report-overhead     # cost of stream_report=True

``--report-overhead`` answers a different question with the same machinery: how much the step
report's measurement costs, StreamTrainer with ``stream_report`` on vs off (no collate work,
prefetch and hfstream sync off), alternated over several runs so drift hits both alike.

The collate does real tensor work (a feature transform on every sequence), calibrated to cost
about as much as a training step. Torch kernels release the GIL, so the thread and the
training step can run at the same time; a collate written as a pure-Python loop could not
(the GIL would serialise it with the step's Python overhead). Step times are medians of the
intervals between optimizer steps after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def _tiny_lm(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=128, n_embd=128, n_layer=3, n_head=4,
                                      bos_token_id=0, eos_token_id=0))


class CostlyCollate:
    """Stacks token sequences and runs ``rounds`` of a numeric transform on each (real CPU work)."""

    def __init__(self, rounds: int):
        self.rounds = rounds

    def __call__(self, rows):
        ids = torch.tensor([r["input_ids"] for r in rows])
        x = ids.float()
        for _ in range(self.rounds):        # stands in for decoding, augmentation, tokenisation
            x = torch.fft.irfft(torch.fft.rfft(x, dim=-1), n=x.shape[-1], dim=-1).tanh_().mul_(ids.float().std() + 1)
        ids = ids ^ (x.sum() != x.sum()).long()   # depends on the work, changes nothing
        return {"input_ids": ids, "labels": ids.clone()}


class _StepTimes:
    def __init__(self):
        self.t = []

    def __call__(self):
        self.t.append(time.perf_counter())


def _train(stream: bool, collate, steps: int, out_dir: str, batch: int, seq: int,
           stream_kw: dict | None = None) -> list[float]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hfstream import StreamTrainer, StreamTrainingArguments

    from ..extras import require

    datasets = require("datasets", "demo")

    g = torch.Generator().manual_seed(0)
    ds = datasets.Dataset.from_dict({"input_ids": torch.randint(0, 257, (batch * (steps + 1), seq), generator=g).tolist()})
    times = _StepTimes()

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            times()

    common = dict(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=batch, report_to=[],
                  save_strategy="no", use_cpu=True, disable_tqdm=True, logging_strategy="no",
                  dataloader_num_workers=0, remove_unused_columns=False, seed=0)
    if stream:
        kw = {"prefetch_depth": 2, "grad_sync": "native", **(stream_kw or {})}
        args, cls = StreamTrainingArguments(**common, **kw), StreamTrainer
    else:
        args, cls = TrainingArguments(**common), Trainer
    trainer = cls(model=_tiny_lm(), args=args, train_dataset=ds, data_collator=collate, callbacks=[Clock()])
    trainer.train()
    return [b - a for a, b in zip(times.t, times.t[1:])]


def _collate_ms(collate, batch: int, seq: int, n: int = 20) -> float:
    rows = [{"input_ids": list(range(seq))} for _ in range(batch)]
    collate(rows)
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        collate(rows)
        t.append(time.perf_counter() - t0)
    return statistics.median(t) * 1e3


def run(steps: int = 40, warmup: int = 5, batch: int = 8, seq: int = 128, rounds: int | None = None,
        out_dir: str = "runs/bench_prefetch") -> dict:
    """Measure compute alone, collate alone, stock Trainer and StreamTrainer (prefetch_depth=2)."""
    torch.set_num_threads(1)
    load = [os.getloadavg()[0]]
    compute = statistics.median(_train(False, CostlyCollate(0), steps, out_dir, batch, seq)[warmup:]) * 1e3
    if rounds is None:      # calibrate: collate about as costly as a step
        per_round = (_collate_ms(CostlyCollate(20), batch, seq) - _collate_ms(CostlyCollate(0), batch, seq)) / 20
        rounds = max(1, round(compute / max(per_round, 1e-3)))
    collate = CostlyCollate(rounds)
    collate_ms = _collate_ms(collate, batch, seq)
    stock = statistics.median(_train(False, collate, steps, out_dir, batch, seq)[warmup:]) * 1e3
    stream = statistics.median(_train(True, collate, steps, out_dir, batch, seq)[warmup:]) * 1e3
    bound = max(collate_ms, compute)
    load.append(os.getloadavg()[0])
    return {"compute_ms": compute, "collate_ms": collate_ms, "collate_rounds": rounds,
            "stock_step_ms": stock, "prefetch_step_ms": stream,
            "stock_over_sum": stock / (collate_ms + compute), "prefetch_over_max": stream / bound,
            "speedup": stock / stream, "steps": steps, "warmup": warmup, "batch": batch, "seq": seq,
            "torch": torch.__version__, **_load_fields(load)}


def report_overhead(steps: int = 40, warmup: int = 5, repeats: int = 4, batch: int = 8, seq: int = 128,
                    out_dir: str = "runs/bench_report") -> dict:
    """Median step time with the step report on and off, runs alternated ``repeats`` times."""
    torch.set_num_threads(1)
    load = [os.getloadavg()[0]]
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for on in (False, True):
            kw = dict(prefetch_depth=0, grad_sync="native", stream_report=on)
            times[on] += _train(True, CostlyCollate(0), steps, out_dir, batch, seq, kw)[warmup:]
    off_ms, on_ms = statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3
    load.append(os.getloadavg()[0])
    return {"report_off_step_ms": off_ms, "report_on_step_ms": on_ms, "overhead": on_ms / off_ms - 1.0,
            "steps_each": len(times[True]), "repeats": repeats, "torch": torch.__version__, **_load_fields(load)}


def _load_fields(load: list[float]) -> dict:
    """The load average at the start and the end, and whether it made the figures meaningless
    (the rule of `hfstream bench`: `hfstream.cli.bench.summary.machine_loaded`)."""
    from .summary import machine_loaded

    return {"loadavg_1min": load, "cores": os.cpu_count() or 1, "loaded": machine_loaded(load, os.cpu_count() or 1)}


def _say_if_loaded(r: dict) -> None:
    from .summary import loaded_line

    if r.get("loaded"):
        print(loaded_line(r["loaded"]))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median (default 5)")
    p.add_argument("--rounds", type=int, default=None, help="collate work; default: calibrated to one step")
    p.add_argument("--report-overhead", action="store_true",
                   help="instead: measure the cost of stream_report=True (on vs off, alternated)")
    p.add_argument("--json", default=None, help="write the result here")


def run_from_args(ns: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    if ns.steps <= ns.warmup + 2:
        msg = f"--steps ({ns.steps}) must exceed --warmup ({ns.warmup}) by at least 3"
        if parser is not None:
            parser.error(msg)
        print(f"hfstream bench-prefetch: error: {msg}", file=sys.stderr)
        return 2
    if ns.report_overhead:
        r = report_overhead(steps=ns.steps, warmup=ns.warmup)
        print(f"stream_report off    {r['report_off_step_ms']:8.2f} ms/step (median of {r['steps_each']} steps)")
        print(f"stream_report on     {r['report_on_step_ms']:8.2f} ms/step")
        print(f"overhead             {100 * r['overhead']:+8.2f} %")
        _say_if_loaded(r)
    else:
        r = run(steps=ns.steps, warmup=ns.warmup, rounds=ns.rounds)
        _print_prefetch(r)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


def _print_prefetch(r: dict) -> None:
    print(f"compute alone        {r['compute_ms']:8.1f} ms/step")
    print(f"collate alone        {r['collate_ms']:8.1f} ms/batch  ({r['collate_rounds']} rounds)")
    print(f"stock Trainer        {r['stock_step_ms']:8.1f} ms/step  = {r['stock_over_sum']:.2f} x (collate + compute)")
    print(f"StreamTrainer, d=2   {r['prefetch_step_ms']:8.1f} ms/step  = {r['prefetch_over_max']:.2f} x max(collate, compute)")
    print(f"speed-up             {r['speedup']:8.2f} x")
    _say_if_loaded(r)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hfstream.cli.bench.prefetch", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv), p)


if __name__ == "__main__":
    sys.exit(main())
