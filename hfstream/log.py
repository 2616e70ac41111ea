"""hfstream's log lines: on stderr, at the Trainer's ``log_level``, each marked ``[hfstream]`` once.

Three kinds of line: ``info`` (details, shown with ``--log_level info``), `notice` (a decision
hfstream made for the user: an ``"auto"`` resolved, ``use_cpu`` switched on, a bucket cap chosen;
shown at the default level, once per process, on the main process only) and ``warning``
(something given up or wrong, on every rank that meets it).
"""

from __future__ import annotations

import logging
import os

NOTICE = 25   # between INFO (20) and WARNING (30): shown at the Trainer's default level, hidden at "error"
logging.addLevelName(NOTICE, "NOTICE")

_said: set[str] = set()   # the notices this process has already said (each is said once)


class Prefixed(logging.Formatter):
    """``[hfstream] message``, once: a message that names hfstream itself ("hfstream: ...") loses that name."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        for own in ("hfstream: ", "hfstream "):
            if message.startswith(own):
                message = message[len(own):]
                break
        return f"[hfstream] {message}"


def show_hfstream_logs(level: int) -> None:
    """hfstream's log lines follow the Trainer's ``log_level`` (warnings by default), on stderr.

    At the default level (warning) the decisions (`notice`) are shown too: a user who did not
    ask for details still learns what hfstream chose for them. ``log_level="error"`` hides them.
    """
    root = logging.getLogger("hfstream")
    root.setLevel(min(level, NOTICE) if level <= logging.WARNING else level)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(Prefixed())
        root.addHandler(handler)
        root.propagate = False


def _main_process() -> bool:
    # The decisions are the same on every rank (each rank resolves the same arguments, the bucket
    # cap is agreed): rank 0 says them for all. RANK is set by every launcher before the process
    # group exists (the arguments are parsed before it is).
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def notice(logger: logging.Logger, message: str, *args) -> None:
    """Say a decision hfstream made for the user: once per process, on the main process, at `NOTICE`.

    Visible without ``--log_level info`` (also before a Trainer set the level: arguments are
    built first). The same decision met again (a second Trainer, a copy of the arguments) is
    not repeated.
    """
    text = message % args if args else message
    if text in _said:
        return
    _said.add(text)
    if logging.getLogger("hfstream").level == logging.NOTSET:   # no Trainer yet: the default level
        show_hfstream_logs(logging.WARNING)
    if _main_process():
        logger.log(NOTICE, message, *args)
