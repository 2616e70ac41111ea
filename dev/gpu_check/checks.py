"""What the parts share: the named checks a part passes or fails by, what each compared, its
device, a small MLP.

A check that compares (gradients against a reference, a report against the profiler, a batch
against its source) says how many things of which kind it compared (`Checks.compare`): a
comparison of nothing fails, and so does a part that compared nothing at all. This is how a
check that cannot fail is caught: a one-rank NCCL collective that is a copy, a collective that
is a no-op, an option read back where it was set, two names for one tensor.
"""

from __future__ import annotations

import math


class Checks:
    """The named checks of one part; it passes when every one holds and at least one compared something."""

    def __init__(self):
        self.items: list[tuple[str, bool, str]] = []
        self.compared: list[tuple[str, int, str]] = []    # (check, how many, of what)

    def add(self, name: str, ok: bool, info: str = "") -> bool:
        self.items.append((name, bool(ok), info))
        return bool(ok)

    def compare(self, name: str, count: int, kind: str, ok: bool, info: str = "") -> bool:
        """A check that compared ``count`` things of ``kind``; with none compared it fails, whatever ``ok`` says."""
        count = int(count)
        self.compared.append((name, count, kind))
        if count <= 0:
            return self.add(name, False, f"compared nothing ({kind})" + (f"; {info}" if info else ""))
        return self.add(name, ok, f"{count} {kind}" + (f"; {info}" if info else ""))

    def failed(self) -> list[str]:
        return [f"{n}" + (f": {i}" if i else "") for n, ok, i in self.items if not ok]

    def compared_line(self) -> str:
        """One line for the table: what the part compared, check by check (the kinds summed)."""
        totals: dict[str, int] = {}
        for _, n, kind in self.compared:
            totals[kind] = totals.get(kind, 0) + n
        return "compared: " + (", ".join(f"{n} {kind}" for kind, n in totals.items()) if totals else "NOTHING")

    def result(self, summary: list[str], numbers: dict, detail: str = "") -> dict:
        if not self.compared:
            self.add("the part compared something", False, "no check of this part compared anything")
        failed = self.failed()
        return {"status": "fail" if failed else "pass", "summary": [self.compared_line()] + list(summary),
                "failed": failed, "numbers": numbers, "checks": [list(c) for c in self.items],
                "compared": [list(c) for c in self.compared], "detail": detail}


def same_memory(a, b) -> bool:
    """Whether two tensors are one tensor under two names (same object, or the same storage at the same place)."""
    if a is b:
        return True
    try:
        return (a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                and a.storage_offset() == b.storage_offset() and a.numel() > 0)
    except (RuntimeError, NotImplementedError):   # a tensor without storage (meta, functional)
        return False


def compare_tensors(checks: Checks, name: str, got, want, atol: float, kind: str = "tensors") -> float:
    """Compare two lists of tensors elementwise within ``atol``; returns the largest ``|got - want|``.

    Counts the pairs compared; a pair that is one tensor twice is not a comparison: it is reported
    and fails the check (as does a length mismatch or an empty list).
    """
    got, want = list(got), list(want)
    pairs = list(zip(got, want))
    aliased = [i for i, (a, b) in enumerate(pairs) if same_memory(a, b)]
    real = [(a, b) for i, (a, b) in enumerate(pairs) if i not in set(aliased)]
    worst = max([0.0] + [float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0
                         for a, b in real])
    shapes_ok = all(a.shape == b.shape for a, b in real)
    elements = sum(a.numel() for a, _ in real)
    info = f"{elements} elements, max |diff| {worst:.1e} (atol {atol:g})"
    if aliased:
        info += f"; {len(aliased)} pair(s) are one tensor twice (identical objects compared)"
    if len(got) != len(want):
        info += f"; {len(got)} vs {len(want)} tensors"
    ok = not aliased and len(got) == len(want) and shapes_ok and worst <= atol
    checks.compare(name, len(real), kind, ok, info)
    return worst


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
