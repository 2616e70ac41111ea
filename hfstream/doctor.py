"""The step report on disk, and `hfstream doctor`: read a run's report back and say what to change.

StreamTrainer writes ``output_dir/stream_report.json`` at the end of `train()` (rank 0; the
report of every rank, its spans and its advice, strict JSON). ``hfstream doctor PATH`` prints
that report as the run printed it, with its advice, for a run directory or the file itself.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPORT_FILE = "stream_report.json"


def write_report(report, output_dir) -> Path:
    """Write ``report`` (a `StreamReport`) to ``output_dir/stream_report.json``; returns the path."""
    path = Path(output_dir) / REPORT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report.to_json())
    return path


def find_report(path) -> Path | None:
    """The report a user means by ``path``: the file, ``path/stream_report.json``, or the newest one below."""
    p = Path(path)
    if p.is_file():
        return p
    if (p / REPORT_FILE).is_file():
        return p / REPORT_FILE
    if p.is_dir():
        found = sorted(p.rglob(REPORT_FILE), key=lambda f: f.stat().st_mtime)
        return found[-1] if found else None
    return None


def load_report(path):
    """The `StreamReport` stored at ``path`` (null back to NaN, so it prints as the run printed it).

    Raises:
        FileNotFoundError: nothing there holds a report, with what to pass instead.
        ValueError: the file is not a step report.
    """
    from .timeline import StreamReport

    file = find_report(path)
    if file is None:
        raise FileNotFoundError(
            f"no step report at {path}: pass a run's output_dir (StreamTrainer writes {REPORT_FILE} there at the "
            f"end of train(), with stream_report=True, the default) or the {REPORT_FILE} file itself")
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is not a step report (not JSON: {exc}); pass a {REPORT_FILE} "
                         f"that StreamTrainer wrote") from None
    if not isinstance(data, dict) or "mean" not in data:
        raise ValueError(f"{file} is not a step report (no 'mean'); pass a {REPORT_FILE} that StreamTrainer wrote")

    def nan(x):
        if isinstance(x, dict):
            return {k: nan(v) for k, v in x.items()}
        if isinstance(x, list):
            return [nan(v) for v in x]
        return float("nan") if x is None else x

    report = StreamReport({k: (nan(v) if k in ("mean", "per_rank") else v) for k, v in data.items()})
    return report, file


def doctor(path) -> int:
    """Print the report at ``path`` and its advice; 2 if there is none."""
    from .advice import MIN_SAVING

    try:
        report, file = load_report(path)
    except (FileNotFoundError, ValueError) as exc:
        print(f"hfstream doctor: {exc}", file=sys.stderr)
        return 2
    print(f"{file}\n")
    print(str(report))
    if "advice" not in report:
        print("\n(this report predates advice: rerun with this hfstream to get it)")
    elif not report["advice"]:
        print(f"\nno advice: no change of the candidates is predicted to save {MIN_SAVING:.0%} of the step")
    return 0
