"""Reproduced vs published, cell by cell; where the paper disagrees with itself; direction checks.

``compare`` joins an experiment's tables (``tables.build_all``) with the paper's cells of every table
registered as ``compared`` (stem.report.registry), ``directions`` asks whether each variant beats the
dense baseline where the paper says it does,
``paper_consistency`` recomputes printed numbers from other printed numbers, ``gate`` selects cells
a user wants to hold within a tolerance. ``render`` writes it all as one Markdown document.
"""
from __future__ import annotations

import math
from fnmatch import fnmatch

import numpy as np
import pandas as pd

from stem.report import paper_data as P
from stem.report import registry
from stem.report import tables as T

CELL_COLUMNS = ["table", "scale", "variant", "row", "column", "unit", "ours", "paper", "delta", "tolerance",
                "status", "note"]


def tolerance_for(column: str, unit: str, tol: dict) -> float:
    if column == "roi":
        return tol["roi"]
    return {"B params": tol["params"], "GFLOPs/token": tol["gflops"], "%": tol["accuracy"],
            "score": tol["accuracy"]}.get(unit, tol["other"])


def paper_cells() -> pd.DataFrame:
    """The paper's cells of every compared table (as its entry's ``paper_cells`` presents them)."""
    frames = []
    for name in registry.compared():
        t = registry.table(name)
        df = P.load_table(t.csv)
        frames.append(t.paper_cells(df) if t.paper_cells else df)
    return pd.concat(frames, ignore_index=True)


def _note(table, scale, column) -> str:
    notes = registry.table(table).notes
    return notes.get((scale, column)) or notes.get(("", column)) or ""


def compare(ours: dict[str, pd.DataFrame], tol: dict) -> pd.DataFrame:
    """One row per published cell: ours, paper, delta, the tolerance and a status
    ('ok' within tolerance, 'drift' beyond it, 'missing' where we have no number yet)."""
    mine = pd.concat([ours[t] for t in registry.compared() if t in ours], ignore_index=True)
    mine = mine.drop_duplicates(["table", "scale", "variant", "column"]).set_index(["table", "scale", "variant",
                                                                                      "column"])["value"]
    rows = []
    for c in paper_cells().itertuples():
        key = (c.table, c.scale, c.variant, c.column)
        value = mine.get(key, math.nan)
        t = tolerance_for(c.column, c.unit, tol)
        if c.column == "train_tokens":  # the paper rounds token counts ("100 billion"): 5% relative
            t = 0.05 * float(c.value)
        if isinstance(c.value, str) or isinstance(value, str):
            delta = math.nan
            status = "missing" if T._isnan(value) else (
                "ok" if str(value).lower() == str(c.value).lower() else "drift")
        elif T._isnan(value):
            delta, status = math.nan, "missing"
        else:
            delta = float(value) - float(c.value)
            ok = abs(delta) <= t + 1e-9 or math.isclose(float(value), float(c.value), rel_tol=1e-9)
            status = "ok" if ok else "drift"
        rows.append({"table": c.table, "scale": c.scale, "variant": c.variant, "row": c.row, "column": c.column,
                     "unit": c.unit, "ours": value, "paper": c.value, "delta": delta, "tolerance": t,
                     "status": status, "note": _note(c.table, c.scale, c.column)})
    return pd.DataFrame(rows, columns=CELL_COLUMNS)


def directions(ours: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """For every non-baseline cell of the direction-checked tables (Tables 3-6, ROI included): does the
    variant beat the same scale's dense baseline in our results where the paper says it does?"""
    rows = []
    for name in registry.direction_checked():
        t = registry.table(name)
        undirected = t.undirected
        paper = P.load_table(t.csv)
        if t.paper_directions:
            paper = t.paper_directions(paper, T.ordered_scales(set(ours.get(name, T.frame([]))["scale"])))
        paper = paper.set_index(["scale", "variant", "column"])["value"]
        mine = ours.get(name, T.frame([])).set_index(["scale", "variant", "column"])["value"]
        for (scale, variant, column), pv in paper.items():
            if variant == "dense" or column in undirected or (scale, "dense", column) not in paper.index:
                continue
            p_delta = pv - paper[(scale, "dense", column)]
            o, o_base = mine.get((scale, variant, column), math.nan), mine.get((scale, "dense", column), math.nan)
            o_delta = math.nan if T._isnan(o) or T._isnan(o_base) else float(o) - float(o_base)
            rows.append({"table": name, "scale": scale, "variant": variant, "column": column,
                         "paper_delta": p_delta, "ours_delta": o_delta,
                         "paper_says": _verdict(p_delta, column in t.lower_better),
                         "ours": "missing" if T._isnan(o_delta) else _verdict(o_delta, column in t.lower_better),
                         "agree": None if T._isnan(o_delta) else bool(np.sign(p_delta) == np.sign(o_delta))})
    return pd.DataFrame(rows, columns=["table", "scale", "variant", "column", "paper_delta", "ours_delta",
                                       "paper_says", "ours", "agree"])


def _verdict(delta: float, lower_better: bool = False) -> str:
    delta = -delta if lower_better else delta
    return "beats baseline" if delta > 0 else "trails baseline" if delta < 0 else "ties baseline"


def paper_consistency(paper_acct: dict | None = None) -> pd.DataFrame:
    """Printed numbers recomputed from other printed numbers (and, given ``paper_acct`` =
    {(scale, variant): accounting of config/paper.yaml}, from the architectures)."""
    rows = []

    def add(check, table, scale, variant, column, printed, recomputed, half_ulp, note=""):
        delta = recomputed - printed
        rows.append({"check": check, "table": table, "scale": scale, "variant": variant, "column": column,
                     "printed": printed, "recomputed": recomputed, "delta": delta,
                     "consistent": abs(delta) <= half_ulp + 1e-9, "note": note})

    for name in ("table3", "table4"):
        df = P.load_table(name)
        for (scale, variant), g in df.groupby(["scale", "variant"], sort=False):
            v = dict(zip(g["column"], g["value"]))
            add("Avg = mean of the 8 commonsense tasks", name, scale, variant, "avg", v["avg"], T.average(v), 0.005)
    t3 = P.load_table("table3")
    printed = {(r.scale, r.variant, r.column): r.value for r in t3.itertuples()}
    for (scale, variant, column), value in printed.items():
        if column != "roi":
            continue
        args = (printed[(scale, variant, "avg")], printed[(scale, variant, "gflops_per_token")],
                printed[(scale, "dense", "avg")], printed[(scale, "dense", "gflops_per_token")])
        add("ROI from printed Avg and #GFLOPs", "table3", scale, variant, "roi", value, T.roi(*args), 0.005)
        if paper_acct and (scale, variant) in paper_acct:
            g, gb = paper_acct[(scale, variant)]["gflops_per_token"], paper_acct[(scale, "dense")]["gflops_per_token"]
            add("ROI from printed Avg and exact GFLOPs of the architecture", "table3", scale, variant, "roi", value,
                T.roi(args[0], g, args[2], gb), 0.005, "rounding #GFLOPs to 2 decimals moves ROI")
    for (scale, variant, column), value in printed.items():
        if column == "gflops_per_token":
            add("#GFLOPs = 2 x printed #Active", "table3", scale, variant, column, value,
                2 * printed[(scale, variant, "active_params_b")], 0.015,
                "STEM† prints #Active 0.35 but #GFLOPs 0.74 (= 2 x 0.37): it keeps the up-projection, so its active "
                "count equals the baseline's" if variant == "stem_dagger" else "")
    if paper_acct:
        for (scale, variant), a in paper_acct.items():
            for column, ours in [("total_params_b", a["paper_total_params"] / 1e9),
                                 ("active_params_b", a["active_params"] / 1e9),
                                 ("gflops_per_token", a["gflops_per_token"])]:
                if (scale, variant, column) in printed:
                    add("Table 3 parameters / FLOPs from the architectures (config/paper.yaml)", "table3", scale,
                        variant, column, printed[(scale, variant, column)], ours, 0.005,
                        _note("table3", "350m", "total_params_b") if (scale, column) == ("350m", "total_params_b")
                        else "The paper prints 0.37B for the 376,075,200-parameter dense 350M model and 0.74 = 2 x 0.37 "
                        "GFLOPs (exact: 0.752)" if scale == "350m" and variant in ("dense", "hashmoe", "stem_dagger")
                        else "")
    t1 = T.table1({"experiment": "-", "archs": {}, "stages": {}})
    fr = t1[t1["column"] == "saving_fraction"].set_index("variant")["value"]
    for r in P.load_table("table1_saving_fractions").itertuples():
        add("Table 1 saving fraction d_ff/(4d+2L+3d_ff), L=4096 (assumed)", "table1", "", r.variant,
            "saving_fraction", r.value, fr[r.variant], 0.05)
    t2 = P.load_table("table2").set_index(["variant", "column"])["value"]
    add("Warmup ratio: Table 2 caption vs Sec. 4.1 text", "table2", "", "common", "warmup_ratio",
        t2[("common", "warmup_ratio")], t2[("sec4_1", "warmup_ratio")], 0.0, _note("table2", "", "warmup_ratio"))
    for r in official_configs().itertuples():   # printed = the paper's value, recomputed = the official config's
        add(f"Official code config {r.config} vs the paper ({r.paper_source})", "official_code", r.scale, r.variant,
            r.key, float(r.paper), float(r.official), 0.0,
            f"{r.source} ({r.commit}; values: {r.checked})" + (f"; {r.note}" if isinstance(r.note, str) else ""))
    return pd.DataFrame(rows)


def official_configs() -> pd.DataFrame:
    """The official code's settings next to the paper's (reference/official_code/configs.csv, its README)."""
    return pd.read_csv(P.REFERENCE_DIR / "official_code" / "configs.csv")


def gate(cells: pd.DataFrame, patterns: list[str], tolerance: float | None = None) -> pd.DataFrame:
    """Cells matching any of ``patterns`` (fnmatch on 'table/scale/variant/column') that are missing or
    beyond tolerance (the per-unit tolerance, or ``tolerance`` when given)."""
    key = cells["table"] + "/" + cells["scale"] + "/" + cells["variant"] + "/" + cells["column"]
    for p in patterns:
        if not any(fnmatch(k, p) for k in key):
            raise ValueError(f"gate pattern {p!r} matches no published cell (cells are table/scale/variant/column, "
                             "e.g. table3/350m/stem/avg; see diff/cells.csv)")
    chosen = cells[key.map(lambda k: any(fnmatch(k, p) for p in patterns))]
    tol = chosen["tolerance"] if tolerance is None else tolerance
    bad = (chosen["status"] == "missing") | (chosen["delta"].abs() > tol + 1e-9) | (chosen["status"] == "drift") \
        & chosen["delta"].isna()
    return chosen[bad]


def summary(experiment: str, cells: pd.DataFrame, dirs: pd.DataFrame, consistency: pd.DataFrame,
            top: int = 10) -> dict:
    numeric = cells.dropna(subset=["delta"]).copy()
    numeric["gap"] = numeric["delta"].abs() / numeric["tolerance"].where(numeric["tolerance"] > 0, 1.0)
    arch = cells["unit"].isin(["B params", "GFLOPs/token"])
    largest = numeric[(numeric["status"] == "drift") & (numeric["table"] != "table2")
                      & ~numeric["unit"].isin(["B params", "GFLOPs/token"])]
    largest = largest.sort_values("gap", ascending=False).head(top)
    results, config = cells[cells["table"] != "table2"], cells[cells["table"] == "table2"]
    counts = results["status"].value_counts()
    return {
        "experiment": experiment, "label": T.experiment_label(experiment), "paper_scale": experiment == "paper",
        "architecture_cells": int(arch.sum()), "architecture_matching": int((arch & (cells["status"] == "ok")).sum()),
        "config_cells": int(len(config)), "config_matching": int((config["status"] == "ok").sum()),
        "cells": int(len(results)), "within_tolerance": int(counts.get("ok", 0)),
        "beyond_tolerance": int(counts.get("drift", 0)), "missing": int(counts.get("missing", 0)),
        "largest_gaps": [{"cell": f"{r.table}/{r.scale}/{r.variant}/{r.column}", "ours": r.ours, "paper": r.paper,
                          "delta": r.delta, "tolerance": r.tolerance} for r in largest.itertuples()],
        "directions": {"agree": int((dirs["agree"] == True).sum()),  # noqa: E712
                       "disagree": int((dirs["agree"] == False).sum()),  # noqa: E712
                       "missing": int(dirs["agree"].isna().sum())},
        "paper_inconsistencies": int((~consistency["consistent"]).sum()) if len(consistency) else 0,
    }


# ---- rendering -----------------------------------------------------------------------------------
def _num(x, column="", unit="") -> str:
    return T.fmt(x, column, unit)


def _delta(d: float) -> str:
    return f"{d:+.2f}" if 0.01 <= abs(d) < 1e4 or d == 0 else f"{d:+.3g}"


def side_by_side(cells: pd.DataFrame, table: str) -> str:
    """One table in the paper's layout, each cell 'ours / paper (delta)'; ⚠ beyond tolerance."""
    df = cells[cells["table"] == table]
    if df.empty:
        return ""
    out = []
    for (scale, variant), g in df.groupby(["scale", "variant"], sort=False):
        label = T.PAPER_ROW.get(table, {}).get(variant) or P.VARIANT_LABELS.get(variant) or g["row"].iloc[0]
        r = {"Scale": scale, "Model": label}
        for c in g.itertuples():
            s = f"{_num(c.ours, c.column, c.unit)} / {_num(c.paper, c.column, c.unit)}"
            if not T._isnan(c.delta) and c.delta != 0:
                s += f" ({_delta(c.delta)})"
            r[T.column_label(c.column, table)] = s + (" ⚠" if c.status == "drift" else "")
        out.append(r)
    return T.to_markdown(pd.DataFrame(out).fillna(""))


def summary_blocks(s: dict, dirs: pd.DataFrame, gate_failed: int | None = None, level: int = 2) -> list:
    """The diff's summary as page blocks (diff.md at ``level`` 2; the README and HTML report one level down):
    counts, the largest gaps and the direction check."""
    from stem.report import page
    blocks = []
    if not s["paper_scale"]:
        blocks.append(page.Quote(
            "**Tiny-scale comparison.** These models are orders of magnitude smaller and trained on a synthetic "
            "corpus, so absolute deltas against the paper are expected to be large and are not a reproduction "
            "verdict. The informative part is the **direction check**: does each variant beat the dense baseline "
            "where the paper says it does?"))
    blocks += [page.Heading(level, "Summary"), page.Items((
        f"Published result cells compared: **{s['cells']}** — within tolerance: **{s['within_tolerance']}**, "
        f"beyond tolerance: **{s['beyond_tolerance']}**, missing (no result yet): **{s['missing']}**",
        f"Of these, parameter / GFLOPs cells (the accounting saved with each checkpoint): "
        f"**{s['architecture_matching']}/{s['architecture_cells']}** within tolerance (see the Table 3 notes)",
        f"Config vs Table 2: **{s['config_matching']}/{s['config_cells']}** hyperparameter cells match",
        f"Directions (variant vs dense baseline, Tables 3–6 and the DSE paper's Table 1): agree **{s['directions']['agree']}**, "
        f"disagree **{s['directions']['disagree']}**, missing **{s['directions']['missing']}**",
        f"Places where the paper disagrees with itself: **{s['paper_inconsistencies']}** (see below)",
        "Tolerances (absolute): accuracy points / params (B) / GFLOPs / ROI as configured in `report.tolerance`;"
        " text cells must match exactly."))]
    if gate_failed is not None:
        blocks.append(page.Items((f"Gate: **{'FAILED' if gate_failed else 'passed'}** ({gate_failed} chosen cells "
                                  "missing or beyond tolerance)",)))
    if s["largest_gaps"]:
        gaps = pd.DataFrame([(g["cell"], _num(g["ours"]), _num(g["paper"]), _delta(g["delta"]), f"{g['tolerance']:g}")
                             for g in s["largest_gaps"]], columns=["Cell", "Ours", "Paper", "Delta", "Tolerance"])
        blocks += [page.Heading(level + 1, "Largest gaps among result cells (accuracy, scores, ROI; in units of each "
                                "cell's tolerance)"), page.Table(gaps)]
    blocks.append(page.Heading(level, "Directions: does each variant beat the baseline where the paper says it does?"))
    if len(dirs):
        rows = []
        for (table, scale, variant), d in dirs.groupby(["table", "scale", "variant"], sort=False):
            avg = d[d["column"] == "avg"]
            pa = f"{avg['paper_delta'].iloc[0]:+.2f}" if len(avg) else "n/a"
            oa = ("—" if T._isnan(avg["ours_delta"].iloc[0]) else f"{avg['ours_delta'].iloc[0]:+.2f}") if len(avg) \
                else "n/a"
            known = d["agree"].dropna()
            rows.append((table, scale, P.VARIANT_LABELS.get(variant, variant), pa, oa,
                         f"{int(known.sum())}/{len(known)} ({len(d) - len(known)} missing)"))
        blocks.append(page.Table(pd.DataFrame(rows, columns=[
            "Table", "Scale", "Variant", "Paper: Avg vs baseline", "Ours: Avg vs baseline", "Cells agreeing"])))
    return blocks


def render(s: dict, cells: pd.DataFrame, dirs: pd.DataFrame, consistency: pd.DataFrame,
           gate_failures: pd.DataFrame | None = None) -> str:
    from stem.report.page import markdown
    head = f"# Paper diff — {s['label']}\n\n"
    md = [markdown(summary_blocks(s, dirs, None if gate_failures is None else len(gate_failures)))]
    md += ["## Side by side (ours / paper (ours − paper); ⚠ beyond tolerance; — no result yet)", ""]
    for table in registry.compared():
        body = side_by_side(cells, table)
        if body:
            md += [f"### {registry.table(table).title}", "", body]
            notes = sorted({n for n in cells[cells["table"] == table]["note"] if n})
            md += [f"- {n}" for n in notes] + ([""] if notes else [])
    md += ["## Where the paper disagrees with itself", "",
           "Printed numbers recomputed from the paper's other printed numbers (and from the architectures). "
           "Consistent means equal up to the printed rounding.", "",
           "| Check | Cell | Printed | Recomputed | Consistent |", "|---|---|---|---|---|"]
    bad = consistency[~consistency["consistent"]]
    for r in bad.itertuples():
        md.append(f"| {r.check} | {r.table}/{r.scale or '-'}/{r.variant}/{r.column} | {r.printed:g} | "
                  f"{r.recomputed:.4g} | {'yes' if r.consistent else '**no**'} |")
    notes = sorted({n for n in bad["note"] if n})
    md += ["", f"{len(consistency) - len(bad)} other recomputations agree with the printed numbers "
           "(all checks: `diff/paper_consistency.csv`).", ""] + [f"- {n}" for n in notes] + [""]
    return head + "\n".join(md)


def confident_directions(cfg: dict, root=".") -> pd.DataFrame:
    """The direction check with a confidence per verdict (stem.analysis.verdict): each Table 3/4 accuracy
    direction (per task and the average) by a paired bootstrap over the benchmark items, read as agree /
    disagree / inconclusive. Kept beside ``directions`` (point estimates), which it does not change."""
    from stem.analysis.verdict import table_directions
    return pd.DataFrame(table_directions(cfg, root))
