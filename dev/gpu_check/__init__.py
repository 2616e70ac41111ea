"""``python -m dev.gpu_check``: everything that needs a GPU, in one run, one table.

Meant for a machine lent one NVIDIA GPU for a few minutes (``make gpu-check``): it runs with
the machine's own python and ``PYTHONPATH=.``, no install, no network, and imports only torch,
transformers, accelerate, the standard library and hfstream's training path (never ``datasets``
nor ``hfstream.cli.data``). Without a GPU it prints one line and exits 0.

    python -m dev.gpu_check [--json runs/gpu_check.json] [--quick] [--parts gradsync,multirank] [--on-cpu]

The parts (each in its own child process with its own time box, so a hang, a crash or a broken
CUDA context in one is recorded in the table and the others still run):

    1 pytest    the tests marked ``gpu`` (``pytest -m gpu`` on the test files that mark any)
    2 gradsync  GradSync on 2 ranks over gloo, both on cuda:0: gradients equal the
                single-process mean, buckets launched from the hooks and packed off the compute
                stream (the stream current inside the pack), and the host never waits for the
                device while forward, backward and the launches run
    3 prefetch  StreamPrefetcher on copy-heavy batches against a plain pinned
                ``.to(non_blocking=True)`` loop and a plain synchronous copy, a matmul per step
                as long as the copy; batches intact; the consume loop under
                ``set_sync_debug_mode("error")``
    4 ws1       GradSync on one process (no process group) costs nothing: no hook added, no device
                memory, no host read, step time with and without it
    5 trainer   the Trainer with GradSync active on a one-rank NCCL group (a test-only subclass):
                overlap and sharded through grad_bucket_mb="auto" and its re-plans, the clip and the
                bf16 wire, against the stock Trainer on the same GPU (parameters, norms, losses); the
                memory row: step 1, every re-plan and the last step (100) against steady state
    6 onerank   GradSync on a one-rank NCCL group, kept active by a test-only switch: overlap (bf16
                wire) and sharded collectives on a real NCCL group, results; what the device shows:
                packs off the compute stream, finish() ordering the compute stream without holding the
                host, the next forward reached with the all-gathers still running; no host sync in
                the whole step under ``set_sync_debug_mode("error")``; the profiler's NCCL kernels and
                copies counted (one rank's NCCL is a copy: nothing to time against)
    7 multirank every visible GPU under ``torchrun`` with NCCL (a skip, saying so, with one GPU):
                overlap and sharded against the single-process mean and bitwise across ranks, the
                report's comm times against the NCCL kernels, no host sync in the step, the
                forward starting with the all-gathers launched and not waited for, ``accelerator.gather``
                on WORLD beside the gradient group's gathers

Every part says what it compared (how many of what, the first line of its row) and fails when it
compared nothing. The run is held to a budget (330 s; ``--quick`` 165 s), so it ends within
6 minutes (3).

The modules (each imports only the standard library when imported; torch, transformers and
hfstream's training path are imported inside the functions that run a part):

    runner       the parts, their time boxes and the whole run's budget; each part in a child
                 process; the header; the command line (``__main__`` calls its ``main``)
    procs        a child process in its own session, killed whole at its time box; its environment
    table        the table and the JSON
    checks       what the parts share: the named and counted checks, tensor comparison, the device, a small MLP
    syncdebug    how a host sync is seen: ``set_sync_debug_mode`` "error" and "warn", a device sleep,
                 a counter of host reads that also runs on CPU
    gpu_tests    part 1
    gradsync     part 2 (what synchronises in a GradSync step is described there)
    prefetch     part 3
    one_process  part 4
    one_rank_trainer  part 5, and the test-only Trainer whose GradSync stays active at world size 1
    memory       the memory row: each step's allocated bytes and peak, against steady state
    one_rank     part 6, the test-only GradSync that stays active at world size 1, its one-rank group
    device_order what the device shows: a pack's stream, finish() ordering the compute stream, gathers
                 still running when the forward starts
    multi_rank   part 7: the launch, one rank's checks (``python -m ...multi_rank`` under torchrun), the merge
    comm_kernels the profiler's device events: NCCL kernels or copies, their streams; the report against the kernels
"""
