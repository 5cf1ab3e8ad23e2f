"""LongPPL: perplexity on the key tokens of long documents (suite kind ``longppl``; the DSE paper's Table 2).

The published definition (Fang et al., "What is wrong with perplexity for long-context language modeling?",
ICLR 2025; their package ``longppl`` 0.3.0, ``find_key_token`` / ``compute_longppl``): an evaluator model scores
every token of a document twice, with its whole preceding context (``long``: LCL = log P(x_i | x_<i)) and with a
truncated one: the document is cut into chunks of ``window`` tokens, each scored after the ``short`` tokens before
it (so token i sees between ``short`` and ``short + window - 1`` tokens), the first ``short`` tokens never. LSD =
log P_long - log P_short. A token is a key token when LSD > ``alpha`` and LCL > ``beta`` (the package's defaults:
alpha 2, beta -2, short 4096, window 1024). LongPPL of the evaluated model is exp of its mean negative
log-likelihood (whole context) over the key tokens.

Here the evaluator is ``evaluator``: a variant of the same scale and stage (default ``dense``: every model of a
table is scored on the same key tokens, as a fixed evaluator does in the paper, where it is Qwen2-72B-Instruct),
or ``self``. All variants of a scale share the tokenizer, so key tokens are matched by position (the package
matches them through character offsets because its evaluator's tokenizer differs). Per category (``categories``:
{column: source}), the first ``documents`` documents of at least ``short + 1`` tokens, each cut to ``length``
tokens (the model's context at most); a category's LongPPL is exp of the mean NLL over all its documents' key tokens
(the package scores one document at a time; the paper does not say how documents are pooled).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from stem import layout
from stem.eval.lm import load_for_eval
from stem.eval.run import documents

@torch.no_grad()
def token_nll(model, ids: list[int], device) -> torch.Tensor:
    """NLL of tokens 1..n-1 of ``ids`` given everything before them (one forward; float32, on the CPU)."""
    x = torch.tensor([ids], device=device)
    return F.cross_entropy(model(x)[0, :-1].float(), x[0, 1:], reduction="none").cpu()


@torch.no_grad()
def short_nll(model, ids: list[int], short: int, window: int, device) -> torch.Tensor:
    """NLL of tokens ``short``..n-1 given only the chunked short context (the package's sliding window); index j
    of the result is token ``short + j``."""
    out = []
    for start in range(0, len(ids) - short, window):
        chunk = ids[start:start + short + window]
        x = torch.tensor([chunk], device=device)
        out.append(F.cross_entropy(model(x)[0, short - 1:-1].float(), x[0, short:], reduction="none").cpu())
    return torch.cat(out) if out else torch.zeros(0)


def key_tokens(long_nll: torch.Tensor, short: torch.Tensor, n_short: int, alpha: float, beta: float) -> torch.Tensor:
    """Positions (indices into ``long_nll``, i.e. token i + 1) of the key tokens: LSD > alpha and LCL > beta, where
    LSD = short NLL - long NLL and LCL = -long NLL; the first ``n_short`` tokens are never key tokens."""
    tail = long_nll[n_short - 1:]
    keep = ((short - tail) > alpha) & (-tail > beta)
    return torch.nonzero(keep).flatten() + (n_short - 1)


def evaluator_checkpoint(spec: dict, job: dict) -> str | None:
    """The evaluator's checkpoint: the same experiment, scale and stage's ``evaluator`` variant (None: self).
    ``job``: the evaluated checkpoint's identity (experiment, scale, variant, stage)."""
    ev = spec["evaluator"]
    if ev == "self" or job["variant"] == ev:
        return None
    return layout.checkpoint(job["experiment"], job["scale"], ev, job["stage"])


def run_longppl(lm, spec: dict, limit=None) -> tuple[dict, dict, str]:
    """The runner of suite kind ``longppl``: one task per category (``longppl_{category}``), value = LongPPL."""
    length = min(spec.get("length") or lm.max_length, lm.max_length)
    short, window, alpha, beta = spec["short"], spec["window"], spec["alpha"], spec["beta"]
    if short + 1 >= length:
        raise ValueError(f"longppl: short context {short} leaves no token to score in documents of {length} tokens "
                         f"(the model's context is {lm.max_length}); expected short < length - 1")
    ckpt = evaluator_checkpoint(spec, spec.get("job") or lm.spec)
    if ckpt and not Path(ckpt).is_dir():
        raise ValueError(f"longppl: evaluator checkpoint {ckpt}: no such folder (train that model first)")
    evaluator = load_for_eval(ckpt, str(lm.device))[0] if ckpt else lm.model
    tasks, raw = {}, {"evaluator": ckpt or "self", "categories": {}}
    for cat, reader in spec["category_documents"].items():
        want = limit or spec["documents"]
        docs = documents({"documents": reader}, n_docs=want * 10, tok=lm.tok)   # the first long enough ones
        ids = [x[:length] for x in lm.tok.encode_batch(docs) if len(x) > short + 1][:want]
        if not ids:
            raise ValueError(f"longppl: category {cat!r}: no document of source {spec['categories'][cat]!r} has "
                             f"more than {short + 1} tokens")
        key_sum, key_n, all_sum, all_n = 0.0, 0, 0.0, 0
        for x in ids:
            ev_long = token_nll(evaluator, x, lm.device)
            keys = key_tokens(ev_long, short_nll(evaluator, x, short, window, lm.device), short, alpha, beta)
            nll = ev_long if evaluator is lm.model else token_nll(lm.model, x, lm.device)
            key_sum, key_n = key_sum + float(nll[keys].sum()), key_n + len(keys)
            all_sum, all_n = all_sum + float(nll.sum()), all_n + len(nll)
        value = math.exp(key_sum / key_n) if key_n else None
        tasks[f"longppl_{cat}"] = {
            "metric": "longppl", "value": value, "stderr": None, "n": len(ids), "version": "stem-longppl-1",
            "unit": "perplexity", "all_metrics": {"longppl": value, "ppl": math.exp(all_sum / all_n),
                                                  "key_tokens": key_n, "tokens": all_n}}
        raw["categories"][cat] = {"documents": len(ids), "key_tokens": key_n, "tokens": all_n}
    return {"tasks": tasks, "groups": {}}, raw, "stem.eval.longppl"
