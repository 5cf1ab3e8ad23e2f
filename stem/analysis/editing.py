"""Knowledge editing by replacing token-indexed vectors (STEM paper Sec. 3.3, 5.2; Figs 3, 4, 7).

A *source* entity appears in the prompt ("The capital of Spain is"); a *target* entity is the one the model
should behave as if it had seen. The prompt text is unchanged: at every STEM layer, the table rows of the
source entity's tokens are replaced by vectors built from the target entity's rows (Sec. 5.2:
e_{Spain,l} <- e_{Germany,l}). With n_s source and n_t target tokens, a *plan* gives, per source position,
the target tokens whose vectors are averaged into it (Sec. 3.3, Fig. 4):

- ``swap``      n_s == n_t: one to one;
- ``pad_left``  n_s > n_t: the pad token's vector on the left, then the target tokens (the paper's default);
- ``pad_right`` n_s > n_t: the target tokens, then the pad token's vector;
- ``copy``      n_s > n_t: each target token floor(n_s / n_t) times, the last repeated to cover n_s;
- ``subset``    n_s < n_t: the n_s most informative target tokens, in their order (``informativeness``);
- ``average``   any lengths: the mean of all target vectors at every source position.

A source token id that occurs twice in the span with different plans gets the mean of its positions'
vectors (a table row is one vector per token id). ``edited`` writes the rows and restores the saved originals
on exit, bit for bit (checked on the parameters' digest and on the prompts' logits). The same plans applied
to the token embedding (``tok_emb``) are the intervention a dense model admits at the same place (a
token-indexed parameter, the input side): the reference for dense and Hash-MoE, and a comparison for the STEM
variants.
"""
from __future__ import annotations

import contextlib
import random

import torch
import torch.nn.functional as F
import yaml

from stem.analysis.common import encode, find_span, load, score_many, state_digest, table_sites, world_of
from stem.data.synth import article
from stem.eval.generate import greedy_generate

SCHEMES = ("swap", "pad_left", "pad_right", "copy", "subset", "average")
CASES = ("equal", "longer", "shorter")  # n_s == n_t, n_s > n_t, n_s < n_t


def case_of(n_s: int, n_t: int) -> str:
    return "equal" if n_s == n_t else "longer" if n_s > n_t else "shorter"


def schemes_for(n_s: int, n_t: int) -> tuple[str, ...]:
    return {"equal": ("swap", "average"), "longer": ("pad_left", "pad_right", "copy", "average"),
            "shorter": ("subset", "average")}[case_of(n_s, n_t)]


def informativeness(piece: str, token_id: int) -> tuple[int, int]:
    """Sort key of a target token for ``subset``: more letters first (a function word or a one-letter subword
    carries less of the name than a long subword), then the higher id (byte-level BPE numbers merges in the
    order it learns them, so a higher id is a later merge: a longer, rarer piece)."""
    return sum(c.isalpha() for c in piece), token_id


def plan(scheme: str, n_s: int, target: list[int], pad_id: int | None = None,
         pieces: list[str] | None = None) -> list[tuple[int, ...]]:
    """Per source position, the target token ids whose vectors are averaged into it."""
    n_t = len(target)
    if n_s < 1 or n_t < 1:
        raise ValueError(f"edit plan: need at least one source and one target token, got n_s={n_s}, n_t={n_t}")
    if scheme not in schemes_for(n_s, n_t):
        raise ValueError(f"edit scheme {scheme!r} does not apply to n_s={n_s}, n_t={n_t} ({case_of(n_s, n_t)}); "
                         f"expected one of {', '.join(schemes_for(n_s, n_t))}")
    if scheme == "swap":
        return [(t,) for t in target]
    if scheme == "average":
        return [tuple(target)] * n_s
    if scheme in ("pad_left", "pad_right"):
        if pad_id is None:
            raise ValueError(f"edit scheme {scheme!r} needs a pad token id")
        pad = [(pad_id,)] * (n_s - n_t)
        own = [(t,) for t in target]
        return pad + own if scheme == "pad_left" else own + pad
    if scheme == "copy":
        out = [(t,) for t in target for _ in range(n_s // n_t)]
        return out + [(target[-1],)] * (n_s - len(out))
    # subset
    pieces = pieces if pieces is not None else [""] * n_t
    best = sorted(range(n_t), key=lambda i: informativeness(pieces[i], target[i]), reverse=True)[:n_s]
    return [(target[i],) for i in sorted(best)]


def edit_rows(weight: torch.Tensor, source: list[int], positions: list[tuple[int, ...]]) -> dict[int, torch.Tensor]:
    """{source token id: its new row}, built from the *original* rows (a target may share a source token)."""
    acc: dict[int, list[torch.Tensor]] = {}
    for s, ts in zip(source, positions):
        acc.setdefault(s, []).append(weight[list(ts)].mean(dim=0))
    return {s: torch.stack(vs).mean(dim=0) for s, vs in acc.items()}


@contextlib.contextmanager
def edited(weights: list[torch.Tensor], source: list[int], positions: list[tuple[int, ...]]):
    """Within the block, every weight's source rows are replaced; on exit the saved rows are written back."""
    saved = []
    with torch.no_grad():
        new = [edit_rows(w, source, positions) for w in weights]  # all computed before any row is written
        for w, rows in zip(weights, new):
            ids = torch.tensor(sorted(rows))
            saved.append((w, ids, w[ids].clone()))
            w[ids] = torch.stack([rows[int(i)] for i in ids]).to(w.dtype)
    try:
        yield
    finally:
        with torch.no_grad():
            for w, ids, rows in saved:
                w[ids] = rows


# ---- the measurement ---------------------------------------------------------------------------------------
def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    """KL(p || q) in nats from log-probabilities."""
    return float((p_log.exp() * (p_log - q_log)).sum())


def topk_overlap(a_log: torch.Tensor, b_log: torch.Tensor, k: int) -> float:
    a, b = set(a_log.topk(k).indices.tolist()), set(b_log.topk(k).indices.tolist())
    return len(a & b) / k


def world_facts(world, spec: dict) -> dict:
    """The synthetic world's entities as edit facts: {kind: {"templates": {relation: prompt}, "entities":
    {name: {relation: answer}}}}. Answers carry their leading space (how they follow the prompt)."""
    return {
        "country": {"templates": {"capital": "The capital of {e} is", "language": "The people of {e} speak"},
                    "entities": {c.name: {"capital": " " + c.capital, "language": " " + c.language}
                                 for c in world.countries}},
        "person": {"templates": {"profession": "By profession, {e} was", "city": "The city of {e} was"},
                   "entities": {p.name: {"profession": " " + article(p.profession), "city": " " + p.city}
                                for p in world.people}},
    }


def choose_pairs(tok, facts: dict, per_case: int, seed: int) -> list[dict]:
    """Up to ``per_case`` (source, target) pairs per kind and length case, seeded, distinct answers."""
    rng = random.Random(f"edit-pairs:{seed}")
    pairs = []
    for kind, f in facts.items():
        names = list(f["entities"])
        ntok = {n: len(encode(tok, " " + n)) for n in names}
        by_case: dict[str, list] = {c: [] for c in CASES}
        for s in names:
            for t in names:
                if s != t and all(f["entities"][s][r] != f["entities"][t][r] for r in f["templates"]):
                    by_case[case_of(ntok[s], ntok[t])].append((s, t))
        for case in CASES:
            for s, t in rng.sample(by_case[case], min(per_case, len(by_case[case]))):
                pairs.append({"kind": kind, "source": s, "target": t, "case": case})
    return pairs


def _pad_id(tok) -> tuple[int, str]:
    for name in ("<|pad|>", "<pad>", "<|finetune_right_pad_id|>"):
        i = tok.tokenizer.token_to_id(name)
        if i is not None:
            return i, name
    return tok.eos_id, tok.eos_token


def run(ckpt_dir, spec: dict) -> dict:
    model, tok, _ = load(ckpt_dir, spec.get("device", "cpu"))
    explicit = []
    if spec.get("facts"):  # a shipped prompt set (real checkpoints): reference/analysis/edit_facts.yaml
        facts, explicit = read_facts(spec["facts"])
    else:
        facts = world_facts(world_of(spec), spec)
    facts = {k: {**f, "templates": {r: f["templates"][r] for r in spec["relations"].get(k, [])}}
             for k, f in facts.items() if spec["relations"].get(k)}
    for p in explicit:
        p["case"] = case_of(len(encode(tok, " " + p["source"])), len(encode(tok, " " + p["target"])))
    pairs = explicit + choose_pairs(tok, facts, spec["pairs_per_case"], spec["seed"])
    if spec.get("every_source"):
        pairs += every_source(tok, facts, {(p["kind"], p["source"]) for p in pairs})
    out = measure(model, tok, facts, [p for p in pairs if p["kind"] in facts], spec)
    if not spec.get("facts"):
        out["transfer"] = ("country -> state transfer (Sec. 3.3): not run; the synthetic world has no "
                           "sub-national entity with a capital (only countries, their cities and people)")
    return out


def every_source(tok, facts: dict, done: set) -> list[dict]:
    """One pair per entity not yet a source (``done``: (kind, name)), so the whole prompt set is edited: its target
    the next entity in the file's order (cyclically) whose answers all differ from its own."""
    pairs = []
    for kind, f in facts.items():
        names, ents = list(f["entities"]), f["entities"]
        for i, s in enumerate(names):
            t = next((t for t in names[i + 1:] + names[:i]
                      if all(ents[s][r] != ents[t][r] for r in f["templates"])), None)
            if (kind, s) not in done and t is not None:
                pairs.append({"kind": kind, "source": s, "target": t,
                              "case": case_of(len(encode(tok, " " + s)), len(encode(tok, " " + t)))})
    return pairs


def read_facts(path) -> tuple[dict, list[dict]]:
    """(facts by kind, explicit pairs) from a prompt-set YAML; one-line errors naming the file and key."""
    with open(path, encoding="utf-8") as f:
        d = yaml.safe_load(f)
    if not isinstance(d, dict) or not isinstance(d.get("kinds"), dict):
        raise ValueError(f"{path}: expected a mapping with a 'kinds' mapping")
    for kind, f in d["kinds"].items():
        for name, answers in (f.get("entities") or {}).items():
            missing = [r for r in f.get("templates") or {} if r not in (answers or {})]
            if missing:
                raise ValueError(f"{path}: key 'kinds.{kind}.entities.{name}': no answer for relation {missing[0]!r}")
    pairs = [dict(p) for p in d.get("pairs") or []]
    for i, p in enumerate(pairs):
        ents = (d["kinds"].get(p.get("kind")) or {}).get("entities") or {}
        bad = [k for k in ("source", "target") if p.get(k) not in ents]
        if bad:
            raise ValueError(f"{path}: key 'pairs[{i}].{bad[0]}': {p.get(bad[0])!r} is not an entity of kind {p.get('kind')!r}")
    return d["kinds"], pairs


def measure(model, tok, facts: dict, pairs: list[dict], spec: dict) -> dict:
    k, n_coll = spec["topk"], spec["collateral"]
    pad_id, pad_name = _pad_id(tok)
    stem_w = [w for _, w in table_sites(model)]
    sites = ({"stem": stem_w} if stem_w else {}) | {"embedding": [model.tok_emb.weight]}
    digest = state_digest(model)
    rng = random.Random(f"edit-collateral:{spec['seed']}")
    probe = _Probe(model, tok, facts, spec.get("first_token", False))
    known = _known(probe, spec)
    logits = _prompt_logits(model, tok, facts, pairs)
    edits = [e for pair in pairs for e in _pair_edits(probe, pair, sites, pad_id, rng, n_coll, k)]
    restored = state_digest(model) == digest
    if not restored:
        raise RuntimeError("an edit was not undone bit for bit (model state digest changed)")
    if not all(torch.equal(a, b) for a, b in zip(_prompt_logits(model, tok, facts, pairs), logits)):
        raise RuntimeError("an edit was not undone bit for bit (the source prompts' logits changed)")
    out = {"analysis": "editing", "topk": k, "collateral_entities": n_coll, "pad_token": pad_name,
           "sites": sorted(sites), "known": known, "summary": summarize(edits), "edits": edits,
           "restored_bit_identical": restored, "restored_logits_bit_identical": True,
           "restored_logits_prompts": len(logits), "state_sha256": digest,
           "subset_rule": "most letters, then highest BPE id (latest merge), target order kept"}
    if spec.get("example"):
        out["example"] = example(model, tok, facts, edits, sites, pad_id, spec["example"])
    return out


@torch.no_grad()
def _prompt_logits(model, tok, facts: dict, pairs: list[dict]) -> list[torch.Tensor]:
    """Every source prompt's logits (all positions), one forward each: compared bit for bit after the edits."""
    dev = model.tok_emb.weight.device
    return [model(torch.tensor([encode(tok, t.format(e=p["source"]))], device=dev))[0].cpu()
            for p in pairs for t in facts[p["kind"]]["templates"].values()]


@torch.no_grad()
def completes(model, tok, items: list[tuple[str, str]]) -> list[tuple[bool, str]]:
    """Per (prompt, answer): (whether greedy decoding after the prompt writes exactly the answer's tokens first, what
    it wrote up to the first token that differs). One batched forward of prompt + answer: greedy decoding follows
    the answer as long as each position's argmax is the answer's next token, so it is read off that one pass."""
    rows = [(encode(tok, p), encode(tok, a)) for p, a in items]
    x = torch.zeros(len(rows), max(len(p) + len(a) for p, a in rows), dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        x[i, :len(p) + len(a)] = torch.tensor(p + a)
    top = model(x.to(model.tok_emb.weight.device)).argmax(-1).cpu()
    out = []
    for i, (p, a) in enumerate(rows):
        wrote = []
        for j, want in enumerate(a):
            wrote.append(int(top[i, len(p) - 1 + j]))
            if wrote[-1] != want:
                break
        out.append((wrote == a, tok.decode(wrote)))
    return out


def top_tokens(tok, logp: torch.Tensor, k: int) -> list[list]:
    """The ``k`` most likely next tokens as [piece, probability]."""
    top = logp.topk(k)
    return [[tok.decode([int(i)]), round(float(q.exp()), 4)] for q, i in zip(top.values, top.indices)]


class _Probe:
    """A relation's answer for entities: each candidate value scored after the relation's template (one batched
    forward per call), the candidates (every value of the relation among the kind's entities) encoded once.
    ``first_token``: a candidate's score is its first token's next-token log-probability, so one row per prompt
    rather than one per (prompt, candidate) (exact ranking for one-token answers; a real model's vocabulary makes
    each row costly); the candidates' first tokens must then differ."""

    def __init__(self, model, tok, facts: dict, first_token: bool = False):
        self.model, self.tok, self.facts, self.first_token = model, tok, facts, first_token
        self._candidates: dict = {}

    def candidates(self, kind, relation):
        if (kind, relation) not in self._candidates:
            values = sorted({e[relation] for e in self.facts[kind]["entities"].values()})
            cands = [encode(self.tok, v) for v in values]
            firsts = [c[0] for c in cands]
            if self.first_token and len(set(firsts)) < len(firsts):
                dup = next(v for v, f in zip(values, firsts) if firsts.count(f) > 1)
                raise ValueError(f"editing first_token: answers of {kind}/{relation} share a first token "
                                 f"({dup!r} and another); expected distinct first tokens")
            self._candidates[kind, relation] = values, cands
        return self._candidates[kind, relation]

    def predict(self, kind, relation, names):
        """{name: (predicted answer, candidate scores, next-token log-probs)}, one batched forward."""
        values, cands = self.candidates(kind, relation)
        template = self.facts[kind]["templates"][relation]
        scored = [cands[0][:1]] if self.first_token else cands   # first_token: one row, for its next-token log-probs
        res = score_many(self.model, [(encode(self.tok, template.format(e=n)), scored) for n in names])
        if self.first_token:
            res = [(nxt[[c[0] for c in cands]], nxt) for _, nxt in res]
        return {n: (values[int(sc.argmax())], sc, nxt) for n, (sc, nxt) in zip(names, res)}


def _known(probe: _Probe, spec: dict) -> dict:
    """Unedited accuracy per (kind, relation) on a sample: how much of each relation the model knows at all, by the
    candidates' scores (``accuracy``) and by greedy completion (``completed``; ``missed``: what it wrote instead)."""
    known = {}
    for kind, f in probe.facts.items():
        sample = random.Random(f"known:{spec['seed']}").sample(list(f["entities"]),
                                                             min(spec["known_entities"], len(f["entities"])))
        for relation in f["templates"]:
            preds = probe.predict(kind, relation, sample)
            hits = [preds[n][0] == f["entities"][n][relation] for n in sample]
            done = dict(zip(sample, completes(probe.model, probe.tok, [
                (f["templates"][relation].format(e=n), f["entities"][n][relation]) for n in sample])))
            known[f"{kind}/{relation}"] = {"accuracy": sum(hits) / len(hits), "n": len(hits),
                                           "chance": 1 / len(probe.candidates(kind, relation)[0]),
                                           "completed": sum(ok for ok, _ in done.values()) / len(hits),
                                           "missed": {n: text for n, (ok, text) in done.items() if not ok}}
    return known


def _pair_edits(probe: _Probe, pair: dict, sites: dict, pad_id: int, rng, n_coll: int, k: int) -> list[dict]:
    """The edits of one (source, target) pair: for each relation, scheme and site, the source's rows
    overwritten (then restored) and its prompt and ``n_coll`` collateral entities' prompts scored again."""
    tok, facts = probe.tok, probe.facts
    kind, s, t = pair["kind"], pair["source"], pair["target"]
    ents = facts[kind]["entities"]
    src, tgt = encode(tok, " " + s), encode(tok, " " + t)
    pieces = [tok.decode([i]) for i in tgt]
    others = [n for n in ents if n not in (s, t)]
    coll = rng.sample(others, min(n_coll, len(others)))
    edits = []
    for relation in facts[kind]["templates"]:
        find_span(encode(tok, facts[kind]["templates"][relation].format(e=s)), src)
        values = probe.candidates(kind, relation)[0]
        answers = ents[s][relation], ents[t][relation]
        index = values.index(answers[0]), values.index(answers[1])
        first = encode(tok, answers[0])[0], encode(tok, answers[1])[0]   # the answers' first tokens
        before = probe.predict(kind, relation, [s, t] + coll)
        for scheme in schemes_for(len(src), len(tgt)):
            positions = plan(scheme, len(src), tgt, pad_id, pieces)
            for site, weights in sites.items():
                with edited(weights, src, positions):
                    after = probe.predict(kind, relation, [s] + coll)
                edits.append({"kind": kind, "relation": relation, "source": s, "target": t, "case": pair["case"],
                              "n_s": len(src), "n_t": len(tgt), "scheme": scheme, "site": site,
                              "plan": [list(p) for p in positions],
                              "top_before": top_tokens(tok, before[s][2], k),
                              "top_after": top_tokens(tok, after[s][2], k),
                              **_effect(before, after, s, t, coll, answers, index, k),
                              **_moves(before[s][2], after[s][2], first)})
    return edits


def _effect(before: dict, after: dict, s: str, t: str, coll: list, answers: tuple, index: tuple, k: int) -> dict:
    """What one edit did: the source's answer and the target-vs-source candidate margin before and after, its
    next-token distribution against the control (the target's own prompt), the collateral entities' changes."""
    (pred0, sc0, nxt0), (pred1, sc1, nxt1), ctrl = before[s], after[s], before[t][2]
    i_s, i_t = index
    return {"source_answer": answers[0], "target_answer": answers[1], "before": pred0, "after": pred1,
            "success": pred1 == answers[1],
            "flip": bool(sc1[i_t] > sc1[i_s]), "flip_before": bool(sc0[i_t] > sc0[i_s]),
            "margin_gain": float((sc1[i_t] - sc1[i_s]) - (sc0[i_t] - sc0[i_s])),
            "topk_overlap": topk_overlap(nxt1, ctrl, k), "topk_overlap_before": topk_overlap(nxt0, ctrl, k),
            "kl_control": kl(ctrl, nxt1), "kl_control_before": kl(ctrl, nxt0),
            "collateral_changed": sum(after[n][0] != before[n][0] for n in coll) / max(1, len(coll)),
            "collateral_kl": sum(kl(before[n][2], after[n][2]) for n in coll) / max(1, len(coll))}


def _moves(nxt0: torch.Tensor, nxt1: torch.Tensor, first: tuple[int, int]) -> dict:
    """The source prompt's next token before and after: whether it is the target answer's first token (the
    completion moved to the other entity), and the probabilities of the two answers' first tokens."""
    i_s, i_t = first
    return {"moves": int(nxt1.argmax()) == i_t, "moves_before": int(nxt0.argmax()) == i_t,
            "p_target": float(nxt1[i_t].exp()), "p_target_before": float(nxt0[i_t].exp()),
            "p_source": float(nxt1[i_s].exp()), "p_source_before": float(nxt0[i_s].exp())}


def summarize(edits: list[dict]) -> list[dict]:
    """Means per (site, scheme) and per (site, scheme, case)."""
    groups: dict[tuple, list[dict]] = {}
    for e in edits:
        groups.setdefault((e["site"], e["scheme"], "all"), []).append(e)
        groups.setdefault((e["site"], e["scheme"], e["case"]), []).append(e)
    keys = ("success", "flip", "flip_before", "margin_gain", "topk_overlap", "topk_overlap_before", "kl_control",
            "kl_control_before", "collateral_changed", "collateral_kl", "moves", "moves_before", "p_target",
            "p_target_before", "p_source", "p_source_before")
    return [{"site": site, "scheme": scheme, "case": case, "n": len(es),
             **{key: sum(float(e[key]) for e in es) / len(es) for key in keys}}
            for (site, scheme, case), es in sorted(groups.items())]


def example(model, tok, facts, edits, sites, pad_id, ex: dict) -> dict:
    """One edit shown as Fig. 7 shows it: the top-k next tokens (with probabilities) of the source prompt, of
    the control (target) prompt and of the source prompt after the edit, and greedy continuations of each.
    Without a named pair it is the first pair of that kind (the seeded draw; not chosen by its outcome)."""
    kind, s, t, relation = ex["kind"], ex.get("source"), ex.get("target"), ex["relation"]
    if s is None:
        e = next(e for e in edits if e["kind"] == kind and e["relation"] == relation)
        s, t = e["source"], e["target"]
    src, tgt = encode(tok, " " + s), encode(tok, " " + t)
    scheme = ex.get("scheme") or schemes_for(len(src), len(tgt))[0]
    site = "stem" if "stem" in sites else "embedding"
    template, k, n = facts[kind]["templates"][relation], ex.get("topk", 4), ex.get("tokens", 12)
    src_ids, ctrl_ids = encode(tok, template.format(e=s)), encode(tok, template.format(e=t))

    @torch.no_grad()
    def show(ids):
        logp = F.log_softmax(model(torch.tensor([ids], device=model.tok_emb.weight.device))[0, -1].float(), dim=-1)
        return {"topk": top_tokens(tok, logp, k),
                "greedy": tok.decode(greedy_generate(model, ids, n, tok.eos_id))}
    original, control = show(src_ids), show(ctrl_ids)
    with edited(sites[site], src, plan(scheme, len(src), tgt, pad_id, [tok.decode([i]) for i in tgt])):
        after = show(src_ids)
    return {"prompt": template.format(e=s), "control_prompt": template.format(e=t), "source": s, "target": t,
            "scheme": scheme, "site": site, "source_answer": facts[kind]["entities"][s][relation],
            "target_answer": facts[kind]["entities"][t][relation],
            "original": original, "control": control, "edited": after}
