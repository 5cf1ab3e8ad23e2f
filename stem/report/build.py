"""Write the report's pieces under ``reports/{experiment}/``: tables, diff, README.

    tables/{table1..table6,figure1b}.{csv,md,tex}   the paper's tables from this experiment
    tables/reproduced.csv                           all of them, long format (the diff's input)
    diff/diff.md, cells.csv, directions.csv, paper_consistency.csv, summary.json
    figures/*.png|pdf                               (stem.report.figures)
    README.md                                       everything above in one page
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import pandas as pd

from stem.report import diff
from stem.report import paper_data as P
from stem.report import tables as T
from stem.report.results import Results

TABLES = ["table1", "table2", "table3", "table4", "table5", "table6", "figure1b"]
DIFF_FILES = ["diff.md", "cells.csv", "directions.csv", "paper_consistency.csv", "summary.json"]


def _write(path, text: str):
    from stem.io import atomic_write_text
    atomic_write_text(path, text)


def _csv(df: pd.DataFrame) -> str:
    buf = io.StringIO()
    df.to_csv(buf, index=False)
    return buf.getvalue()


def write_tables(cfg: dict, res: Results, out_dir) -> dict[str, pd.DataFrame]:
    out = Path(out_dir)
    ours = T.build_all(cfg, res)
    label = T.experiment_label(cfg)
    for name in TABLES:
        w = T.wide(ours[name])
        _write(out / f"{name}.csv", _csv(w))
        _write(out / f"{name}.md", f"# {T.TITLES[name]}\n\n_{label}_\n\n{T.to_markdown(w)}")
        _write(out / f"{name}.tex", T.to_latex(w, f"{T.TITLES[name]} ({label})"))
    _write(out / "reproduced.csv", _csv(pd.concat([ours[n] for n in TABLES], ignore_index=True)))
    return ours


def load_reproduced(path) -> dict[str, pd.DataFrame]:
    df = pd.read_csv(path, dtype=str, keep_default_na=False)
    num = pd.to_numeric(df["value"].replace("", "nan"), errors="coerce")
    df["value"] = [n if (s == "" or s.lower() == "nan" or pd.notna(n)) else s for s, n in zip(df["value"], num)]
    return {name: g.reset_index(drop=True) for name, g in df.groupby("table", sort=False)}


def paper_accounting() -> dict:
    """Accounting of config/paper.yaml's Table 3 models (for the paper-consistency checks)."""
    from stem import config as C
    cfg = C.read_yaml(C.REPO / "config" / "paper.yaml")  # only archs / variant_overrides are used
    t3 = P.load_table("table3")
    return {(s, v): T.accounting(cfg, s, v) for s, v in t3[["scale", "variant"]].drop_duplicates().itertuples(index=False)}


def run_diff(cfg: dict, ours: dict, gate_patterns=(), gate_tolerance=None, paper_acct=None):
    tol = T.settings(cfg)["tolerance"]
    cells, dirs = diff.compare(ours, tol), diff.directions(ours)
    cons = diff.paper_consistency(paper_acct)
    s = diff.summary(cfg["experiment"], cells, dirs, cons)
    failures = diff.gate(cells, list(gate_patterns), gate_tolerance) if gate_patterns else None
    if failures is not None:
        s["gate"] = {"patterns": list(gate_patterns), "failed": [f"{r.table}/{r.scale}/{r.variant}/{r.column}"
                                                                 for r in failures.itertuples()]}
    return s, cells, dirs, cons, failures


def write_diff(out_dir, s, cells, dirs, cons, failures=None) -> str:
    out = Path(out_dir)
    md = diff.render(s, cells, dirs, cons, failures)
    _write(out / "diff.md", md)
    _write(out / "cells.csv", _csv(cells))
    _write(out / "directions.csv", _csv(dirs))
    _write(out / "paper_consistency.csv", _csv(cons))
    _write(out / "summary.json", json.dumps(s, indent=2, default=float) + "\n")
    return md


# ---- README --------------------------------------------------------------------------------------
def readme(cfg: dict, report_dir, figures: list[str]) -> str:
    """One page: label, diff summary, every table, every figure, conventions. Links are relative."""
    from stem.report.figures import FIGURES
    rd = Path(report_dir)
    exp, label = cfg["experiment"], T.experiment_label(cfg)
    s = json.loads((rd / "diff" / "summary.json").read_text())
    diff_md = (rd / "diff" / "diff.md").read_text()
    summary = diff_md.split("\n", 1)[-1].split("## Side by side", 1)[0].replace("\n## ", "\n### ")
    md = [f"# STEM reproduction report — {label}", ""]
    if exp != "paper":
        md += [f"> Every number below was produced by the **{exp}** experiment (config/{exp}.yaml). It is not a "
               "paper-scale result and must not be read as one; the paper's numbers appear only in the "
               "comparison columns, labelled *paper*.", ""]
    md += ["Contents: [diff summary](#diff-summary) · [tables](#tables) · [figures](#figures) · "
           "[conventions](#conventions). Full cell-by-cell diff: [diff/diff.md](diff/diff.md). "
           "Tables as CSV / Markdown / LaTeX: [tables/](tables/). Parameter accounting: [params.md](params.md).", "",
           "## Diff summary", summary.strip(), "", "## Tables", ""]
    for name in TABLES:
        body = (rd / "tables" / f"{name}.md").read_text().split("\n", 4)[-1]  # drop the title + label lines
        md += [f"### {T.TITLES[name]}", "", body.strip(), "",
               f"[csv](tables/{name}.csv) · [tex](tables/{name}.tex)", ""]
    md += ["## Figures", ""]
    for f in figures:
        md += [f"### {f}", "", FIGURES[f][2], "", f"![{f}](figures/{f}.png)", "", f"[pdf](figures/{f}.pdf)", ""]
    sp, tol = T.settings(cfg)["spikes"], T.settings(cfg)["tolerance"]
    md += ["## Conventions", "",
           "- **Avg** = mean of the eight zero-shot commonsense tasks (ARC-E, ARC-C, BoolQ, PIQA, SIQA, HellaSwag, "
           "OBQA, WinoGrande); a row missing any task has no Avg (shown as —), never a partial mean.",
           "- **ROI** = (Avg / GFLOPs-per-token) / (Avg_base / GFLOPs_base) against the dense baseline of the same "
           "scale (equal training tokens, so this is accuracy per training FLOP, normalised).",
           "- **#Total** follows the paper's convention: dense total + n_STEM x V x d_ff (the removed "
           "up-projections are not subtracted); `#Total exact` is the model as built. The paper's 350M #Total "
           "column fits no consistent table shape (research notes A) — the diff shows ours next to it.",
           "- **#Active** = parameters in matrix products per token; **GFLOPs/token** = 2 x #Active / 1e9.",
           f"- **Loss spike** = training loss above the median of the previous {sp['window']} logged steps by more "
           f"than {sp['k']:g} x 1.4826 x MAD (a robust {sp['k']:g}-sigma rule).",
           f"- **Tolerances** (absolute): accuracy {tol['accuracy']:g} points, params {tol['params']:g} B, "
           f"GFLOPs {tol['gflops']:g}, ROI {tol['roi']:g}; configurable under `report.tolerance`.",
           "- — marks a result that does not exist yet (not a zero).",
           f"- Regenerate: `snakemake --profile profiles/local` (tables, diff, figures, this page); "
           f"`python -m stem diff --experiment {exp}` prints the diff.", ""]
    md.append(f"_Cells: {s['cells']} compared, {s['within_tolerance']} within tolerance, {s['missing']} missing._")
    return "\n".join(md) + "\n"
