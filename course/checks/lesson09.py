"""Lesson 09 checks: ring all-reduce time against the planner, the overlap crossover, and the
final challenge, a real 2-rank run over a slow link graded on its measured distance to the ceiling.

The lab (`run_lab`) is what the lesson measures and what 09.final_challenge grades: two gloo
ranks train the same MLP on the same slow data source over a simulated link
(`hfstream.testing.link.SimulatedLink`), once per configuration, the configurations interleaved step
by step so that a slow second of a shared machine hits all of them alike. The link and the data
source follow this machine's compute (each run's recent backward), so the regime is the same on a
fast laptop and a loaded CI box: all-reducing the gradients in one piece takes 1.2 x backward
(0.05 x backward of it latency per all-reduce: the lab is past the crossover, communication-bound),
and a batch takes 0.6 x (forward + backward) to produce.

Efficiency is graded per step, ceiling / step with ceiling = forward + max(backward, the link's
time for every gradient in one all-reduce) + optimizer (the report's parts of that same step),
then the median over the steps. THRESHOLD lies between what serial or one-bucket runs reach and
what overlap with a few buckets and prefetching reaches on a shared 2-core machine (the author's
measurements are beside it). ``run_lab(..., simulate=False)`` runs the same lab over this
machine's loopback, unslowed: the lesson's one measurement in which nothing is simulated.
"""

from __future__ import annotations

import contextlib
import math
import random
import statistics
import time

from course.checks.drawn import after_colon, common_reason, falsify
from course.grading import Exercise, Wrong

# =============================================================================================
# The lab: a real run on 2 gloo ranks over a simulated slow link
# =============================================================================================

LAB = {
    "dim": 128, "layers": 8, "batch": 4096,     # TinyMLP(128, 128, 8): 16 tensors, 0.5 MiB of fp32 gradients
    "comm_share": 1.2,       # one all-reduce of every gradient takes 1.2 x backward (past the crossover) ...
    "latency_share": 0.05,   # ... of which 0.05 x backward is the per-all-reduce latency
    "data_share": 0.6,       # producing one batch takes 0.6 x (forward + backward)
    "warmup": 3, "steps": 20, "world_size": 2,
}
NAIVE = {"grad_sync": "serial", "bucket_mb": 25.0, "prefetch_depth": 0}
CONFIG_KEYS = ("grad_sync", "bucket_mb", "prefetch_depth")


class SlowBatches:
    """An endless source of ``(x, y)`` regression batches, each taking ``delay_s`` to produce.

    It sleeps (a stand-in for reading and tokenising: the step waits, the core is free) and
    cycles through a few batches made up front, so that producing a batch costs no compute that
    would slow the steps it is meant to hide behind.
    """

    def __init__(self, batch: int, dim: int, delay_s: float, seed: int, distinct: int = 4):
        import torch

        g = torch.Generator().manual_seed(seed)
        w = torch.randn(dim, dim, generator=g) / dim ** 0.5
        xs = [torch.randn(batch, dim, generator=g) for _ in range(distinct)]
        self.batches = [(x, torch.tanh(x @ w)) for x in xs]
        self.delay_s = delay_s

    def __iter__(self):
        k = 0
        while True:
            time.sleep(self.delay_s)
            yield self.batches[k % len(self.batches)]
            k += 1


def _lab_model(lab: dict):
    from course.lib import TinyMLP

    return TinyMLP(dim=lab["dim"], hidden=lab["dim"], layers=lab["layers"], seed=0)


def lab_tensors(lab: dict | None = None) -> list[tuple[str, int]]:
    """``(name, numel)`` of the lab model's parameters in registration order (for the planner)."""
    return [(n, p.numel()) for n, p in _lab_model(lab or LAB).named_parameters()]


class _Session:
    """One configuration on its own copy of the model, data source and report."""

    def __init__(self, name: str, cfg: dict, rank: int, data_s: float, lab: dict):
        import torch

        from hfstream import GradSync, StreamPrefetcher
        from hfstream.report.timeline import StepTimeline

        self.name, self.cfg = name, cfg
        self.model = _lab_model(lab)
        self.sync = GradSync(self.model, bucket_mb=cfg["bucket_mb"], mode=cfg["grad_sync"])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.source = SlowBatches(lab["batch"], lab["dim"], data_s, seed=100 + rank)
        self.prefetcher = StreamPrefetcher(self.source, device="cpu", depth=int(cfg["prefetch_depth"]))
        self.batches = iter(self.prefetcher)
        self.timeline = StepTimeline(rank=rank)
        self.steps = 0

    def step(self) -> None:
        import torch.nn.functional as F

        tl = self.timeline
        tl.begin_step(self.steps)
        x, y = next(self.batches)
        tl.data_ready()
        tl.forward_start()
        loss = F.mse_loss(self.model(x), y)
        tl.forward_end()
        loss.backward()
        tl.backward_end()
        t0 = time.perf_counter()
        self.sync.finish()
        st = self.sync.stats
        tl.add_comm(st.comm_busy_ms, st.exposed_comm_ms, st.bucket_spans, (t0, time.perf_counter()))
        tl.optimizer_start()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        tl.end_step()
        self.steps += 1

    def close(self) -> None:
        self.prefetcher.close()
        self.sync.close()


def _calibrate(lab: dict) -> dict:
    """Forward and backward of the lab model on this machine, ms (median of 6 after 4 warm-up, MAX over ranks)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    model = _lab_model(lab)
    x, y = torch.randn(lab["batch"], lab["dim"]), torch.randn(lab["batch"], lab["dim"])
    fwd, bwd = [], []
    dist.barrier()
    for i in range(10):
        t0 = time.perf_counter()
        loss = F.mse_loss(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if i >= 4:                  # the first steps allocate and warm the caches
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
    t = torch.tensor([statistics.median(fwd), statistics.median(bwd)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"forward_ms": float(t[0]), "backward_ms": float(t[1])}


def lab_link(calibration: dict, grad_bytes: int, world_size: int, lab: dict | None = None) -> dict:
    """The simulated link and data delay for a machine whose compute is ``calibration``."""
    lab = lab or LAB
    bwd = calibration["backward_ms"]
    latency_ms = lab["latency_share"] * bwd
    wire_bits = 2 * (world_size - 1) / world_size * grad_bytes * 8
    rate_mbit = wire_bits / ((lab["comm_share"] - lab["latency_share"]) * bwd / 1e3) / 1e6
    data_ms = lab["data_share"] * (calibration["forward_ms"] + bwd)
    return {"rate_mbit": rate_mbit, "latency_ms": latency_ms, "data_ms": data_ms}


def link_ms(link: dict, grad_bytes: int, world_size: int) -> float:
    """What the link needs for every gradient in one all-reduce: latency + 2(N-1)/N x bytes / rate."""
    wire_bits = 2 * (world_size - 1) / world_size * grad_bytes * 8
    return link["latency_ms"] + wire_bits / (link["rate_mbit"] * 1e6) * 1e3


def _lab_rank(rank: int, world_size: int, configs: dict, lab: dict, seed: int, simulate: bool = True) -> dict:
    """One rank of the lab: calibrate, then step the sessions in turn, one step each, in an order
    shuffled every round (the same on every rank), so that no configuration always runs at the
    same moment of a shared machine's load. Before each of its steps a session's link and data
    delay are set from its own last 3 steps (the median; the slowest rank), so that comm stays
    1.2 x backward however the machine's load changes."""
    import random

    import torch
    import torch.distributed as dist

    from hfstream.testing.link import SimulatedLink

    torch.manual_seed(0)
    calibration = _calibrate(lab)
    grad_bytes = sum(n for _, n in lab_tensors(lab)) * 4
    start = lab_link(calibration, grad_bytes, world_size, lab)
    out = {"calibration": calibration, "link_start": start, "grad_bytes": grad_bytes, "runs": {}}
    real_all_reduce = dist.all_reduce      # the agreement below must not pay the simulated link
    link = SimulatedLink(start["rate_mbit"], start["latency_ms"])
    order = random.Random(seed)
    with link.installed() if simulate else contextlib.nullcontext():
        sessions = [_Session(name, cfg, rank, start["data_ms"] / 1e3, lab) for name, cfg in configs.items()]
        recent = {s.name: [] for s in sessions}
        now = {s.name: start for s in sessions}
        used = {s.name: [] for s in sessions}
        try:
            dist.barrier()
            for _ in range(lab["warmup"] + lab["steps"]):
                for s in order.sample(sessions, len(sessions)):
                    link.rate_mbit, link.latency_ms = now[s.name]["rate_mbit"], now[s.name]["latency_ms"]
                    s.source.delay_s = now[s.name]["data_ms"] / 1e3
                    used[s.name].append(link_ms(now[s.name], grad_bytes, world_size) if simulate else None)
                    s.step()
                    last = s.timeline.records[-1]
                    t = torch.tensor([last.forward_ms, last.backward_ms], dtype=torch.float64)
                    real_all_reduce(t, op=dist.ReduceOp.MAX)
                    recent[s.name] = (recent[s.name] + [(float(t[0]), float(t[1]))])[-3:]
                    now[s.name] = lab_link({"forward_ms": statistics.median(f for f, _ in recent[s.name]),
                                            "backward_ms": statistics.median(b for _, b in recent[s.name])},
                                           grad_bytes, world_size, lab)
            for s in sessions:
                recs = list(s.timeline.records)[lab["warmup"]:]
                out["runs"][s.name] = {"records": [r.as_dict() for r in recs], "buckets": len(s.sync.buckets),
                                       "link_ms": used[s.name][lab["warmup"]:],
                                       "link_last": now[s.name] if simulate else None}
        finally:
            for s in sessions:
                s.close()
    return out


PARTS = ("data_wait_ms", "forward_ms", "backward_ms", "comm_busy_ms", "exposed_comm_ms", "optimizer_ms")


def _breakdown(per_rank: list[dict]) -> dict:
    """Per step: the mean over ranks of each part, the slowest rank's step, the ceiling and the
    efficiency; then the median over steps of each."""
    steps = []
    for i, recs in enumerate(zip(*(r["records"] for r in per_rank))):
        s = {k: statistics.fmean(r[k] for r in recs) for k in PARTS}
        s["step_ms"] = max(r["step_ms"] for r in recs)
        s["link_ms"] = per_rank[0]["link_ms"][i]
        if s["link_ms"] is None:            # the real link: the report's own ceiling, with comm busy as measured
            s["link_ms"] = s["comm_busy_ms"]
        s["ceiling_ms"] = s["forward_ms"] + max(s["backward_ms"], s["link_ms"]) + s["optimizer_ms"]
        s["efficiency"] = s["ceiling_ms"] / s["step_ms"]
        steps.append(s)
    out = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    out["efficiency_all"] = [round(s["efficiency"], 3) for s in steps]
    return out


LAST_LAB: dict = {}


def run_lab(configs: dict[str, dict], timeout: float = 120.0, lab: dict | None = None, seed: int = 0,
            simulate: bool = True) -> dict:
    """Train the lab model on 2 gloo ranks once per configuration, the runs interleaved step by
    step over one simulated link; return each run's median breakdown and efficiency.

    Args:
        configs: ``{name: {"grad_sync": "serial"|"overlap", "bucket_mb": MiB, "prefetch_depth": n}}``.
        timeout: seconds before the ranks are stopped.
        lab: overrides of `LAB` (``{"data_share": 0.0}``: batches that cost nothing to produce).
        simulate: False runs gloo over this machine's loopback, unslowed; ``link_ms`` is then the
            measured comm busy, and ``link`` is None.

    Returns:
        ``{"grad_bytes", "calibration", "runs": {name: breakdown}}``; each breakdown has the median
        over steps of data wait, forward, backward, comm busy, exposed comm, optimizer, step,
        ``link_ms`` (every gradient in one all-reduce, alone on the link), ``ceiling_ms`` =
        forward + max(backward, link_ms) + optimizer and ``efficiency`` = ceiling / step, per
        step then the median; plus ``buckets``, ``config`` and ``link`` (the link at the end).
    """
    from hfstream.testing import run_on_ranks

    for name, cfg in configs.items():
        validate_config(cfg, name)
    lab = {**LAB, **(lab or {})}
    per_rank = run_on_ranks(_lab_rank, lab["world_size"], dict(configs), lab, seed, simulate, timeout=timeout)
    r0 = per_rank[0]
    runs = {}
    for name in configs:
        runs[name] = {**_breakdown([r["runs"][name] for r in per_rank]), "buckets": r0["runs"][name]["buckets"],
                      "config": dict(configs[name]), "link": r0["runs"][name]["link_last"]}
    result = {"grad_bytes": r0["grad_bytes"], "calibration": r0["calibration"], "lab": lab, "runs": runs,
              "simulated": simulate}
    LAST_LAB.clear()
    LAST_LAB.update(result)
    return result


def validate_config(cfg, name: str = "config") -> None:
    """Raise `Wrong` naming the key when a run configuration is not one the lab can run."""
    if not isinstance(cfg, dict):
        raise Wrong(f"{name} should be a dict with keys {CONFIG_KEYS}, got {type(cfg).__name__}")
    extra = [k for k in cfg if k not in CONFIG_KEYS]
    missing = [k for k in CONFIG_KEYS if k not in cfg]
    if extra or missing:
        raise Wrong(f"{name} needs exactly the keys {CONFIG_KEYS}" + (f"; unknown: {extra}" if extra else "")
                    + (f"; missing: {missing}" if missing else ""))
    if cfg["grad_sync"] not in ("serial", "overlap"):
        raise Wrong(f"grad_sync={cfg['grad_sync']!r}: the lab runs GradSync, whose modes are 'serial' and 'overlap'")
    mb = cfg["bucket_mb"]
    if mb == "auto":
        raise Wrong("bucket_mb='auto' tunes the cap over its first 20-60 steps, and this run times only "
                    f"{LAB['steps']}: choose the cap yourself (ask your overlap_step_ms which)")
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or math.isnan(mb) or mb < 0:
        raise Wrong(f"bucket_mb={mb!r}: a cap in MiB >= 0 (0 = one tensor per bucket, float('inf') = one bucket)")
    depth = cfg["prefetch_depth"]
    if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= 8:
        raise Wrong(f"prefetch_depth={depth!r}: an int from 0 (no prefetching) to 8")


# =============================================================================================
# 09.scaling: ring all-reduce time and the ceiling against the planner
# =============================================================================================

def _plan_case(model: str = "llama-8b", **overrides):
    """(shape, cfg, buckets as (bytes, ready)) of a planner scenario."""
    import dataclasses

    from hfstream.plan import PlanConfig, load_model, predict_buckets

    shape = load_model(model)
    cfg = dataclasses.replace(PlanConfig(), **overrides)
    return shape, cfg, predict_buckets(shape, cfg.grad_bytes, cfg.bucket_mb, cfg.first_bucket_mb)


def _ring_variants(nbytes: float, n: int, gbs: float, lat_us: float) -> list[tuple[str, float]]:
    """Likely wrong answers for one ring all-reduce (ms), each with the hint that fixes it."""
    bw = gbs * 1e9
    ring = 2 * (n - 1) / n if n > 1 else 0.0
    lat = 2 * (n - 1) * lat_us * 1e-3
    want = ring * nbytes / bw * 1e3 + lat
    return [
        ("return milliseconds, not seconds", want / 1e3),
        ("you priced every byte once, bytes / bandwidth (an integer division, 2 * (N - 1) // N, which is 1 for every "
         "N >= 2, does that too): in a ring all-reduce a device's bytes cross the link in a reduce-scatter and again "
         "in an all-gather", nbytes / bw * 1e3 + lat),
        ("you priced 2 x bytes at every N: that is only the limit for large N; with N = 2 each device sends "
         "half its buffer in the reduce-scatter and half in the all-gather", 2 * nbytes / bw * 1e3 + lat),
        ("that is the bytes of one half of the ring (a reduce-scatter alone); an all-reduce runs an all-gather "
         "after it, as many bytes again", (n - 1) / n * nbytes / bw * 1e3 + lat),
        ("you left out the latency: every step of the ring pays it once", ring * nbytes / bw * 1e3),
        ("you paid the latency once per all-reduce: every step of the ring pays it",
         ring * nbytes / bw * 1e3 + lat_us * 1e-3),
        ("you paid the latency for the steps of one half of the ring only; the all-gather's steps pay it too",
         ring * nbytes / bw * 1e3 + (n - 1) * lat_us * 1e-3),
        ("every step of the ring pays the latency once, and a ring of N devices has 2(N-1) steps, not 2N",
         ring * nbytes / bw * 1e3 + 2 * n * lat_us * 1e-3),
        ("latency_us is in microseconds: x 1e-3 for milliseconds", ring * nbytes / bw * 1e3 + lat * 1e3),
        ("latency_us is in microseconds: x 1e-3 for milliseconds (you multiplied by 1e-6: that is seconds)",
         ring * nbytes / bw * 1e3 + lat / 1e3),
        ("link_gbs is in GB/s, bytes per second (25 GB/s = one 200 Gbit/s port): do not divide by 8",
         want - ring * nbytes / bw * 1e3 + ring * nbytes / (bw / 8) * 1e3),
        ("link_gbs is in GB/s = 10**9 bytes per second, not GiB/s (2**30)",
         ring * nbytes / (gbs * 2**30) * 1e3 + lat),
    ]


def diagnose_ring(got: float, nbytes: float, n: int, gbs: float, lat_us: float) -> str | None:
    """The hint for a wrong ring all-reduce time, or None when ``got`` is right."""
    from hfstream.plan import allreduce_s

    want = allreduce_s(nbytes, n, gbs, lat_us) * 1e3
    if math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12):
        return None
    if n == 1:
        return f"with world_size 1 there is nobody to reduce with: return 0 (you returned {got:.4g})"
    for hint, value in _ring_variants(nbytes, n, gbs, lat_us):
        if math.isclose(got, value, rel_tol=1e-6) and not math.isclose(value, want, rel_tol=1e-6):
            return hint
    return (f"ring_allreduce_ms({nbytes:.4g} bytes, N={n}, {gbs:g} GB/s, {lat_us:g} us) returned {got:.6g}, "
            f"the planner says {want:.6g}")


scaling = Exercise("09.scaling", uses=["ring_allreduce_ms", "predict_step"],
                   title="ring all-reduce and the ceiling from 1 to 1024 devices")


REVEAL_RING = "ms = 2*(N-1)/N * nbytes / (link_gbs * 1e9) * 1e3 + 2*(N-1) * latency_us * 1e-3; 0 for N = 1"
REVEAL_STEP = ("comm_busy = sum(ring_allreduce_ms(b, ...) for b in bucket_bytes); serial = forward + backward + "
               "comm_busy + optimizer; ideal = forward + max(backward, comm_busy) + optimizer")
RING_CASE = "one ring all-reduce, as the planner prices it"


@scaling.case(RING_CASE,
              hint="two terms: the bytes each device sends over the link's bandwidth, and the latency paid once "
                   "per ring step; mind the units (GB/s, microseconds, milliseconds); one device sends nothing",
              reveal=REVEAL_RING)
def _(learner):
    """Property: ring_allreduce_ms is the planner's price of one ring all-reduce, on the lesson's sizes and on drawn
    ones: 1 kB to 10 GB, world sizes that are not powers of two (3, 5, 7, 12, 100, 4097), links of 1 to 400 GB/s,
    latencies of 0 to 50 us."""
    cases = [(25 * 2**20, n, 25.0, 5.0) for n in (1, 2, 8, 1024)] + [(1e9, 8, 50.0, 0.0), (100 * 2**20, 64, 12.5, 20.0)]
    for nbytes, n, gbs, lat in cases:
        got = learner.ring_allreduce_ms(nbytes, n, gbs, lat)
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            raise Wrong(f"ring_allreduce_ms should return a number of milliseconds, got {type(got).__name__}")
        hint = diagnose_ring(float(got), nbytes, n, gbs, lat)
        if hint:
            raise Wrong(hint, reveal=REVEAL_RING)
    drawn = _draw_rings()

    def prop(case):
        nbytes, n, gbs, lat = case
        got = learner.ring_allreduce_ms(nbytes, n, gbs, lat)
        hint = diagnose_ring(float(got), nbytes, n, gbs, lat)
        return None if hint is None else (f"ring_allreduce_ms({nbytes:.4g} bytes, N={n}, {gbs:g} GB/s, {lat:g} us) "
                                          f"returned {float(got):.6g}: {hint}")

    def smaller(case):
        nbytes, n, gbs, lat = case
        for m in (2, 3, 4):
            if m < n:
                yield (nbytes, m, gbs, lat)
        for nb in (1e6, 1e9):
            if nb < nbytes:
                yield (nb, n, gbs, lat)
        if gbs != 1.0:
            yield (nbytes, n, 1.0, lat)

    found = falsify(drawn, prop, smaller=smaller, kind=after_colon)
    if found is not None:
        raise Wrong(str(found), reveal=REVEAL_RING)
    return f"6 sizes and world sizes and {len(drawn)} drawn, as hfstream.plan.allreduce_s"


def _draw_rings(seed: int = 91, count: int = 12) -> list[tuple]:
    """``(bytes, N, GB/s, latency us)``: whole bytes from 1 kB to 10 GB, N not a power of two in most cases."""
    rng = random.Random(seed)
    worlds = (3, 5, 6, 7, 12, 100, 4097, 2, 9, 1000)
    return [(float(rng.randint(10**3, 10**10)), worlds[k % len(worlds)], float(rng.choice((1, 12.5, 25, 50, 100, 400))),
             float(rng.choice((0, 1, 5, 20, 50)))) for k in range(count)]


@scaling.case("comm busy, serial step and ceiling of llama-8b for N = 1 .. 1024, as the planner",
              hint="every bucket is its own all-reduce, one after another on the link; the serial step waits "
                   "for all of them after backward; the ceiling is lesson 00's", reveal=REVEAL_STEP,
              after=RING_CASE)
def _(learner):
    """Property: predict_step gives the planner's comm busy (each bucket its own ring all-reduce, on the link passed
    in), serial step and ceiling, for llama-8b on 1 to 1024 devices and for drawn steps on other links (3 to 400
    GB/s, 0 to 30 us), comm busy below and above backward."""
    from hfstream.plan import allreduce_s, predict_row

    shape, cfg, buckets = _plan_case()
    sizes = [b for b, _ in buckets]
    total = sum(sizes)
    for n in (1, 2, 8, 64, 1024):
        row = predict_row(shape, cfg, n, buckets)
        got = learner.predict_step(n, row["forward_ms"], row["backward_ms"], row["optimizer_ms"], list(sizes),
                                   cfg.link_gbs, cfg.latency_us)
        if not isinstance(got, dict) or not {"comm_busy_ms", "step_serial_ms", "ideal_ms"} <= set(got):
            raise Wrong("predict_step should return a dict with the keys 'comm_busy_ms', 'step_serial_ms' and "
                        "'ideal_ms'")
        busy, f, b, o = row["comm_busy_ms"], row["forward_ms"], row["backward_ms"], row["optimizer_ms"]
        g = {k: float(got[k]) for k in ("comm_busy_ms", "step_serial_ms", "ideal_ms")}
        if not math.isclose(g["comm_busy_ms"], busy, rel_tol=1e-6, abs_tol=1e-9):
            one = allreduce_s(total, n, cfg.link_gbs, cfg.latency_us) * 1e3
            if math.isclose(g["comm_busy_ms"], one, rel_tol=1e-6):
                raise Wrong(f"you reduced all {total / 2**30:.1f} GiB as one all-reduce: the model travels in "
                            f"{len(sizes)} buckets and each is its own all-reduce, paying its own 2(N-1) "
                            f"latencies", reveal=REVEAL_STEP)
            if math.isclose(g["comm_busy_ms"], max(allreduce_s(s, n, cfg.link_gbs, cfg.latency_us) for s in sizes) * 1e3,
                            rel_tol=1e-6):
                raise Wrong("comm busy is the sum over buckets, not the largest: the link reduces one bucket at a time", reveal=REVEAL_STEP)
            raise AssertionError(f"at N={n}: comm_busy_ms {g['comm_busy_ms']:.6g}, the planner says {busy:.6g}")
        if not math.isclose(g["step_serial_ms"], f + b + busy + o, rel_tol=1e-6):
            raise AssertionError(f"at N={n}: step_serial_ms {g['step_serial_ms']:.6g}, expected forward + backward + "
                                 f"comm busy + optimizer = {f + b + busy + o:.6g}")
        if not math.isclose(g["ideal_ms"], row["ideal_ms"], rel_tol=1e-6):
            if math.isclose(g["ideal_ms"], f + b + o, rel_tol=1e-6):
                raise Wrong(f"at N={n} comm busy ({busy:.0f} ms) exceeds backward ({b:.0f} ms): the link, not compute, "
                            f"sets the ceiling there", reveal=REVEAL_STEP)
            if math.isclose(g["ideal_ms"], f + b + busy + o, rel_tol=1e-6):
                raise Wrong("that is the serial step: the ceiling hides communication behind backward",
                            reveal=REVEAL_STEP)
            raise AssertionError(f"at N={n}: ideal_ms {g['ideal_ms']:.6g}, the planner says {row['ideal_ms']:.6g}")
    drawn = _draw_steps()

    def prop(case):
        n, f, b, o, sizes, gbs, lat = case
        got = learner.predict_step(n, f, b, o, list(sizes), gbs, lat)
        g = {k: float(got[k]) for k in ("comm_busy_ms", "step_serial_ms", "ideal_ms")}
        busy = sum(allreduce_s(x, n, gbs, lat) * 1e3 for x in sizes)
        shown = (f"predict_step(N={n}, forward {f:g}, backward {b:g}, optimizer {o:g}, {len(sizes)} buckets, {gbs:g} "
                 f"GB/s, {lat:g} us) gave comm busy {g['comm_busy_ms']:.4g}, serial {g['step_serial_ms']:.4g}, ideal "
                 f"{g['ideal_ms']:.4g}")
        if not math.isclose(g["comm_busy_ms"], busy, rel_tol=1e-6, abs_tol=1e-9):
            default = sum(allreduce_s(x, n, 25.0, 5.0) * 1e3 for x in sizes)
            if math.isclose(g["comm_busy_ms"], default, rel_tol=1e-6):
                return (f"{shown}: that comm busy is what the planner's default link (25 GB/s, 5 us) takes: price the "
                        f"buckets on the link_gbs and latency_us passed in")
            return f"{shown}: comm busy is the sum over the buckets of one ring all-reduce each, on this link"
        if not math.isclose(g["step_serial_ms"], f + b + busy + o, rel_tol=1e-6):
            return f"{shown}: the serial step runs every part one after another"
        if not math.isclose(g["ideal_ms"], f + max(b, busy) + o, rel_tol=1e-6):
            if math.isclose(g["ideal_ms"], max(f + b, busy) + o, rel_tol=1e-6):
                return (f"{shown}: that ceiling lets communication run beside forward; no gradient exists before "
                        f"backward starts, so comm overlaps backward only")
            if math.isclose(g["ideal_ms"], f + b + o, rel_tol=1e-6):
                return f"{shown}: comm busy exceeds backward here: the link, not compute, sets the ceiling"
            return f"{shown}: the ceiling is lesson 00's, with this comm busy"
        return None

    found = falsify(drawn, prop, kind=after_colon, smaller=lambda c: ((m, *c[1:]) for m in (2, 3) if m < c[0]))
    if found is not None:
        raise Wrong(str(found), reveal=REVEAL_STEP)
    row = predict_row(shape, cfg, 1024, buckets)
    return (f"llama-8b at N=1024: comm busy {row['comm_busy_ms']:.0f} ms > backward {row['backward_ms']:.0f} ms, "
            f"ceiling {row['ideal_ms']:.0f} ms; {len(drawn)} drawn steps on other links")


def _draw_steps(seed: int = 92, count: int = 8) -> list[tuple]:
    """``(N, forward, backward, optimizer, bucket bytes, GB/s, latency us)``: links slower and faster than the
    default, comm busy below and above backward."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        sizes = tuple(float(rng.randint(10**5, 10**9)) for _ in range(rng.randint(1, 6)))
        out.append((rng.choice((2, 3, 8, 24, 512)), float(rng.randint(5, 50)), float(rng.randint(20, 200)),
                    float(rng.randint(1, 20)), sizes, float(rng.choice((3.0, 12.5, 100.0, 400.0))),
                    float(rng.choice((0.0, 2.0, 10.0, 30.0)))))
    return out


# =============================================================================================
# 09.crossover: from which N overlap can no longer hide communication
# =============================================================================================

# (label, model, PlanConfig overrides): the planner's answers are 5, 687, None, 1694.
CROSSOVER_CASES = [
    ("llama-8b, 25 GB/s, 5 us", "llama-8b", {}),
    ("llama-8b, 100 GB/s, 5 us", "llama-8b", {"link_gbs": 100.0}),
    ("llama-8b, 100 GB/s, no latency", "llama-8b", {"link_gbs": 100.0, "latency_us": 0.0}),
    ("llama-1b, 50 GB/s, 32k tokens", "llama-1b", {"link_gbs": 50.0, "tokens_per_device": 32768}),
]

crossover = Exercise("09.crossover", uses=["crossover_world_size", "min_link_gbs"],
                     title="where overlap stops hiding communication")


REVEAL_CROSSOVER = ("if busy(max_world_size) <= backward: return None; lo, hi = 1, max_world_size; "
                    "while hi - lo > 1: mid = (lo + hi) // 2; lo, hi = (mid, hi) if busy(mid) <= backward "
                    "else (lo, mid); return hi")
REVEAL_MIN_LINK = ("B = 2(N-1)/N x total bytes / (backward - 2(N-1) x latency x buckets), in GB/s; "
                   "math.inf when the latency terms alone exceed backward; 0 for N = 1")


@crossover.case("the first N whose comm busy exceeds backward, as hfstream.plan.overlap_limit",
                hint="comm busy grows with N, so the answer is where a yes/no question flips: search for it "
                     "without walking every N; return None when even the largest N stays within backward",
                reveal=REVEAL_CROSSOVER, timeout=30.0)
def _(learner):
    """Property: crossover_world_size is the first N <= max_world_size whose comm busy exceeds backward, or None,
    for the planner's four scenarios, a comm busy exactly equal to backward, and drawn links whose crossover is at
    N = 2, exactly at max_world_size, nowhere, or between."""
    from hfstream.plan import overlap_limit, predict_row

    answers = []
    for label, model, over in CROSSOVER_CASES:
        shape, cfg, buckets = _plan_case(model, **over)
        bwd = predict_row(shape, cfg, 2, buckets)["backward_ms"]
        sizes = [b for b, _ in buckets]
        want = overlap_limit(shape, cfg, buckets)
        got = learner.crossover_world_size(bwd, list(sizes), cfg.link_gbs, cfg.latency_us)
        answers.append(f"{label}: {got}")
        if got == want:
            continue
        if want is None:
            raise Wrong(f"{label}: without latency, comm busy only approaches 2 x bytes / bandwidth = "
                        f"{2 * sum(sizes) / (cfg.link_gbs * 1e9) * 1e3:.0f} ms as N grows, below backward "
                        f"({bwd:.0f} ms): no N crosses, return None (you returned {got})", reveal=REVEAL_CROSSOVER)
        if got is None:
            raise Wrong(f"{label}: you returned None, but the latency terms grow without bound in N, in each of "
                        f"the {len(sizes)} buckets: the planner finds N = {want}. Search up to "
                        f"max_world_size, not just while the bandwidth term grows", reveal=REVEAL_CROSSOVER)
        if got == want - 1:
            raise Wrong(f"{label}: you returned {got}, the last N where overlap is still complete; the question is "
                        f"the first N where comm busy > backward ({want})", reveal=REVEAL_CROSSOVER)
        if got > want and got & (got - 1) == 0:
            raise Wrong(f"{label}: you returned {got}, a power of two; the crossover is N = {want}. Comm busy grows "
                        f"monotonically in N, so bisect over every integer", reveal=REVEAL_CROSSOVER)
        raise AssertionError(f"{label}: crossover_world_size returned {got}, the planner says {want}")
    _crossover_at_the_boundary(learner)
    drawn = _draw_crossovers()

    def prop(case):
        bwd, sizes, gbs, lat, top = case
        want = _first_over(bwd, sizes, gbs, lat, top)
        got = learner.crossover_world_size(bwd, list(sizes), gbs, lat, max_world_size=top)
        if got == want:
            return None
        shown = (f"crossover_world_size(backward {bwd:.4g} ms, {len(sizes)} buckets, {gbs:g} GB/s, {lat:g} us, "
                 f"max_world_size={top}) returned {got}")
        if want == 2 and got is not None and got > 2:
            return (f"{shown}: comm busy already exceeds backward at N = 2 here, and your search never tried N = 2 "
                    f"(busy at N = 1 is 0, so the search can start from 1)")
        if want == top and got is None:
            return (f"{shown}: comm busy first exceeds backward at N = max_world_size itself, which your search left "
                    f"out (range(a, b) stops before b)")
        if got == (want or 0) - 1:
            return f"{shown}: that is the last N where overlap is still complete; the question is the first N past it"
        return f"{shown}: search every N from 1 to max_world_size for the first whose comm busy exceeds backward"

    found = falsify(drawn, prop, kind=after_colon)
    if found is not None:
        raise Wrong(str(found), reveal=REVEAL_CROSSOVER)
    return "; ".join(answers) + f"; comm busy equal to backward still hidden; {len(drawn)} drawn"


def _busy_ms(sizes, n, gbs, lat) -> float:
    from hfstream.plan import allreduce_s

    return sum(allreduce_s(x, n, gbs, lat) * 1e3 for x in sizes) if n > 1 else 0.0


def _first_over(bwd, sizes, gbs, lat, top):
    """The first N in 1..top whose comm busy exceeds backward (busy grows with N: bisect), or None."""
    if _busy_ms(sizes, top, gbs, lat) <= bwd:
        return None
    lo, hi = 1, top
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _busy_ms(sizes, mid, gbs, lat) <= bwd else (lo, mid)
    return hi


def _draw_crossovers(seed: int = 93, count: int = 8) -> list[tuple]:
    """``(backward ms, bucket bytes, GB/s, latency us, max_world_size)``, in turn: a crossover at N = 2, one at
    max_world_size exactly, none (no latency, a fast link), and one between."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        sizes = tuple(float(rng.randint(10**6, 10**9)) for _ in range(rng.randint(1, 4)))
        gbs, lat = float(rng.choice((5, 25, 100))), float(rng.choice((1, 5, 20)))
        kind = k % 4
        if kind == 0:                                        # already past at N = 2
            bwd, top = round(0.6 * _busy_ms(sizes, 2, gbs, lat), 3), 2 ** rng.randint(6, 20)
        elif kind == 1:                                      # at max_world_size exactly
            top = rng.randint(5, 3000)
            bwd = (_busy_ms(sizes, top - 1, gbs, lat) + _busy_ms(sizes, top, gbs, lat)) / 2
        elif kind == 2:                                      # never: no latency, busy stays below 2 x bytes / rate
            lat, top = 0.0, 2 ** 30
            bwd = 1.5 * 2 * sum(sizes) / (gbs * 1e9) * 1e3
        else:
            top = 2 ** 20
            bwd = _busy_ms(sizes, rng.randint(3, 5000), gbs, lat) * 0.999
        out.append((bwd, sizes, gbs, lat, top))
    return out


# One 1 GB bucket on a 1 GB/s link without latency: comm busy is 1000 ms at N=2 and 1500 ms at N=4,
# exactly in floating point in any order of the formula's operations (1.5 x 1e9 / 1e9 x 1e3).
BOUNDARY_BUCKETS, BOUNDARY_GBS, BOUNDARY_BACKWARD = [10**9], 1.0, 1500.0


def _crossover_at_the_boundary(learner) -> None:
    """Comm busy exactly equal to backward is still hidden: the crossover is the first N that *exceeds*."""
    for max_n, want in ((8, 5), (4, None)):
        got = learner.crossover_world_size(BOUNDARY_BACKWARD, list(BOUNDARY_BUCKETS), BOUNDARY_GBS, 0.0,
                                           max_world_size=max_n)
        if got == want:
            continue
        raise Wrong(f"one 1 GB bucket on a 1 GB/s link, no latency, backward 1500 ms, max_world_size={max_n}: "
                    f"comm busy is exactly 1500 ms at N=4, which still fits in backward; you returned {got}. "
                    f"The crossover is the first N whose comm busy *exceeds* backward"
                    + (", and None when even max_world_size does not" if want is None else ""),
                    reveal=REVEAL_CROSSOVER)


@crossover.case("the slowest link that keeps comm busy within backward",
                hint="write comm busy at N as a function of the bandwidth and solve comm busy = backward for it; "
                     "the latency terms do not depend on the bandwidth",
                reveal=REVEAL_MIN_LINK)
def _(learner):
    """Property: min_link_gbs is the bandwidth at which comm busy just fits in backward (0 for one device, math.inf
    when the latencies alone fill backward), for llama-8b and for drawn buckets, world sizes and latencies."""
    import dataclasses

    from hfstream.plan import predict_row

    shape, cfg, buckets = _plan_case()
    sizes = [b for b, _ in buckets]
    bwd = predict_row(shape, cfg, 2, buckets)["backward_ms"]
    got1 = learner.min_link_gbs(1, bwd, list(sizes), cfg.latency_us)
    if got1 != 0:
        raise Wrong(f"one device needs no link at all: return 0 for world_size 1 (you returned {got1})",
                    reveal=REVEAL_MIN_LINK)
    details = []
    for n in (8, 64, 512, 4096):        # at 4096 the latency terms alone outlast backward
        got = learner.min_link_gbs(n, bwd, list(sizes), cfg.latency_us)
        lat_ms = 2 * (n - 1) * cfg.latency_us * 1e-3 * len(sizes)
        if lat_ms >= bwd:
            if got == math.inf:
                details.append(f"N={n}: none")
                continue
            what = ("a negative bandwidth: the time left for the bytes is below zero" if isinstance(got, (int, float))
                    and got < 0 else f"{got!r}")
            raise Wrong(f"at N={n} the latency terms alone take {lat_ms:.0f} ms, more than backward ({bwd:.0f} ms), "
                        f"and you returned {what}. No bandwidth is fast enough there: the exercise asks for "
                        f"math.inf in that case", reveal=REVEAL_MIN_LINK)
        if not isinstance(got, (int, float)) or not got > 0:
            raise Wrong(f"min_link_gbs should return a bandwidth > 0 in GB/s, got {got!r} at N={n}",
                        reveal=REVEAL_MIN_LINK)
        if math.isinf(got):
            raise Wrong(f"at N={n} the latency terms take {lat_ms:.0f} ms of backward's {bwd:.0f} ms: a finite "
                        f"bandwidth fits the rest; return math.inf only when the latency alone exceeds backward",
                        reveal=REVEAL_MIN_LINK)
        fast = predict_row(shape, dataclasses.replace(cfg, link_gbs=got * 1.001), n, buckets)
        slow = predict_row(shape, dataclasses.replace(cfg, link_gbs=got * 0.999), n, buckets)
        if fast["overlap_complete"] and not slow["overlap_complete"]:
            details.append(f"N={n}: {got:.1f} GB/s")
            continue
        ring = 2 * (n - 1) / n
        no_lat = ring * sum(sizes) / (bwd / 1e3) / 1e9
        once = ring * sum(sizes) / ((bwd - 2 * (n - 1) * cfg.latency_us * 1e-3) / 1e3) / 1e9
        if math.isclose(got, once, rel_tol=1e-9):
            raise Wrong(f"at N={n} you paid the latency terms once; every bucket is its own all-reduce and pays its "
                        f"2(N-1) latencies, so the {len(sizes)} buckets pay them {len(sizes)} times ({lat_ms:.0f} ms of "
                        f"backward)", reveal=REVEAL_MIN_LINK)
        if math.isclose(got, no_lat, rel_tol=1e-3):
            raise Wrong(f"at N={n} you left out the latency: {len(sizes)} buckets x 2(N-1) steps x "
                        f"{cfg.latency_us:g} us = {lat_ms:.0f} ms of backward are spent waiting, so the bandwidth "
                        f"term must fit in what is left", reveal=REVEAL_MIN_LINK)
        if math.isclose(got, sum(sizes) / ((bwd - lat_ms) / 1e3) / 1e9, rel_tol=1e-3):
            raise Wrong("you left out the ring factor: in a ring all-reduce a device's bytes cross the link more "
                        "than once", reveal=REVEAL_MIN_LINK)
        raise AssertionError(f"at N={n}: with {got:.4g} GB/s the planner says comm busy "
                             f"{fast['comm_busy_ms']:.0f} ms vs backward {bwd:.0f} ms "
                             f"({'fits' if fast['overlap_complete'] else 'does not fit'}); it should just fit")
    # Latency terms exactly equal to backward (2 buckets x 2(N-1) x 500 us = 2 ms at N=2): nothing is left
    # for the bytes, so no bandwidth is fast enough.
    try:
        got = learner.min_link_gbs(2, 2.0, [2**20, 2**20], 500.0)
    except ZeroDivisionError:
        got = "nothing: it divided by zero"
    if got != math.inf:
        raise Wrong(f"at N=2 with 2 buckets and 500 us per ring step the latency terms alone take 2 ms, all of a "
                    f"2 ms backward, and you returned {got if isinstance(got, str) else repr(got)}: no time is left for the bytes, so no bandwidth "
                    f"fits (math.inf)", reveal=REVEAL_MIN_LINK)
    drawn = _draw_links()

    def prop(case):
        n, bwd, sizes, lat = case
        got = learner.min_link_gbs(n, bwd, list(sizes), lat)
        shown = (f"min_link_gbs(N={n}, backward {bwd:g} ms, {len(sizes)} buckets of {sum(sizes) / len(sizes):.3g} bytes "
                 f"on average, {lat:g} us) returned {got!r}")
        lat_ms = 2 * (n - 1) * lat * 1e-3 * len(sizes)
        if lat_ms >= bwd:
            return None if got == math.inf else f"{shown}: the latency terms alone take {lat_ms:.3g} ms: math.inf"
        if not isinstance(got, (int, float)) or not 0 < got < math.inf:
            return f"{shown}: a finite bandwidth > 0 fits here"
        fits = _busy_ms(sizes, n, got * 1.001, lat) <= bwd
        short = _busy_ms(sizes, n, got * 0.999, lat) > bwd
        if fits and short:
            return None
        ring = 2 * (n - 1) / n
        once = ring * sum(sizes) / ((bwd - 2 * (n - 1) * lat * 1e-3) / 1e3) / 1e9
        if math.isclose(got, once, rel_tol=1e-3):
            return (f"{shown}: you paid the latency terms once; every bucket is its own all-reduce and pays its 2(N-1) "
                    f"latencies, so {len(sizes)} buckets pay them {len(sizes)} times")
        if math.isclose(got, ring * sum(sizes) / (bwd / 1e3) / 1e9, rel_tol=1e-3):
            return f"{shown}: you left out the latency: the bandwidth term must fit in what the latencies leave"
        return f"{shown}: with it comm busy is {_busy_ms(sizes, n, got, lat):.4g} ms for a {bwd:g} ms backward"

    found = falsify(drawn, prop, kind=after_colon, smaller=lambda c: ((m, *c[1:]) for m in (2, 3) if m < c[0]))
    if found is not None:
        raise Wrong(str(found), reveal=REVEAL_MIN_LINK)
    return "; ".join(details) + f"; latency equal to backward: none; {len(drawn)} drawn"


def _draw_links(seed: int = 94, count: int = 8) -> list[tuple]:
    """``(N, backward ms, bucket bytes, latency us)``: 1 to 12 buckets (the latency paid once per bucket matters),
    N from 2 to 4096, latencies that leave time for the bytes and, once, latencies that do not."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        sizes = tuple(float(rng.randint(10**5, 10**8)) for _ in range(rng.randint(2, 12)))
        n, lat = rng.choice((2, 3, 7, 64, 1000)), float(rng.choice((1, 5, 20)))
        lat_ms = 2 * (n - 1) * lat * 1e-3 * len(sizes)
        bwd = round(lat_ms * (0.5 if k == count - 1 else rng.uniform(1.5, 20)), 3)
        out.append((n, bwd, sizes, lat))
    return out


# =============================================================================================
# 09.final_challenge: a real run, graded on its measured efficiency
# =============================================================================================

# THRESHOLD lies between what the author measured for the serial and one-bucket runs and for
# overlap with a few buckets and prefetching, on the course's shared 2-core VM (2026-12, load
# average 3 to 5; each row the median of 20 steps, the range over 6 interleaved runs):
#
#   naive: serial, 25 MiB, no prefetch                      0.45 - 0.49
#   serial, prefetch 2                                      0.61 - 0.69
#   overlap at 25 MiB (one bucket), prefetch 2              0.62 - 0.68
#   overlap, one tensor per bucket (16 buckets), prefetch 2 0.64 - 0.66
#   overlap at 1/16 MiB (8 buckets), prefetch 2             0.74 - 0.79
#   overlap at 1/8 MiB (4 buckets), prefetch 2              0.75 - 0.80
#   overlap at 3/16 MiB (3 buckets), prefetch 2             0.71 - 0.79
#   overlap at 1/4 MiB (2 buckets), prefetch 2              0.71 - 0.79
#   overlap at 1/8 MiB (4 buckets), no prefetch             0.52 - 0.57
#
# Under heavier load (load average 8 to 11) every row dropped by up to 0.05, which the second
# measurement (RETRY_BAND) absorbs. The lesson measures its own sweep after the check.
THRESHOLD = 0.72
RETRY_BAND = 0.08      # a result this close below the threshold is measured once more, the steps pooled
LAST_CHALLENGE: dict = {}   # the graded run (breakdown, config, graded efficiency), for the lesson's figure


challenge = Exercise("09.final_challenge", uses=["overlap_step_ms", "final_run_config"],
                     title="plan the lab's buckets, then get a real run close to its ceiling")

REVEAL_SCHEDULE = ("end = 0.0; for nbytes, ready in buckets: end = max(ready * backward_ms, end) + "
                   "ring_allreduce_ms(nbytes, world_size, link_gbs, latency_us); "
                   "return forward_ms + max(backward_ms, end) + optimizer_ms")


def _schedule_cases():
    """(label, buckets, forward, backward, optimizer, N, link GB/s, latency us) and the planner's step."""
    import dataclasses

    from hfstream.plan import ModelShape, PlanConfig, predict_buckets, predict_row

    out = []
    for model, over, n in (("llama-8b", {}, 8), ("llama-8b", {"bucket_mb": 100.0}, 64),
                           ("llama-1b", {"link_gbs": 100.0, "bucket_mb": 4.0}, 16),
                           ("llama-8b", {"link_gbs": 400.0}, 2), ("llama-8b", {}, 1)):
        shape, cfg, buckets = _plan_case(model, **over)
        row = predict_row(shape, cfg, n, buckets)
        out.append((f"{model}, N={n}, {cfg.bucket_mb:g} MiB buckets, {cfg.link_gbs:g} GB/s", buckets, row, n, cfg))
    # The lab's own shape: 16 tensors, cut at a few caps, on a slow link.
    lab_shape = ModelShape("lab MLP", sum(c for _, c in lab_tensors()),
                           tuple((name, c, "dense") for name, c in lab_tensors()))
    cfg = PlanConfig(tokens_per_device=LAB["batch"], link_gbs=0.012, latency_us=1500.0, compute_tflops=0.02,
                     mem_bandwidth_gbs=5.0, world_sizes=(2,))
    for cap in (0.0, 0.125, 0.25):
        c = dataclasses.replace(cfg, bucket_mb=cap)
        buckets = predict_buckets(lab_shape, 4, cap)
        out.append((f"the lab MLP at {cap:g} MiB, N=2", buckets, predict_row(lab_shape, c, 2, buckets), 2, c))
    return out


@challenge.case("your overlapped step matches the planner's schedule",
                hint="replay backward on a clock: a bucket can start once backward has produced its last gradient "
                     "and the link has finished the previous bucket; the optimizer waits for backward and for "
                     "the last reduction", reveal=REVEAL_SCHEDULE)
def _(learner):
    """Property: overlap_step_ms is the planner's overlapped step (each bucket reduced from the later of its ready
    time and the previous bucket's end), for the planner's scenarios and for drawn buckets on links that idle
    between buckets and links that outlast backward. A mistake is named only when it explains every case that
    fails (two mistakes can give the same step on one case)."""
    fixed = [(tuple(buckets), row["forward_ms"], row["backward_ms"], row["optimizer_ms"], n, cfg.link_gbs,
              cfg.latency_us) for _, buckets, row, n, cfg in _schedule_cases()]
    drawn = _draw_schedules()
    failing = []
    for case in fixed + drawn:
        got, want, shown, reasons = _schedule_eval(learner, case)
        if not math.isclose(got, want, rel_tol=1e-6):
            failing.append(reasons)
    if not failing:
        return f"{len(fixed)} schedules, as hfstream.plan.predict_row, and {len(drawn)} drawn"
    why = common_reason(failing)

    def prop(case):
        got, want, shown, reasons = _schedule_eval(learner, case)
        if math.isclose(got, want, rel_tol=1e-6):
            return None
        return f"{shown}: {why if why in reasons else 'replay backward on a clock, bucket by bucket'}"

    found = (falsify(drawn, prop, kind=after_colon,
                     smaller=lambda c: ((c[0][:k] + c[0][-1:], *c[1:]) for k in range(1, len(c[0]) - 1)))
             or falsify(fixed, prop))
    if why is None:
        raise AssertionError(str(found))
    raise Wrong(str(found), reveal=REVEAL_SCHEDULE)


def _schedule_eval(learner, case):
    """(the learner's step, the planner's, the call shown, the known mistakes that give the learner's step)."""
    buckets, f, b, o, n, gbs, lat = case
    shown_case = (f"overlap_step_ms({len(buckets)} buckets ready at "
                  f"{', '.join(f'{r:.0%}' for _, r in buckets[:4])}{', ...' if len(buckets) > 4 else ''} of "
                  f"backward, forward {f:.4g}, backward {b:.4g}, optimizer {o:.4g}, N={n}, {gbs:g} GB/s, {lat:g} us)")
    try:
        got = learner.overlap_step_ms(list(buckets), f, b, o, n, gbs, lat)
    except Exception as e:
        raise Wrong(f"overlap_step_ms raised {type(e).__name__}: {e} ({shown_case}); it takes buckets as a list of "
                    f"(bytes, ready) pairs, ready = the fraction of backward done when the bucket is complete")
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise Wrong(f"overlap_step_ms should return the step in ms, got {got!r} ({shown_case})")
    want = _schedule_ms(buckets, f, b, o, n, gbs, lat)
    times = [_busy_ms([x], n, gbs, lat) for x, _ in buckets]
    reasons = []
    for value, why in (
        (f + b + sum(times) + o, "that is the serial step: with overlap a bucket's reduction starts during backward, "
                                 "as soon as the bucket is complete"),
        (f + max(b, sum(times)) + o, "that is the ceiling, as if every bucket could start when backward starts; a "
                                     "bucket starts only once backward has produced its last gradient (its ready "
                                     "fraction)"),
        (f + max(b, buckets[0][1] * b + sum(times)) + o,
         "you kept the link busy from the first bucket on, without a pause: when a bucket is not ready yet the link "
         "waits for it (idle), so a bucket starts at the later of its ready time and the previous one's end"),
        (f + max(b, max(r * b + t for (_, r), t in zip(buckets, times))) + o,
         "you started every bucket at its ready time, but the link reduces one bucket at a time: a bucket also waits "
         "for the previous one to finish"),
        (f + max(b, buckets[-1][1] * b + times[-1]) + o,
         "you timed the last bucket alone: it also waits for the link to finish the buckets before it"),
        (_schedule_ms([(x, r * (f + b) / b) for x, r in buckets], f, b, o, n, gbs, lat),
         "a bucket's ready fraction is of backward alone: it is ready ready x backward_ms after backward starts; you "
         "counted forward in that time, and forward comes before the whole schedule once more"),
    ):
        if math.isclose(got, value, rel_tol=1e-6) and not math.isclose(value, want, rel_tol=1e-6):
            reasons.append(why)
    return float(got), want, f"{shown_case} returned {float(got):.6g}", reasons


def _schedule_ms(buckets, f, b, o, n, gbs, lat) -> float:
    end = 0.0
    for nbytes, ready in buckets:
        end = max(ready * b, end) + _busy_ms([nbytes], n, gbs, lat)
    return f + max(b, end) + o


def _draw_schedules(seed: int = 95, count: int = 8) -> list[tuple]:
    """``(buckets, forward, backward, optimizer, N, GB/s, latency us)``: 2 to 6 buckets whose ready fractions grow
    from a few % to 100 %, on links fast enough to idle between buckets and slow enough to outlast backward."""
    rng = random.Random(seed)
    out = []
    for k in range(count):
        m = rng.randint(2, 6)
        readies = sorted(round(rng.uniform(0.05, 0.95), 2) for _ in range(m - 1)) + [1.0]
        buckets = tuple((float(rng.randint(10**6, 10**8)), r) for r in readies)
        if k % 3 == 2:          # a small last bucket (a model's first layer): an earlier one may end last alone
            buckets = buckets[:-2] + ((2e8, buckets[-2][1]), (1e5, 1.0))
        f, b, o = float(rng.randint(5, 30)), float(rng.randint(40, 200)), float(rng.randint(1, 20))
        total = sum(x for x, _ in buckets)
        share = (0.2, 0.7, 1.5, 3.0)[k % 4]             # link time for everything, as a share of backward
        gbs = round(2 * total / (share * b / 1e3) / 1e9, 3)
        out.append((buckets, f, b, o, rng.choice((2, 4, 8)), gbs, float(rng.choice((0, 5)))))
    return out


CONFIG_CASE = "the configuration is one the lab can run"
REVEAL_RUN = ("{'grad_sync': 'overlap', 'bucket_mb': min(caps, key=lambda cap: overlap_step_ms(lab_buckets(cap), "
              "...)), 'prefetch_depth': 2}")


@challenge.case(CONFIG_CASE,
                hint="return a dict with grad_sync ('serial' or 'overlap'), bucket_mb (MiB) and prefetch_depth (int)")
def _(learner):
    """Property: final_run_config() names grad_sync, bucket_mb and prefetch_depth with values the lab runs."""
    cfg = learner.final_run_config()
    validate_config(cfg, "final_run_config()")
    return f"{cfg}"


def diagnose_run(run: dict, grad_bytes: int) -> str | None:
    """The hint for a lab run below the threshold: what its breakdown says went wrong, if anything."""
    cfg, eff = run["config"], run["efficiency"]
    head = f"efficiency = ceiling / step = {eff:.2f}, below {THRESHOLD:.2f}: "
    if run["data_wait_ms"] > 0.15 * run["step_ms"]:
        return (head + f"each step waited {run['data_wait_ms']:.0f} ms of its {run['step_ms']:.0f} ms for data. A batch "
                f"takes longer to produce than the step leaves time for unless it is produced *while* the step "
                f"computes: prefetch_depth >= 1 (lesson 03)")
    if cfg["grad_sync"] == "serial":
        return (head + f"grad_sync='serial' reduces every gradient after backward, so the {run['exposed_comm_ms']:.0f} ms "
                f"of communication add to the step. 'overlap' launches each bucket during backward (lesson 05)")
    if run["buckets"] == 1:
        return (head + f"bucket_mb={cfg['bucket_mb']:g} puts all {grad_bytes / 2**20:.2f} MiB of gradients in one bucket, "
                f"which is complete only when backward ends: nothing overlaps. Choose a cap smaller than the model: "
                f"ask your overlap_step_ms which (lesson 06)")
    if run["comm_busy_ms"] > 1.35 * run["link_ms"]:
        return (head + f"{run['buckets']} buckets keep the link busy {run['comm_busy_ms']:.0f} ms where one all-reduce of "
                f"every gradient needs {run['link_ms']:.0f} ms: each bucket pays the latency again (and costs this CPU "
                f"a launch), and past the crossover every extra latency adds to the step. Fewer, larger buckets")
    return None


def _measure(cfg: dict, seed: int = 0) -> dict:
    """`run_lab` on the learner's configuration; a rank that fails becomes an error naming why."""
    from hfstream.testing import RankFailure

    try:
        return run_lab({"yours": cfg}, seed=seed)
    except RankFailure as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not ln.startswith("---")]
        raise AssertionError(f"the lab's ranks failed ({lines[-1] if lines else exc}); run the cell again, and "
                             f"if it persists, restart the kernel") from None


@challenge.case(f"measured on 2 ranks over the slow link: ceiling / step >= {THRESHOLD:.2f}",
                hint="every part of the step the lab times must be as short as it can be: ask your planner which "
                     "cap, and remember what lessons 03 and 05 hid",
                after=["your overlapped step matches the planner's schedule", CONFIG_CASE], timeout=200.0,
                reveal=REVEAL_RUN)
def _(learner):
    """Property: the learner's configuration, run on 2 gloo ranks over the lab's slow link, reaches a median
    ceiling / step of at least THRESHOLD (measured a second time, steps pooled, when it lands just below)."""
    cfg = learner.final_run_config()
    validate_config(cfg, "final_run_config()")
    result = _measure(cfg)
    run = result["runs"]["yours"]
    eff, tries = run["efficiency"], [run["efficiency"]]
    if THRESHOLD - RETRY_BAND <= eff < THRESHOLD:
        # Close to the line on a shared machine: measure once more and pool the steps of both runs.
        again = _measure(cfg, seed=1)
        tries.append(again["runs"]["yours"]["efficiency"])
        eff = statistics.median(run["efficiency_all"] + again["runs"]["yours"]["efficiency_all"])
    LAST_CHALLENGE.clear()
    LAST_CHALLENGE.update({**run, "efficiency": eff, "runs": len(tries)})
    detail = (f"ceiling / step = {eff:.2f} (step {run['step_ms']:.0f} ms, ceiling {run['ceiling_ms']:.0f} ms,"
              f" exposed comm {run['exposed_comm_ms']:.0f} ms, {run['buckets']} bucket{'s' if run['buckets'] > 1 else ''}"
              + (f"; two runs, {' and '.join(f'{t:.2f}' for t in tries)}, steps pooled" if len(tries) > 1 else "")
              + ")")
    if eff >= THRESHOLD:
        return detail
    hint = diagnose_run({**run, "efficiency": eff}, result["grad_bytes"])
    if hint:
        raise Wrong(hint + f" [{detail}]", reveal=REVEAL_RUN)
    raise AssertionError(f"{detail}: below {THRESHOLD:.2f}")
