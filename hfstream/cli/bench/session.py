"""What runs inside one rank: the timed sessions, one per mode, stepped side by side.

Every rank builds the same sessions in the same order (`rank_main`), warms each up, then times
them in interleaved rounds. How the parts of a step are measured (``time.perf_counter`` on every
rank; `hfstream.cli.bench.summary` takes per step the mean over ranks, the step itself the
slowest rank, then the median over the timed steps):

    GradSync modes   forward | loss.backward() | sync.finish() | optimizer.step + zero_grad;
                     comm busy and exposed comm from ``sync.stats``
    DDP modes        a comm hook (the default all-reduce hook plus timestamps) records when each
                     bucket is launched and completed; backward ends at the last launch, and the
                     rest of ``loss.backward()`` (DDP waits for its buckets there) is exposed comm
    sharded          as GradSync's modes, ``optimizer.step()`` of the sharded AdamW included; the
                     reduce-scatters are comm busy/exposed of ``finish()``, the previous step's
                     all-gathers come with the same ``sync.stats``; what the forward waited for
                     them is taken out of forward and counted as exposed comm (as the step report)
    FSDP2            forward | loss.backward() | optimizer: FSDP2 hides its collectives, so comm
                     busy/exposed are not measured (its waits are inside forward and backward)

Each session also reports its optimizer's state per rank (bytes of the state tensors this rank
holds, after the timed steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import statistics
import sys
import threading
import time

from hfstream.gradsync import DDP_BUCKET_MB, GradSync, union_length
from hfstream.gradsync.tune import max_auto_steps

from .config import MODES, BenchConfig, ModelSpec

AUTO_TUNING_MAX_STEPS = max_auto_steps()   # bound on the extra warm-up an "auto" session takes to finish tuning
AUTO_MODES = ("overlap-auto", "sharded")   # the compared modes whose GradSync runs bucket_mb="auto"


def _build_model(spec: ModelSpec, seed: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=spec.n_layer, n_embd=spec.n_embd, n_head=spec.n_head, vocab_size=spec.vocab_size,
        n_positions=spec.seq_len, bos_token_id=spec.vocab_size - 1, eos_token_id=spec.vocab_size - 1,
    )
    torch.manual_seed(seed)   # every mode starts from the same weights
    return GPT2LMHeadModel(config)


class _CommTimer:
    """State of `_timed_allreduce_hook`: launch/complete times of DDP's bucket reductions."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def take(self) -> list[tuple[float, float]]:
        with self._lock:
            spans, self.spans = self.spans, []
        return spans


def _timed_allreduce_hook(state: _CommTimer, bucket):
    """DDP's default all-reduce hook (divide, then sum over ranks) plus timestamps.

    It calls ``torch.distributed.all_reduce`` by attribute, so under the simulated link the
    future DDP waits on completes when the link says (see `hfstream.cli.bench.link.SimulatedLink`).
    """
    import torch.distributed as dist

    buf = bucket.buffer()
    buf.div_(state.world_size)
    launched = time.perf_counter()
    fut = dist.all_reduce(buf, async_op=True).get_future()

    def done(f):
        with state._lock:
            state.spans.append((launched, time.perf_counter()))
        return f.value()[0]

    return fut.then(done)


class _Progress:
    """Progress on stderr, from rank 0, at most every couple of seconds, with an honest ETA.

    The ETA is the steps left times the mean time of the steps measured so far (from the end of
    the first step: the setup before it is not a step's cost), and "unknown" until `MIN_MEASURED`
    steps have been. A session with ``bucket_mb="auto"`` tunes for a number of steps it decides
    as it goes (at most `AUTO_TUNING_MAX_STEPS`): while one is pending the ETA is a lower bound.
    """

    MIN_MEASURED = 3

    def __init__(self, total_steps: int, enabled: bool, tuning_sessions: int = 0, clock=time.perf_counter):
        self.total, self.done, self.enabled, self.clock = total_steps, 0, enabled, clock
        self.tuning_left = tuning_sessions   # "auto" sessions that have not finished tuning
        self.measured = 0                    # steps timed since the first one ended (tuning steps too)
        self.first_end = None
        self.last = clock()

    def _tick(self) -> float:
        now = self.clock()
        if self.first_end is None:
            self.first_end = now
        else:
            self.measured += 1
        return now

    def tuning(self, label: str, i: int) -> None:
        """One extra step of an "auto" session that is still choosing its bucket cap."""
        now = self._tick()
        if now - self.last >= 2.0:
            self._say(label, "tuning", f"step {i:>3}/{AUTO_TUNING_MAX_STEPS} at most | ", now)

    def tuned(self) -> None:
        self.tuning_left = max(0, self.tuning_left - 1)

    def step(self, label: str, i: int, n: int, phase: str) -> None:
        self.done += 1
        now = self._tick()
        if now - self.last < 2.0 and self.done < self.total:
            return
        self._say(label, phase, f"step {i:>3}/{n:<3} | ", now)

    def eta(self) -> str:
        left = self.total - self.done
        if left == 0 and not self.tuning_left:
            return "ETA 0s"
        if self.measured < self.MIN_MEASURED:
            return "ETA unknown (too few steps timed)"
        per_step = (self.clock() - self.first_end) / self.measured
        if self.tuning_left:
            return (f"ETA at least {_fmt_s(per_step * left)} ({per_step:.2f} s/step; auto-tuning adds up to "
                    f"{AUTO_TUNING_MAX_STEPS} steps per 'auto' session, {self.tuning_left} to go)")
        return f"ETA {_fmt_s(per_step * left)} ({per_step:.2f} s/step)"

    def _say(self, label: str, phase: str, where: str, now: float) -> None:
        if not self.enabled:
            return
        self.last = now
        elapsed = now - (self.first_end if self.first_end is not None else now)
        print(f"[hfstream bench] {label:<13} {phase:<10} {where}{self.done}/{self.total} steps "
              f"({100 * self.done / self.total:3.0f} %) | {_fmt_s(elapsed)} since the first step | {self.eta()}",
              file=sys.stderr, flush=True)


def _fmt_s(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s" if s >= 60 else f"{s:.0f}s"


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the optimizer state tensors this rank holds (a DTensor counts its local shard)."""
    import torch

    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def _fully_shard(model, reshard_after_forward: bool) -> None:
    """FSDP2 as its docs apply it to a transformer: each block its own unit, then the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


class _Session:
    """One mode on its own copy of the model: built once, then stepped in rounds.

    Args:
        kind: ``"ddp"``, ``"serial"``, ``"overlap"``, ``"sharded"`` or ``"fsdp2"``.
        bucket_mb: bucket cap in MiB; None = DDP's own default; "auto" = GradSync tunes it.
            For ``"fsdp2"``: ``reshard_after_forward`` (True/False) instead.
        label: the run's name in the results, e.g. ``"ddp@4"``.
    """

    def __init__(self, kind: str, bucket_mb: float | str | None, cfg: BenchConfig, label: str):
        import torch
        import torch.distributed as dist

        self.kind, self.bucket_mb, self.label = kind, bucket_mb, label
        # Sharded mode's all-gathers run across the step boundary (launched in the step, waited
        # for in the next forward): after another mode's steps they would have finished for free.
        self.carries_over = kind == "sharded"
        self.model = _build_model(cfg.model, cfg.seed)
        self.sync = self.timer = None
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.forward = DistributedDataParallel(self.model, bucket_cap_mb=bucket_mb)
            self.timer = _CommTimer(dist.get_world_size())
            self.forward.register_comm_hook(self.timer, _timed_allreduce_hook)
        elif kind == "fsdp2":
            _fully_shard(self.model, reshard_after_forward=bool(bucket_mb))
            self.forward = self.model
        else:
            self.sync = GradSync(self.model, bucket_mb=bucket_mb, mode=kind)
            self.forward = self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        if kind == "sharded":
            self.opt = self.sync.shard_optimizer(self.opt)
        self.records: list[dict] = []
        self.steps = 0

    def step(self, x, keep: bool) -> None:
        """One training step on batch ``x``; its record is kept when ``keep``."""
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        batch = x                      # the data is already in memory: data wait is ~0 by design
        t1, c1 = time.perf_counter(), time.thread_time()
        loss = self.forward(input_ids=batch, labels=batch).loss
        t2, c2 = time.perf_counter(), time.thread_time()
        loss.backward()
        t3, c3 = time.perf_counter(), time.thread_time()
        if self.sync is not None:
            self.sync.finish()
        t4 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t5, c5, p5 = time.perf_counter(), time.thread_time(), time.process_time()
        self.steps += 1
        halves, waited = {}, 0.0
        if self.kind == "fsdp2":
            backward, busy, exposed, collectives = t3 - t2, math.nan, math.nan, math.nan
        elif self.sync is not None:
            st = self.sync.stats
            backward, busy, exposed, collectives = t3 - t2, st.comm_busy_ms, st.exposed_comm_ms, st.num_collectives
            if self.kind == "sharded":
                # This step's stats carry the previous step's all-gathers; the forward's wait for
                # them is communication, not forward compute (as in the step report).
                waited = min(st.all_gather_exposed_ms, (t2 - t1) * 1e3)
                halves = {"reduce_scatter_busy_ms": busy, "reduce_scatter_exposed_ms": exposed,
                          "all_gather_busy_ms": st.all_gather_busy_ms, "all_gather_exposed_ms": waited}
                busy, exposed, collectives = busy + st.all_gather_busy_ms, exposed + waited, collectives + st.num_all_gathers
        else:
            spans = self.timer.take()
            # The last bucket is launched when backward has produced its last gradient; what
            # loss.backward() spends after that is DDP waiting for its reductions.
            last = max((a for a, _ in spans), default=t3)
            backward = min(max(last - t2, 0.0), t3 - t2)
            # The same "in flight" measure GradSync reports as comm_busy_ms.
            busy, exposed, collectives = union_length(spans) * 1e3, (t3 - t2 - backward) * 1e3, len(spans)
        if keep:
            self.records.append({
                # Sharded: the forward pre-hooks' wait for the all-gathers is exposed comm, not forward.
                "data_ms": (t1 - t0) * 1e3, "forward_ms": (t2 - t1) * 1e3 - waited, "backward_ms": backward * 1e3,
                "comm_busy_ms": busy, "exposed_comm_ms": exposed, "sync_ms": (t4 - t3) * 1e3,
                "optimizer_ms": (t5 - t4) * 1e3, "step_ms": (t5 - t0) * 1e3, "collectives": collectives,
                # Share of a core this rank's compute thread got: well below 1 means another
                # process (or gloo's threads) took the core. DDP's backward also waits for its
                # buckets, which costs no CPU, so its share is taken over the compute part.
                "forward_cpu_share": (c2 - c1) / (t2 - t1), "backward_cpu_share": (c3 - c2) / max(backward, 1e-9),
                # CPU time of this process's other threads (gloo's send/receive/reduce threads):
                # on a machine with a core per rank, that is time taken from compute.
                "comm_threads_cpu_ms": ((p5 - p0) - (c5 - c0)) * 1e3,
                "loss": float(loss.detach()),
                **halves,
            })

    def settle(self) -> None:
        """Wait for what this session's last step left in flight (sharded: its all-gathers)."""
        if self.carries_over:
            self.sync.wait_for_params()

    def result(self) -> dict:
        tuned = self.sync.cap_mb if self.sync is not None and self.bucket_mb == "auto" else self.bucket_mb
        tuning = getattr(self.sync, "tuning_result", None)
        return {"kind": self.kind, "bucket_mb": tuned, "tuning": dataclasses.asdict(tuning) if tuning else None,
                "buckets": len(self.sync.buckets) if self.sync is not None else None, "records": self.records,
                "optimizer_state_bytes": optimizer_state_bytes(self.opt)}

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
        self.model = self.forward = self.sync = self.opt = None


def _rounds(cfg: BenchConfig) -> int:
    return max(1, min(cfg.rounds, cfg.steps))


def _run_interleaved(sessions: list[_Session], cfg: BenchConfig, batches: list, progress: _Progress) -> None:
    """Warm every session up, then time them in rounds, round-robin.

    Interleaving spreads slow phases of a shared machine (another job, frequency changes) over
    all modes instead of charging them to whichever mode ran at that moment. A session whose
    communication crosses the step boundary (sharded: the all-gathers) takes one untimed step
    at the start of each round, so no timed step finds its gathers done during other modes' steps,
    and waits for them at the end of its turn, so they do not run during the next mode's steps.
    """
    import torch.distributed as dist

    for s in sessions:
        dist.barrier()   # start together: a step's time should not include a peer's setup
        for i in range(cfg.warmup):
            s.step(batches[s.steps % len(batches)], keep=False)
            progress.step(s.label, i + 1, cfg.warmup, "warm-up")
        # bucket_mb="auto" tries caps in its first steps; time it only once it has chosen. The
        # choice is collective, so every rank leaves this loop at the same step.
        extra = 0
        while s.sync is not None and s.sync.tuning is not None and extra < AUTO_TUNING_MAX_STEPS:
            s.step(batches[s.steps % len(batches)], keep=False)
            extra += 1
            progress.tuning(s.label, extra)
        if s.bucket_mb == "auto":
            progress.tuned()
    rounds = _rounds(cfg)
    for r in range(rounds):
        for s in sessions:
            n = cfg.steps // rounds + (r < cfg.steps % rounds)
            dist.barrier()
            if s.carries_over and n:   # a lead-in, untimed: its gathers now overlap its own step
                s.step(batches[s.steps % len(batches)], keep=False)
                progress.step(s.label, len(s.records), cfg.steps, f"round {r + 1}/{rounds} lead-in")
            for i in range(n):
                s.step(batches[s.steps % len(batches)], keep=True)
                progress.step(s.label, len(s.records), cfg.steps, f"round {r + 1}/{rounds}")
            s.settle()   # nothing of its own left on the link or the cores for the next mode's steps


def rank_main(rank: int, world_size: int, cfg_dict: dict, shaping: dict) -> dict:
    """One rank of the benchmark: the same sessions, in the same order, on every rank.

    Phase 1 sweeps DDP's bucket size (when ddp-best or overlap-best is asked for) and agrees
    on the best; phase 2 runs the compared modes side by side, interleaved.
    """
    import torch
    import torch.distributed as dist
    import transformers

    from .link import SimulatedLink, measure_allreduce

    transformers.logging.set_verbosity_error()
    cfg = BenchConfig.from_dict(cfg_dict)
    spec = cfg.model
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)   # each rank its own shard
    batches = [torch.randint(0, spec.vocab_size, (spec.batch_size, spec.seq_len), generator=gen) for _ in range(4)]
    params = sum(p.numel() for p in _build_model(spec, cfg.seed).parameters())

    sweep = "ddp-best" in cfg.modes or "overlap-best" in cfg.modes
    sweep_runs = [("ddp", mb, "ddp@default" if mb is None else f"ddp@{mb:g}") for mb in [None, *cfg.ddp_buckets]] \
        if sweep else []
    if "sharded-best" in cfg.modes:
        sweep_runs += [("sharded", mb, f"sharded@{mb:g}") for mb in cfg.sharded_buckets]
    if "fsdp2-best" in cfg.modes:
        sweep_runs += [("fsdp2", reshard, f"fsdp2@reshard={reshard}") for reshard in (True, False)]
    main_runs = [m for m in MODES if m in cfg.modes]
    # One untimed lead-in per round for each session that carries work over (`_Session.carries_over`).
    lead_ins = _rounds(cfg) * (sum(kind == "sharded" for kind, _, _ in sweep_runs)
                               + sum(m in ("sharded", "sharded-best") for m in main_runs))
    total = (len(sweep_runs) + len(main_runs)) * (cfg.warmup + cfg.steps) + lead_ins
    progress = _Progress(total, enabled=rank == 0, tuning_sessions=sum(m in AUTO_MODES for m in main_runs))

    link = SimulatedLink(shaping["rate_mbit"], shaping["latency_ms"]) if shaping["kind"] == "simulated" else None
    sweep_results: dict[str, dict] = {}
    runs: dict[str, dict] = {}
    best_mb, load = None, [os.getloadavg()[0]]
    with link.installed() if link is not None else contextlib.nullcontext():
        calibration = measure_allreduce(min(8 * 2**20, params * 4))
        best = {}
        if sweep_runs:
            # One sweep for every "-best" mode, interleaved like the compared modes.
            sessions = [_Session(kind, mb, cfg, label) for kind, mb, label in sweep_runs]
            _run_interleaved(sessions, cfg, batches, progress)
            for s in sessions:
                sweep_results[s.label] = s.result()
                s.close()
            del sessions
            gc.collect()
            # Every rank must pick the same best bucket, by the statistic the report shows: per
            # step the slowest rank, then the median over steps.
            steps = torch.tensor([[r["step_ms"] for r in res["records"]] for res in sweep_results.values()],
                                 dtype=torch.float64)
            dist.all_reduce(steps, op=dist.ReduceOp.MAX)
            medians = [statistics.median(row) for row in steps.tolist()]
            for kind in ("ddp", "sharded", "fsdp2"):
                mine = [(m, mb) for m, (k, mb, _) in zip(medians, sweep_runs) if k == kind]
                if mine:
                    best[kind] = min(mine, key=lambda t: t[0])[1]
            best_mb = best.get("ddp")
        load.append(os.getloadavg()[0])
        # (kind, bucket_mb) of each mode; GradSync's modes default to DDP's cap, as GradSync does.
        specs = {"serial": ("serial", DDP_BUCKET_MB), "ddp-default": ("ddp", None), "ddp-best": ("ddp", best_mb),
                 "overlap": ("overlap", DDP_BUCKET_MB),
                 "overlap-best": ("overlap", DDP_BUCKET_MB if best_mb is None else best_mb),
                 "overlap-auto": ("overlap", "auto"),
                 "fsdp2-best": ("fsdp2", best.get("fsdp2", False)),
                 "sharded": ("sharded", "auto"),
                 "sharded-best": ("sharded", best.get("sharded", DDP_BUCKET_MB))}
        sessions = [_Session(*specs[m], cfg, m) for m in main_runs]
        _run_interleaved(sessions, cfg, batches, progress)
        for s in sessions:
            runs[s.label] = s.result()
            s.close()
        load.append(os.getloadavg()[0])
    return {"runs": runs, "sweep": sweep_results, "best_ddp_bucket_mb": best_mb, "best_of_sweep": best,
            "calibration": calibration, "params": params, "num_threads": torch.get_num_threads(),
            "loadavg_1min": load}
