"""The knowledge experiment's capacity measure (docs/knowledge.md): bits stored, recall, bits per parameter.

For a checkpoint trained on a bios world of N individuals (stem.data.bios) every fact (individual i, attribute
a, value v uniform over a set S_a) is probed with the attribute's first template cut before its value, ``{name}
was born in`` (after the EOS separator, as a biography starts in training), and the value's tokens ``" v"`` scored under the model (teacher-forced, one forward per batch):

- exact-match recall: every value token is the model's argmax (the greedy completion is the value);
- the capacity lower bound (Allen-Zhu & Li 2024, Part 3.3, Sec. 2's bit-complexity lower bound, written here
  from first principles): a model that gives value v probability q_i,a (chain rule over its tokens) is a code
  for the values of length sum -log2 q_i,a, while the values, uniform and independent, need N sum_a log2|S_a|
  bits; so the model (with the templates, which carry no fact) holds at least
  ``bits = sum_a sum_i (log2|S_a| + log2 q_i,a)`` bits of the world's facts. Per attribute and in total; it can
  be negative for a model worse than uniform on the values (reported as is).

Bits per parameter are given both ways: over all parameters (``params_total``) and over the parameters a token
activates (``params_activated``: the matrices every token uses, accounting's ``active_params``, plus the one
row per STEM table the token reads). A model is ``valid`` at the smallest world when its recall is at least
``min_recall`` (the report says a sweep whose smallest world is not learnt is invalid).
"""
from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from stem.analysis.common import load, state_digest, table_sites
from stem.data.bios import make_bios
from stem.models.accounting import accounting
from stem.options import NameKind


def probes(bios, n: int, tok) -> list[tuple[int, int, list[int], list[int]]]:
    """(individual, attribute, prompt ids, value ids) for every fact of the world's first ``n`` individuals."""
    out = []
    for a, templates in enumerate(bios.templates):
        prefix = templates[0].split(" {value}")[0]
        for i in range(n):
            out.append((i, a, prompt(tok, prefix.format(name=bios.names[i])), tok.encode_batch([" " + bios.value(i, a)])[0]))
    return out


def prompt(tok, text: str) -> list[int]:
    """A probe's prompt as a biography starts in training: after the document separator (EOS). Without it the name
    sits at position 0 with no left context, which no training window's name had: DSE's N-gram memory (keyed by
    the name and its left neighbour) then reads a row it never trained (docs/knowledge.md "Fifth config": DSE
    recalled 0.73 of the pair world N 50 without it, 0.91 with it; dense 0.96 / 0.975)."""
    return [tok.eos_id] + tok.encode_batch([text])[0]


@torch.no_grad()
def score(model, items, batch: int = 256) -> list[tuple[float, bool]]:
    """Per probe: (cross-entropy of the value in bits, whether every value token is the argmax)."""
    out = []
    for b in range(0, len(items), batch):
        chunk = items[b:b + batch]
        width = max(len(p) + len(v) for _, _, p, v in chunk)
        x = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, (_, _, p, v) in enumerate(chunk):
            x[r, :len(p) + len(v)] = torch.tensor(p + v)
        logp = F.log_softmax(model(x).float(), dim=-1)
        for r, (_, _, p, v) in enumerate(chunk):
            pos = torch.arange(len(p) - 1, len(p) + len(v) - 1)
            lp = logp[r, pos]
            target = torch.tensor(v)
            ce = -float(lp[torch.arange(len(v)), target].sum()) / math.log(2)
            out.append((ce, bool((lp.argmax(-1) == target).all())))
    return out


def param_counts(model) -> dict:
    acct = accounting(model)
    rows = sum(int(p.shape[1]) for _, p in table_sites(model))   # one row of each STEM table per token
    return {"params_total": int(acct["total_params"]), "params_active": int(acct["active_params"]),
            "params_activated": int(acct["active_params"]) + rows}


def run(ckpt_dir, spec: dict) -> dict:
    model, tok, _ = load(ckpt_dir, spec.get("device", "cpu"))
    world = {**spec["knowledge"], "name_kind": spec.get("name_kind") or spec["knowledge"].get("name_kind", NameKind.ONE)}
    bios, n = make_bios(world), int(spec["n"])
    items = probes(bios, n, tok)
    scored = score(model, items)
    per_attr = {}
    for a, attr in enumerate(bios.attributes):
        sel = [s for it, s in zip(items, scored) if it[1] == a]
        size = len(bios.values[a])
        per_attr[attr] = {"set_size": size, "bits_max": n * math.log2(size),
                          "bits": sum(math.log2(size) - ce for ce, _ in sel),
                          "recall": sum(hit for _, hit in sel) / len(sel),
                          "value_tokens": sum(len(it[3]) for it in items if it[1] == a) / n}
    counts = param_counts(model)
    bits = sum(r["bits"] for r in per_attr.values())
    recall = sum(hit for _, hit in scored) / len(scored)
    return {"analysis": "knowledge", "source": spec["source"], "n": n, "exposures": int(spec["exposures"]),
            "name_kind": world["name_kind"], "base_variant": spec["base_variant"], "seed_index": spec["seed_index"],
            "bits": bits, "bits_max": sum(r["bits_max"] for r in per_attr.values()), "recall": recall,
            "valid": recall >= float(spec["min_recall"]), "min_recall": float(spec["min_recall"]),
            "bits_per_param_total": bits / counts["params_total"],
            "bits_per_param_activated": bits / counts["params_activated"],
            **counts, "attributes": per_attr,
            "name_tokens": sum(len(tok.encode_batch([" " + bios.names[i]])[0]) for i in range(n)) / n,
            "items": [{"i": it[0], "attribute": bios.attributes[it[1]], "bits": math.log2(len(bios.values[it[1]])) - ce,
                       "hit": hit} for it, (ce, hit) in zip(items, scored)]}


# ---- editing with a positive control (issue 40 item 4): an individual's token-indexed rows replaced ----------
def _hits(model, items) -> list[bool]:
    return [hit for _, hit in score(model, items)]


def _copy_rows(params, src: int, dst: int) -> list[torch.Tensor]:
    """Row ``dst`` of every parameter replaced by row ``src``; returns the old rows (to undo bit for bit)."""
    saved = [p[dst].clone() for p in params]
    with torch.no_grad():
        for p in params:
            p[dst] = p[src]
    return saved


def _edit(model, bios, tok, params, a: int, b: int, others: list[int], before: dict) -> dict:
    """A's rows <- B's at every site parameter: A's prompts answered with B's values (success), B's own facts
    (unaffected), the other individuals' facts (collateral: the share whose hit changed), then undone."""
    ta, tb = (tok.encode_batch([" " + bios.names[i]])[0][0] for i in (a, b))
    as_b = [(a, k, p, v) for (_, k, p, _), (_, _, _, v) in zip(probes_of(bios, tok, [a]), probes_of(bios, tok, [b]))]
    saved = _copy_rows(params, tb, ta)
    try:
        success = _hits(model, as_b)
        own_b = _hits(model, probes_of(bios, tok, [b]))
        rest = _hits(model, probes_of(bios, tok, others))
    finally:
        with torch.no_grad():
            for p, row in zip(params, saved):
                p[ta] = row
    return {"a": a, "b": b, "success": sum(success) / len(success),
            "b_unaffected": sum(x == y for x, y in zip(own_b, before[b])) / len(own_b),
            "collateral": sum(x != y for x, y in zip(rest, [h for i in others for h in before[i]])) / max(1, len(rest))}


def probes_of(bios, tok, people: list[int]) -> list:
    """``probes`` of the given individuals, in their order (the attributes of each together)."""
    out = []
    for i in people:
        for a, templates in enumerate(bios.templates):
            text = templates[0].split(" {value}")[0].format(name=bios.names[i])
            out.append((i, a, prompt(tok, text), tok.encode_batch([" " + bios.value(i, a)])[0]))
    return out


def run_edit(ckpt_dir, spec: dict) -> dict:
    """Per site (the STEM tables' rows, the token-embedding rows, both): over ``pairs`` random pairs (A, B), success,
    B unaffected, collateral on ``collateral`` other individuals, and whether the model is restored bit for bit;
    with ``inject`` set, the injection of individuals the model never saw (``inject``, below)."""
    model, tok, _ = load(ckpt_dir, spec.get("device", "cpu"))
    bios, n = make_bios({**spec["knowledge"], "name_kind": spec["name_kind"]}), int(spec["n"])
    if any(len(tok.encode_batch([" " + bios.names[i]])[0]) != 1 for i in range(n)):
        raise ValueError(f"knowledge_edit: {spec['source']}'s names are not one token each (name_kind "
                         f"{spec['name_kind']}); expected a one-token world")
    rng = random.Random(f"knowledge-edit:{spec['seed']}")
    pairs = [tuple(rng.sample(range(n), 2)) for _ in range(int(spec["pairs"]))]
    before = {i: h for i, h in zip(range(n), _chunks(_hits(model, probes_of(bios, tok, list(range(n)))),
                                                   len(bios.attributes)))}
    digest = state_digest(model)
    # the STEM tables' rows alone, the token-embedding rows alone (dense's only token-indexed site), and every
    # token-indexed row (the positive control: A's prompt then reads exactly B's rows, so A answers as B does)
    stem = [p for _, p in table_sites(model)]
    sites = {"stem": stem, "embedding": [model.tok_emb.weight], "all": [model.tok_emb.weight, *stem]}
    out = {}
    for site, params in sites.items():
        if not params:
            continue
        edits = [_edit(model, bios, tok, params, a, b,
                       rng.sample([i for i in range(n) if i not in (a, b)], min(int(spec["collateral"]), n - 2)),
                       before) for a, b in pairs]
        out[site] = {k: sum(e[k] for e in edits) / len(edits) for k in ("success", "b_unaffected", "collateral")}
        out[site]["edits"] = edits
    injected = inject(model, bios, tok, sites, n, spec["inject"], rng, before) if spec.get("inject") else None
    return {"analysis": "knowledge_edit", "source": spec["source"], "n": n, "base_variant": spec["base_variant"],
            "seed_index": spec["seed_index"], "pairs": len(pairs),
            "recall_before": sum(map(sum, before.values())) / (n * len(bios.attributes)),
            "sites": out, "inject": injected, "undo_bit_exact": state_digest(model) == digest}


def _chunks(xs: list, k: int) -> list[list]:
    return [xs[i:i + k] for i in range(0, len(xs), k)]


# ---- injection (issue 40 item 5): an individual the model never saw gets rows ------------------------------
# The world of N is the pool's first N individuals; individual N + j (its name a token of the tokenizer, never in
# the training data) is held out. Two ways to give it knowledge, each at a site (its embedding row, its STEM rows,
# both): ``copy`` (its rows <- a known donor's: it then answers the donor's facts) and ``fit`` (its rows alone
# fitted by Adam on its own biographies, everything else frozen, for a stated budget: ``steps`` full-batch steps
# over ``docs`` biographies at ``lr``), measured on its own facts (recall, bits) and on the others' (collateral).
def held_out(bios, n: int, people: int) -> list[int]:
    """The first ``people`` individuals after the world's N (never in its training data)."""
    if n + people > len(bios.names):
        raise ValueError(f"analysis.knowledge_edit.inject.people: {people}; expected at most knowledge.names - N "
                         f"= {len(bios.names) - n} (the held-out individuals are the pool's after the world's N)")
    return list(range(n, n + people))


def _bio_batch(bios, tok, x: int, docs: int, seed: str) -> torch.Tensor:
    """``docs`` biographies of individual ``x`` (a random paraphrase and order each), right-padded with -1."""
    from stem.data.bios import biography

    rng = random.Random(seed)
    rows = [tok.encode_batch([biography(rng, bios, x)])[0] for _ in range(docs)]
    out = torch.full((docs, max(map(len, rows))), -1, dtype=torch.long)
    for r, ids in enumerate(rows):
        out[r, :len(ids)] = torch.tensor(ids)
    return out


def fit_rows(model, params, rows: list[int], batches: list[torch.Tensor], steps: int, lr: float) -> list[list[float]]:
    """Row ``rows[j]`` (a token id) of each of ``params`` fitted by Adam (betas 0.9/0.999, no weight decay) on the
    next-token loss of ``batches[j]`` (-1: padding) but the token's own occurrences, every other parameter and row
    left as it is; returns each row's loss before and after. The rows are fitted in one batch on the sum of their
    own mean losses: a row occurs only in its own biographies, so its gradient is its own fit's (one forward for
    all instead of one each: ~2x less CPU for 4 individuals on this machine)."""
    flags = {id(p): p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(any(p is q for q in params))
    width = min(model.cfg.max_seq_len + 1, max(b.shape[1] for b in batches))   # a longer biography: its start
    batch = torch.cat([F.pad(b[:, :width], (0, width - min(width, b.shape[1])), value=-1) for b in batches])
    x, y = batch[:, :-1].clamp(min=0), batch[:, 1:].clone()
    owner = torch.cat([torch.full((len(b),), j) for j, b in enumerate(batches)])
    for j, row in enumerate(rows):   # the name itself is not scored: its output row (the head's, frozen) never trained
        y[(owner == j)[:, None] & (y == row)] = -1
    counts = torch.stack([(y[owner == j] != -1).sum() for j in range(len(rows))])
    state = [[(torch.zeros_like(p[r]), torch.zeros_like(p[r])) for p in params] for r in rows]
    losses = []
    try:
        for t in range(1, steps + 2):
            logits = model(x)
            ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-1,
                                 reduction="none").reshape(y.shape).sum(1)
            per_row = torch.zeros(len(rows)).index_add_(0, owner, ce) / counts
            losses.append(per_row.detach().tolist())
            if t > steps:
                break
            grads = torch.autograd.grad(per_row.sum(), params)
            with torch.no_grad():
                for r, row_state in zip(rows, state):
                    for p, g, (m, v) in zip(params, grads, row_state):
                        m.mul_(0.9).add_(g[r], alpha=0.1)
                        v.mul_(0.999).addcmul_(g[r], g[r], value=0.001)
                        p[r] -= lr * (m / (1 - 0.9 ** t)) / ((v / (1 - 0.999 ** t)).sqrt() + 1e-8)
    finally:
        for p in model.parameters():
            p.requires_grad_(flags[id(p)])
    return [[losses[0][j], losses[-1][j]] for j in range(len(rows))]


def _measure(model, bios, tok, x: int, facts_of: int, others: list[int], before: dict) -> dict:
    """X's prompts scored against ``facts_of``'s values (recall, bits), and the others' hits changed."""
    own = [(x, a, p, v) for (_, a, p, _), (_, _, _, v) in zip(probes_of(bios, tok, [x]),
                                                               probes_of(bios, tok, [facts_of]))]
    scored = score(model, own)
    rest = _hits(model, probes_of(bios, tok, others))
    return {"recall": sum(h for _, h in scored) / len(scored),
            "bits": sum(math.log2(len(bios.values[a])) - ce for (_, a, _, _), (ce, _) in zip(own, scored)),
            "collateral": sum(a != b for a, b in zip(rest, [h for i in others for h in before[i]])) / max(1, len(rest))}


def _inject_site(model, bios, tok, params, people: list[int], donors: list[int], others: list[int], before: dict,
                 cfg: dict) -> list[dict]:
    """At one site, for each held-out individual: copy a donor's rows, then (all fitted at once, ``fit_rows``) its
    rows fitted, each measured with only its own rows changed; every row restored after each."""
    rows = [tok.encode_batch([" " + bios.names[x]])[0][0] for x in people]
    out = []
    for x, d, tx in zip(people, donors, rows):
        rec = {"x": x, "donor": d, "before": _measure(model, bios, tok, x, x, others, before)}
        saved = _copy_rows(params, tok.encode_batch([" " + bios.names[d]])[0][0], tx)
        try:
            rec["copy"] = _measure(model, bios, tok, x, d, others, before)
        finally:
            _restore(params, tx, saved)
        out.append(rec)
    batches = [_bio_batch(bios, tok, x, int(cfg["docs"]), f"knowledge-inject:{x}") for x in people]
    saved = [[p[tx].clone() for p in params] for tx in rows]
    try:
        losses = fit_rows(model, params, rows, batches, int(cfg["steps"]), float(cfg["lr"]))
        fitted = [[p[tx].clone() for p in params] for tx in rows]
        for tx, old in zip(rows, saved):
            _restore(params, tx, old)
        for rec, tx, new, old, loss in zip(out, rows, fitted, saved, losses):
            _restore(params, tx, new)
            rec["fit"] = {**_measure(model, bios, tok, rec["x"], rec["x"], others, before), "loss": loss}
            _restore(params, tx, old)
    finally:
        for tx, old in zip(rows, saved):
            _restore(params, tx, old)
    return out


def _restore(params, row: int, saved: list[torch.Tensor]):
    with torch.no_grad():
        for p, old in zip(params, saved):
            p[row] = old


def inject(model, bios, tok, sites: dict, n: int, cfg: dict, rng: random.Random, before: dict) -> dict:
    """Per site: the held-out individuals (``cfg["people"]``), each copied from a random known donor and fitted on
    its own biographies (``fit_rows``); means of recall, bits and collateral, per-person records; undo checked."""
    people = held_out(bios, n, int(cfg["people"]))
    donors = [rng.randrange(n) for _ in people]
    others = rng.sample(range(n), min(int(cfg.get("collateral", 10)), n))
    digest, out = state_digest(model), {}
    for site, params in sites.items():
        if params and not (site == "all" and not sites.get("stem")):   # without STEM rows "all" is the embedding
            recs = _inject_site(model, bios, tok, params, people, donors, others, before, cfg)
            out[site] = {f"{how}_{k}": sum(r[how][k] for r in recs) / len(recs) for how in ("before", "copy", "fit")
                         for k in ("recall", "bits", "collateral")}
            out[site]["people"] = recs
    return {"sites": out, "steps": int(cfg["steps"]), "docs": int(cfg["docs"]), "lr": float(cfg["lr"]),
            "people": len(people), "undo_bit_exact": state_digest(model) == digest}
