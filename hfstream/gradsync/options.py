"""The accepted values of GradSync's arguments, defined once.

`StreamTrainingArguments` validates its fields against the same names, so a value the
Trainer accepts is one GradSync accepts.
"""

from __future__ import annotations

import enum

import torch

from .. import streams
from .buckets import bucket_cap_bytes



class Mode(str, enum.Enum):
    """How the gradients are synchronised: ``grad_sync`` of the Trainer, ``mode`` of GradSync.

    A ``str`` as well, so ``Mode.SHARDED == "sharded"`` and users keep passing strings; it prints
    as the string it is (messages name ``'sharded'``, not the enum).
    """

    OVERLAP = "overlap"   # GradSync: buckets all-reduced from the gradient hooks, during backward
    SERIAL = "serial"     # GradSync: every bucket all-reduced in finish(), after backward
    SHARDED = "sharded"   # GradSync: reduce-scatter in backward, each rank steps its slice, all-gather after
    NATIVE = "native"     # the Trainer's own DDP (or FSDP/DeepSpeed): hfstream reduces nothing

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def by_gradsync(self) -> bool:
        """GradSync reduces the gradients (every mode but ``NATIVE``)."""
        return self is not Mode.NATIVE


MODES = tuple(m.value for m in Mode if m.by_gradsync)   # GradSync's accepted ``mode`` values
STREAM_PRIORITIES = tuple(streams.PRIORITIES)   # "normal", "high"
COMM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}          # wire dtypes, by their short name
COMM_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
DEFAULT_TIMEOUT_S = 1800.0   # torch's default process-group timeout
DEFAULT_BUCKET_MB = "auto"   # GradSync's and StreamTrainingArguments' default cap: tuned online


def comm_dtype_name(value, argument: str = "comm_dtype") -> str | None:
    """The short name (``"bf16"``/``"fp16"``) of a wire dtype given by name, alias or torch dtype; None stays None.

    Raises:
        ValueError: naming ``argument`` and the accepted values.
    """
    if value is None:
        return None
    for name, dtype in COMM_DTYPES.items():
        if value is dtype:
            return name
    if isinstance(value, str):
        key = COMM_DTYPE_ALIASES.get(value.lower(), value.lower())
        if key in COMM_DTYPES:
            return key
    raise ValueError(
        f"{argument}={value!r} is not valid; accepted values: None (the gradients' own dtype), "
        f"'bf16' (or torch.bfloat16), 'fp16' (or torch.float16)"
    )


def check_arguments(mode: str, bucket_mb, first_bucket_mb, comm_stream_priority: str, timeout,
                    last_bucket_mb=None) -> None:
    """Raise a `ValueError` naming the first GradSync argument that is not valid, and what to pass instead."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not valid; accepted values: 'overlap' (reduce during backward), "
                         f"'serial' (reduce everything in finish()), 'sharded' (reduce-scatter during backward, "
                         f"all-gather after the step: docs/design.md section 7)")
    if not (isinstance(bucket_mb, str) and bucket_mb == "auto"):
        try:
            bucket_cap_bytes(bucket_mb)
        except ValueError as exc:
            raise ValueError(f"{exc}, or 'auto' (tuned online in the first steps)") from None
    if first_bucket_mb is not None:
        bucket_cap_bytes(first_bucket_mb, "first_bucket_mb")
    if last_bucket_mb is not None:
        bucket_cap_bytes(last_bucket_mb, "last_bucket_mb")
    if comm_stream_priority not in STREAM_PRIORITIES:
        raise ValueError(f"comm_stream_priority={comm_stream_priority!r} is not valid; accepted values: "
                         f"{', '.join(map(repr, STREAM_PRIORITIES))}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"timeout={timeout!r} is not valid; give seconds > 0 (the Trainer passes ddp_timeout), "
                         f"or None for {DEFAULT_TIMEOUT_S:.0f} s")
