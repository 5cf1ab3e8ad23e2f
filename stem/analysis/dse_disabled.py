"""DSE module ablation (the DSE paper's App. G, Figs 9-10): accuracy with the DSE gate overridden at inference.

The checkpoint is evaluated through the real eval path (the registered lm-eval model ``stem``, stem.eval.lm,
on the tasks of one configured eval suite: its fixtures, shots and metric) once per ``modes`` entry of the
model's ``dse_mode`` switch (stem.models.dse): ``normal`` (the full model), ``disabled`` (gate 0: the DSE
output is zero, Fig. 9) and ``forced`` (gate 1: full-strength injection, Fig. 10). Retained performance is
100 x accuracy(mode) / accuracy(normal), per task and per category (the mean of its tasks' accuracies).

The categories are configured (``categories``): the paper contrasts factual-knowledge benchmarks (TriviaQA,
...) with reading comprehension (C3, ...). On the tiny fixtures (stem.eval.fixtures), ``factual`` is the
closed-book world-fact tasks (ARC-e/c: a question about a country or person with four answers; OpenBookQA:
"The capital of X is" with four capitals) and ``context`` is BoolQ, whose passage states the country's facts
the yes/no question asks about. Per-item scores are kept for paired comparisons.

Two more tasks come from the synthetic world itself (``world``: an experiment with a world; many more items
than the fixtures): ``world_closed_book``, a world fact in the training templates' wording with its answer
among ``choices`` candidates of the same relation (the knowledge capacity probe's items, stem.analysis.
capacity), and ``world_in_context``, the same prompt after one sentence stating a *counterfactual* value
("The capital of X is Y. The capital of X is" -> " Y"), the true value left out of the candidates, so only
the context can answer it (reading comprehension at its simplest: copy the stated fact).
"""
from __future__ import annotations

import random

from stem.eval.spec import kind_of, suite_spec

# The analysis code's imports sit in the functions: the workflow imports ``WORLD_TASKS`` from here while it
# builds the DAG (stem.analysis.workflow), and stem.analysis.common / stem.eval.lm bring torch and lm_eval.
MODES = ("normal", "disabled", "forced")
WORLD_TASKS = ("world_closed_book", "world_in_context")


def resolve_spec(exp, spec: dict):
    """Completes the job spec (stem.analysis.workflow) from the config's typed tree (stem.config.experiment.Experiment):
    the eval suite whose fixtures, shots and metric the ablation runs with; each category's tasks must be in it
    (or be the world tasks, with a ``world:``)."""
    spec["eval"] = suite_spec(exp, spec["suite"])
    groups = ((exp.eval or {}).get("fixtures") or {}).get("groups") or {}
    known = set(spec["eval"]["tasks"]) | {t for g in spec["eval"]["tasks"] for t in groups.get(g, [])}
    known |= set(WORLD_TASKS) if exp.world else set()
    for cat, tasks in spec["categories"].items():
        if set(tasks) - known:
            raise ValueError(f"key 'analysis.dse_disabled.categories.{cat}': tasks {sorted(set(tasks) - known)} "
                             f"are not in eval suite {spec['suite']!r} (expected some of {sorted(known)})")


def world_queries(world, tok, probe: dict) -> dict[str, list]:
    """{task: [(prompt ids, [candidate ids...]) with the answer first]} for the two world tasks."""
    from stem.analysis.capacity import world_items   # torch (lazy: the DAG imports this module)
    from stem.analysis.common import encode          # torch (lazy: the DAG imports this module)
    rng = random.Random(f"dse_disabled:{probe['seed']}")
    items = world_items(world)
    pools: dict[str, list[str]] = {}
    for it in items:
        pools.setdefault(it["relation"], [])
        if it["answer"] not in pools[it["relation"]]:
            pools[it["relation"]].append(it["answer"])
    chosen = rng.sample(items, min(probe["items"], len(items)))
    out = {t: [] for t in WORLD_TASKS}
    for it in chosen:
        wrong = [a for a in pools[it["relation"]] if a != it["answer"]]
        k = min(probe["choices"] - 1, len(wrong) - 1)
        closed = [it["answer"]] + rng.sample(wrong, k)
        stated, *others = rng.sample(wrong, k + 1)        # the counterfactual value and its distractors
        out["world_closed_book"].append((encode(tok, it["prompt"]), [encode(tok, c) for c in closed]))
        out["world_in_context"].append((encode(tok, f"{it['prompt']}{stated}. {it['prompt']}"),
                                        [encode(tok, c) for c in [stated] + others]))
    return out


def run(ckpt_dir, spec: dict) -> dict:
    from stem.analysis.common import score_many, world_of   # torch (lazy: the DAG imports this module)
    from stem.eval.lm import StemLM                           # torch, lm_eval (likewise)

    ev, cats = spec["eval"], spec["categories"]
    tasks = [t for ts in cats.values() for t in ts]
    world_tasks = [t for t in tasks if t in WORLD_TASKS]
    if world_tasks and not (spec.get("world") and spec.get("world_probe")):
        raise ValueError(f"analysis dse_disabled: categories name {world_tasks}, which need the experiment's "
                         "synthetic world and the key 'analysis.dse_disabled.world_probe'")
    ev = {**ev, "tasks": [t for t in tasks if t not in WORLD_TASKS]}
    lm = StemLM(str(ckpt_dir), device=spec.get("device"), batch_size=ev["batch_size"])
    if lm.model.cfg.dse is None:
        raise ValueError(f"checkpoint {ckpt_dir}: the model has no DSE memory (analysis dse_disabled is for DSE models)")
    queries = world_queries(world_of(spec), lm.tok, spec["world_probe"]) if world_tasks else {}
    modes = ["normal"] + [m for m in spec["modes"] if m != "normal"]
    acc, items, metric, harness = {}, {}, {t: "acc (world probe)" for t in world_tasks}, None
    for mode in modes:
        lm.model.set_dse_mode(mode)
        acc[mode], items[mode] = {}, {}
        if ev["tasks"]:
            norm, raw, harness = kind_of(ev).run(lm, ev, spec.get("limit"))
            for t in ev["tasks"]:
                metric[t] = norm["tasks"][t]["metric"]
                acc[mode][t] = norm["tasks"][t]["value"]
                items[mode][t] = _items(raw, t, metric[t])
        for t in world_tasks:   # the lm-eval model's weights, in its dtype
            hits = [float(int(sc.argmax()) == 0) for sc, _ in score_many(lm.model, queries[t])]
            acc[mode][t], items[mode][t] = 100.0 * sum(hits) / len(hits), hits
    lm.model.set_dse_mode("normal")
    rows = []
    for mode in modes[1:]:
        for cat, ts in cats.items():
            for name, members in [(t, [t]) for t in ts] + [(f"{cat} (mean)", ts)]:
                full = sum(acc["normal"][t] for t in members) / len(members)
                got = sum(acc[mode][t] for t in members) / len(members)
                rows.append({"mode": mode, "category": cat, "task": name, "accuracy": got, "full_accuracy": full,
                             "retained": 100.0 * got / full if full else None})
    return {"analysis": "dse_disabled", "suite": ev["suite"], "harness": harness, "modes": modes,
            "categories": cats, "metric": metric, "accuracy": acc,
            "retained": rows, "items": items}


def _items(raw: dict, task: str, metric: str) -> list[float]:
    """Per-item scores of a task in doc order, from lm-eval's logged samples."""
    name, _, filt = metric.partition(",")
    samples = sorted((s for s in raw["samples"][task] if s.get("filter", "none") == (filt or "none")),
                     key=lambda s: s["doc_id"])
    return [float(s[name]) for s in samples]
