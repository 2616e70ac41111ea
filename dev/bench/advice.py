"""Is the report's advice right? Run a scenario, apply its first advice, measure again.

Four scenarios (issue 20; serial, issue 45): a data-bound run (one process, a collate as costly as
a step, no prefetch), a comm-bound run (2 gloo ranks on a shaped link, one large bucket, fp32 wire),
a serial run on the same link (4 MiB buckets, all reduced after backward: its first advice should
be ``grad_sync="overlap"``, with the premise it checked) and a run already close to its ceiling (2
ranks on the plain loopback, default settings). For each:
the step before, the first advice and its predicted step, the step after applying it, and how
far the prediction was from the measurement (the target: within 25 %; at the ceiling: no
advice worth 10 %).

    python -m dev.bench.advice --json advice.json                  # all four (root for the shaped link)
    python -m dev.bench.advice --scenarios data,ceiling           # without root

A scenario's runs are `StreamTrainer` runs through torchrun (the 2-rank ones; in a network
namespace with a ``tc tbf`` limit for the shaped link, `netns`), a GPT-2 built from a config,
random tokens, no hub. Steps: the report's mean after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hfstream.report.table import row

SETTINGS = ("prefetch_depth", "dataloader_num_workers", "grad_bucket_mb", "grad_sync", "grad_comm_dtype",
            "gradient_accumulation_steps")
SCENARIOS = {
    # name: (ranks, shaped link Mbit/s or None, StreamTrainingArguments overrides, collate rounds)
    "data": (1, None, dict(prefetch_depth=0, grad_sync="native"), 50),   # about a step of collate
    "comm": (2, 1000, dict(grad_sync="overlap", grad_bucket_mb=float("inf"), grad_comm_dtype=None), 0),
    "serial": (2, 1000, dict(grad_sync="serial", grad_bucket_mb=4.0, grad_comm_dtype=None), 0),
    "ceiling": (2, None, dict(), 0),
}


class FeatureCollate:
    """Stacks the sequences and computes ``rounds`` of a feature transform on 512 features per token.

    Each round is a few large tensor operations (milliseconds each), which release the GIL: a
    producer thread and the training step then really run side by side, as a loader that decodes
    or augments with torch (or waits for storage) does. A collate of many tiny operations would
    hold the GIL most of the time and serialise with the step's own Python (then worker processes,
    ``dataloader_num_workers``, are the fix, which this scenario does not measure).
    """

    def __init__(self, rounds: int):
        self.rounds = rounds

    def __call__(self, rows):
        ids = torch.tensor([r["input_ids"] for r in rows])
        x = ids.float().unsqueeze(-1).expand(*ids.shape, 512).contiguous()
        for _ in range(self.rounds):
            x = torch.fft.irfft(torch.fft.rfft(x, dim=1), n=x.shape[1], dim=1).tanh_()
        ids = ids ^ (x.sum() != x.sum()).long()   # depends on the work, changes nothing
        return {"input_ids": ids, "labels": ids.clone()}


def _worker(ns) -> int:
    """One rank of one run (under torchrun, or alone): train, write rank 0's report."""
    import datasets
    from transformers import GPT2Config, GPT2LMHeadModel

    from hfstream import StreamTrainer, StreamTrainingArguments

    kw = json.loads(ns.args)
    torch.manual_seed(0)
    n_embd, n_layer = (128, 3) if ns.collate_rounds else (384, 4)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=128, n_embd=n_embd, n_layer=n_layer,
                                       n_head=4 if n_embd == 128 else 6, bos_token_id=0, eos_token_id=0))
    g = torch.Generator().manual_seed(0)
    rows = 4 * (ns.steps + 2) * int(kw.get("gradient_accumulation_steps", 1))
    ds = datasets.Dataset.from_dict({"input_ids": torch.randint(0, 257, (rows, 128), generator=g).tolist()})
    ds = ds.map(lambda r: {"labels": r["input_ids"]})
    args = StreamTrainingArguments(output_dir=ns.out, max_steps=ns.steps, per_device_train_batch_size=4,
                                   report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
                                   logging_steps=ns.steps, learning_rate=1e-4, seed=0, **kw)
    collate = FeatureCollate(ns.collate_rounds) if ns.collate_rounds else None
    trainer = StreamTrainer(model=model, args=args, train_dataset=ds, data_collator=collate)
    trainer.train()
    return 0


def _run(name: str, kw: dict, steps: int, tmp: str, shaped) -> dict:
    """One run of scenario ``name`` with ``kw``; its report (rank 0's stream_report.json)."""
    ranks, _, _, rounds = SCENARIOS[name]
    out = os.path.join(tmp, f"{name}-{len(os.listdir(tmp))}")
    worker = ["-m", "dev.bench.advice", "--worker", "--out", out, "--steps", str(steps),
              "--collate-rounds", str(rounds), "--args", json.dumps(kw)]
    from hfstream.testing import free_port

    from hfstream.cli.bench.netns import gloo_loopback_env, run_in_namespace

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))}
    if ranks == 1:
        cmd = [sys.executable, *worker]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-port", str(free_port()), *worker]
    if shaped is not None:
        env.update(gloo_loopback_env(inside_namespace=True))
        proc = run_in_namespace(shaped, cmd, timeout_s=900, env=env, capture_output=True)
    else:
        env.update(gloo_loopback_env(inside_namespace=False))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"scenario {name} {kw} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(Path(out, "stream_report.json").read_text())


def _scenario(name: str, steps: int, tmp: str) -> dict:
    ranks, rate, kw, _ = SCENARIOS[name]
    shaped_cm = None
    if rate is not None:
        from hfstream.cli.bench.netns import can_shape, shaped_namespace

        ok, why = can_shape()
        if not ok:
            return {"scenario": name, "skipped": f"the shaped link needs root and tc: {why}"}
        shaped_cm = shaped_namespace(rate_mbit=rate * ranks)
    import contextlib

    with shaped_cm if shaped_cm is not None else contextlib.nullcontext() as ns_name:
        before = _run(name, kw, steps, tmp, ns_name)
        advice = before.get("advice") or []
        row = {"scenario": name, "ranks": ranks, "rate_mbit": rate, "settings": kw,
               "before_ms": before["mean"]["step_ms"], "advice": advice}
        if not advice:
            return row
        first = advice[0]
        applied = {**kw, first["setting"]: first["value"], **first.get("also", {})}   # the change advised, nothing else
        after = _run(name, applied, steps, tmp, ns_name)
    step_after = after["mean"]["step_ms"]
    if first["setting"] == "gradient_accumulation_steps":   # per the first run's samples
        step_after *= int(kw.get("gradient_accumulation_steps", 1)) / int(first["value"])
    row.update(after_ms=step_after, predicted_ms=first["predicted_step_ms"], applied=applied,
               prediction_error=(first["predicted_step_ms"] - step_after) / step_after)
    return row


def _table(rows: list[dict]) -> str:
    widths = (-9, 9, 2, -30, 10, 9, 7)   # scenario, before, gap, first advice, predicted, after, error
    lines = [row(["scenario", "before", "", "first advice", "predicted", "after", "error"], (*widths[:-1], 8))]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['scenario']:<9}skipped: {r['skipped']}")
            continue
        if not r["advice"]:
            lines.append(row([r["scenario"], f"{r['before_ms']:.1f}", "", "(none)"], widths[:4]))
            continue
        a = r["advice"][0]
        lines.append(row([r["scenario"], f"{r['before_ms']:.1f}", "", f"{a['setting']}={a['value']}",
                          f"{r['predicted_ms']:.1f}", f"{r['after_ms']:.1f}", f"{100 * r['prediction_error']:.0f}"],
                         widths) + "%")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dev.bench.advice", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated: {', '.join(SCENARIOS)}")
    p.add_argument("--steps", type=int, default=16, help="optimizer steps per run (default 16)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--args", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--collate-rounds", type=int, default=0, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker:
        return _worker(ns)
    names = [s for s in ns.scenarios.split(",") if s]
    bad = [s for s in names if s not in SCENARIOS]
    if bad:
        p.error(f"--scenarios: unknown {', '.join(bad)}; accepted: {', '.join(SCENARIOS)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            t0 = time.time()
            rows.append(_scenario(name, ns.steps, tmp))
            print(f"[{name}: {time.time() - t0:.0f} s]", file=sys.stderr, flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(_table(rows))
    print(f"load average {load:.2f} on {os.cpu_count()} cores")
    for r in rows:
        for a in r.get("advice", []):
            print(f"  {r['scenario']}: {a['setting']}={a['value']} -> {a['predicted_step_ms']} ms: {a['reason']} "
                  f"(premise: {a.get('premise')})")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"rows": rows, "load_average": load,
                                             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                                            indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
