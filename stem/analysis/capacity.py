"""Knowledge capacity probe: the fraction of the synthetic world's facts a model recalls.

Each fact is a prompt in the wording of the training templates and its answer among ``choices`` candidates
(the answer plus distractors drawn, seeded, from the same relation's other values); the model recalls it
when the answer has the highest summed log-probability. Per relation (with its chance level 1/choices)
and per entity-frequency bucket: the entity's name is counted in the training corpus and the entities are
split into equal-count buckets (rare, mid, frequent). Per-item hits are kept for paired comparisons between
variants (stem.report.verdict).
"""
from __future__ import annotations

import json
import random

from stem.analysis.common import encode, load, score_many, world_of
from stem.data.synth import article

BUCKETS = ("rare", "mid", "frequent")


def world_items(world) -> list[dict]:
    """(relation, entity, prompt, answer, the relation's value pool) for every country and person."""
    items = []
    for c in world.countries:
        for rel, prompt, ans in (("capital", f"The capital of {c.name} is", c.capital),
                                 ("continent", f"{c.name} is a country in", c.continent),
                                 ("language", f"The people of {c.name} speak", c.language)):
            items.append({"relation": rel, "entity": c.name, "prompt": prompt, "answer": " " + ans})
    for p in world.people:
        for rel, prompt, ans in (("profession", f"By profession, {p.name} was", article(p.profession)),
                                 ("birth_year", f"{p.name} was born in the year", str(p.birth_year)),
                                 ("city", f"{p.name} lived in the city of", p.city)):
            items.append({"relation": rel, "entity": p.name, "prompt": prompt, "answer": " " + ans})
    return items


def corpus_counts(path, names: list[str]) -> dict[str, int]:
    """Occurrences of each name in the text of a JSON-lines corpus."""
    with open(path, encoding="utf-8") as f:
        text = "\n".join(json.loads(line)["text"] for line in f if line.strip())
    return {n: text.count(n) for n in names}


def buckets(counts: dict[str, int]) -> tuple[dict[str, str], list[int]]:
    """Entities split by count into three equal-size buckets: ({name: bucket}, the two boundary counts)."""
    order = sorted(counts, key=lambda n: (counts[n], n))
    k = len(order)
    cut = [k // 3, 2 * k // 3]
    out = {n: BUCKETS[0 if i < cut[0] else 1 if i < cut[1] else 2] for i, n in enumerate(order)}
    return out, [counts[order[c]] for c in cut]


def run(ckpt_dir, spec: dict) -> dict:
    model, tok, _ = load(ckpt_dir, spec.get("device", "cpu"))
    world = world_of(spec)
    rng = random.Random(f"capacity:{spec['seed']}")
    countries = rng.sample(world.countries, min(spec["countries"], len(world.countries)))
    people = rng.sample(world.people, min(spec["people"], len(world.people)))
    keep = {c.name for c in countries} | {p.name for p in people}
    items = [it for it in world_items(world) if it["entity"] in keep]
    pools: dict[str, list[str]] = {}
    for it in world_items(world):
        pools.setdefault(it["relation"], []).append(it["answer"])
    queries = []
    for it in items:
        wrong = sorted(set(pools[it["relation"]]) - {it["answer"]})
        it["candidates"] = [it["answer"]] + rng.sample(wrong, min(spec["choices"] - 1, len(wrong)))
        queries.append((encode(tok, it["prompt"]), [encode(tok, c) for c in it["candidates"]]))
    scored = score_many(model, queries)
    counts = corpus_counts(spec["corpus"], sorted(keep))
    bucket_of, edges = buckets(counts)
    for it, (sc, _) in zip(items, scored):
        it["hit"] = int(sc.argmax()) == 0
        it["bucket"] = bucket_of[it["entity"]]
        it["count"] = counts[it["entity"]]
    table = {}
    for key in ["all"] + sorted(pools):
        sel = [it for it in items if key == "all" or it["relation"] == key]
        row = {"n": len(sel), "recall": sum(it["hit"] for it in sel) / len(sel),
               "chance": sum(1 / len(it["candidates"]) for it in sel) / len(sel)}
        for b in BUCKETS:
            sb = [it for it in sel if it["bucket"] == b]
            row[b] = sum(it["hit"] for it in sb) / len(sb) if sb else None
        table[key] = row
    return {"analysis": "capacity", "choices": spec["choices"], "bucket_edges": edges, "table": table,
            "items": [{k: it[k] for k in ("relation", "entity", "answer", "hit", "bucket", "count")} for it in items]}
