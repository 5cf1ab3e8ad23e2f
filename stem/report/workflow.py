"""Helpers of rules/report.smk (kept here so the rule file holds only rules)."""
from __future__ import annotations

from stem import config as C
from stem.report.build import DIFF_FILES, TABLES
from stem.report.figures import FIGURES
from stem.report.tables import settings


def report_files(experiment: str) -> list[str]:
    """Every file the aggregate stage writes except the README: tables, diff, figures (PNG and PDF).
    All are requested (by the README rule and `rule all`), so a missing or incomplete one (a report killed
    half-way) is rebuilt, and the README after it: Snakemake checks only the outputs something asks for."""
    r = f"reports/{experiment}"
    return ([f"{r}/tables/{t}.{ext}" for t in TABLES for ext in ("csv", "md", "tex")] + [f"{r}/tables/reproduced.csv"]
            + [f"{r}/diff/{name}" for name in DIFF_FILES]
            + [f"{r}/figures/{f}.{ext}" for f in FIGURES for ext in ("png", "pdf")])


def report_outputs(experiment: str) -> list[str]:
    """What `rule all` needs from the aggregate stage: every report file and the README."""
    return [*report_files(experiment), f"reports/{experiment}/README.md"]


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
