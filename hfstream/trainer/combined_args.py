"""Combining `StreamTrainingArguments` with another `TrainingArguments` subclass (TRL's ``SFTConfig``).

``stream_arguments(SFTConfig)`` builds the combined class the right way round; the check that
`StreamTrainingArguments.__post_init__` runs refuses a class whose other parent's defaults were
lost. Why they can be lost: a dataclass takes each field from the last base, in reverse MRO
order, that has it, and every `TrainingArguments` subclass has all of `TrainingArguments`'
fields, so in ``class Args(StreamTrainingArguments, SFTConfig)`` every default ``SFTConfig``
overrides (``bf16``, ``learning_rate``, ...) silently becomes `TrainingArguments`' again.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from transformers import Trainer, TrainingArguments

from .args import StreamTrainingArguments
from .field_defaults import declares

def _rebuild(base: type) -> StreamTrainingArguments:
    """Unpickling: an empty instance of ``stream_arguments(base)``; pickle then restores its state."""
    cls = stream_arguments(base)
    return cls.__new__(cls)


def stream_arguments(base: type) -> type:
    """``base`` (a `TrainingArguments` subclass, TRL's ``SFTConfig`` say) plus hfstream's fields.

    Returns the dataclass ``class Stream<Base>(base, StreamTrainingArguments)``: every field and
    default of ``base`` (``base`` comes first, so its overrides of `TrainingArguments`' defaults
    stand), its ``__post_init__`` and methods, and hfstream's fields and checks. The same class
    for the same ``base`` every time; its instances pickle and deep-copy (``training_args.bin``
    in a checkpoint, `copy.deepcopy`) and `HfArgumentParser` parses it.

    >>> from trl import SFTConfig, SFTTrainer                                     # doctest: +SKIP
    >>> class MySFTTrainer(StreamTrainerMixin, SFTTrainer): pass                  # doctest: +SKIP
    >>> args = stream_arguments(SFTConfig)(output_dir="out", prefetch_depth=2)    # doctest: +SKIP
    >>> trainer = MySFTTrainer(model=model, args=args, train_dataset=ds)          # doctest: +SKIP

    ``StreamTrainingArguments`` and its subclasses come back unchanged, and ``TrainingArguments``
    gives ``StreamTrainingArguments``.
    """
    if not (isinstance(base, type) and issubclass(base, TrainingArguments)):
        raise TypeError(f"stream_arguments() needs a TrainingArguments subclass (TRL's SFTConfig, say), got {base!r}")
    if issubclass(base, StreamTrainingArguments):
        return base
    if base is TrainingArguments:
        return StreamTrainingArguments
    return _combined(base)


@functools.cache
def _combined(base: type) -> type:
    name = f"Stream{base.__name__}"

    def __reduce_ex__(self, protocol):
        if type(self) is not cls:        # a user's subclass of it pickles by its own name, as usual
            return super(cls, self).__reduce_ex__(protocol)
        # Python 3.10 has no object.__getstate__: the instance's __dict__ is its state there.
        state = self.__getstate__() if hasattr(self, "__getstate__") else self.__dict__
        return _rebuild, (base,), state

    namespace = {
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"`{base.__qualname__}` plus hfstream's fields: `hfstream.stream_arguments({base.__name__})`.",
        "__reduce_ex__": __reduce_ex__,
    }
    # The parent defaults StreamTrainingArguments changes for speed come from ``base``'s copy of
    # TrainingArguments' fields otherwise (a dataclass takes each field from the last base that has
    # it): declare them again, unless ``base`` chose its own.
    ours = StreamTrainingArguments.__dataclass_fields__
    again = [n for n in StreamTrainingArguments.SPEED_DEFAULTS if not declares(base, n)]
    namespace["__annotations__"] = {n: ours[n].type for n in again}
    for n in again:
        namespace[n] = dataclasses.field(default=ours[n].default, metadata=ours[n].metadata)
    cls = dataclass(type(name, (base, StreamTrainingArguments), namespace))
    return cls


def default_stream_args(trainer_cls: type, mixin: type, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Trainer builds a plain TrainingArguments when none is given; build ours instead.

    Another Trainer subclass (TRL's SFTTrainer) builds its own config class from what it is
    given; ours would not fit it, so it is asked for explicitly instead.
    """
    missing = args[1] is None if len(args) > 1 else kwargs.get("args") is None
    if not missing:
        return args, kwargs
    base = next(c for c in trainer_cls.__mro__ if issubclass(c, Trainer) and not issubclass(c, mixin))
    if base is not Trainer:
        raise TypeError(
            f"{trainer_cls.__name__} needs args: {base.__name__} builds default arguments of its own class, which "
            f"lack hfstream's fields. Pass args=hfstream.stream_arguments(<{base.__name__}'s config class>)"
            f"(output_dir=...), e.g. stream_arguments(SFTConfig) for TRL's SFTTrainer."
        )
    default = StreamTrainingArguments(output_dir="tmp_trainer")
    if len(args) > 1:
        return (args[0], default, *args[2:]), kwargs
    return args, {**kwargs, "args": default}
