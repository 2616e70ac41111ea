"""Part 4: GradSync on one process without a process group costs nothing.

At world size 1 GradSync is inactive by design; what a user relies on is that it then does
nothing at all, so the same script runs on one device at full speed. Observed, not read back:
it adds no hook to the model (a hook would run every step), no device memory (a bucket buffer
would be allocated at the first step), no host read in a step (counted; on a GPU none under
``set_sync_debug_mode("error")``), and no step time (within 10 %, GPU only: on a shared CPU the
noise is larger). A GradSync that stayed active here (the one-rank switch of part 6 on a
one-rank group) fails the hook check on CPU (tests/test_gpu_check_compared.py).
"""

from __future__ import annotations

import time

from dev.gpu_check.checks import Checks, median, mlp, mse, part_device, synchronize
from dev.gpu_check.syncdebug import host_reads, sync_debug


def part_ws1(quick: bool, on_cpu: bool, timeout_s: float) -> dict:
    import torch

    from hfstream import GradSync

    cuda = not on_cpu
    dev = part_device(on_cpu)
    checks = Checks()
    width, layers, batch = (128, 4, 16) if on_cpu else (1024, 6, 64)
    rounds, steps = (3, 40) if (quick or on_cpu) else (5, 100)
    torch.manual_seed(0)
    model = mlp(width, layers).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width, device=dev), torch.randn(batch, width, device=dev)
    errors: list[str] = []

    def run_round(count: int, with_sync: bool) -> float:
        sync = GradSync(model, bucket_mb=25.0) if with_sync else None
        synchronize(cuda)
        t0 = time.perf_counter()
        with sync_debug("error", cuda):
            try:
                for _ in range(count):
                    mse(model, x, y).backward()
                    if sync is not None:
                        sync.finish()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            except RuntimeError as exc:
                errors.append(f"{'with' if with_sync else 'without'} GradSync: {str(exc).splitlines()[0]}")
        synchronize(cuda)
        ms = (time.perf_counter() - t0) * 1e3 / count
        if sync is not None:
            sync.close()
        return ms

    # What GradSync adds to the model and the device: nothing (measured around one step with it,
    # after one without: the first backward allocates the math libraries' workspaces).
    mse(model, x, y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    hooks_before = model_hooks(model)
    synchronize(cuda)
    memory_before = torch.cuda.memory_allocated(dev) if cuda else 0
    probe = GradSync(model, bucket_mb=25.0)
    hooks_added = model_hooks(model) - hooks_before
    mse(model, x, y).backward()
    probe.finish()
    opt.step()
    opt.zero_grad(set_to_none=True)
    synchronize(cuda)
    memory_added = (torch.cuda.memory_allocated(dev) - memory_before) if cuda else 0
    probe.close()

    run_round(10, False)
    run_round(10, True)
    without, with_ = [], []
    for _ in range(rounds):
        without.append(run_round(steps, False))
        with_.append(run_round(steps, True))
    a, b = median(without), median(with_)
    checks.compare("GradSync at world size 1 adds no hook to the model",
                   len(list(model.parameters())) + len(list(model.modules())), "parameters and modules watched",
                   hooks_added == 0, f"{hooks_added} hooks added")
    if cuda:   # on CPU: no device memory, no sync-debug mode (the counted host reads below stand for it)
        checks.compare("GradSync at world size 1 allocates no device memory (a step with it, after one without)",
                       1, "steps", memory_added == 0, f"{memory_added} bytes added")
        checks.add("no host sync in the step under set_sync_debug_mode('error')", not errors, "; ".join(errors))
        # On a shared CPU the noise is larger than the difference: there it is only reported.
        checks.compare("step time with GradSync ~ without (within 10 %)", rounds * steps, "timed steps each",
                       b <= 1.10 * a + 0.005, f"{b:.3f} vs {a:.3f} ms")
    # One step with GradSync watched: it must not read a tensor on the host (on CPU too, where the
    # sync-debug mode does not exist). The counter's control is a deliberate .item().
    with host_reads(dev.type) as control:
        torch.ones((), device=dev).item()
    checks.add("control: the host-read counter catches a deliberate .item()", len(control.reads) == 1)
    sync = GradSync(model, bucket_mb=25.0)
    with host_reads(dev.type) as watch:
        mse(model, x, y).backward()
        sync.finish()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync.close()
    checks.compare("no host read in a step with GradSync (counted)", watch.calls, "torch calls watched",
                   not watch.reads, "; ".join(watch.reads[:4]))
    summary = [f"step {a:.3f} ms without, {b:.3f} ms with GradSync ({100 * (b / a - 1):+.1f} %), median of {rounds} "
               f"rounds x {steps} steps, MLP {layers}x{width}" + ("; no host sync under 'error'" if cuda else ""),
               f"added by GradSync: {hooks_added} hooks" + (f", {memory_added} bytes of device memory" if cuda else "")]
    return checks.result(summary, dict(without_ms=without, with_ms=with_, median_without_ms=a, median_with_ms=b,
                                       hooks_added=hooks_added, memory_added=memory_added))


def model_hooks(model) -> int:
    """Hooks on the model: its parameters' post-accumulate-grad hooks and its modules' forward hooks."""
    grads = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())
    return grads + sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
