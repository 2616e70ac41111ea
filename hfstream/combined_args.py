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

_FIELDS = "__dataclass_fields__"


def _declared_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields ``cls``'s own class body declares (new `Field` objects), not those it inherits."""
    own = cls.__dict__.get(_FIELDS)
    if own is None:                      # not decorated with @dataclass itself: it declares no field
        return {}
    inherited = {id(f) for base in cls.__mro__[1:] for f in base.__dict__.get(_FIELDS, {}).values()}
    return {name: f for name, f in own.items() if id(f) not in inherited}


def _same_default(a: dataclasses.Field, b: dataclasses.Field) -> bool:
    if a is b:
        return True
    if (a.default_factory is dataclasses.MISSING) != (b.default_factory is dataclasses.MISSING):
        return False
    if a.default_factory is not dataclasses.MISSING:
        if a.default_factory is b.default_factory:
            return True
        try:                             # two factories (two lambdas, say) that build equal values
            return bool(a.default_factory() == b.default_factory())
        except Exception:
            return False
    try:
        return a.default is b.default or bool(a.default == b.default)
    except Exception:
        return False


def _show_default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        return f"{getattr(f.default_factory, '__qualname__', f.default_factory)}()"
    return "(required)" if f.default is dataclasses.MISSING else repr(f.default)


@functools.cache
def _lost_defaults(cls: type) -> tuple[tuple[str, str, str, str | None], ...]:
    """Fields whose default in ``cls`` is not the one the first declaring class in its MRO gives.

    Python resolves an attribute through the MRO: the first class that declares it wins. A
    dataclass instead takes each field from the last base, in reverse MRO order, whose fields
    include it, and every `TrainingArguments` subclass includes all of `TrainingArguments`'
    fields. ``class X(StreamTrainingArguments, SFTConfig)`` therefore gets `TrainingArguments`'
    ``learning_rate`` although ``SFTConfig`` declares its own. Returns ``(field, declaring class,
    its default, the class's default or None where it is no field of the class)`` for each such
    field; empty when nothing was lost. A class's own declarations are its own choice and always
    win, so they never show here.
    """
    actual = getattr(cls, _FIELDS, {})
    lost, seen = [], set()
    for klass in cls.__mro__:
        if not (isinstance(klass, type) and issubclass(klass, TrainingArguments)):
            continue
        for name, declared in _declared_fields(klass).items():
            if name in seen:
                continue
            seen.add(name)                # the first class in the MRO that declares a field decides it
            got = actual.get(name)
            if got is None or not _same_default(declared, got):
                shown = None if got is None else _show_default(got)
                lost.append((name, klass.__qualname__, _show_default(declared), shown))
    return tuple(lost)


def check_field_defaults(cls: type) -> None:
    """Refuses a class that lost defaults of its bases (see `_lost_defaults`); cached per class."""
    lost = _lost_defaults(cls)
    if not lost:
        return
    mro = cls.__mro__
    others = [b for b in mro[1:] if isinstance(b, type) and issubclass(b, TrainingArguments)
              and not issubclass(StreamTrainingArguments, b) and not issubclass(b, StreamTrainingArguments)]
    other = others[0].__name__ if others else "TheOtherArguments"
    name = cls.__name__
    wrong_order = bool(others) and mro.index(StreamTrainingArguments) < mro.index(others[0])
    changed = [(f, owner, want, got) for f, owner, want, got in lost if got is not None]
    missing = [(f, owner) for f, owner, _, got in lost if got is None]
    problems = []
    if changed:
        shown = "; ".join(f"{f}: {owner} says {want}, {name} has {got}" for f, owner, want, got in changed[:4])
        more = f" (and {len(changed) - 4} more: {', '.join(f for f, *_ in changed[4:])})" if len(changed) > 4 else ""
        problems.append(f"{name} loses the defaults its bases give {len(changed)} field(s): {shown}{more}. A dataclass "
                        "takes each field from the last base (in reverse MRO order) that has it, and "
                        "StreamTrainingArguments has every field of TrainingArguments")
    if missing:
        owners = sorted({owner for _, owner in missing})
        listed = ", ".join(f for f, _ in missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        problems.append(f"{len(missing)} field(s) of {', '.join(owners)} are not fields of {name} ({listed}): "
                        f"{name} is not decorated with @dataclass")
    fixes = []
    if cls.__dict__.get(_FIELDS) is None:
        fixes.append(f"decorate {name} with @dataclass")
    if wrong_order:
        fixes.append(f"put {other} first: `class {name}({other}, StreamTrainingArguments)`")
    fix = " and ".join(fixes) or f"declare the affected fields in {name} itself"
    raise TypeError(f"{'. '.join(problems)}. Instead, {fix}; or use `hfstream.stream_arguments({other})`, which "
                    "builds the combined class.")


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
