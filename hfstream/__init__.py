"""hfstream: hide data movement and gradient communication behind compute in Hugging Face
training, and measure how close each step comes to its ceiling.

    >>> from hfstream import StreamTrainer, StreamTrainingArguments   # the two-name migration
    >>> from hfstream import GradSync, StreamPrefetcher               # the building blocks

`hfstream.data` (local corpus and byte-level tokenizer) imports `datasets`; it is kept out of
this import path on purpose.
"""

from .args import StreamTrainingArguments
from .gradsync import GradSync
from .prefetch import StreamPrefetcher
from .trainer import StreamReport, StreamTrainer, StreamTrainerMixin

__version__ = "0.1.0"
__all__ = [
    "GradSync", "StreamPrefetcher", "StreamReport", "StreamTrainer", "StreamTrainerMixin",
    "StreamTrainingArguments", "__version__",
]
