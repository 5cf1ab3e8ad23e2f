"""The report's tables and figures by name: the one list the aggregate stage reads.

A table is registered with ``@paper_table(name, title, ...)`` on its builder, a figure with
``@report_figure(name, caption, ...)`` on its drawing function. The workflow (rules/report.smk through
stem.report.workflow), the table writer, the diff, the figures, the README and the HTML report all iterate
``tables()`` / ``figures()``; none of them names a table or a figure. The paper's own tables and figures are
registered when stem.report.tables and stem.report.figures are imported, the analyze stage's by
stem.report.analyses and stem.report.mechanism, the DSE sweeps' by stem.report.sweep_figures (their
``stem.plugins.BUILTIN`` list: the registries ``stem.registry.REPORT_TABLES`` / ``REPORT_FIGURES`` import them
on their first lookup); a config's plugin modules register more the same way. This module imports nothing
of the project but stem.registry.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from stem.registry import REPORT_FIGURES as FIGURES
from stem.registry import REPORT_TABLES as TABLES
NAME = re.compile(r"^[a-z][a-z0-9_]*$")   # a file name under reports/ and a Snakemake output / wildcard value
RESERVED = {"md", "long", "reproduced"}   # rule report_tables' other outputs, tables/reproduced.csv


def _check_name(what: str, name: str):
    if not isinstance(name, str) or not NAME.match(name) or name in RESERVED:
        raise ValueError(f"report {what} {name!r}: expected a name of lower-case letters, digits and '_' "
                         f"(not {', '.join(sorted(RESERVED))})")


@dataclass(frozen=True)
class PaperTable:
    """One table of the report.

    name: file name under ``reports/{experiment}/tables/`` and the ``table`` column of its cells.
    title: heading of its Markdown, LaTeX, README and HTML versions.
    build(exp, res) -> long DataFrame in ``paper_data.COLUMNS`` (value NaN where there is no result yet);
        ``exp``: the experiment config's typed tree (stem.config.experiment.Experiment).
    csv: the paper's cells, ``reference/paper/{csv}.csv``; None for a table the paper does not print.
    labels: {column id: printed column label}.
    stages: the training stages whose results feed it, first with a result wins (the config's
        ``report.stages.{name}`` overrides).
    compared: the diff compares it cell by cell with ``csv``; direction_checked: the diff asks whether each
        variant beats the same scale's dense baseline where the paper says it does (except in the columns
        ``undirected``, e.g. parameter counts).
    notes: {(scale or "", column): text} shown beside those cells in the diff.
    inputs(exp) -> files its builder reads besides the training summaries and eval JSONs (inputs of the
        workflow's report_tables rule).
    paper_cells(df) -> the reference cells as compared (default: ``csv`` as it is).
    paper_directions(df, scales) -> the reference cells as the direction check reads them, keyed like ours
        (scale, variant, column) at our ``scales`` (default: ``csv`` as it is); for another paper's models.
    lower_better: columns where a lower value beats the baseline (a loss); the check's sign is the same.
    empty: what its Markdown, the README and the HTML say when it has no rows (None: page.Table's default).
    """
    name: str
    title: str
    build: Callable
    csv: str | None = None
    labels: dict = field(default_factory=dict)
    stages: tuple = ()
    compared: bool = False
    direction_checked: bool = False
    undirected: tuple = ()
    notes: dict = field(default_factory=dict)
    inputs: Callable | None = None
    paper_cells: Callable | None = None
    paper_directions: Callable | None = None
    lower_better: tuple = ()
    empty: str | None = None

    def __post_init__(self):
        _check_name("table", self.name)
        if (self.compared or self.direction_checked) and not self.csv:
            raise ValueError(f"table {self.name!r}: compared / direction_checked needs the paper's cells (csv=...)")


@dataclass(frozen=True)
class Figure:
    """One figure of the report (PNG and PDF under ``reports/{experiment}/figures/``).

    draw(exp, res, ours, files) -> a matplotlib figure; ``ours`` = {table: long DataFrame} (the reproduced
        tables), ``files`` = what ``inputs`` named (paths, relative to the working directory).
    caption: under the figure in the README and the HTML report.
    inputs(exp, evals) -> {name: path or [paths]} the figure reads besides the reproduced tables; ``evals``
        lists the experiment's eval JSONs.
    scale: the scale a figure plots (None for figures that choose for themselves); the variants it draws are the
        experiment's (config/variants.yaml's ``figures:``, stem.config.figure_variants).
    experiments: the experiments it is drawn for (() = every one), e.g. a figure of one experiment's own results.
    """
    name: str
    draw: Callable
    caption: str
    inputs: Callable | None = None
    scale: str | None = None
    experiments: tuple = ()

    def __post_init__(self):
        _check_name("figure", self.name)


def paper_table(name: str, title: str, **kw):
    """Decorator: register ``build(exp, res)`` as table ``name`` (keywords: the fields of PaperTable)."""
    return TABLES.register(name, lambda build: PaperTable(name, title, build, **kw))


def report_figure(name: str, caption: str, **kw):
    """Decorator: register ``draw(exp, res, ours, files)`` as figure ``name`` (keywords: Figure's fields)."""
    return FIGURES.register(name, lambda draw: Figure(name, draw, caption, **kw))


def tables():
    """Every registered table, in registration order (the paper's first): a read-only mapping name -> table."""
    return TABLES


def figures(experiment: str | None = None):
    """Every registered figure (a read-only mapping name -> figure), or those drawn for ``experiment``."""
    if experiment is None:
        return FIGURES
    return {n: f for n, f in FIGURES.items() if not f.experiments or experiment in f.experiments}


def table(name: str) -> PaperTable:
    return TABLES[name]


def figure(name: str) -> Figure:
    return FIGURES[name]


def compared() -> list[str]:
    return [n for n, t in tables().items() if t.compared]


def direction_checked() -> list[str]:
    return [n for n, t in tables().items() if t.direction_checked]
