"""Parts 4 and 5, on one process without a process group.

4: GradSync costs nothing at world size 1 (step time with and without it, no host sync).
5: a StreamTrainer run (tiny GPT-2 from a config): it trains, and its ``stream_report()``.
"""

from __future__ import annotations

import math
import tempfile
import time

from hfstream.tools.gpu_check.checks import Checks, median, mlp, mse, part_device, synchronize
from hfstream.tools.gpu_check.syncdebug import host_reads, sync_debug


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
    world_sizes = []

    def run_round(count: int, with_sync: bool) -> float:
        sync = GradSync(model, bucket_mb=25.0) if with_sync else None
        if sync is not None:
            world_sizes.append(sync.world_size)
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

    run_round(10, False)
    run_round(10, True)
    without, with_ = [], []
    for _ in range(rounds):
        without.append(run_round(steps, False))
        with_.append(run_round(steps, True))
    a, b = median(without), median(with_)
    checks.compare("GradSync without a process group has world size 1", len(world_sizes), "GradSync instances",
                   all(w == 1 for w in world_sizes), f"{world_sizes}")
    checks.add("no host sync in the step under set_sync_debug_mode('error')" if cuda else "steps ran", not errors,
               "; ".join(errors))
    if cuda:   # on a shared CPU the noise is larger than the difference: there it is only reported
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
               f"rounds x {steps} steps, MLP {layers}x{width}" + ("; no host sync under 'error'" if cuda else "")]
    return checks.result(summary, dict(without_ms=without, with_ms=with_, median_without_ms=a, median_with_ms=b))


def part_trainer(quick: bool, on_cpu: bool, timeout_s: float) -> dict:
    import logging

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from hfstream import StreamTrainer, StreamTrainingArguments

    checks = Checks()
    steps = 12 if quick else 20
    seq, vocab, batch = 32, 64, 16
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    # Arithmetic sequences (start, stride): predictable after two tokens, so the loss must fall.
    g = torch.Generator().manual_seed(1)
    n = steps * batch
    ids = (torch.randint(0, vocab, (n, 1), generator=g) + torch.randint(1, 4, (n, 1), generator=g)
           * torch.arange(seq)) % vocab
    dataset = [{"input_ids": row.clone(), "labels": row.clone()} for row in ids]
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as out:
        args = StreamTrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=3e-3,
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
            lr_scheduler_type="constant", seed=0, prefetch_depth=2, use_cpu=on_cpu)
        trainer = StreamTrainer(model=model, args=args, train_dataset=dataset)
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    report = trainer.stream_report()
    mean = dict(report.get("mean") or {}) if report else {}
    first, last = losses[:3], losses[-3:]
    drop = (sum(first) / len(first), sum(last) / len(last)) if losses else (math.nan, math.nan)
    on_device = next(model.parameters()).device
    checks.compare(f"{steps} optimizer steps logged", len(losses), "logged losses", len(losses) == steps)
    checks.compare("it trains: mean of the last 3 losses < 0.9 x the first 3", min(len(first), len(last)) * 2,
                   "losses", all(math.isfinite(v) for v in losses) and drop[1] < 0.9 * drop[0],
                   f"{drop[0]:.3f} -> {drop[1]:.3f}")
    checks.add("the model trained on the GPU" if not on_cpu else "the model trained on the CPU",
               on_device.type == ("cpu" if on_cpu else "cuda"), str(on_device))
    checks.add("stream_report() has a mean row with a step time", mean.get("step_ms", 0) > 0, f"{mean}")

    def ms(key):
        v = mean.get(key)
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"

    eff = mean.get("efficiency")
    summary = [
        f"loss {drop[0]:.3f} -> {drop[1]:.3f} in {len(losses)} steps (tiny GPT-2, batch {batch}x{seq}, "
        f"grad_sync {report.get('grad_sync') if report else '?'}, prefetch_depth {report.get('prefetch_depth') if report else '?'})",
        f"stream_report mean: data wait {ms('data_wait_ms')}, forward {ms('forward_ms')}, backward {ms('backward_ms')}, "
        f"optimizer {ms('optimizer_ms')}, step {ms('step_ms')}, ideal {ms('ideal_ms')} ms, efficiency "
        + (f"{100 * eff:.0f} %" if isinstance(eff, float) and math.isfinite(eff) else "n/a"),
    ]
    return checks.result(summary, dict(losses=losses, mean=mean), detail=str(report) if report else "")
