"""Has a `TrainingArguments` subclass kept its other parent's defaults? (`StreamTrainingArguments.__post_init__` asks.)

A dataclass takes each field from the last base, in reverse MRO order, that has it, and every
`TrainingArguments` subclass has all of `TrainingArguments`' fields, so in
``class Args(StreamTrainingArguments, SFTConfig)`` every default ``SFTConfig`` overrides
(``bf16``, ``learning_rate``, ...) silently becomes `TrainingArguments`' again. `combined_args`
builds such classes the right way round.
"""

from __future__ import annotations

import dataclasses
import functools

from transformers import TrainingArguments

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


def declares(cls: type, name: str) -> bool:
    """Whether a `TrainingArguments` subclass in ``cls``'s MRO, other than `TrainingArguments`, declares field ``name``."""
    return any(name in _declared_fields(k) for k in cls.__mro__
               if isinstance(k, type) and issubclass(k, TrainingArguments) and k is not TrainingArguments)


def check_field_defaults(cls: type, ours: type) -> None:
    """Refuses a class that lost defaults of its bases (see `_lost_defaults`); cached per class.

    ``ours.SPEED_DEFAULTS`` are not refused: losing one of them costs speed, not results.
    """
    speed_only = getattr(ours, "SPEED_DEFAULTS", ())
    lost = [entry for entry in _lost_defaults(cls) if entry[0] not in speed_only]
    if not lost:
        return
    mro = cls.__mro__
    others = [b for b in mro[1:] if isinstance(b, type) and issubclass(b, TrainingArguments)
              and not issubclass(ours, b) and not issubclass(b, ours)]
    other = others[0].__name__ if others else "TheOtherArguments"
    name = cls.__name__
    wrong_order = bool(others) and mro.index(ours) < mro.index(others[0])
    changed = [(f, owner, want, got) for f, owner, want, got in lost if got is not None]
    missing = [(f, owner) for f, owner, _, got in lost if got is None]
    problems = []
    if changed:
        shown = "; ".join(f"{f}: {owner} says {want}, {name} has {got}" for f, owner, want, got in changed[:4])
        more = f" (and {len(changed) - 4} more: {', '.join(f for f, *_ in changed[4:])})" if len(changed) > 4 else ""
        problems.append(f"{name} loses the defaults its bases give {len(changed)} field(s): {shown}{more}. A dataclass "
                        "takes each field from the last base (in reverse MRO order) that has it, and "
                        f"{ours.__name__} has every field of TrainingArguments")
    if missing:
        owners = sorted({owner for _, owner in missing})
        listed = ", ".join(f for f, _ in missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        problems.append(f"{len(missing)} field(s) of {', '.join(owners)} are not fields of {name} ({listed}): "
                        f"{name} is not decorated with @dataclass")
    fixes = []
    if cls.__dict__.get(_FIELDS) is None:
        fixes.append(f"decorate {name} with @dataclass")
    if wrong_order:
        fixes.append(f"put {other} first: `class {name}({other}, {ours.__name__})`")
    fix = " and ".join(fixes) or f"declare the affected fields in {name} itself"
    raise TypeError(f"{'. '.join(problems)}. Instead, {fix}; or use `hfstream.stream_arguments({other})`, which "
                    "builds the combined class.")
