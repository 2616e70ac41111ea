"""What each half of an all-reduce costs on this machine's backend: the probe behind `gradsync.collectives`.

``python -m dev.bench.collectives [--mb 27] [--reps 11] [--world-size 2]`` runs gloo
ranks on this machine and prints, per primitive, whether it gives the right result and its
median time for one bucket of ``--mb`` MiB: all-reduce, reduce-scatter, all-to-all alone and
with the local sum that turns it into a reduce-scatter, all-gather (single tensor and list
form). docs/design.md section 7 quotes it; on a machine shared with other jobs run it several
times and compare within one run only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from hfstream.gradsync.sharded import collectives
from hfstream.testing import run_on_ranks


def probe(rank: int, world_size: int, mb: float, reps: int) -> dict[str, tuple[bool, float]]:
    """On each rank: ``{primitive: (correct, median ms)}`` for one bucket of ``mb`` MiB of float32."""
    n = max(world_size, int(mb * 2**20 / 4) // world_size * world_size)
    size = n // world_size
    x = torch.full((n,), float(rank + 1))
    total = world_size * (world_size + 1) / 2          # sum over ranks of (rank + 1)
    buf, recv, mine, gathered = torch.empty(n), torch.empty(n), torch.empty(size), torch.empty(n)
    part = torch.full((size,), float(rank + 1))
    expected = torch.arange(1, world_size + 1, dtype=torch.float32).repeat_interleave(size)
    chunks = list(gathered.chunk(world_size))

    def all_to_all_sum():
        dist.all_to_all_single(recv, x, async_op=True).wait()
        collectives.sum_received(recv, mine, world_size)

    cases = {
        "all_reduce": (lambda: dist.all_reduce(buf.copy_(x), async_op=True).wait(), lambda: bool((buf == total).all())),
        "reduce_scatter": (lambda: collectives.launch_reduce_scatter(x, mine, None, local_sum=False).wait(),
                           lambda: bool((mine == total).all())),
        "all_to_all": (lambda: dist.all_to_all_single(recv, x, async_op=True).wait(), lambda: True),
        "all_to_all + local sum": (all_to_all_sum, lambda: bool((mine == total).all())),
        "all_gather (single tensor)": (lambda: collectives.launch_all_gather(gathered, part, None).wait(),
                                       lambda: torch.equal(gathered, expected)),
        "all_gather (list)": (lambda: dist.all_gather(chunks, part, async_op=True).wait(),
                              lambda: torch.equal(gathered, expected)),
    }
    out = {}
    for name, (run, check) in cases.items():
        run()   # warm-up, and the result to check
        ok = check()
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        out[name] = (ok, statistics.median(times) * 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=27.0, help="bucket size in MiB (default 27)")
    parser.add_argument("--reps", type=int, default=11, help="timed repetitions; the median is shown (default 11)")
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks on this machine (default 2)")
    args = parser.parse_args(argv)
    results = run_on_ranks(probe, args.world_size, args.mb, args.reps, timeout=600)
    print(f"{args.mb:g} MiB float32, {args.world_size} gloo ranks, median of {args.reps}:")
    for name in results[0]:
        cells = "  ".join(f"rank {r}: {'ok ' if res[name][0] else 'BAD'} {res[name][1]:8.1f} ms"
                          for r, res in enumerate(results))
        print(f"  {name:28s} {cells}")
    return 0 if all(ok for res in results for ok, _ in res.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
