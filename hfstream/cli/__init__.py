"""The ``hfstream`` command: what a person runs beside training, never inside a user's ``train()``.

The training path (`hfstream.trainer`, `hfstream.prefetch`, `hfstream.gradsync`, `hfstream.report`)
imports nothing from here; a test holds it to that.

    main    the ``hfstream`` command (demo, bench, bench-prefetch, soak, plan, doctor, corpus, env)
    doctor  ``hfstream doctor``: a run's step report read back, with its advice
    bench   gradient sync and prefetching measured side by side on a shaped link; the soak run
    demo    what ``hfstream demo`` trains (`demo/train_clm.py`) and its accelerate configs
    plot    the figures (step breakdown, timeline, loss, plan); needs ``hfstream[plots]``
    trace   a ``torch.profiler`` Chrome trace of chosen steps, as a Trainer callback
    data    a local corpus and tokenizers (byte-level, or BPE trained here): no hub; needs ``hfstream[demo]``
"""
