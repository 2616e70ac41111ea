"""The step report's quantities: one row per quantity, one name everywhere (docs/design.md section 4).

A field's ``key`` is its name in the report dict, its JSON, and the Trainer's logged scalars
(``stream/<key>``; TensorBoard and W&B show them as ``train/stream/<key>``); its ``label`` is the
printed row, the key without its unit with ``_`` written as a space or a hyphen, so a reader of the
table finds the same name in the logs. ``measured`` fields come from marks, events and GradSync's
stats (they are `StepRecord`'s fields); ``derived`` fields are computed from the measured ones, and
recomputed (not averaged) when steps or ranks are averaged.

``modes`` says where a field exists: ``"all"``; ``"comm"``, wherever hfstream launches the
collectives (``overlap``, ``serial``, ``sharded``; NaN, printed n/a, under ``native``, whose
reductions DDP hides); ``"sharded"``, only under ``grad_sync="sharded"`` (absent elsewhere, not NaN).
"""

from __future__ import annotations

from typing import NamedTuple


class Field(NamedTuple):
    key: str        # the one name: report dict, JSON, `stream/<key>` scalars
    label: str      # the printed row
    unit: str       # "ms", or "ratio" (printed as a percentage)
    source: str     # "measured" or "derived"
    modes: str      # "all", "comm" or "sharded"
    meaning: str


FIELDS: tuple[Field, ...] = (
    Field("data_wait_ms", "data wait", "ms", "measured", "all",
          "host time the step waited for its batch (always a host time)"),
    Field("forward_ms", "forward", "ms", "measured", "all",
          "forward compute (under sharded without the wait for the all-gathers)"),
    Field("backward_ms", "backward", "ms", "measured", "all",
          "backward compute, with any sync work in finish() beyond the collectives' busy time"),
    Field("comm_busy_ms", "comm busy", "ms", "measured", "comm",
          "time at least one collective was in flight (union of their spans); sharded: reduce-scatter + all-gather"),
    Field("exposed_comm_ms", "exposed comm", "ms", "measured", "all",
          "time the step waited for communication; sharded: reduce-scatter + all-gather"),
    Field("reduce_scatter_busy_ms", "reduce-scatter busy", "ms", "derived", "sharded",
          "the backward's reduce-scatters in flight (comm_busy_ms - all_gather_busy_ms)"),
    Field("reduce_scatter_exposed_ms", "reduce-scatter exposed", "ms", "derived", "sharded",
          "what finish() waited for the reduce-scatters (exposed_comm_ms - all_gather_exposed_ms)"),
    Field("all_gather_busy_ms", "all-gather busy", "ms", "measured", "sharded",
          "the previous step's parameter all-gathers in flight, from their launch to each one's completion"),
    Field("all_gather_exposed_ms", "all-gather exposed", "ms", "measured", "sharded",
          "what the training forward's pre-hooks waited for those all-gathers"),
    Field("comm_cpu_ms", "comm cpu", "ms", "measured", "all",
          "CPU time of the process group's own threads (gloo's) in the step: what the collectives took from "
          "the host's cores; n/a where the backend has no such threads (one process, NCCL)"),
    Field("optimizer_ms", "optimizer", "ms", "measured", "all",
          "from the end of finish() to the end of the step: clipping, optimizer.step(), zero_grad"),
    Field("step_ms", "step", "ms", "measured", "all",
          "the whole optimizer step, from fetching its data to the end of its optimizer"),
    Field("ideal_ms", "ideal", "ms", "derived", "all",
          "the one-step ceiling: forward + max(backward, comm busy) + optimizer (data hidden)"),
    Field("cross_step_limit_ms", "cross-step limit", "ms", "derived", "sharded",
          "the sharded ceiling: max(forward + backward + optimizer / N, comm busy)"),
    Field("efficiency", "efficiency", "ratio", "derived", "all",
          "ceiling / step: ideal_ms / step_ms, under sharded cross_step_limit_ms / step_ms"),
    Field("overlap", "overlap", "ratio", "derived", "comm",
          "share of the communication hidden: 1 - exposed comm / comm busy"),
)

BY_KEY = {f.key: f for f in FIELDS}
KEYS = tuple(f.key for f in FIELDS)
MEASURED = tuple(f.key for f in FIELDS if f.source == "measured")   # `StepRecord`'s fields (a test holds it so)
SHARDED_ONLY = tuple(f.key for f in FIELDS if f.modes == "sharded")
