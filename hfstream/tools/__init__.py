"""What a person runs beside training, never inside a user's ``train()``.

The training path (`hfstream.trainer.args`, `hfstream.trainer`, `hfstream.prefetch`,
`hfstream.gradsync`, ...) imports nothing from here; a test holds it to that.

    cli     the ``hfstream`` command (demo, bench, bench-prefetch, soak, plan, corpus, env)
    bench   gradient sync and prefetching measured side by side on a shaped link; the soak run
    plan    the planner: step time, exposed communication and the ceiling without running
    plot    the figures (step breakdown, timeline, loss, plan)
    trace   a ``torch.profiler`` Chrome trace of chosen steps, as a Trainer callback
    data    a local corpus and tokenizers (byte-level, or BPE trained here): no hub
    gpu_check  ``make gpu-check``: the checks that need a GPU, one table (skips without one)
"""
