"""Helpers of rules/report.smk (kept here so the rule file holds only rules): every list of tables and
figures comes from the registry (stem.report.registry)."""
from __future__ import annotations

from stem.report import registry
from stem.report.build import DIFF_FILES


def report_files(experiment: str) -> list[str]:
    """Every file the aggregate stage writes except the README and the HTML report: tables, diff, figures
    (PNG and PDF). All are requested (by the README and HTML rules and `rule all`), so a missing or incomplete
    one (a report killed half-way) is rebuilt, and the pages after it: Snakemake checks only the outputs
    something asks for."""
    r = f"reports/{experiment}"
    return ([f"{r}/tables/{t}.{ext}" for t in registry.tables() for ext in ("csv", "md", "tex")]
            + [f"{r}/tables/reproduced.csv"] + [f"{r}/diff/{name}" for name in DIFF_FILES]
            + [f"{r}/figures/{f}.{ext}" for f in registry.figures() for ext in ("png", "pdf")])


def report_outputs(experiment: str) -> list[str]:
    """What `rule all` needs from the aggregate stage: every report file, the README and the HTML report."""
    return [*report_files(experiment), f"reports/{experiment}/README.md", f"reports/{experiment}/report.html"]


def table_inputs(cfg: dict) -> list[str]:
    """Files the registered tables read besides the training summaries and eval JSONs (their ``inputs``)."""
    files = []
    for t in registry.tables().values():
        files += [f for f in (t.inputs(cfg) if t.inputs else []) if f not in files]
    return files


def figure_inputs(cfg: dict, evals: list[str], figure: str) -> dict:
    """A figure's inputs: the reproduced tables, plus what its registry entry names."""
    fig = registry.figure(figure)
    return {"tables": f"reports/{cfg['experiment']}/tables/reproduced.csv",
            **(fig.inputs(cfg, evals) if fig.inputs else {})}
