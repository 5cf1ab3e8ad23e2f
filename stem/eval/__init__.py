"""Evaluation: suite kinds, suite and job specs, eval targets (spec.py, torch-free: the workflow reads it), one
suite end to end (run.py), the lm-eval adapter (harness.py), the ``stem`` lm-eval model (lm.py),
needle-in-a-haystack (niah.py), perplexity (ppl.py), offline fixtures (fixtures.py), greedy decoding
(generate.py), comparing two variants' results (compare.py). The evaluator's speed benchmark is stem.bench.eval.

``import stem.eval.lm`` (or touching ``stem.eval.StemLM``) registers the model ``stem`` with lm-eval;
it is imported lazily so that the workflow can read suite specs without importing torch/lm-eval.
"""


def __getattr__(name):
    if name == "StemLM":
        from stem.eval.lm import StemLM  # lazy: torch and lm-eval (see above)
        return StemLM
    raise AttributeError(name)
