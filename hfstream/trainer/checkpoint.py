"""Refuse a damaged checkpoint before resuming from it, with the file and what to do instead.

A job killed while it saved leaves a checkpoint whose files are cut short. Loading one fails
deep inside safetensors or torch.load with a message that names neither the file nor the fix
("Error while deserializing header: incomplete metadata"). `check_checkpoint` opens only what
is cheap to open (safetensors headers, the zip directory at the end of each torch file, the
JSON files), so a good checkpoint costs milliseconds to check, whatever the model's size.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the file and the way out."""


def _damaged(path: Path) -> str | None:
    """Why ``path`` cannot be read, or None when its structure is intact."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt"):   # opening checks the header against the file's size
                pass
        elif path.suffix in (".pt", ".pth", ".bin"):
            if path.stat().st_size == 0:
                return "the file is empty"
            if not zipfile.is_zipfile(path):
                return "not a complete torch file (its zip directory is missing: cut short?)"
        elif path.suffix == ".json":
            json.loads(path.read_text())
    except Exception as exc:   # each reader raises its own type; all mean "damaged"
        return f"{type(exc).__name__}: {exc}"
    return None


def check_checkpoint(directory: str | os.PathLike) -> None:
    """Raise `CheckpointError` if any file of ``directory`` is truncated or corrupt."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"resume_from_checkpoint={str(directory)!r} is not a directory; pass a "
                              f"checkpoint-N folder from output_dir, or True for the last one")
    from .report_file import REPORT_FILE

    for path in sorted(directory.iterdir()):
        if not path.is_file() or path.name == REPORT_FILE:   # hfstream's report: resuming reads nothing of it
            continue
        why = _damaged(path)
        if why is not None:
            raise CheckpointError(
                f"checkpoint {str(directory)!r} is damaged: {path.name}: {why}. A job stopped while saving "
                f"leaves such files. Resume from an earlier checkpoint (resume_from_checkpoint='<output_dir>/"
                f"checkpoint-N'), or delete this one and resume with True."
            )
