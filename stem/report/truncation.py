"""The report's truncation table: for every eval JSON of the experiment, per task whose requests were cut to fit the
model's context, the task's score beside the suite's policy (stem.eval.lm.truncate), the requests cut of those
sent and the tokens they lost (the eval JSON's ``truncation``, stem.eval.run); an eval JSON written before the
counts existed is a row saying so. ``truncation_summary`` condenses it for the diff summary.
"""
from __future__ import annotations

import pandas as pd

from stem import config as C
from stem.config.experiment import Experiment
from stem.report import registry
from stem.report import tables as T

COLUMNS = ("score", "policy", "truncated", "requests", "tokens_dropped")


def rows(exp: Experiment, res) -> list[dict]:
    """One row per task with a truncated request, and per eval JSON without counts."""
    suites = (exp.eval or {}).get("stages") or {}   # the eval section, untyped (stem.eval.spec)
    out = []
    for scale, variant, stage in C.train_targets(exp) + C.seed_targets(exp):
        for suite in suites.get(stage, []):
            ev = res.eval(scale, variant, stage, suite)
            if ev is None:
                continue
            path = str(res.stage_dir(scale, variant, stage) / "eval" / f"{suite}.json")
            cut = ev.get("truncation")
            if not isinstance(cut, dict):
                out.append({"scale": scale, "variant": variant, "stage": stage, "suite": suite, "task": "(all)",
                            "path": path, "score": None, "policy": "not recorded", "truncated": None,
                            "requests": None, "tokens_dropped": None})
                continue
            for task, n in (cut.get("tasks") or {}).items():
                if n.get("truncated"):
                    out.append({"scale": scale, "variant": variant, "stage": stage, "suite": suite, "task": task,
                                "path": path, "score": T.task_score(ev, task), "policy": cut.get("policy"), **n})
    return out


def truncation_long(exp: Experiment, res) -> pd.DataFrame:
    return T.frame([T.cell("truncation", r["scale"], r["variant"], c, r[c], r["path"],
                           row=f"{r['variant']} {r['stage']}: {r['suite']} {r['task']}",
                           unit="%" if c == "score" else "")
                    for r in rows(exp, res) for c in COLUMNS])


def truncation_summary(cut: pd.DataFrame | None) -> dict:
    """From the truncation table (long): the tasks with cut requests, the requests and tokens cut, and the eval
    JSONs without counts."""
    if cut is None or cut.empty:
        return {"tasks": 0, "truncated": 0, "requests": 0, "tokens_dropped": 0, "not_recorded": 0}
    wide = cut.pivot_table(index=["scale", "variant", "row"], columns="column", values="value", aggfunc="first")
    known = wide[wide["policy"] != "not recorded"]
    total = lambda c: int(pd.to_numeric(known[c], errors="coerce").fillna(0).sum()) if c in known else 0  # noqa: E731
    return {"tasks": len(known), "truncated": total("truncated"), "requests": total("requests"),
            "tokens_dropped": total("tokens_dropped"), "not_recorded": int((wide["policy"] == "not recorded").sum())}


def truncation_lines(t: dict | None) -> list[str]:
    """The summary's truncation line (⚠ where any evaluation prompt was cut or not counted)."""
    if not t:
        return []
    line = ("Truncation: no evaluation request was cut to fit a model's context" if not t["tasks"] else
            f"⚠ **Truncation: {t['truncated']} of {t['requests']} requests cut to fit the context** in {t['tasks']} "
            f"tasks ({t['tokens_dropped']:,} tokens dropped; each suite's policy, table `truncation`)")
    if t["not_recorded"]:
        line += f"; {t['not_recorded']} eval JSONs without counts (written before they were recorded)"
    return [line]


registry.paper_table(
    "truncation", "Truncation: evaluation tasks whose requests were cut to fit the model's context (the suite's "
                  "policy; score beside it)",
    labels={"score": "score", "policy": "policy", "truncated": "requests cut", "requests": "requests",
            "tokens_dropped": "tokens dropped"},
    empty="_(no rows: no evaluation request was cut, or no results yet)_")(truncation_long)
