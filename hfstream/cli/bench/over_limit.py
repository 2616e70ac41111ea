"""Where a sharded mode's milliseconds over the cross-step limit go.

The limit, max(forward + backward + optimizer / N, comm busy), is taken from the serial run
(compute undisturbed, one all-reduce alone on the link; `summary`). A sharded step over it is
split into what each part took beyond serial's (forward and backward: packing and the
communication threads' share of the cores; the bucket-by-bucket step), the two halves' exposed
waits, the data wait, and the rest (bookkeeping between the timeline's marks, and the
difference between the median step and the sum of its parts' medians: each field is the median
over the timed steps on its own, so the rest moves by several ms between runs). On a comm-bound
link the limit is comm busy, and a step at or under it has nothing over (the split then says
how its compute compares).
"""

from __future__ import annotations

import math

PARTS = ("forward", "backward", "reduce-scatter exposed", "all-gather exposed", "optimizer", "data wait", "rest")


def _f(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not math.isnan(v) else 0.0


def over_limit(mode: dict, serial: dict, world_size: int, limit_ms: float) -> dict:
    """``{"over_ms", "parts": {part: ms}}``: the parts sum to step - (serial's forward + backward + optimizer / N)."""
    base = {"forward": _f(serial.get("forward_ms")), "backward": _f(serial.get("backward_ms")),
            "optimizer": _f(serial.get("optimizer_ms")) / world_size}
    parts = {
        "forward": _f(mode.get("forward_ms")) - base["forward"],
        "backward": _f(mode.get("backward_ms")) - base["backward"],
        "reduce-scatter exposed": _f(mode.get("reduce_scatter_exposed_ms")),
        "all-gather exposed": _f(mode.get("all_gather_exposed_ms")),
        "optimizer": _f(mode.get("optimizer_ms")) - base["optimizer"],
        "data wait": _f(mode.get("data_wait_ms")),
    }
    step = _f(mode.get("step_ms"))
    parts["rest"] = step - sum(base.values()) - sum(parts.values())
    return {"over_ms": step - limit_ms, "compute_ms": sum(base.values()), "parts": parts}


def format_over_limit(name: str, split: dict) -> str:
    """One note line: ``<mode>: 41 ms over the limit: forward +2, backward +17, ...``."""
    over = split["over_ms"]
    head = (f"  {name}: {over:.0f} ms over the limit" if over > 0.5 else
            f"  {name}: at or under the limit ({over:+.0f} ms)")
    cells = ", ".join(f"{part} {ms:+.0f}" for part, ms in split["parts"].items())
    return f"{head}; against serial's compute ({split['compute_ms']:.0f} ms): {cells}"
