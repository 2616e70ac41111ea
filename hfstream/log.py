"""hfstream's log lines: on stderr, at the Trainer's ``log_level``, each marked ``[hfstream]`` once."""

from __future__ import annotations

import logging


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
    """hfstream's log lines follow the Trainer's ``log_level`` (warnings by default), on stderr."""
    root = logging.getLogger("hfstream")
    root.setLevel(level)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(Prefixed())
        root.addHandler(handler)
        root.propagate = False
