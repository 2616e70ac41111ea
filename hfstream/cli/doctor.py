"""`hfstream doctor`: read a run's step report back and say what to change.

``hfstream doctor PATH`` prints the report StreamTrainer wrote (`hfstream.trainer.report_file`) as
the run printed it, with its advice, for a run directory (the newest report below it) or the file
itself.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..trainer.report_file import REPORT_FILE


def find_reports(path) -> list[Path]:
    """Every report ``path`` holds, oldest first (by modification time): the file itself, or those below it."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(p.rglob(REPORT_FILE), key=lambda f: (f.stat().st_mtime, str(f)))
    return []


def find_report(path) -> Path | None:
    """The report a user means by ``path``: the file, or the newest one at or below the directory."""
    found = find_reports(path)
    return found[-1] if found else None


def load_report(path):
    """The `StreamReport` stored at ``path`` (null back to NaN, so it prints as the run printed it).

    Raises:
        FileNotFoundError: nothing there holds a report, with what to pass instead.
        ValueError: the file is not a step report.
    """
    from ..report.timeline import StreamReport

    if not Path(path).exists():
        raise FileNotFoundError(f"{path} does not exist: pass a run's output_dir or its {REPORT_FILE}")
    file = find_report(path)
    if file is None:
        raise FileNotFoundError(
            f"no step report at {path}: pass a run's output_dir (StreamTrainer writes {REPORT_FILE} at the end of "
            f"train(), with stream_report=True, the default, into its last checkpoint-N folder, or into "
            f"output_dir when none was saved) or the {REPORT_FILE} file itself")
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

    report = StreamReport.from_dict({k: (nan(v) if k in ("mean", "per_rank") else v) for k, v in data.items()})
    return report, file


def doctor(path) -> int:
    """Print the report at ``path`` and its advice; 2 if there is none."""
    from ..report.advice import MIN_SAVING

    try:
        report, file = load_report(path)
    except (FileNotFoundError, ValueError) as exc:
        print(f"hfstream doctor: {exc}", file=sys.stderr)
        return 2
    found = find_reports(path)
    if len(found) > 1:
        print(f"{len(found)} step reports under {path} (oldest first):")
        for f in found:
            print(f"  {f}")
        print(f"reading the newest: {file}\n")
    else:
        print(f"{file}\n")
    print(str(report))
    if "advice" not in report:
        print("\n(this report predates advice: rerun with this hfstream to get it)")
    elif not report["advice"] and not report.get("ruled_out"):   # a report without the reasons (older)
        print(f"\nno advice: no change of the candidates is predicted to save {MIN_SAVING:.0%} of the step")
    return 0
