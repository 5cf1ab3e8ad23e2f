"""Benchmarks that print figures (ratios measured in one run), never asserted by tests; ``python -m stem bench``:

    train.py    ``bench ffn`` (one STEM FFN layer vs dense), ``bench attention`` (document mask vs causal),
                ``bench train`` (the whole training step, dense vs STEM, dense vs sparse table update)
    offload.py  ``bench offload``: the offloaded STEM/DSE engine on a checkpoint (rules/bench.smk, the report's
                offload figure)
    host.py     ``bench host``: the host side of a host-table step (fetch, accumulation, row update, replays) and
                its update overlapped with a simulated device step
    eval.py     ``eval --bench``: the evaluator's loglikelihood requests/s and generation tokens/s

Each module imports torch; this package imports nothing.
"""
