"""Soak: does a long run stay flat? Resident memory, threads and open files per rank over time.

Two gloo processes train a tiny GPT-2 through `StreamTrainer` (overlap + prefetch) for
``--steps`` steps; every ``--every`` steps each rank samples its own resident set (VmRSS),
thread count and open file descriptors from /proc. After the warm-up the three must stay
flat: a leak in the prefetcher (threads, pinned buffers), the gradient buckets or the
timeline's rings would show as a slope. The output ends with a verdict, ``flat``, ``growing``
(what grew, on which rank) or ``unknown`` (too few samples after the warm-up), and the
thresholds it was judged by (`verdict`).

``--memory`` answers a second question with the same machinery: what GradSync's flat buckets
cost next to DDP's. It trains a larger model for a few steps under ``grad_sync="overlap"`` and
under ``"native"`` (DistributedDataParallel) and compares the resident set after warm-up with
the gradient bytes.

    python -m hfstream.cli.bench.soak --steps 2000 --json soak.json
    python -m hfstream.cli.bench.soak --memory

Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch


def _sample() -> dict[str, float]:
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024,
            "threads": len(os.listdir("/proc/self/task")),
            "open_files": len(os.listdir("/proc/self/fd"))}


def _model(width: int, layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=64, n_embd=width, n_layer=layers,
                                      n_head=max(1, width // 32), bos_token_id=0, eos_token_id=0))


def _train_rank(rank, world_size, steps, every, grad_sync, width, layers, out_dir, samples_n=4096):
    from transformers import TrainerCallback

    from hfstream import StreamTrainer, StreamTrainingArguments

    samples: list[dict] = []

    class Sampler(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % every == 0 or state.global_step == 1:
                samples.append({"step": state.global_step, **_sample()})

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 257, (samples_n, 32), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    model = _model(width, layers)
    args = StreamTrainingArguments(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-4,
        report_to=[], save_strategy="no", logging_steps=steps, disable_tqdm=True, use_cpu=True,
        dataloader_num_workers=0, grad_sync=grad_sync, prefetch_depth=2, seed=0, grad_bucket_mb=1.0,
        num_train_epochs=1000, log_level="error",
    )
    trainer = StreamTrainer(model=model, args=args, train_dataset=data, callbacks=[Sampler()])
    trainer.train()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"rank": rank, "samples": samples, "grad_mib": grad_bytes / 2**20}


def _run(steps, every, grad_sync, width, layers, timeout, samples_n=4096):
    from hfstream.testing import run_on_ranks

    with tempfile.TemporaryDirectory() as out:
        return run_on_ranks(_train_rank, 2, steps, every, grad_sync, width, layers, out, samples_n,
                            timeout=timeout, init_process_group=False)


def _slope(samples: list[dict], key: str, warmup_steps: int) -> tuple[float, float, float]:
    """(value after warm-up, last value, least-squares slope per 1000 steps) of one quantity."""
    rows = [s for s in samples if s["step"] >= warmup_steps]
    if len(rows) < 2:
        return (rows[0][key], rows[0][key], 0.0) if rows else (float("nan"),) * 3
    xs, ys = [r["step"] for r in rows], [r[key] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return ys[0], ys[-1], slope * 1000


def soak(steps: int = 2000, every: int = 100, warmup_steps: int = 200, samples_n: int = 4096) -> dict:
    """Train ``steps`` steps (an epoch is samples_n / 8 steps; each epoch starts a new prefetcher)."""
    ranks = _run(steps, every, "overlap", 64, 2, timeout=max(600.0, steps * 0.5), samples_n=samples_n)
    table = {}
    for r in ranks:
        table[r["rank"]] = {key: dict(zip(("after_warmup", "last", "slope_per_1000_steps"),
                                          _slope(r["samples"], key, warmup_steps)))
                            for key in ("rss_mib", "threads", "open_files")}
        table[r["rank"]]["judged_samples"] = sum(s["step"] >= warmup_steps for s in r["samples"])
    doc = {"steps": steps, "every": every, "warmup_steps": warmup_steps, "per_rank": table,
           "samples": {r["rank"]: r["samples"] for r in ranks}}
    doc["verdict"] = verdict(table)
    return doc


# A leaked thread or file descriptor never comes back: any rise after the warm-up is growth.
# The resident set moves with the allocator's caching; a leak shows as a steady slope that adds
# up (a short run's slope alone is noise: 1 MiB over 40 steps is 25 MiB per 1000 steps).
RSS_SLOPE_LIMIT_MIB = 10.0     # MiB per 1000 steps, least squares over the samples after the warm-up
RSS_RISE_LIMIT_MIB = 4.0       # ... and the resident set rose by more than this after the warm-up
MIN_JUDGED_SAMPLES = 3         # fewer samples after the warm-up: no verdict


def verdict(per_rank: dict) -> dict:
    """``flat``, ``growing`` (with what grew, on which rank) or ``unknown`` (too few samples), with the thresholds."""
    thresholds = {"rss_mib_per_1000_steps": RSS_SLOPE_LIMIT_MIB, "rss_rise_mib": RSS_RISE_LIMIT_MIB,
                  "threads": 0, "open_files": 0,
                  "min_samples_after_warmup": MIN_JUDGED_SAMPLES}
    if not per_rank:
        return {"verdict": "unknown", "why": ["no rank reported samples"], "thresholds": thresholds}
    few = [rank for rank, row in per_rank.items() if row.get("judged_samples", 0) < MIN_JUDGED_SAMPLES]
    if few:
        return {"verdict": "unknown", "thresholds": thresholds,
                "why": [f"rank {rank}: fewer than {MIN_JUDGED_SAMPLES} samples after the warm-up (raise --steps, "
                        f"or lower --every or --warmup)" for rank in few]}
    grew = []
    for rank, row in per_rank.items():
        for key in ("threads", "open_files"):
            if row[key]["last"] > row[key]["after_warmup"]:
                grew.append(f"rank {rank}: {key} {row[key]['after_warmup']:g} -> {row[key]['last']:g}")
        rss = row["rss_mib"]
        rise = rss["last"] - rss["after_warmup"]
        if rss["slope_per_1000_steps"] > RSS_SLOPE_LIMIT_MIB and rise > RSS_RISE_LIMIT_MIB:
            grew.append(f"rank {rank}: resident set {rss['after_warmup']:.1f} -> {rss['last']:.1f} MiB, "
                        f"{rss['slope_per_1000_steps']:+.1f} MiB per 1000 steps")
    return {"verdict": "growing" if grew else "flat", "why": grew, "thresholds": thresholds}


def format_verdict(v: dict) -> str:
    """One line (or a few) that ends the soak's output."""
    rule = (f"threads and open files must not rise after the warm-up, nor the resident set by more than "
            f"{RSS_RISE_LIMIT_MIB:g} MiB at over {RSS_SLOPE_LIMIT_MIB:g} MiB per 1000 steps")
    if v["verdict"] == "flat":
        return f"verdict: flat ({rule}: held on every rank)"
    return f"verdict: {v['verdict']} ({rule})\n" + "\n".join(f"  {why}" for why in v["why"])


def memory(width: int = 384, layers: int = 6, steps: int = 30) -> dict:
    rows = {}
    for mode in ("native", "overlap"):
        ranks = _run(steps, steps, mode, width, layers, timeout=600.0)
        rows[mode] = {"rss_mib": [r["samples"][-1]["rss_mib"] for r in ranks], "grad_mib": ranks[0]["grad_mib"]}
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hfstream soak", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (default 2000)")
    p.add_argument("--every", type=int, default=100, help="sample every N steps (default 100)")
    p.add_argument("--warmup", type=int, default=200, help="steps before flatness is judged (default 200)")
    p.add_argument("--memory", action="store_true", help="GradSync's resident memory next to DDP's instead")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ns = p.parse_args(argv)
    if not os.path.isdir("/proc/self"):
        print("the soak benchmark reads /proc: Linux only", file=sys.stderr)
        return 2
    if ns.steps < 1 or ns.every < 1:
        p.error("--steps and --every must be >= 1")
    if ns.memory:
        doc = memory()
        for mode, row in doc.items():
            print(f"{mode:<8} resident MiB per rank {[round(x) for x in row['rss_mib']]}  "
                  f"(gradients {row['grad_mib']:.1f} MiB)")
        extra = [o - n for o, n in zip(doc["overlap"]["rss_mib"], doc["native"]["rss_mib"])]
        print(f"overlap - native: {[round(x, 1) for x in extra]} MiB per rank")
    else:
        doc = soak(ns.steps, ns.every, ns.warmup)
        print(f"{ns.steps} steps, 2 ranks, overlap + prefetch; after warm-up ({ns.warmup} steps) -> last sample, "
              "slope per 1000 steps")
        for rank, row in doc["per_rank"].items():
            parts = [f"{k} {v['after_warmup']:.1f} -> {v['last']:.1f} ({v['slope_per_1000_steps']:+.2f})"
                     for k, v in row.items() if isinstance(v, dict)]
            print(f"rank {rank}: " + "; ".join(parts))
        print(format_verdict(doc["verdict"]))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
