"""What every lesson shares: notebook setup, tiny models built from configs, figures.

Lessons import from here and from `hfstream`; exercise code written by the learner may use
any name defined here (the multi-process checks import this module in every rank).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping, Sequence

import torch
import torch.nn as nn

__all__ = [
    "setup_notebook", "has_accelerator", "accelerator_device", "figure_path", "show",
    "TinyMLP", "tiny_gpt2", "random_regression", "bar_chart", "line_chart",
]

GPU_CELL = re.compile(r"^# GPU: (.*)$")


def has_accelerator() -> bool:
    """True when torch sees a CUDA/XPU/MPS/... device."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()


def accelerator_device() -> torch.device:
    """The current accelerator, or the CPU when there is none."""
    if has_accelerator() and hasattr(torch, "accelerator"):
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


def _skip_gpu_cells(lines: list[str]) -> list[str]:
    """IPython input transformer: a cell starting `# GPU: sentence` runs only on an accelerator."""
    if lines:
        m = GPU_CELL.match(lines[0].rstrip("\n"))
        if m and not has_accelerator():
            return [f"print({('Skipped on CPU (no accelerator). ' + m.group(1))!r})\n"]
    return lines


def setup_notebook() -> None:
    """Called by every lesson's first cell: GPU cells skip themselves on CPU, figures inline."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None:
        return
    if _skip_gpu_cells not in ip.input_transformers_cleanup:
        ip.input_transformers_cleanup.append(_skip_gpu_cells)
    import warnings

    warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm without ipywidgets
    os.environ.setdefault("HF_HUB_OFFLINE", "1")          # the course never downloads
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def figure_path(name: str) -> Path:
    """Where a lesson saves a figure: ``course/figures/<name>`` (git-ignored)."""
    out = Path(os.environ.get("HFSTREAM_COURSE_FIGURES", Path(__file__).resolve().parent / "figures"))
    out.mkdir(parents=True, exist_ok=True)
    return out / name


def show(path: str | os.PathLike) -> Path:
    """Display a saved figure in the notebook (and return its path)."""
    path = Path(path)
    try:
        from IPython.display import Image, display

        display(Image(filename=str(path)))
    except ImportError:
        print(f"figure saved to {path}")
    return path


class TinyMLP(nn.Module):
    """A small deterministic MLP: enough layers that gradients arrive one after another."""

    def __init__(self, dim: int = 32, hidden: int = 64, layers: int = 4, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        sizes = [dim] + [hidden] * (layers - 1) + [dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def tiny_gpt2(seed: int = 0, vocab: int = 257, layers: int = 2, width: int = 64, positions: int = 64):
    """A GPT-2 built from a config (no hub), sized for a laptop; vocab 257 fits the byte tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=width, n_layer=layers,
                     n_head=max(1, width // 32), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def random_regression(n: int = 64, dim: int = 32, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for `TinyMLP` (a fixed random linear map plus noise)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, dim, generator=g) / dim ** 0.5
    return x, x @ w + 0.01 * torch.randn(n, dim, generator=g)


def bar_chart(values: Mapping[str, float], path: str | os.PathLike, title: str, ylabel: str = "ms per step",
              reference: float | None = None, reference_label: str = "ceiling") -> Path:
    """A labelled bar per entry, an optional dashed reference line (the ceiling); saved to ``path``."""
    from matplotlib.figure import Figure   # no pyplot: leaves the notebook's backend alone

    fig = Figure(figsize=(6.5, 3.2))
    ax = fig.subplots()
    names = list(values)
    bars = ax.bar(names, [values[n] for n in names], color="#4c72b0")
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    if reference is not None:
        ax.axhline(reference, color="#c44e52", linestyle="--", label=f"{reference_label} {reference:.1f}")
        ax.legend(fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


def line_chart(series: Mapping[str, Sequence[tuple[float, float]]], path: str | os.PathLike, title: str,
               xlabel: str, ylabel: str, logx: bool = False) -> Path:
    """One line per series of ``(x, y)`` points; saved to ``path``."""
    from matplotlib.figure import Figure   # no pyplot: leaves the notebook's backend alone

    fig = Figure(figsize=(6.5, 3.4))
    ax = fig.subplots()
    for label, points in series.items():
        xs, ys = zip(*points) if points else ((), ())
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)
