"""Helpers of rules/report.smk (kept here so the rule file holds only rules): every list of tables and
figures comes from the registry (stem.report.registry)."""
from __future__ import annotations

from stem import layout as L
from stem.config.experiment import Experiment
from stem.report import registry


def report_files(experiment: str) -> list[str]:
    """Every file the aggregate stage writes except the README and the HTML report: tables, diff, figures
    (PNG and PDF). All are requested (by the README and HTML rules and `rule all`), so a missing or incomplete
    one (a report killed half-way) is rebuilt, and the pages after it: Snakemake checks only the outputs
    something asks for."""
    return ([L.table_file(experiment, t, ext) for t in registry.tables() for ext in L.TABLE_FILES]
            + [L.reproduced(experiment)] + [L.diff_file(experiment, name) for name in L.DIFF_FILES]
            + [L.figure_file(experiment, f, ext) for f in registry.figures(experiment)
               for ext in L.FIGURE_FILES])


def report_outputs(experiment: str) -> list[str]:
    """What `rule all` needs from the aggregate stage: every report file, the README and the HTML report."""
    return [*report_files(experiment), L.report_readme(experiment), L.report_html(experiment)]


def table_inputs(exp: Experiment) -> list[str]:
    """Files the registered tables read besides the training summaries and eval JSONs (their ``inputs``)."""
    files = []
    for t in registry.tables().values():
        files += [f for f in (t.inputs(exp) if t.inputs else []) if f not in files]
    return files


def figure_inputs(exp: Experiment, evals: list[str], figure: str) -> dict:
    """A figure's inputs: the reproduced tables, plus what its registry entry names."""
    fig = registry.figure(figure)
    return {"tables": L.reproduced(exp.experiment),
            **(fig.inputs(exp, evals) if fig.inputs else {})}
