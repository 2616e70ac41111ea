"""Device memory over a training run: what each optimizer step leaves allocated and its peak, and
the checks that nothing grows.

A leak in GradSync shows as memory that grows step after step (a buffer kept per step, a plan's
buffers kept after a re-plan), and a re-plan that builds the new layout beside the old one shows
as a peak of two layouts. Measured with the CUDA caching allocator's counters
(``torch.cuda.memory_allocated``: bytes of live tensors; ``max_memory_allocated`` since the last
``reset_peak_memory_stats``), which never wait for the device. The allowance is one bucket of the
plan in use: the size of what GradSync allocates or frees at once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepMemory:
    """One optimizer step: bytes allocated after it, the peak during it, the plan's largest bucket then."""

    allocated: int
    peak: int
    bucket_bytes: int


class MemoryLog:
    """Per optimizer step, `StepMemory`; the peak counter is reset after each step (CUDA only: on CPU it records nothing).

    Args:
        device: the training device.
    """

    def __init__(self, device):
        import torch

        self.device = device
        self.cuda = device.type == "cuda"
        self.steps: dict[int, StepMemory] = {}   # global step -> its memory
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def step_ended(self, step: int, bucket_bytes: int) -> None:
        """After optimizer step ``step`` (the first call for a step counts; the Trainer may end an epoch there too)."""
        import torch

        if not self.cuda or step in self.steps:
            return
        self.steps[step] = StepMemory(torch.cuda.memory_allocated(self.device),
                                      torch.cuda.max_memory_allocated(self.device), int(bucket_bytes))
        torch.cuda.reset_peak_memory_stats(self.device)


def memory_checks(checks, name: str, steps: dict[int, StepMemory], replans: list[int]) -> dict:
    """The memory row of one run: steady state is two steps after the last re-plan (the plan final, the
    optimizer's state built). Against it, within one bucket of the final plan: what the last step leaves
    allocated (no growth), the last step's peak, step 1's peak; each re-plan step's peak within one
    bucket of the larger of the two plans. Returns the numbers shown in the table."""
    mib = 2.0 ** 20
    if not steps:
        checks.compare(f"{name}: memory sampled at every step", 0, "steps sampled", False)
        return {}
    last = max(steps)
    settle = max(replans, default=0) + 2
    if settle >= last or settle not in steps or 1 not in steps:
        checks.add(f"{name}: the plan settled before the last step (steady state to compare with)", False,
                   f"last re-plan at step {max(replans, default=0)}, {last} steps")
        return {}
    steady, end = steps[settle], steps[last]
    bucket = end.bucket_bytes
    growth = end.allocated - steady.allocated
    checks.compare(f"{name}: no growth from steady state to the last step (allocated, within one bucket)",
                   last - settle, "steps after steady state", growth <= bucket,
                   f"step {settle} {steady.allocated / mib:.2f} MiB, step {last} {end.allocated / mib:.2f} MiB, "
                   f"bucket {bucket / mib:.2f} MiB")
    checks.compare(f"{name}: the last step's peak within one bucket of steady state's", 1, "peaks",
                   end.peak <= steady.peak + bucket,
                   f"step {last} {end.peak / mib:.2f} MiB vs step {settle} {steady.peak / mib:.2f} MiB")
    checks.compare(f"{name}: step 1's peak within one bucket of steady state's", 1, "peaks",
                   steps[1].peak <= steady.peak + bucket,
                   f"step 1 {steps[1].peak / mib:.2f} MiB vs step {settle} {steady.peak / mib:.2f} MiB")
    over = {r: steps[r].peak - steady.peak - max(steps[r].bucket_bytes, steps[r - 1].bucket_bytes if r > 1 else 0)
            for r in replans if r in steps}
    worst = max(over, key=over.__getitem__) if over else None
    checks.compare(f"{name}: every re-plan step's peak within one bucket of steady state's", len(over), "re-plan steps",
                   all(v <= 0 for v in over.values()),
                   (f"worst step {worst}: {steps[worst].peak / mib:.2f} MiB vs {steady.peak / mib:.2f} MiB + a bucket"
                    if worst is not None else ""))
    return dict(steady_step=settle, steady_peak_mib=steady.peak / mib, step1_peak_mib=steps[1].peak / mib,
                replan_peak_mib=max((steps[r].peak for r in over), default=0) / mib, last_step=last,
                last_peak_mib=end.peak / mib, growth_mib=growth / mib, bucket_mib=bucket / mib)
