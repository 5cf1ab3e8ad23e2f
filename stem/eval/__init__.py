"""Evaluation: the ``stem`` lm-eval model (lm.py), suites and output format (run.py), offline fixtures
(fixtures.py), needle-in-a-haystack (niah.py), greedy decoding (generate.py), benchmark (bench.py).

``import stem.eval.lm`` (or touching ``stem.eval.StemLM``) registers the model ``stem`` with lm-eval;
it is imported lazily so that the workflow can read suite specs without importing torch/lm-eval.
"""


def __getattr__(name):
    if name == "StemLM":
        from stem.eval.lm import StemLM
        return StemLM
    raise AttributeError(name)
