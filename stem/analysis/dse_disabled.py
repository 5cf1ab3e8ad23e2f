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
"""
from __future__ import annotations

MODES = ("normal", "disabled", "forced")


def run(ckpt_dir, spec: dict) -> dict:
    from stem.eval.lm import StemLM
    from stem.eval.run import kind_of

    ev, cats = spec["eval"], spec["categories"]
    tasks = [t for ts in cats.values() for t in ts]
    ev = {**ev, "tasks": tasks}
    lm = StemLM(str(ckpt_dir), device=spec.get("device"), batch_size=ev["batch_size"])
    if lm.model.cfg.dse is None:
        raise ValueError(f"checkpoint {ckpt_dir}: the model has no DSE memory (analysis dse_disabled is for DSE models)")
    modes = ["normal"] + [m for m in spec["modes"] if m != "normal"]
    acc, items = {}, {}
    for mode in modes:
        lm.model.set_dse_mode(mode)
        norm, raw, harness = kind_of(ev).run(lm, ev, spec.get("limit"))
        acc[mode] = {t: norm["tasks"][t]["value"] for t in tasks}
        items[mode] = {t: _items(raw, t, norm["tasks"][t]["metric"]) for t in tasks}
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
            "categories": cats, "metric": {t: norm["tasks"][t]["metric"] for t in tasks}, "accuracy": acc,
            "retained": rows, "items": items}


def _items(raw: dict, task: str, metric: str) -> list[float]:
    """Per-item scores of a task in doc order, from lm-eval's logged samples."""
    name, _, filt = metric.partition(",")
    samples = sorted((s for s in raw["samples"][task] if s.get("filter", "none") == (filt or "none")),
                     key=lambda s: s["doc_id"])
    return [float(s[name]) for s in samples]
