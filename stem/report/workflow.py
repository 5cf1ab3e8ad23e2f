"""Helpers of rules/report.smk (kept here so the rule file holds only rules)."""
from __future__ import annotations

from stem import config as C
from stem.report.figures import FIGURES
from stem.report.tables import settings


def report_outputs(experiment: str) -> list[str]:
    """What `rule all` needs from the aggregate stage (the README pulls in tables, diff and figures)."""
    return [f"reports/{experiment}/README.md"]


def figure_inputs(cfg: dict, evals: list[str], figure: str) -> dict:
    """A figure's inputs: the reproduced tables, plus the metrics or eval JSONs it plots."""
    exp = cfg["experiment"]
    scale, variants, _ = FIGURES[figure]
    inputs = {"tables": f"reports/{exp}/tables/reproduced.csv"}
    if figure == "fig1b_niah":
        inputs["niah"] = [p for p in evals if p.endswith("eval/niah.json")]
    elif variants:
        stage = settings(cfg)["stages"]["table3"][0]  # the curves are of the pretraining runs
        inputs["metrics"] = [f"{C.stage_dir(exp, s, v, st)}/metrics.jsonl" for s, v, st in C.train_targets(cfg)
                             if s == scale and v in variants and st == stage]
    return inputs
