"""Shared fixtures: `run_distributed` (N gloo processes on CPU, hard timeout) and the gpu marker."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # tests never download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_accelerator() -> bool:
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_accelerator():
        return
    skip = pytest.mark.skip(reason="needs an accelerator (no CUDA/XPU/MPS device here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def run_distributed():
    """Call as ``run_distributed(fn, world_size, *args, timeout=..., **kwargs)``.

    ``fn(rank, world_size, *args)`` must be defined at module level in the test file.
    """
    from hfstream.testing import run_on_ranks

    return run_on_ranks
