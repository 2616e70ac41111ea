"""Pictures of a run: the step breakdown against the ceiling, and the loss curve.

Each figure is drawn on its own ``matplotlib.figure.Figure`` (no pyplot, no display needed), so
drawing one never switches a notebook's backend; every function saves a PNG and returns its path.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Sequence

from hfstream.report.fields import BY_KEY

# The step's parts, labelled as the report prints them (hfstream/report/fields.py).
PARTS = tuple((key, BY_KEY[key].label, color) for key, color in (
    ("data_wait_ms", "#c9c9c9"), ("forward_ms", "#4c72b0"), ("backward_ms", "#55a868"),
    ("exposed_comm_ms", "#c44e52"), ("optimizer_ms", "#8172b2")))


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not math.isnan(v)


def _subplots(figsize: tuple[float, float]):
    from .extras import require

    fig = require("matplotlib.figure", "plots").Figure(figsize=figsize)
    return fig, fig.subplots()


def plot_breakdown(report: dict[str, Any], path: str | os.PathLike, title: str = "step breakdown vs ceiling") -> Path:
    """Stacked bar per rank (and their mean) of where a step's time goes, with the ceiling marked."""
    per_rank = report.get("per_rank") or []
    bars = [("mean", report.get("mean", report))] + [(f"rank {i}", r) for i, r in enumerate(per_rank) if r]
    if len(bars) == 2:
        bars = bars[:1]   # one rank: its mean is the rank
    fig, ax = _subplots((max(5.0, 3.2 + 1.1 * len(bars)), 4.2))
    for x, (_, row) in enumerate(bars):
        bottom = 0.0
        for key, label, color in PARTS:
            v = row.get(key, 0.0)
            v = 0.0 if v is None or math.isnan(v) else v
            ax.bar(x, v, bottom=bottom, color=color, label=label if x == 0 else None, width=0.6)
            bottom += v
        # The mode's ceiling: the cross-step limit under grad_sync="sharded", the ideal step otherwise.
        key = "cross_step_limit_ms" if _number(row.get("cross_step_limit_ms")) else "ideal_ms"
        ceiling = row.get(key)
        if _number(ceiling):
            ax.hlines(ceiling, x - 0.4, x + 0.4, colors="black", linestyles="--",
                      label=f"ceiling ({BY_KEY[key].label})" if x == 0 else None)
    ax.set_xticks(range(len(bars)), [name for name, _ in bars])
    ax.set_ylabel("ms per optimizer step")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return _save(fig, path)


def plot_loss(log_history: Sequence[dict[str, Any]], path: str | os.PathLike, title: str = "training loss") -> Path:
    """Training (and, where logged, evaluation) loss against the optimizer step.

    A run shorter than ``logging_steps`` logs no per-step loss, only the mean over the run
    (``train_loss``) when ``train()`` ends: that mean is drawn as one point at the last step, and
    the figure says why there is no curve. With nothing at all to draw it says that instead.
    """
    train = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    evals = [(h["step"], h["eval_loss"]) for h in log_history if "eval_loss" in h and "step" in h]
    summary = next((h for h in reversed(log_history) if "train_loss" in h), None)
    fig, ax = _subplots((5.5, 3.6))
    note = None
    if train:
        ax.plot(*zip(*train), "o-" if len(train) < 3 else "-", label="train", color="#4c72b0")
    elif summary is not None:
        step = summary.get("step", 0)
        ax.plot([step], [summary["train_loss"]], "o", label="train (mean over the run)", color="#4c72b0")
        ax.set_xlim(0, max(step, 1) * 1.1)
        note = (f"no per-step loss was logged: the run's {step} step(s) ended before the first\n"
                f"logging step; set logging_steps <= {max(step, 1)} for a curve")
    else:
        note = "no loss in the log history: nothing was trained or logged"
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval", color="#c44e52")
    if note:
        ax.text(0.5, 0.06, note, transform=ax.transAxes, ha="center", va="bottom", fontsize=8, color="#555555")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    if train or evals or summary is not None:
        ax.legend()
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path, dpi: int = 110) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


LANE_COLORS = {"data wait": "#c9c9c9", "forward": "#4c72b0", "backward": "#55a868", "exposed comm": "#c44e52",
               "optimizer": "#8172b2"}
LANES = ("data", "compute", "comm")


def plot_timeline(spans: Sequence[Sequence[Any]], path: str | os.PathLike,
                  title: str = "timeline: data, compute and communication per rank") -> Path:
    """One lane per stream per rank (data, compute, comm) over a few steps.

    ``spans`` are ``(rank, lane, name, start, end)`` in seconds (`StepTimeline` spans, or the
    ``spans`` of a `StreamReport`). Each rank's clock is shown from its own first span, so
    ranks on different machines line up by step, not by wall clock.
    """
    ranks = sorted({int(s[0]) for s in spans})
    fig, ax = _subplots((9, 0.9 + 0.75 * max(1, len(ranks)) * len(LANES)))
    origin = {r: min(s[3] for s in spans if int(s[0]) == r) for r in ranks}
    labels, ticks, seen = [], [], set()
    for i, rank in enumerate(ranks):
        for j, lane in enumerate(LANES):
            y = (len(ranks) - 1 - i) * (len(LANES) + 0.6) + (len(LANES) - 1 - j)
            ticks.append(y)
            labels.append(f"rank {rank} {lane}")
            for r, ln, name, t0, t1 in spans:
                if int(r) != rank or ln != lane:
                    continue
                color = LANE_COLORS.get(name, "#dd8452" if lane == "comm" else "#999999")
                key = name if lane != "comm" else "reduction (bucket)"
                ax.barh(y, (t1 - t0) * 1e3, left=(t0 - origin[rank]) * 1e3, height=0.7, color=color,
                        edgecolor="white", linewidth=0.5, label=key if key not in seen else None)
                seen.add(key)
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel("ms since the first step shown")
    ax.set_title(title, fontsize=10)
    if seen:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return _save(fig, path)


def plot_plan(doc: dict[str, Any], path: str | os.PathLike, title: str | None = None) -> Path:
    """Step time serial, overlapped and sharded, the ceiling and the cross-step limit, against world size (log x).

    ``doc`` is a `hfstream.plan.plan` document.
    """
    rows = doc["rows"]
    n = [r["world_size"] for r in rows]
    fig, ax = _subplots((6.4, 4.0))
    ax.plot(n, [r["step_serial_ms"] for r in rows], "o-", color="#c44e52", label="step, serial (no overlap)")
    ax.plot(n, [r["step_overlap_ms"] for r in rows], "s-", color="#4c72b0", label="step, overlap")
    ax.plot(n, [r["ideal_ms"] for r in rows], "k--", label="ceiling: fwd + max(bwd, comm) + opt")
    if rows and "step_sharded_ms" in rows[0]:
        ax.plot(n, [r["step_sharded_ms"] for r in rows], "^-", color="#8172b2", label="step, sharded")
        ax.plot(n, [r["cross_step_limit_ms"] for r in rows], "-.", color="#8172b2",
                label="cross-step limit: max(fwd + bwd + opt/N, comm)")
    ax.plot(n, [r["forward_ms"] + r["backward_ms"] + r["optimizer_ms"] for r in rows], ":", color="#55a868",
            label="compute only")
    limit = doc["overlap_incomplete_from"]
    if limit is not None and min(n) <= limit <= max(n):
        ax.axvline(limit, color="grey", lw=0.8)
        ax.text(limit, ax.get_ylim()[1], f" comm > bwd from N={limit}", fontsize=8, va="top", color="grey")
    ax.set_xscale("log", base=2)
    if len(n) <= 16:
        ax.set_xticks(n, [str(x) for x in n])
        ax.minorticks_off()
    ax.set_xlabel("world size N (devices)")
    ax.set_ylabel("ms per optimizer step")
    ax.set_ylim(bottom=0)
    ax.set_title(title or f"hfstream plan: {doc['model']['name']}, {doc['inputs']['tokens_per_device']:,} "
                          f"tokens/device, {doc['inputs']['link_gbs']:g} GB/s", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path, dpi=120)
