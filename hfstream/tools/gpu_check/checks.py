"""What the parts share: the named checks a part passes or fails by, its device, a small MLP."""

from __future__ import annotations

import math


class Checks:
    """The named checks of one part; it passes when every one holds."""

    def __init__(self):
        self.items: list[tuple[str, bool, str]] = []

    def add(self, name: str, ok: bool, info: str = "") -> bool:
        self.items.append((name, bool(ok), info))
        return bool(ok)

    def failed(self) -> list[str]:
        return [f"{n}" + (f": {i}" if i else "") for n, ok, i in self.items if not ok]

    def result(self, summary: list[str], numbers: dict, detail: str = "") -> dict:
        failed = self.failed()
        return {"status": "fail" if failed else "pass", "summary": summary, "failed": failed,
                "numbers": numbers, "checks": [list(c) for c in self.items], "detail": detail}


def mlp(width: int, layers: int):
    import torch

    mods = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            mods.append(torch.nn.Tanh())
    return torch.nn.Sequential(*mods)


def mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


def synchronize(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return math.nan if not n else (s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2]))


def part_device(on_cpu: bool):
    import torch

    return torch.device("cpu") if on_cpu else torch.device("cuda", 0)
