"""Write the report's pieces under ``reports/{experiment}/``: tables, diff, README, HTML report.

    tables/{name}.{csv,md,tex}     every registered table (stem.report.registry) from this experiment
    tables/reproduced.csv          all of them, long format (the diff's, README's and HTML report's input)
    diff/diff.md, cells.csv, directions.csv, paper_consistency.csv, summary.json
    figures/*.png|pdf              every registered figure (stem.report.figures)
    README.md, report.html         everything above in one page, both made from the same page blocks
                                   (stem.report.page) built from the data above (never from rendered text)
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import pandas as pd

from stem import config as C
from stem.config import experiment
from stem import layout as L
from stem.config.experiment import Experiment
from stem.io import atomic_write_text
from stem.report import diff, page, registry
from stem.report import paper_data as P
from stem.report import tables as T
from stem.report.results import Results

TABLES = registry.TABLES  # name -> PaperTable, every registered table (filled when stem.report.tables is imported)
DIFF_FILES = L.DIFF_FILES  # the diff folder's files (stem.layout: every path of the workflow)


def _write(path, text: str):
    atomic_write_text(path, text)


def _csv(df: pd.DataFrame) -> str:
    buf = io.StringIO()
    df.to_csv(buf, index=False)
    return buf.getvalue()


def write_tables(exp: Experiment, res: Results, out_dir) -> dict[str, pd.DataFrame]:
    out = Path(out_dir)
    ours = T.build_all(exp, res)
    label = T.experiment_label(exp)
    for name, table in registry.tables().items():
        w = T.wide(ours[name])
        _write(out / f"{name}.csv", _csv(w))
        _write(out / f"{name}.md", f"# {table.title}\n\n_{label}_\n\n{T.to_markdown(w, table.empty)}")
        _write(out / f"{name}.tex", T.to_latex(w, f"{table.title} ({label})"))
    _write(out / "reproduced.csv", _csv(pd.concat([ours[n] for n in TABLES], ignore_index=True)))
    return ours


def load_reproduced(path) -> dict[str, pd.DataFrame]:
    df = pd.read_csv(path, dtype=str, keep_default_na=False)
    num = pd.to_numeric(df["value"].replace("", "nan"), errors="coerce")
    df["value"] = [n if (s == "" or s.lower() == "nan" or pd.notna(n)) else s for s, n in zip(df["value"], num)]
    return {name: g.reset_index(drop=True) for name, g in df.groupby("table", sort=False)}


def paper_accounting() -> dict:
    """Accounting of config/paper.yaml's Table 3 models (for the paper-consistency checks)."""
    exp = experiment.load(C.REPO / "config" / "paper.yaml")
    t3 = P.load_table("table3")
    return {(s, v): T.accounting(exp, s, v) for s, v in t3[["scale", "variant"]].drop_duplicates().itertuples(index=False)}


def run_diff(exp: Experiment, ours: dict, gate_patterns=(), gate_tolerance=None, paper_acct=None, accepted=None):
    """``accepted``: an accepted-disagreements file (default: the config's ``report.accepted``, relative to the
    repository); the summary's ``accepted`` lists its cells with their verdicts now."""
    rs = T.settings(exp)
    tol = rs.tolerance
    cells, dirs = diff.compare(ours, tol), diff.directions(ours, C.baseline_variant(exp))
    cons = diff.paper_consistency(paper_acct)
    s = diff.summary(exp.experiment, cells, dirs, cons, prov=ours.get("provenance"), cut=ours.get("truncation"),
                     control=rs.directions)
    path = accepted if accepted is not None else (C.REPO / rs.accepted if rs.accepted else None)
    if path is not None:
        entries = diff.load_accepted(path)
        diff.check_accepted(exp, entries, path)
        s["accepted"] = {"file": str(accepted) if accepted is not None else rs.accepted,
                         "cells": diff.accepted_rows(dirs, entries)}
    failures = diff.gate(cells, list(gate_patterns), gate_tolerance) if gate_patterns else None
    if failures is not None:
        s["gate"] = {"patterns": list(gate_patterns), "failed": [f"{r.table}/{r.scale}/{r.variant}/{r.column}"
                                                                 for r in failures.itertuples()]}
    return s, cells, dirs, cons, failures


def write_diff(exp: Experiment, out_dir, s, cells, dirs, cons, failures=None) -> str:
    out = Path(out_dir)
    md = diff.render(exp, s, cells, dirs, cons, failures)
    _write(out / "diff.md", md)
    _write(out / "cells.csv", _csv(cells))
    _write(out / "directions.csv", _csv(dirs))
    _write(out / "paper_consistency.csv", _csv(cons))
    _write(out / "summary.json", json.dumps(s, indent=2, default=float) + "\n")
    return md


# ---- README and HTML report: one page built from the data ---------------------------------------------
def load_directions(path) -> pd.DataFrame:
    """diff/directions.csv as diff.directions() returned it (stem.report.diff.load_directions)."""
    return diff.load_directions(path)


def page_blocks(exp: Experiment, ours: dict, s: dict, dirs: pd.DataFrame, figures: list[str]) -> list:
    """The one-page report: label, diff summary, every table, every figure, conventions. Links are relative."""
    exp_name, label = exp.experiment, T.experiment_label(exp)
    figs = registry.figures()
    b = [page.Heading(1, f"STEM reproduction report — {label}")]
    if exp_name != "paper":
        b.append(page.Quote(f"Every number below was produced by the **{exp_name}** experiment "
                            f"(config/{exp_name}.yaml). It is not a paper-scale result and must not be read as one; "
                            "the paper's numbers appear only in the comparison columns, labelled *paper*."))
    b += [page.Para("Contents: [diff summary](#diff-summary) · [tables](#tables) · [figures](#figures) · "
                    "[conventions](#conventions). Full cell-by-cell diff: [diff/diff.md](diff/diff.md). "
                    "Tables as CSV / Markdown / LaTeX: [tables/](tables/). "
                    "Parameter accounting: [params.md](params.md)."),
          page.Heading(2, "Diff summary"),
          *diff.summary_blocks(s, dirs, C.variant_labels(exp), len(s["gate"]["failed"]) if "gate" in s else None,
                               level=3),
          page.Heading(2, "Tables")]
    for name, table in registry.tables().items():
        b += [page.Heading(3, table.title), page.Table(T.wide(ours.get(name, T.frame([]))), *[table.empty] * bool(table.empty)),
              page.Para(f"[csv](tables/{name}.csv) · [tex](tables/{name}.tex)")]
        if table.notes and not table.compared:   # a compared table's notes are in the diff, beside its cells
            b.append(page.Items(tuple(dict.fromkeys(table.notes.values()))))
    b.append(page.Heading(2, "Figures"))
    for f in figures:
        b += [page.Heading(3, f), page.Para(figs[f].caption), page.Image(f, f"figures/{f}.png"),
              page.Para(f"[pdf](figures/{f}.pdf)")]
    sp, tol = T.settings(exp).spikes, T.settings(exp).tolerance
    b += [page.Heading(2, "Conventions"), page.Items((
        "**Avg** = mean of the eight zero-shot commonsense tasks (ARC-E, ARC-C, BoolQ, PIQA, SIQA, HellaSwag, "
        "OBQA, WinoGrande); a row missing any task has no Avg (shown as —), never a partial mean.",
        "**ROI** = (Avg / GFLOPs-per-token) / (Avg_base / GFLOPs_base) against the dense baseline of the same "
        "scale (equal training tokens, so this is accuracy per training FLOP, normalised).",
        "**#Total** follows the paper's convention: dense total + n_STEM x V x d_ff (the removed "
        "up-projections are not subtracted); `#Total exact` is the model as built. The paper's 350M #Total "
        "column fits no consistent table shape (research notes A) — the diff shows ours next to it.",
        "**#Active** = parameters in matrix products per token; **GFLOPs/token** = 2 x #Active / 1e9. The "
        "parameter columns are the accounting written with each model's checkpoint (`checkpoint/accounting.json`).",
        f"**Loss spike** = training loss above the median of the previous {sp.window} logged steps by more "
        f"than {sp.k:g} x 1.4826 x MAD (a robust {sp.k:g}-sigma rule).",
        f"**Tolerances** (absolute): accuracy {tol['accuracy']:g} points, params {tol['params']:g} B, "
        f"GFLOPs {tol['gflops']:g}, ROI {tol['roi']:g}; configurable under `report.tolerance`.",
        "— marks a result that does not exist yet (not a zero).",
        f"Regenerate: `snakemake --profile profiles/local` (tables, diff, figures, this page and report.html); "
        f"`python -m stem diff --experiment {exp_name}` prints the diff.")),
        page.Para(f"_Cells: {s['cells']} compared, {s['within_tolerance']} within tolerance, {s['missing']} missing._")]
    return b


def report_page(exp: Experiment, report_dir, figures: list[str] | None = None) -> list:
    """The page's blocks from the report's data files: reproduced.csv, diff/summary.json, diff/directions.csv."""
    rd = Path(report_dir)
    s = json.loads((rd / "diff" / "summary.json").read_text())
    figures = list(registry.figures(exp.experiment)) if figures is None else figures
    return page_blocks(exp, load_reproduced(rd / "tables" / "reproduced.csv"), s,
                       load_directions(rd / "diff" / "directions.csv"), figures)


def readme(exp: Experiment, report_dir, figures: list[str] | None = None) -> str:
    """reports/{experiment}/README.md."""
    return page.markdown(report_page(exp, report_dir, figures))


def html_report(exp: Experiment, report_dir, figures: list[str] | None = None) -> str:
    """reports/{experiment}/report.html: the README's page, self-contained (figures embedded)."""
    return page.to_html(report_page(exp, report_dir, figures), f"STEM reproduction report — "
                        f"{T.experiment_label(exp)}", report_dir)
