"""Development tools, outside the installed package: run from a clone with ``PYTHONPATH=.``.

    gpu_check  ``make gpu-check``: everything that needs a GPU, one table (skips without one)
    bench      measurements behind docs/benchmarks.md that ``hfstream bench`` does not run: the
               advice check and sweep, an unused parameter's cost, the collectives probe
    mutate     mutation testing, one `ast` change at a time, against chosen test files
"""
