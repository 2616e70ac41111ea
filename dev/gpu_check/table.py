"""The one table a gpu-check prints, and the same results as strict JSON."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from hfstream.report.table import row, wrap

TAIL_LINES = 40          # lines of a failed part's output the table shows


def format_table(header: dict, results: list[dict], width: int = 118) -> str:
    """The one table: a header line, one row per part (continuation lines for more numbers),
    the overall verdict, then what each failed part said."""
    keys = ("date", "device", "torch", "cuda", "transformers", "accelerate", "python", "mode", "git")
    head = "  ".join(f"{k} {header[k]}" for k in keys if header.get(k) not in (None, ""))
    lines = wrap([f"hfstream gpu-check  {head}"], width)
    name_w = max([len("part")] + [len(r.get("title") or r.get("name", "?")) for r in results])
    widths = (-name_w, 2, -6, 1, 7, 2)   # part, gap, status, gap, secs, gap, then the numbers
    indent = sum(abs(w) for w in widths)
    lines.append(row(["part", "", "status", "", "secs", ""], widths) + "key numbers")
    lines.append("-" * min(width, max(indent + 40, 60)))
    for r in results:
        title = r.get("title") or r.get("name", "?")
        secs = r.get("seconds")
        secs_s = f"{secs:.1f}" if isinstance(secs, (int, float)) and not math.isnan(secs) else "-"
        texts = [str(s) for s in (r.get("summary") or [])] + [f"FAILED {f}" for f in (r.get("failed") or [])]
        wrapped = wrap(texts or [""], max(width - indent, 30))
        lines.append(row([title, "", r.get("status", "?"), "", secs_s, ""], widths) + wrapped[0])
        lines += [" " * indent + w for w in wrapped[1:]]
    counts = {s: sum(1 for r in results if r.get("status") == s) for s in ("pass", "fail", "skip")}
    total = header.get("seconds")
    lines.append("-" * min(width, max(indent + 40, 60)))
    lines.append(f"overall: {overall_status(results)} ({counts['pass']} pass, {counts['fail']} fail, "
                 f"{counts['skip']} skip)" + (f" in {total:.1f} s" if isinstance(total, (int, float)) else ""))
    for r in results:
        if r.get("status") == "fail" and r.get("detail"):
            lines.append(f"--- {r.get('title') or r.get('name')}: details ---")
            lines += tail(str(r["detail"]), TAIL_LINES).splitlines()
    return "\n".join(lines)


def overall_status(results: list[dict]) -> str:
    """fail: a part failed; incomplete: a part that should have run did not (no time left, no pytest on a
    GPU machine), so nothing may say pass; else pass where any part passed."""
    if any(r.get("status") == "fail" for r in results):
        return "fail"
    if any(r.get("incomplete") for r in results):
        return "incomplete"
    return "pass" if any(r.get("status") == "pass" for r in results) else "skip"


def strict_json(x: Any) -> Any:
    """NaN and infinities become null, tuples lists: what ``json.dumps(allow_nan=False)`` accepts."""
    if isinstance(x, dict):
        return {str(k): strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_json(path: str | os.PathLike, header: dict, results: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"header": header, "overall": overall_status(results), "parts": results}
    path.write_text(json.dumps(strict_json(doc), indent=2, allow_nan=False) + "\n")


def tail(text: str, n: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])
