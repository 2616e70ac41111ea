"""Text tables, one way: cells padded to their columns, long lines wrapped under an indent.

The step report, ``hfstream plan``, ``hfstream bench`` and the GPU check print their tables with
these two functions, so a column is a width and an alignment, written once per table.
"""

from __future__ import annotations

import textwrap
from typing import Iterable, Sequence


def row(cells: Sequence[object], widths: Sequence[int]) -> str:
    """One line of a table: each cell right-aligned in its column, left-aligned where the width is negative.

    Args:
        cells: the cells, already formatted (anything else is written with ``str``).
        widths: one per cell: its column's width; negative for a left-aligned column.

    >>> row(["mode", "1.5", "2"], [-6, 5, 3])
    'mode    1.5  2'
    """
    if len(cells) != len(widths):
        raise ValueError(f"{len(cells)} cells for {len(widths)} column widths: pass one width per cell")
    return "".join(f"{str(c):<{-w}}" if w < 0 else f"{str(c):>{w}}" for c, w in zip(cells, widths))


def wrap(lines: Iterable[str], width: int, indent: str = "  ", break_on_hyphens: bool = True) -> list[str]:
    """Each line wrapped to ``width`` columns, its continuation lines indented by ``indent``; an empty line kept.

    >>> wrap(["one two three"], 8)
    ['one two', '  three']
    """
    return [w for line in lines for w in (textwrap.wrap(line, width, subsequent_indent=indent,
                                                        break_on_hyphens=break_on_hyphens) or [""])]
