"""A `torch.profiler` Chrome trace of chosen optimizer steps, as a Trainer callback.

    trainer.add_callback(TraceSteps(first=10, last=12, out_dir="runs/demo"))
    # -> runs/demo/trace_steps10-12_rank0.json: open in chrome://tracing or https://ui.perfetto.dev

The timeline figure (`hfstream.cli.plot.plot_timeline`) shows what hfstream measured; the trace
shows every operator and kernel underneath, with the streams they ran on. Activities are the
ones the installed torch supports (CPU, plus CUDA/XPU where present).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import TrainerCallback


def parse_step_range(text: str) -> tuple[int, int]:
    """``"10-12"`` -> (10, 12); ``"7"`` -> (7, 7). Steps count from 1, like ``global_step``."""
    try:
        first, _, last = text.partition("-")
        a, b = int(first), int(last or first)
    except ValueError:
        raise ValueError(f"trace_steps={text!r} is not valid; expected FIRST-LAST, e.g. 10-12") from None
    if a < 1 or b < a:
        raise ValueError(f"trace_steps={text!r} is not valid; need 1 <= FIRST <= LAST")
    return a, b


class TraceSteps(TrainerCallback):
    """Profile optimizer steps ``first``..``last`` (inclusive) and export a Chrome trace per rank.

    Args:
        first, last: optimizer steps, counting from 1.
        out_dir: where ``trace_steps{first}-{last}_rank{r}.json`` is written.
    """

    def __init__(self, first: int, last: int, out_dir: str | os.PathLike):
        if first < 1 or last < first:
            raise ValueError(f"TraceSteps(first={first}, last={last}): need 1 <= first <= last")
        self.first, self.last, self.out_dir = first, last, Path(out_dir)
        self.path: Path | None = None
        self._prof = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self._prof is None and state.global_step + 1 == self.first:
            self._prof = torch.profiler.profile(activities=list(torch.profiler.supported_activities()),
                                                record_shapes=False, with_stack=False)
            self._prof.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self._prof is not None and state.global_step >= self.last:
            self._export(args)

    def on_train_end(self, args, state, control, **kwargs):
        if self._prof is not None:          # training stopped inside the range
            self._export(args)

    def _export(self, args) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / f"trace_steps{self.first}-{self.last}_rank{args.process_index}.json"
        prof.export_chrome_trace(str(self.path))
