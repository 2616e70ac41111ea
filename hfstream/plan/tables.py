"""The text table of a `plan` document: one line per world size, then where overlap stops being complete.

What ``hfstream plan`` prints; the figure of the same document is `hfstream.cli.plot.plot_plan`.
"""

from __future__ import annotations

from ..report.table import row, wrap
from .shapes import _count_str

WIDTH = 100   # the default table and its notes fit a terminal this wide (--wide: every column)


def _links(inp: dict) -> str:
    g = inp.get("devices_per_node")
    if not g or g == 1:
        return f"link {inp['link_gbs']:g} GB/s per device, {inp['latency_us']:g} us per ring step"
    intra = inp.get("intra_node_gbs") or inp["link_gbs"]
    return (f"{g} devices per node at {intra:g} GB/s, {inp['link_gbs']:g} GB/s per device across nodes, "
            f"{inp['latency_us']:g} us per ring step")


def _ms(v: float) -> str:
    return f"{v:.3g}" if v < 10 else f"{v:.1f}" if v < 1e4 else f"{v:.3g}"


def _ranges(sizes: list[int], doc: dict) -> str:
    """``[2, 4, 8, 64]`` of rows ``1, 2, 4, 8, 16, 32, 64`` -> ``"2-8, 64"`` (runs of consecutive rows)."""
    order = [r["world_size"] for r in doc["rows"]]
    runs, run = [], []
    for n in order:
        if n in sizes:
            run.append(n)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return ", ".join(f"{r[0]:,}" if len(r) == 1 else f"{r[0]:,}-{r[-1]:,}" for r in runs)


def _fastest(row: dict) -> str:
    """The quickest grad_sync at this world size; "equal" where none is 0.5 % ahead of the others (one device)."""
    steps = {"serial": row["step_serial_ms"], "overlap": row["step_overlap_ms"], "sharded": row["step_sharded_ms"]}
    best = min(steps, key=steps.get)
    others = [v for k, v in steps.items() if k != best]
    return best if min(others) > 1.005 * steps[best] else "equal"


WIDE_COLUMNS = (("N", 5), ("2(N-1)/N", 9), ("fwd", 8), ("bwd", 8), ("opt", 7), ("comm busy", 10), ("last bkt", 9),
                ("exp serial", 11), ("exp overlap", 12), ("step serial", 12), ("step overlap", 13), ("ceiling", 9),
                ("eff ser", 8), ("eff ovl", 8), ("exp RS+AG", 10), ("step shard", 11), ("limit", 8))
COLUMNS = (("N", 6), ("forward", 9), ("backward", 9), ("optimizer", 10), ("comm busy", 10), ("exposed", 9),
           ("serial", 9), ("overlap", 9), ("sharded", 9), ("ceiling", 9), ("fastest", 9))


def _wide_rows(doc: dict) -> list[str]:
    """Every column: ring factor, last bucket, both exposures, both efficiencies, the sharded parts."""
    widths = [w for _, w in WIDE_COLUMNS]
    lines = [row([name for name, _ in WIDE_COLUMNS], widths)]
    for r in doc["rows"]:
        lines.append(
            row([r["world_size"], f"{r['ring_factor']:.3f}", _ms(r["forward_ms"]), _ms(r["backward_ms"]),
                 _ms(r["optimizer_ms"]), _ms(r["comm_busy_ms"]), _ms(r["last_bucket_ms"]), _ms(r["exposed_serial_ms"]),
                 _ms(r["exposed_overlap_ms"]), _ms(r["step_serial_ms"]), _ms(r["step_overlap_ms"]), _ms(r["ideal_ms"]),
                 f"{r['efficiency_serial']:.2f}", f"{r['efficiency_overlap']:.2f}",
                 _ms(r["reduce_scatter_exposed_ms"] + r["all_gather_exposed_ms"]), _ms(r["step_sharded_ms"]),
                 _ms(r["cross_step_limit_ms"])], widths)
            + ("" if r["overlap_complete"] else "  comm > bwd") + ("  sharded wins" if r["sharded_beats_overlap"] else ""))
    return lines


def _rows(doc: dict) -> list[str]:
    """The columns a reader needs, under plain headers, in `WIDTH` columns."""
    widths = [w for _, w in COLUMNS]
    lines = [row([name for name, _ in COLUMNS], widths)]
    for r in doc["rows"]:
        lines.append(row([f"{r['world_size']:,}", _ms(r["forward_ms"]), _ms(r["backward_ms"]), _ms(r["optimizer_ms"]),
                          _ms(r["comm_busy_ms"]), _ms(r["exposed_overlap_ms"]), _ms(r["step_serial_ms"]),
                          _ms(r["step_overlap_ms"]), _ms(r["step_sharded_ms"]), _ms(r["ideal_ms"]), _fastest(r)],
                         widths))
    return lines


def format_plan_table(doc: dict, wide: bool = False) -> str:
    """The human-readable table of a `plan` document: 100 columns, or every column with ``wide``."""
    inp, m, b = doc["inputs"], doc["model"], doc["buckets"]
    compute = (f"{doc['compute_tflops']:.4g} TFLOP/s achieved" if inp["compute_tflops"] is not None
               else f"{inp['peak_tflops']:g} TFLOP/s peak x {inp['mfu']:g} MFU")
    head = [
        f"hfstream plan | {m['name']}: {_count_str(m['params'])} params, {doc['grad_bytes_total'] / 2**30:.3g} GiB of "
        f"{inp['grad_bytes']}-byte gradients in {b['count']} bucket(s) (cap {inp['bucket_mb']} MiB"
        + (f", first {inp['first_bucket_mb']:g}" if inp["first_bucket_mb"] else "") + ")",
        f"{inp['tokens_per_device']:,} tokens per device per step; {doc['step_flops']:.3g} FLOP per device per step "
        f"at {compute} | {_links(inp)} | "
        f"optimizer {inp['optimizer_bytes_per_param']:g} B/param at {inp['mem_bandwidth_gbs']:.4g} GB/s",
    ]
    if wide:
        head.append("ms per step; exposed = communication the step waits for; eff = ceiling / step; sharded: "
                    "reduce-scatter in backward, optimizer / N, all-gather behind the next forward; "
                    "limit = max(fwd + bwd + opt / N, comm)")
    else:
        head.append("ms per step; serial, overlap, sharded = the step under that grad_sync; exposed = the "
                    "communication the overlap step waits for; ceiling = forward + max(backward, comm busy) + "
                    "optimizer; fastest = the quickest of the three (--wide: every column)")
    tail = []
    limit = doc["overlap_incomplete_from"]
    if limit is None:
        tail.append("comm busy stays below backward at every world size: overlap can hide it all but the last bucket")
    else:
        upto = f"overlap complete up to N = {limit - 1:,}" if limit > 2 else "already with two devices"
        tail.append(f"comm busy exceeds backward from N = {limit:,} ({upto}); from there on the ceiling is set "
                    f"by the link, not by compute")
    tail.append("the last bucket's reduction starts when backward ends, so even with overlap it is always exposed")
    wins = doc.get("sharded_beats_overlap_at") or []
    if wins:
        gain = max(r["step_overlap_ms"] - r["step_sharded_ms"] for r in doc["rows"] if r["sharded_beats_overlap"])
        tail.append(f"grad_sync='sharded' beats overlap at N = {_ranges(wins, doc)} (by up to {_ms(gain)} ms per step): "
                    f"the optimizer runs on 1/N of the parameters and the all-gathers hide behind the step and the next forward")
    else:
        tail.append("grad_sync='sharded' beats overlap at none of these world sizes")

    return "\n".join(wrap(head, WIDTH) + [""] + (_wide_rows(doc) if wide else _rows(doc)) + wrap(tail, WIDTH))
