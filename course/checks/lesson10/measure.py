"""The measurements behind lesson 10's figures, on real gloo processes: the learner's reduce-scatter
against all_reduce, and DDP's best vs overlap vs sharded against the cross-step limit.

The simulated link is `hfstream.testing.link.SimulatedLink` (all-reduce, all-to-all, all-gather).
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hfstream.report.timeline import cross_step_limit
from hfstream.testing.link import SimulatedLink

from .reduce_scatter import learner_reduce_scatter

MiB = 2**20


# =============================================================================================
# The simulated link, and the reduce-scatter measured on it and on the bare loopback
# =============================================================================================
class _PreallocatedReduceScatter:
    """hfstream's gloo reduce-scatter (all-to-all + local sum) into buffers allocated once, as
    `GradSync(mode="sharded")` keeps them; also what the measurement uses while yours is a stub."""

    def __init__(self):
        self.buffers = {}

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        from hfstream.gradsync.sharded import collectives

        n = dist.get_world_size()
        if flat.numel() not in self.buffers:
            self.buffers[flat.numel()] = (torch.empty_like(flat), torch.empty(flat.numel() // n, dtype=flat.dtype))
        received, out = self.buffers[flat.numel()]
        collectives.launch_reduce_scatter(flat, received, None, local_sum=True).wait()
        collectives.sum_received(received, out, n)
        return out.div_(n)


def _time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _rs_measure_rank(rank, world_size, path, real_mib, sim_mib, rate_mbit, reps):
    from course.grading import load_module

    library = _PreallocatedReduceScatter()
    rs = load_module(path).reduce_scatter_mean if path else library
    out = {}
    for label, mib, link in (("loopback", real_mib, None), ("simulated", sim_mib, SimulatedLink(rate_mbit, record=True))):
        flat = torch.randn(int(mib * MiB / 4) // world_size * world_size)
        buf = flat.clone()
        fns = {"all_reduce_ms": lambda: dist.all_reduce(buf.copy_(flat)), "reduce_scatter_ms": lambda: rs(flat),
               "preallocated_ms": lambda: library(flat)}
        with link.installed() if link else contextlib.nullcontext():
            for fn in fns.values():
                fn()                                             # warm-up: connections, buffers
            best = collections.defaultdict(list)
            for _ in range(2):                                   # alternate: a busy moment hits them all
                for key, fn in fns.items():
                    best[key].append(_time(fn, reps))
        out[label] = {key: min(v) for key, v in best.items()} | {"mib": mib}
    link = SimulatedLink(rate_mbit)
    out["predicted"] = {"all_reduce_ms": link.wire_s(2 * (world_size - 1) / world_size * sim_mib * MiB) * 1e3,
                        "reduce_scatter_ms": link.wire_s((world_size - 1) / world_size * sim_mib * MiB) * 1e3}
    return out


def measure_reduce_scatter(namespace: dict, real_mib: float = 16.0, sim_mib: float = 4.0, rate_mbit: float = 1000.0,
                           reps: int = 3) -> dict:
    """The learner's reduce_scatter_mean against dist.all_reduce on 2 gloo ranks: on the bare loopback
    (real, unsimulated) and on a simulated ``rate_mbit`` link (`SimulatedLink`)."""
    from hfstream.testing import run_on_ranks

    path = learner_reduce_scatter(namespace)
    out = run_on_ranks(_rs_measure_rank, 2, path, real_mib, sim_mib, rate_mbit, reps, timeout=120, pg_timeout_s=60)
    res = {k: {m: max(r[k][m] for r in out) for m in out[0][k]} for k in out[0]}
    res["who"] = "your reduce_scatter_mean" if path else "hfstream's reduce-scatter (yours is not written yet)"
    res["rate_mbit"] = rate_mbit
    return res


def rs_figure(m: dict, path) -> Path:
    """Two panels: the simulated link (with what its byte model predicts), and the real loopback."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.8, 3.4))
    left, right = fig.subplots(1, 2)
    sim, real, pred = m["simulated"], m["loopback"], m["predicted"]
    yours = m["who"].startswith("your")
    mine = "reduce-scatter\n(yours)" if yours else "reduce-scatter\n(hfstream's)"
    panels = ((left, sim, ["all_reduce_ms", "reduce_scatter_ms"],
               f"SIMULATED link: {m['rate_mbit']:.0f} Mbit/s, bandwidth only\n{sim['mib']:g} MiB, 2 gloo ranks; "
               f"black ticks: bytes / bandwidth"),
              (right, real, ["all_reduce_ms", "reduce_scatter_ms"] + (["preallocated_ms"] if yours else []),
               f"REAL loopback, not shaped, not simulated\n{real['mib']:g} MiB, 2 gloo ranks on this machine"))
    labels = {"all_reduce_ms": "all_reduce", "reduce_scatter_ms": mine,
              "preallocated_ms": "hfstream's\n(buffers reused)"}
    colors = {"all_reduce_ms": "#c44e52", "reduce_scatter_ms": "#4c72b0", "preallocated_ms": "#8172b2"}
    for ax, data, keys, title in panels:
        vals = [data[k] for k in keys]
        bars = ax.bar([labels[k] for k in keys], vals, color=[colors[k] for k in keys])
        ax.bar_label(bars, fmt="%.1f ms", fontsize=8)
        ax.set_title(title, fontsize=8)
        ax.set_ylabel("ms (median)")
        ax.tick_params(axis="x", labelsize=7)
        ax.set_ylim(0, max(vals) * 1.25)
    left.scatter([0, 1], [pred["all_reduce_ms"], pred["reduce_scatter_ms"]], marker="_", s=700, color="black",
                 zorder=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


# =============================================================================================
# The last figure: DDP's best vs overlap vs sharded vs the cross-step limit, measured
# =============================================================================================
def _block_names(model) -> dict[int, str]:
    """Modules to time in the forward: embeddings, each block, the final norm (GPT-2)."""
    out = {}
    for name, m in model.named_modules():
        if name in ("transformer.wte", "transformer.ln_f") or (name.startswith("transformer.h.") and name.count(".") == 2):
            out[id(m)] = name.replace("transformer.", "")
    return out


def _compute_step(model, ids, opt) -> tuple[float, float, float]:
    """One step with no communication at all: (forward, backward, clip + AdamW) in seconds."""
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def _agree_max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _modes_rank(rank, world_size, steps, rounds, comm_ratios, bucket_mb, layers, width, seed):
    """One rank of `measure_modes`. Every round: a block of compute-only steps, the link sized from
    it (every ``comm_ratio``), then one block of consecutive steps per (mode, link), in an order
    shuffled every round (the same on every rank), so that a busy moment of the machine does not
    always hit the same mode."""
    import random

    import transformers

    from course.lib import tiny_gpt2
    from hfstream.gradsync import GradSync

    transformers.logging.set_verbosity_error()
    ids = torch.randint(0, 257, (4, 64), generator=torch.Generator().manual_seed(100 + rank))

    def build():
        model = tiny_gpt2(layers=layers, width=width)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)

    model, opt = build()
    for _ in range(2):
        _compute_step(model, ids, opt)            # warm-up: the first steps allocate
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    wire_bits = 2 * (world_size - 1) / world_size * grad_bytes * 8
    runs = {"compute": (model, opt, None)}
    for mode in ("overlap", "sharded"):
        model, opt = build()
        sync = GradSync(model, mode=mode, bucket_mb=bucket_mb)
        if mode == "sharded":
            opt = sync.shard_optimizer(opt)
        runs[mode] = (model, opt, sync)
    link = SimulatedLink(1000.0, record=True)
    order = random.Random(seed)
    timeline = None
    parts = collections.defaultdict(list)          # per compute step: forward, backward, optimizer (ms)
    comm = collections.defaultdict(list)           # per round and link: the whole all-reduce's time (ms)
    blocks = collections.defaultdict(list)         # per round, mode and link: that block's steps (ms)
    with link.installed():
        for round_ in range(rounds):
            model, opt, _ = runs["compute"]
            dist.barrier()
            fb = []
            for _ in range(steps):
                f, b, o = _compute_step(model, ids, opt)
                fb.append(f + b)
                for k, v in zip(("forward", "backward", "optimizer"), (f, b, o)):
                    parts[k].append(v * 1e3)
            # This round's link: one all-reduce of every gradient takes comm_ratio x (forward +
            # backward) of the compute just measured (the slowest rank's), however loaded the machine.
            fwd_bwd = _agree_max(statistics.median(fb))
            rates = {ratio: wire_bits / (ratio * fwd_bwd) / 1e6 for ratio in comm_ratios}
            for ratio in comm_ratios:
                comm[ratio].append(ratio * fwd_bwd * 1e3)
            todo = [(mode, ratio) for ratio in comm_ratios for mode in ("overlap", "sharded")]
            for mode, ratio in order.sample(todo, len(todo)):
                model, opt, sync = runs[mode]
                sync.wait_for_params()
                dist.barrier()
                link.rate_mbit = rates[ratio]
                record = mode == "sharded" and round_ == rounds - 1 and ratio == comm_ratios[0]
                starts, marks, hooks = [], [], []
                if record:
                    names = _block_names(model)
                    for m in model.modules():
                        if id(m) in names:
                            hooks.append(m.register_forward_pre_hook(
                                lambda mod, args, name=names[id(m)]: marks.append((name, time.perf_counter()))))
                for i in range(steps + 2):
                    starts.append(time.perf_counter())
                    if record and i == steps:
                        link.events.clear()
                        marks.clear()
                    loss = model(input_ids=ids, labels=ids).loss
                    if record and i == steps:
                        marks.append(("backward", time.perf_counter()))
                    if record and i == steps + 1:
                        marks.append(("next forward end", time.perf_counter()))
                    loss.backward()
                    sync.finish()
                    sync.clip_grad_norm_(1.0)           # the global norm in "sharded", clip_grad_norm_ otherwise
                    if record and i == steps:
                        marks.append(("optimizer", time.perf_counter()))
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if record and i == steps:
                        marks.append(("step end", time.perf_counter()))
                if record:
                    # The step recorded, up to the end of the next step's forward that waits for its gathers.
                    t0 = starts[steps]
                    timeline = {"marks": [(n, t - t0) for n, t in marks],
                                "transfers": [{**e, "launch": e["launch"] - t0, "start": e["start"] - t0,
                                               "done": e["done"] - t0} for e in link.events],
                                "next_step": starts[steps + 1] - t0}
                    for h in hooks:
                        h.remove()
                # The steps of a block from one start to the next (the first is a warm-up after the
                # modes' turn; the last start only closes the step before it).
                blocks[f"{mode}@{ratio:g}"].append([(b - a) * 1e3 for a, b in zip(starts[1:-1], starts[2:])])
                link.events.clear()
        for _, _, sync in runs.values():
            if sync is not None:
                sync.close()
    return {"parts": dict(parts), "comm_ms": {f"{r:g}": v for r, v in comm.items()}, "grad_mib": grad_bytes / MiB,
            "blocks": dict(blocks), "timeline": timeline, "buckets": len(runs["sharded"][2].buckets)}


def measure_modes(steps: int = 3, rounds: int = 3, comm_ratios: tuple[float, ...] = (1.0, 2.0),
                  bucket_mb: float = 0.25, layers: int = 4, width: int = 128, seed: int = 0) -> dict:
    """A tiny GPT-2 on 2 gloo ranks: GradSync ``"overlap"`` and ``"sharded"`` measured on simulated links
    (`SimulatedLink`) on which one all-reduce of every gradient takes ``comm_ratio`` x (forward +
    backward), in ``rounds`` rounds of interleaved blocks (see `_modes_rank`). DDP's ceiling and the
    cross-step limit are computed from forward, backward and optimizer measured without
    communication in the same rounds, and from the link's all-reduce time.

    Returns:
        ``links``: per comm_ratio, the medians over rounds of overlap and sharded (each round's
        value the median of its block, the slowest rank per step), their per-round values, the
        ceiling and the limit; and the compute parts, the gradient size, the buckets, one sharded
        step's timeline (on the first link), ``rounds``, ``world_size``.
    """
    from hfstream.testing import run_on_ranks

    out = run_on_ranks(_modes_rank, 2, steps, rounds, tuple(comm_ratios), bucket_mb, layers, width, seed,
                       timeout=240, pg_timeout_s=90)
    n = len(out)
    f, b, o = (max(statistics.median(r["parts"][k]) for r in out) for k in ("forward", "backward", "optimizer"))

    def per_round(key):
        # each step: the slowest rank; each block: the median step; one value per round
        return [statistics.median(max(x) for x in zip(*steps_)) for steps_ in zip(*(r["blocks"][key] for r in out))]

    links = []
    for ratio in comm_ratios:
        c = statistics.median(out[0]["comm_ms"][f"{ratio:g}"])
        over, shard = per_round(f"overlap@{ratio:g}"), per_round(f"sharded@{ratio:g}")
        links.append({"comm_ratio": ratio, "comm_ms": c,
                      "rate_mbit": 2 * (n - 1) / n * out[0]["grad_mib"] * MiB * 8 / (c / 1e3) / 1e6,
                      "overlap_ms": statistics.median(over), "sharded_ms": statistics.median(shard),
                      "overlap_rounds": over, "sharded_rounds": shard,
                      "sharded_wins": sum(s < v for s, v in zip(shard, over)),
                      "ddp_ceiling_ms": f + max(b, c) + o, "limit_ms": cross_step_limit(f, b, o / n, c)})
    first = links[0]
    return {"links": links, "forward_ms": f, "backward_ms": b, "optimizer_ms": o, "world_size": n,
            "rounds": rounds, "steps": steps, "grad_mib": out[0]["grad_mib"], "buckets": out[0]["buckets"],
            "timeline": out[0]["timeline"],
            **{k: first[k] for k in ("comm_ms", "rate_mbit", "overlap_ms", "sharded_ms", "ddp_ceiling_ms",
                                     "limit_ms")}}


def _spread(values: list[float]) -> str:
    return f"{min(values):.0f}-{max(values):.0f} ms over {len(values)} rounds"


def modes_sentences(m: dict) -> list[str]:
    """What this measurement says, one sentence per link, computed from its numbers (never a claim
    the numbers do not carry)."""
    out = []
    for ln in m["links"]:
        over, shard, rounds = ln["overlap_ms"], ln["sharded_ms"], len(ln["sharded_rounds"])
        head = f"link at {ln['comm_ratio']:g} x (forward + backward), {ln['rate_mbit']:.0f} Mbit/s: "
        gain = over - shard
        if ln["sharded_wins"] == rounds:
            verdict = f"sharded beat overlap in every round, by {gain:.0f} ms at the median ({gain / over:.0%})"
        elif ln["sharded_wins"] == 0:
            verdict = f"sharded did not beat overlap in any round ({-gain:.0f} ms slower at the median)"
        else:
            verdict = (f"sharded beat overlap in {ln['sharded_wins']} of {rounds} rounds "
                       f"(medians {shard:.0f} vs {over:.0f} ms): not a result this machine reproduces")
        best = ln["ddp_ceiling_ms"]
        vs_ddp = (f"{best - shard:.0f} ms below DDP's best ({best:.0f} ms), which no all-reduce schedule can beat"
                  if shard < best else f"not below DDP's best ({best:.0f} ms)")
        over_limit = shard - ln["limit_ms"]
        tol = 0.05 * ln["limit_ms"]
        if over_limit > tol:
            lim = f"{over_limit:.0f} ms above its own limit ({ln['limit_ms']:.0f} ms)"
        elif over_limit >= -tol:
            lim = f"at its own limit ({ln['limit_ms']:.0f} ms, within 5 %)"
        else:
            lim = (f"below the limit computed for it ({ln['limit_ms']:.0f} ms), which nothing can beat: the "
                   f"limit's parts, measured without communication, came out slower than the same work did "
                   f"inside the sharded steps (a busy machine), so read it as at the limit")
        out.append(head + verdict + f"; sharded {shard:.0f} ms ({_spread(ln['sharded_rounds'])}), overlap "
                   f"{over:.0f} ms ({_spread(ln['overlap_rounds'])}); sharded is {vs_ddp}, and {lim}.")
    wins = [ln["sharded_wins"] == len(ln["sharded_rounds"]) for ln in m["links"]]
    if len(wins) > 1 and wins[-1] and not all(wins):
        out.append(f"On this machine sharded's advantage held in every round only on the slower link "
                   f"({m['links'][-1]['comm_ratio']:g} x): on the faster one the transfers that should hide under "
                   f"the forward share its two cores with it (gloo's threads).")
    elif not any(wins):
        out.append("On this machine sharded's advantage did not hold in every round on either link: the formula's "
                   "promise is not what this run measured (run the cell again on an idle machine to see whether "
                   "it is the load).")
    return out


def modes_figure(m: dict, path) -> Path:
    """Per link: DDP's ceiling and the cross-step limit (computed, hatched), overlap and sharded
    (measured: the median over rounds, the whisker their range)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.6, 3.8))
    ax = fig.subplots()
    style = {"computed": dict(color="#c9d6ea", edgecolor="#4c72b0", hatch="//"), "measured": dict(color="#4c72b0")}
    names = ["DDP's best\nfwd + max(bwd, comm) + opt", "overlap", "sharded", "cross-step limit\nmax(fwd + bwd + opt/N, comm)"]
    width, top = 0.8 / len(names), 0.0
    for g, ln in enumerate(m["links"]):
        values = [("computed", ln["ddp_ceiling_ms"], None), ("measured", ln["overlap_ms"], ln["overlap_rounds"]),
                  ("measured", ln["sharded_ms"], ln["sharded_rounds"]), ("computed", ln["limit_ms"], None)]
        for k, (kind, v, spread) in enumerate(values):
            x = g + (k - 1.5) * width
            err = None if spread is None else [[v - min(spread)], [max(spread) - v]]
            ax.bar([x], [v], width * 0.92, yerr=err, capsize=3, label=kind if g == 0 and k < 2 else None,
                         **style[kind])
            ax.text(x, v if spread is None else max(spread), f"{v:.0f}", ha="center", va="bottom", fontsize=7)
            top = max(top, v if spread is None else max(spread))
    ticks = [g + (k - 1.5) * width for g in range(len(m["links"])) for k in range(len(names))]
    ax.set_xticks(ticks, names * len(m["links"]), fontsize=5.5)
    for g, ln in enumerate(m["links"]):
        ax.text(g, top * 1.22, f"SIMULATED {ln['rate_mbit']:.0f} Mbit/s: all-reduce = {ln['comm_ms']:.0f} ms "
                f"= {ln['comm_ratio']:g} x (fwd + bwd)", ha="center", fontsize=7)
    ax.set_ylim(0, top * 1.32)
    ax.set_ylabel("ms per step (2 ranks)")
    ax.set_title(f"tiny GPT-2, 2 gloo ranks: medians of {m['rounds']} interleaved rounds (whiskers: their range)",
                 fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


def timeline_sentences(m: dict) -> list[str]:
    """Where the all-gathers of the recorded sharded step sat, from the timeline itself."""
    tl = m["timeline"]
    at = dict(tl["marks"])
    end = at["next forward end"]              # the figure's window: this step and the next forward
    mine = [e for e in tl["transfers"] if e["launch"] <= end]
    gathers = [e for e in mine if e["kind"] == "all_gather" and e["bytes"] >= 64]
    scatters = [e for e in mine if e["kind"] == "all_to_all"]
    if not gathers:
        return ["no all-gather was recorded in this step"]
    before_bwd_end = sum(e["launch"] < at["optimizer"] for e in scatters)
    in_step = sum(e["launch"] < at["step end"] for e in gathers)
    in_flight = sum(e["done"] > tl["next_step"] for e in gathers)
    return [f"{before_bwd_end} of {len(scatters)} reduce-scatters were launched during backward (the last ones by "
            f"finish()), before the clip;",
            f"{in_step} of {len(gathers)} all-gathers were launched during clip + step (each as soon as its bucket's "
            f"slice was stepped), the others after it;",
            f"{in_flight} of them were still on the link when the next forward began; the last arrived "
            f"{(max(e['done'] for e in gathers) - tl['next_step']) * 1e3:.0f} ms into that forward, which took "
            f"{(at['next forward end'] - tl['next_step']) * 1e3:.0f} ms."]


def timeline_figure(m: dict, path) -> Path:
    """One sharded step on rank 0: compute phases and module starts above, transfers on the link below."""
    from matplotlib.figure import Figure

    tl = m["timeline"]
    fig = Figure(figsize=(8.8, 3.4))
    ax = fig.subplots()
    marks = tl["marks"]
    at = {n: t for n, t in marks if n in ("backward", "optimizer", "step end", "next forward end")}
    nxt = tl["next_step"]
    phases = [("forward", 0.0, at["backward"]), ("backward", at["backward"], at["optimizer"]),
              ("clip+step", at["optimizer"], at["step end"]), ("next forward", nxt, at["next forward end"])]
    colors = {"forward": "#55a868", "backward": "#4c72b0", "clip+step": "#8172b2", "next forward": "#8fd19e"}
    for name, a, b in phases:
        ax.barh(2, (b - a) * 1e3, left=a * 1e3, color=colors[name], height=0.6)
        ax.text((a + b) / 2 * 1e3, 2, name, ha="center", va="center", fontsize=7)
    for n, t in marks:
        if n not in at and (t <= at["backward"] or nxt <= t <= at["next forward end"]):
            ax.plot([t * 1e3, t * 1e3], [1.65, 2.35], color="black", linewidth=0.6)
    end = at["next forward end"]
    kinds = {"all_to_all": (1, "#dd8452", "reduce-scatter"), "all_gather": (0, "#c44e52", "all-gather"),
             "all_reduce": (1, "#999999", "all-reduce (norm)")}
    shown = set()
    for e in tl["transfers"]:
        row, color, label = kinds.get(e["kind"], (1, "#999999", e["kind"]))
        if e["bytes"] < 64 or e["launch"] > end:   # the clip's one-scalar all-reduce; the next backward's
            continue
        ax.barh(row, max((e["done"] - e["start"]) * 1e3, 0.2), left=e["start"] * 1e3, color=color, height=0.5,
                edgecolor="white", linewidth=0.5, label=None if label in shown else label)
        shown.add(label)
    ax.set_yticks([0, 1, 2], ["all-gathers\n(link)", "reduce-scatters\n(link)", "compute\n(rank 0)"], fontsize=7)
    ax.set_xlabel("ms from the start of the step (ticks on the forward: a block starts)")
    ax.set_title("one sharded step on rank 0, SIMULATED link: where the reduce-scatters and all-gathers travel",
                 fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)

