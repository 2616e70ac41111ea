"""hfstream: hide data movement and gradient communication behind compute in Hugging Face
training, and measure how close each step comes to its ceiling.

    >>> from hfstream import StreamTrainer, StreamTrainingArguments   # the two-name migration
    >>> from hfstream import GradSync, StreamPrefetcher               # the building blocks

The names are imported on first use (PEP 562): ``import hfstream`` is cheap, and
``from hfstream import GradSync`` loads torch but not transformers. The training path lives in
this package; what a person runs beside training is in `hfstream.cli` (docs/design.md
section 3). `hfstream.cli.data` imports `datasets` (``hfstream[demo]``); nothing on the training
path does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "GradSync": "hfstream.gradsync",
    "StreamPrefetcher": "hfstream.prefetch",
    "StreamReport": "hfstream.report.timeline",
    "StreamTrainer": "hfstream.trainer.trainer",
    "StreamTrainerMixin": "hfstream.trainer.trainer",
    "StreamTrainingArguments": "hfstream.trainer.args",
    "stream_arguments": "hfstream.trainer.combined_args",
}
__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time these load lazily
    from .trainer.args import StreamTrainingArguments
    from .trainer.combined_args import stream_arguments
    from .gradsync import GradSync
    from .prefetch import StreamPrefetcher
    from .report.timeline import StreamReport
    from .trainer.trainer import StreamTrainer, StreamTrainerMixin


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hfstream' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
