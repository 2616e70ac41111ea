"""StreamTrainer(grad_sync="sharded") on 2 processes, and a torch.profiler trace of one sharded step on an accelerator."""

from __future__ import annotations

from pathlib import Path

import torch


# =============================================================================================
# The Trainer: StreamTrainer(grad_sync="sharded"), 2 processes
# =============================================================================================
def _trainer_rank(rank, world_size, out_dir, grad_sync):
    import datasets
    import transformers

    from course.lib import tiny_gpt2
    from hfstream import StreamTrainer, StreamTrainingArguments

    transformers.logging.set_verbosity_error()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 257, (64, 32), generator=g)
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = StreamTrainingArguments(output_dir=out_dir, grad_sync=grad_sync, max_steps=8, per_device_train_batch_size=4,
                                   learning_rate=1e-3, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                                   report_to=[], seed=0, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                                   prefetch_depth=0, lr_scheduler_type="constant")
    trainer = StreamTrainer(model=tiny_gpt2(layers=2, width=64), args=args, train_dataset=data)
    trainer.remove_callback(transformers.PrinterCallback)     # the notebook prints what matters
    trainer.train()
    state = trainer.optimizer.state
    state_numel = sum(v.numel() for s in state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim())
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "mode": getattr(trainer, "grad_sync_mode", grad_sync), "state_numel": state_numel,
            "model_numel": sum(p.numel() for p in trainer.model.parameters())}


def train_sharded(out_dir: str, grad_sync: str = "sharded") -> dict:
    """`StreamTrainer(grad_sync=...)` for 8 steps on 2 gloo processes; losses, replica agreement, optimizer state."""
    from hfstream.testing import run_on_ranks

    ranks = run_on_ranks(_trainer_rank, 2, out_dir, grad_sync, init_process_group=False, timeout=240)
    diff = max(float((ranks[0]["params"][k] - ranks[1]["params"][k]).abs().max()) for k in ranks[0]["params"])
    return {"losses": ranks[0]["losses"], "max_rank_difference": diff, "mode": ranks[0]["mode"],
            "state_numel": [r["state_numel"] for r in ranks], "model_numel": ranks[0]["model_numel"]}


# =============================================================================================
# On an accelerator: a torch.profiler trace of one sharded step
# =============================================================================================
def _profile_rank(rank, world_size, device, out_dir):
    import transformers

    from course.lib import tiny_gpt2
    from hfstream.gradsync import GradSync

    transformers.logging.set_verbosity_error()
    dev = torch.device(device)
    if dev.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.set_device_index(0)
    model = tiny_gpt2(layers=4, width=128).to(dev)
    ids = torch.randint(0, 257, (8, 64), generator=torch.Generator().manual_seed(rank)).to(dev)
    sync = GradSync(model, mode="sharded", bucket_mb=0.25)
    opt = sync.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(label):
        with torch.profiler.record_function(f"{label}: forward"):
            loss = model(input_ids=ids, labels=ids).loss
        with torch.profiler.record_function(f"{label}: backward"):
            loss.backward()
            sync.finish()
        with torch.profiler.record_function(f"{label}: clip + optimizer step"):
            sync.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    for i in range(3):
        step(f"warm-up {i}")
    activities = list(torch.profiler.supported_activities()) if rank == 0 else [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        step("step")
        with torch.profiler.record_function("next step: forward"):
            model(input_ids=ids, labels=ids)
        if dev.type != "cpu":
            torch.accelerator.synchronize()
    sync.close()
    if rank != 0:
        return None
    path = Path(out_dir) / "sharded_step_rank0.json"
    prof.export_chrome_trace(str(path))
    spans = {}
    gathers = []
    for e in prof.events():
        name = e.name
        start, end = e.time_range.start / 1e3, e.time_range.end / 1e3
        if name in ("step: forward", "step: backward", "step: clip + optimizer step", "next step: forward"):
            spans[name] = (start, end)
        elif "all_gather" in name.lower() or "allgather" in name.lower():
            gathers.append((start, end, name))
    t0 = spans["step: forward"][0]
    step_end = spans["step: clip + optimizer step"][1]
    nxt = spans["next step: forward"]
    after = sorted(g for g in gathers if g[0] >= step_end - 1e-3)
    lines = [f"rank 0, ms from the step's start: forward {spans['step: forward'][0] - t0:.1f}-"
             f"{spans['step: forward'][1] - t0:.1f}, backward ...-{spans['step: backward'][1] - t0:.1f}, step ends "
             f"{step_end - t0:.1f}, next forward {nxt[0] - t0:.1f}-{nxt[1] - t0:.1f}"]
    if after:
        names = sorted({g[2] for g in after})
        lines.append(f"{len(after)} all-gather events after the step ({', '.join(names[:3])}): first starts "
                     f"{after[0][0] - t0:.1f}, last ends {max(g[1] for g in after) - t0:.1f}; "
                     f"{sum(g[1] > nxt[0] for g in after)} of them end after the next forward has begun")
    else:
        lines.append(f"no all-gather event after the step among {len(gathers)} all-gather events in the trace")
    return {"summary": "\n".join(lines), "trace": str(path)}


def profile_sharded_step(device: str, out_dir: str) -> dict:
    """One sharded step (and the next forward) of a tiny GPT-2 on 2 gloo ranks on ``device``, rank 0
    under ``torch.profiler``; returns a summary of where the all-gathers ran and the trace's path."""
    from hfstream.testing import RankFailure, run_on_ranks

    try:
        return run_on_ranks(_profile_rank, 2, device, out_dir, timeout=180, pg_timeout_s=60)[0]
    except RankFailure as exc:
        # Two ranks on one device need gloo to carry device tensors, which not every build does.
        last = [ln.strip() for ln in str(exc).splitlines() if ln.strip()][-1]
        return {"summary": f"the 2-rank sharded step on {device} did not run here (gloo with {device} tensors): "
                           f"{last}", "trace": None}
