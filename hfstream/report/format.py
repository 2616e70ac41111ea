"""The step report as text: an aligned table, one row per field of `fields.FIELDS`.

The rows are labelled with the fields' labels (the key without its unit), so the table, the JSON
and the logged ``stream/<key>`` scalars share one vocabulary (docs/design.md section 4). Under
the table: the ceiling's formula, the run's notes, and the report's ``advice`` when it has any.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any

from .fields import FIELDS, SHARDED_ONLY
from .table import row

LABEL_WIDTH = max(len(f.label) for f in FIELDS) + 2
CELL_WIDTH = 12


def _cell(value: Any, unit: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{100 * value:.1f} %" if unit == "ratio" else f"{value:.2f} ms"


ADVICE_WIDTH = 100   # an advice line, and each line of its wrapped reason, fits this many columns


def _wrap(text: str, indent: str = "      ") -> list[str]:
    return textwrap.wrap(text, ADVICE_WIDTH, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)


def format_advice(advice: list[dict] | None) -> list[str]:
    """One entry per piece of advice, each at most `ADVICE_WIDTH` columns a line.

    ``advice: set <setting>=<value> (predicted <x> ms)`` first (a change of the effective batch:
    its new step and the time per sample), then the reason wrapped under it, indented, the premise it
    checked (the run's measurement that shows its mechanism), its expected error, and, where the
    machine was loaded when the run ended, a line saying the prediction is
    unreliable and why (the load against the bench's limit).
    """
    lines = []
    for a in advice or ():
        predicted = a.get("predicted_step_ms")
        tail = f" (predicted {predicted:.2f} ms)" if isinstance(predicted, (int, float)) else ""
        if isinstance(predicted, (int, float)) and a.get("predicted_ms_per_sample") is not None:
            tail = (f" (predicted {predicted:.2f} ms a step of more samples, {a.get('ms_per_sample')} -> "
                    f"{a.get('predicted_ms_per_sample')} ms per sample)")
        elif isinstance(predicted, (int, float)) and "predicted_ms_per_sample" in a:
            tail = f" (predicted {predicted:.2f} ms a step of more samples, {a.get('saving', 0):.0%} less per sample)"
        also = "".join(f", {k}={v}" for k, v in (a.get("also") or {}).items())   # applied together
        text = [f"  advice: set {a.get('setting')}={a.get('value')}{also}{tail}"]
        text += _wrap(str(a.get("reason", "")))
        if a.get("premise"):   # the run's measurement that shows the mechanism the change relies on
            text += _wrap(f"premise: {a['premise']}")
        if "expected_error" in a:
            err = a.get("expected_error")
            text += _wrap("expected error: not yet measured (the sweep of docs/benchmarks.md has not been run on a "
                          "quiet machine)" if err is None else f"expected error: {100 * err:.0f} % (the sweep, "
                          "docs/benchmarks.md)")
        load = a.get("load") or {}
        if load.get("unreliable"):
            text += textwrap.wrap(
                f"unreliable: the machine was loaded (1-minute load {load.get('loadavg_1min')} on "
                f"{load.get('cores')} cores, above {load.get('limit'):g}): other work took time from the "
                f"measured parts; rerun on a quiet machine", ADVICE_WIDTH, initial_indent="      ",
                subsequent_indent="      ", break_on_hyphens=False)
        lines.append("\n".join(text))
    return lines


def format_report(report: dict[str, Any], title: str = "hfstream step report") -> str:
    """A short, aligned text table of a `summarize` result, or of a report (``mean``, ``per_rank``).

    Fields of ``grad_sync="sharded"`` are shown only where some rank has them. A report's ``notes``
    and ``advice`` follow the table, one line each.
    """
    if not report:
        return f"{title}: no steps measured"
    per_rank = report.get("per_rank") if isinstance(report.get("per_rank"), list) else None
    mean = report.get("mean", report)
    lines = [f"{title} (mean of {int(mean.get('steps', 0))} steps after warm-up"
             + (f", {len(per_rank)} rank{'s' if len(per_rank) != 1 else ''})" if per_rank else ")")]
    if mean.get("tuning_steps"):   # grad_bucket_mb="auto" trying caps: apart from the mean (timeline.summarize)
        lines.append(f"  tuning: {int(mean['tuning_steps'])} steps while grad_bucket_mb='auto' tried caps, "
                     f"{_cell(mean.get('tuning_step_ms'), 'ms')} a step, "
                     + ("and no step after them: the mean is theirs" if mean.get("tuning_in_mean")
                        else "not in the mean"))
    rows = [mean, *(per_rank or ())]
    widths = [-LABEL_WIDTH] + [CELL_WIDTH] * len(rows)
    if per_rank:
        lines.append("  " + row(["", "mean", *(f"rank {i}" for i in range(len(per_rank)))], widths))
    sharded = any(key in r and not math.isnan(r[key]) for r in rows for key in SHARDED_ONLY)
    for f in FIELDS:
        if f.key in SHARDED_ONLY and not sharded:
            continue   # other modes have no all-gather: the rows are not shown
        lines.append("  " + row([f.label, *(_cell(r.get(f.key, math.nan), f.unit) for r in rows)], widths))
    if sharded:
        lines += ["  ideal = forward + max(backward, comm busy) + optimizer (DDP's ceiling)",
                  "  cross-step limit = max(forward + backward + optimizer, comm busy) (the ceiling here)",
                  "  all-gather: the previous step's, behind this forward; efficiency = cross-step limit / step"]
    else:
        lines.append("  ideal = forward + max(backward, comm busy) + optimizer (the ceiling); efficiency = ideal / step")
    lines += _save_lines(report.get("save"))
    for note in report.get("notes") or ():
        lines.append(f"  note: {note}")
    lines += format_advice(report.get("advice"))
    if "advice" in report and not report.get("advice") and report.get("ruled_out"):
        lines.append("  no advice:")
        for reason in report["ruled_out"]:
            lines += _wrap_item(reason)
    load = report.get("load") or {}
    if load.get("loadavg_1min") is not None:
        lines.append(f"  load: {load['loadavg_1min']} on {load.get('cores')} cores ({load.get('per_core')} per core; "
                     f"advice unreliable above {load.get('limit_per_core')})"
                     + (": UNRELIABLE" if load.get("unreliable") else ""))
    return "\n".join(lines)


def _save_lines(save: dict | None) -> list[str]:
    """The checkpoint saves: the training thread's time in them, per save and in all (this rank's)."""
    if not save or not save.get("saves"):
        return []
    n, exposed = save["saves"], save["exposed_s"]
    line = (f"  saves: {n}, {exposed:.2f} s of the training thread's time ({exposed / n:.3f} s a save"
            + (f", {100 * exposed / save['run_s']:.1f} % of the run)" if save.get("run_s") else ")"))
    if save.get("save_async"):
        line += (f"; async: snapshot {save['snapshot_s']:.2f} s, waits {save['wait_s']:.2f} s (the end of train() "
                 f"{save.get('drain_s', 0.0):.2f} s), written behind training in {save['write_s']:.2f} s")
    else:
        line += "; blocking (save_async=True writes them behind training)"
    return [line]


def _wrap_item(reason: str) -> list[str]:
    """``    - reason`` wrapped, continuation lines under the text."""
    return textwrap.wrap(reason, ADVICE_WIDTH, initial_indent="    - ", subsequent_indent="      ",
                         break_on_hyphens=False)
