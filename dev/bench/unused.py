"""What one unused trainable parameter costs: step time with and without it, on a slow link.

A trainable parameter the loss never uses, registered last (an unused pooler, an unrouted
expert), sits in the first bucket of a plan made in reverse registration order. Buckets launch
in plan order, so before GradSync re-planned from the observed gradient order nothing launched
until ``finish()``. This measures, side by side in one run on 2 ranks over a simulated link
(`SimulatedLink`, no root needed): the model without the head, the model with it (buckets
re-planned after the first step, as GradSync does), and the model with it and the plan frozen
in registration order (what GradSync did before).

    python -m dev.bench.unused --json unused.json          # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from hfstream.cli.bench.link import SimulatedLink

VARIANTS = ("no unused parameter", "unused head, re-planned", "unused head, registration order")


class _WithHead(torch.nn.Module):
    """A GPT-2 LM and, optionally, a trainable pooler registered last that the loss never uses."""

    def __init__(self, with_head: bool, n_layer: int, n_embd: int):
        from transformers import GPT2Config, GPT2LMHeadModel

        super().__init__()
        torch.manual_seed(0)
        self.lm = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=128, n_embd=n_embd, n_layer=n_layer,
                                             n_head=max(1, n_embd // 64), bos_token_id=0, eos_token_id=0))
        if with_head:
            self.pooler = torch.nn.Linear(n_embd, n_embd)

    def forward(self, ids):
        return self.lm(input_ids=ids, labels=ids).loss


def _rank(rank: int, world_size: int, cfg: dict) -> dict:
    from hfstream.gradsync import GradSync

    torch.set_num_threads(1)
    link = SimulatedLink(rate_mbit=cfg["rate_mbit"], latency_ms=cfg["latency_ms"])
    ids = torch.randint(0, 512, (cfg["batch"], cfg["seq"]), generator=torch.Generator().manual_seed(rank))
    out = {}
    with link.installed():
        for variant in VARIANTS:
            model = _WithHead(variant != VARIANTS[0], cfg["n_layer"], cfg["n_embd"])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            with GradSync(model, bucket_mb=cfg["bucket_mb"]) as sync:
                if variant == VARIANTS[2]:
                    sync.keep_plan()    # never re-plan: the plan stays in registration order
                times, early = [], []
                for step in range(cfg["warmup"] + cfg["steps"]):
                    t0 = time.perf_counter()
                    model(ids).backward()
                    sync.finish()
                    opt.step()
                    opt.zero_grad()
                    if step >= cfg["warmup"]:
                        times.append((time.perf_counter() - t0) * 1e3)
                        early.append(sync.stats.launched_in_backward)
                out[variant] = dict(step_ms=statistics.median(times), buckets=len(sync.buckets),
                                    launched_in_backward=statistics.median(early))
    return out


def main(argv: list[str] | None = None) -> int:
    from hfstream.testing import run_on_ranks

    p = argparse.ArgumentParser(prog="python -m dev.bench.unused", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate-mbit", type=float, default=1000.0)
    p.add_argument("--latency-ms", type=float, default=0.2)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    cfg = dict(rate_mbit=ns.rate_mbit, latency_ms=ns.latency_ms, bucket_mb=ns.bucket_mb, steps=ns.steps,
               warmup=ns.warmup, n_layer=4, n_embd=384, batch=4, seq=128)
    ranks = run_on_ranks(_rank, 2, cfg, timeout=1200)
    base = max(r[VARIANTS[0]]["step_ms"] for r in ranks)
    rows = []
    print(f"2 ranks, GPT-2 {cfg['n_layer']}x{cfg['n_embd']}, simulated link {ns.rate_mbit:g} Mbit/s, "
          f"bucket {ns.bucket_mb:g} MiB; median of {ns.steps} steps, slowest rank")
    print(f"{'variant':<34}{'step ms':>10}{'x base':>8}{'buckets':>9}{'launched in bwd':>17}")
    for v in VARIANTS:
        step = max(r[v]["step_ms"] for r in ranks)
        row = dict(variant=v, step_ms=step, ratio=step / base, buckets=ranks[0][v]["buckets"],
                   launched_in_backward=min(r[v]["launched_in_backward"] for r in ranks))
        rows.append(row)
        print(f"{v:<34}{step:>10.1f}{step / base:>8.2f}{row['buckets']:>9}{row['launched_in_backward']:>17g}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(dict(config=cfg, rows=rows, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())), f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
