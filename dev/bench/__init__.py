"""Measurements behind docs/benchmarks.md that the ``hfstream`` command does not run.

    advice       is the report's advice right? three scenarios, the advice applied, measured again
    sweep        the advice on runs nobody tuned it for: generated runs, before and after
    unused       what one unused trainable parameter costs on a slow link
    collectives  what each half of an all-reduce costs on this machine's backend

Each runs as ``python -m dev.bench.<module>`` from the repository root; the shaped link and the
simulated one are `hfstream bench`'s (`hfstream.cli.bench.netns`, `hfstream.testing.link`).
"""
