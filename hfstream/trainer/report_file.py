"""The step report on disk: inside the checkpoint it describes, so that it rotates with it.

StreamTrainer writes ``stream_report.json`` at the end of `train()` (rank 0; the report of every
rank, its spans and its advice, strict JSON) inside the checkpoint folder of the step training
ended on (``output_dir/checkpoint-N/``), so that ``output_dir`` holds exactly what the stock
Trainer leaves there and the report rotates with the checkpoint it describes. A run that saved no
checkpoint at its last step gets it in its newest checkpoint, and one that saved none
(``save_strategy="no"``) in ``output_dir`` itself. ``hfstream doctor`` reads it back
(`hfstream.cli.doctor`).
"""

from __future__ import annotations

import os
from pathlib import Path

REPORT_FILE = "stream_report.json"


def report_dir(output_dir, step: int | None = None) -> Path:
    """Where a run's report goes: ``output_dir/checkpoint-<step>`` if it exists, else the newest checkpoint, else ``output_dir``."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

    if step is not None:
        checkpoint = Path(output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        if checkpoint.is_dir():
            return checkpoint
    newest = get_last_checkpoint(str(output_dir)) if Path(output_dir).is_dir() else None
    return Path(newest) if newest is not None else Path(output_dir)


def write_report(report, output_dir, step: int | None = None) -> Path:
    """Write ``report`` (a `StreamReport`) to `report_dir` ``(output_dir, step)``; returns the path."""
    path = report_dir(output_dir, step) / REPORT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")   # renamed whole: another rank never reads half of it
    partial.write_text(report.to_json())
    os.replace(partial, path)
    return path
