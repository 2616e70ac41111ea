"""The commands' optional dependencies: a missing one is named with the extra that installs it.

``pip install hfstream`` trains; the figures need ``hfstream[plots]`` (matplotlib) and the demo's
data ``hfstream[demo]`` (datasets, and matplotlib for its figures).
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """``import module``, or an error that says which extra of hfstream installs it.

    Args:
        module: what to import (``"matplotlib.figure"``, ``"datasets"``).
        extra: the extra of hfstream that depends on its package (``"plots"``, ``"demo"``).

    Raises:
        ModuleNotFoundError: the package is not installed, with the ``pip install`` line that adds it.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        package = module.split(".")[0]
        if (exc.name or "").split(".")[0] != package:   # a module of another package is missing: not ours to name
            raise
        raise ModuleNotFoundError(f"{package} is not installed; it comes with hfstream's {extra!r} extra: "
                                  f"pip install 'hfstream[{extra}]'", name=package) from None
