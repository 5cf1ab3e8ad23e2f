"""Perplexity of the first documents of a corpus (suite kind ``ppl``): lm-eval's rolling loglikelihood of each
document, token perplexity and bits per byte."""
from __future__ import annotations

import math

from lm_eval.api.instance import Instance

from stem.eval.run import documents


def run_ppl(lm, spec: dict, limit=None) -> tuple[dict, dict, str]:
    """The runner of suite kind ``ppl`` (registered by name in stem.eval.spec)."""
    docs = documents(spec, n_docs=limit or spec["n_documents"], tok=lm.tok)
    reqs = [Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(docs)]
    lls = lm.loglikelihood_rolling(reqs)
    n_tok = sum(len(lm.tok_encode(d)) for d in docs)
    n_bytes = sum(len(d.encode()) for d in docs)
    ppl, bpb = math.exp(-sum(lls) / n_tok), -sum(lls) / n_bytes / math.log(2)
    entry = {"metric": "token_perplexity", "value": ppl, "stderr": None, "n": len(docs), "version": "stem-ppl-1",
             "unit": "perplexity", "all_metrics": {"token_perplexity": ppl, "bits_per_byte": bpb}}
    raw = {"loglikelihoods": lls, "tokens": n_tok, "bytes": n_bytes}
    return {"tasks": {"ppl": entry}, "groups": {}}, raw, "stem.eval.ppl"
