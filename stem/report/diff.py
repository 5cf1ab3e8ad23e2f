"""Reproduced vs published, cell by cell; where the paper disagrees with itself; direction checks.

``compare`` joins an experiment's tables (``tables.build_all``) with the paper's cells of every table
registered as ``compared`` (stem.report.registry), ``directions`` gives every direction's verdict from one
source, the ``directions`` table (paired bootstrap; point estimates only where it has no row), and
``gate_directions`` fails on resolved disagreements or verdicts changed against a baseline,
``paper_consistency`` recomputes printed numbers from other printed numbers, ``gate`` selects cells
a user wants to hold within a tolerance. ``render`` writes it all as one Markdown document.
"""
from __future__ import annotations

import math
from fnmatch import fnmatch
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from stem import config as C
from stem import provenance
from stem.config.experiment import Experiment
from stem.io import atomic_write_text
from stem.report import page, registry
from stem.report import paper_data as P
from stem.report import tables as T
from stem.report import verdict as V
from stem.report.page import markdown
from stem.report.provenance import commit_label, results_summary
from stem.report.truncation import truncation_lines, truncation_summary

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
            status = "missing" if T.isnan(value) else (
                "ok" if str(value).lower() == str(c.value).lower() else "drift")
        elif T.isnan(value):
            delta, status = math.nan, "missing"
        else:
            delta = float(value) - float(c.value)
            ok = abs(delta) <= t + 1e-9 or math.isclose(float(value), float(c.value), rel_tol=1e-9)
            status = "ok" if ok else "drift"
        rows.append({"table": c.table, "scale": c.scale, "variant": c.variant, "row": c.row, "column": c.column,
                     "unit": c.unit, "ours": value, "paper": c.value, "delta": delta, "tolerance": t,
                     "status": status, "note": _note(c.table, c.scale, c.column)})
    return pd.DataFrame(rows, columns=CELL_COLUMNS)


def point_directions(ours: dict[str, pd.DataFrame], baseline: str) -> pd.DataFrame:
    """For every non-baseline cell of the direction-checked tables (Tables 3-6, ROI included): does the
    variant beat the same scale's ``baseline`` in our results where the paper says it does? Point estimates
    (the tables' numbers), no uncertainty: ``directions`` uses them only where the bootstrap table has no row."""
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
            if variant == baseline or column in undirected or (scale, baseline, column) not in paper.index:
                continue
            p_delta = pv - paper[(scale, baseline, column)]
            o, o_base = mine.get((scale, variant, column), math.nan), mine.get((scale, baseline, column), math.nan)
            o_delta = math.nan if T.isnan(o) or T.isnan(o_base) else float(o) - float(o_base)
            rows.append({"table": name, "scale": scale, "variant": variant, "column": column,
                         "paper_delta": p_delta, "ours_delta": o_delta,
                         "paper_says": _verdict(p_delta, column in t.lower_better),
                         "ours": "missing" if T.isnan(o_delta) else _verdict(o_delta, column in t.lower_better),
                         "agree": None if T.isnan(o_delta) else bool(np.sign(p_delta) == np.sign(o_delta))})
    return pd.DataFrame(rows, columns=["table", "scale", "variant", "column", "paper_delta", "ours_delta",
                                       "paper_says", "ours", "agree"])


DIRECTION_COLUMNS = ["table", "scale", "variant", "stage", "column", "paper_delta", "ours_delta", "lo", "hi", "n",
                     "verdict", "category", "paper_effect_resolvable", "origin", "source", "p", "p_adjusted",
                     "raw_verdict", "raw_category"]
NUMBERS = ("paper_delta", "ours_delta", "lo", "hi", "p", "p_adjusted")
BOOTSTRAP = "tables/directions.csv"   # origin of a verdict read from the registered ``directions`` table
POINT = "point estimate (no per-item data)"
KEY = ["table", "scale", "variant", "stage", "column"]


def _bool(x):
    return None if T.isnan(x) or x in ("", None) else str(x) == "True"


def bootstrap_directions(ours: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The registered ``directions`` table (stem.report.analyses: paired bootstrap, 95%) back as one row per
    direction, each with its verdict's category (stem.report.verdict.category)."""
    d = ours.get("directions")
    if d is None or d.empty:
        return pd.DataFrame(columns=DIRECTION_COLUMNS)
    rows = []
    for (scale, variant, _), g in d.groupby(["scale", "variant", "row"], sort=False):
        v = dict(zip(g["column"], g["value"]))
        if "check_table" not in v:
            raise ValueError(f"directions table row {scale}/{variant}/{g['row'].iloc[0]}: no check_table / check_column "
                             "(tables/reproduced.csv predates them: rebuild the tables, rule report_tables)")
        num = lambda k: None if T.isnan(v.get(k, math.nan)) else float(v[k])  # noqa: E731
        rows.append({"table": v["check_table"], "scale": scale, "variant": variant,
                     "stage": "" if T.isnan(v.get("stage", math.nan)) else str(v["stage"]),
                     "column": str(v["check_column"]), "paper_delta": num("paper_delta"),
                     "ours_delta": num("ours_delta"), "lo": num("lo"), "hi": num("hi"),
                     "n": int(num("n") or 0), "verdict": str(v.get("verdict", "missing")),
                     "category": V.category(v.get("verdict")), "p": num("p"), "p_adjusted": num("p_adjusted"),
                     "raw_verdict": str(v.get("raw_verdict", v.get("verdict", "missing"))),
                     "raw_category": V.category(v.get("raw_verdict", v.get("verdict"))),
                     "paper_effect_resolvable": _bool(v.get("paper_effect_resolvable", math.nan)),
                     "origin": BOOTSTRAP, "source": g["source"].iloc[0]})
    return pd.DataFrame(rows, columns=DIRECTION_COLUMNS)


def directions(ours: dict[str, pd.DataFrame], baseline: str) -> pd.DataFrame:
    """Every direction's verdict, from one source: the rows of the ``directions`` table (paired bootstrap over
    items / windows; stem.report.analyses) first, then the point-estimate direction cells of the direction-
    checked tables that it has no row for (Table 3's ROI, Tables 5-6, the DSE paper's Table 1: no per-item data),
    verdict 'agree (point estimate)' / 'disagree (point estimate)' / 'missing'. ``baseline``: the variant each
    is compared with (stem.config.baseline_variant)."""
    boot = bootstrap_directions(ours)
    have = set(zip(boot["table"], boot["scale"], boot["variant"], boot["column"]))
    rows = []
    for r in point_directions(ours, baseline).itertuples():
        if (r.table, r.scale, r.variant, r.column) in have:
            continue
        verdict = "missing" if r.agree is None or T.isnan(r.ours_delta) else (
            "inconclusive" if r.ours_delta == 0 else f"{'agree' if r.agree else 'disagree'} (point estimate)")
        rows.append({"table": r.table, "scale": r.scale, "variant": r.variant, "stage": "", "column": r.column,
                     "paper_delta": r.paper_delta, "ours_delta": None if T.isnan(r.ours_delta) else r.ours_delta,
                     "lo": None, "hi": None, "n": 0, "verdict": verdict, "category": V.category(verdict),
                     "paper_effect_resolvable": None, "origin": POINT, "p": None, "p_adjusted": None,
                     "raw_verdict": verdict, "raw_category": V.category(verdict),
                     "source": f"{registry.table(r.table).title}: {r.variant} vs {baseline}, {r.column}"})
    point = pd.DataFrame(rows, columns=DIRECTION_COLUMNS)
    parts = [f for f in (boot, point) if len(f)]
    return pd.concat(parts, ignore_index=True) if parts else boot


def direction_counts(dirs: pd.DataFrame, control=None) -> dict:
    """The summary's direction counts: ``checked`` over the bootstrap table's rows (tables/directions.csv; the
    controlled verdicts), ``raw`` the same rows' per-cell verdicts, ``tested`` the family (rows with a p-value)
    and ``chance_raw`` the resolved per-cell verdicts chance alone would give it (no variant differing from the
    baseline: tested x (1 - level)); ``control`` (stem.specs.DirectionControl): the procedure and alpha;
    ``point_only`` over the point-estimate rows, and how many sized directions could resolve the paper's effect
    (interval half-width below the paper's |delta|)."""
    boot = dirs[dirs["origin"] == BOOTSTRAP]
    sized = boot["paper_effect_resolvable"].dropna()
    raw = boot["raw_category"] if "raw_category" in boot else boot["category"]
    tested = int(boot["p"].notna().sum()) if "p" in boot else 0
    return {"source": f"{BOOTSTRAP}: paired bootstrap, {V.LEVEL:.0%}", "checked": V.count(boot["category"]),
            "raw": V.count(raw), "tested": tested, "chance_raw": tested * (1 - V.LEVEL),
            "procedure": control.procedure if control else "none", "alpha": control.alpha if control else 1 - V.LEVEL,
            "point_only": V.count(dirs[dirs["origin"] == POINT]["category"]),
            "paper_effect_resolvable": int(sum(bool(x) for x in sized)), "paper_effect_sized": int(len(sized))}


def cell_name(r) -> str:
    """A direction's name in the gate's lines and the accepted-disagreements file: table/scale/variant/column."""
    return "/".join(str(r[k]) for k in ("table", "scale", "variant", "column"))


def _ci(r) -> str:
    return "" if r["lo"] is None or T.isnan(r["lo"]) else f" [{r['lo']:+.3g}, {r['hi']:+.3g}]"


def gate_directions(dirs: pd.DataFrame, baseline: pd.DataFrame | None = None, accepted=()) -> list[str]:
    """One line per failing direction: a resolved disagreement (interval excludes 0, the paper's sign the other
    way) that is not an ``accepted`` one (``load_accepted``), or, given ``baseline`` (an earlier
    diff/directions.csv), a verdict whose category changed (unless into an accepted disagreement) or that is
    gone. A direction new since the baseline does not fail; a baseline never waives a disagreement."""
    def name(r):
        return cell_name(r) + (f" ({r['stage']})" if r["stage"] else "")

    ok = {_accepted_key(a) for a in accepted}
    waived = lambda r: r["category"] == "disagree" and tuple(str(r[k]) for k in KEY) in ok  # noqa: E731
    out = [f"{name(r)}: disagrees with the paper (ours {r['ours_delta']:+.3g}{_ci(r)}, paper {r['paper_delta']:+.3g})"
           for r in dirs.to_dict("records") if r["category"] == "disagree" and not waived(r)]
    if baseline is not None:
        now = {tuple(str(r[k]) for k in KEY): r for r in dirs.to_dict("records")}
        for b in baseline.to_dict("records"):
            key = tuple(str(b[k]) for k in KEY)
            r = now.get(key)
            if r is None:
                out.append(f"{name(b)}: in the baseline ({b['category']}), not in these results")
            elif r["category"] != b["category"] and not waived(r):
                out.append(f"{name(r)}: verdict changed against the baseline: {b['category']} -> {r['category']}"
                           f" (ours {r['ours_delta'] if r['ours_delta'] is None else format(r['ours_delta'], '+.3g')}"
                           f"{_ci(r)})")
    return out


ACCEPTED_KEYS = ("cell", "stage", "verdict", "interval", "reason")


def _accepted_key(a: dict) -> tuple:
    table, scale, variant, column = a["cell"].split("/", 3)
    return table, scale, variant, a["stage"], column


def load_accepted(path) -> list[dict]:
    """The accepted-disagreements file (YAML): a list of {cell: table/scale/variant/column, stage, verdict (the
    verdict then: disagree), interval: [lo, hi] (then), reason}. The directions gate passes these cells while
    they still disagree; the report lists them with their interval then and now. One-line errors."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such accepted-disagreements file")
    entries = yaml.safe_load(p.read_text()) or []
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list of accepted disagreements, got {type(entries).__name__}")
    for i, a in enumerate(entries):
        where = f"{path}: entry {i + 1}"
        if not isinstance(a, dict) or set(a) != set(ACCEPTED_KEYS):
            raise ValueError(f"{where}: expected exactly the keys {', '.join(ACCEPTED_KEYS)}, got "
                             f"{sorted(a) if isinstance(a, dict) else a!r}")
        if not isinstance(a["cell"], str) or a["cell"].count("/") != 3:
            raise ValueError(f"{where}: key 'cell': {a['cell']!r}; expected table/scale/variant/column")
        if V.category(a["verdict"]) != "disagree":
            raise ValueError(f"{where}: key 'verdict': {a['verdict']!r}; expected disagree (only a disagreement "
                             "is accepted)")
        iv = a["interval"]
        if not (isinstance(iv, list) and len(iv) == 2 and all(isinstance(x, (int, float)) for x in iv)
                and iv[0] <= iv[1]):
            raise ValueError(f"{where}: key 'interval': {iv!r}; expected [lo, hi], two numbers, lo <= hi")
        if not isinstance(a["reason"], str) or not a["reason"].strip():
            raise ValueError(f"{where}: key 'reason': {a['reason']!r}; expected a sentence saying why")
        a["stage"] = "" if a["stage"] is None else str(a["stage"])
    return entries


ACCEPTED_HEADER = ("# Accepted disagreements (stem.report.diff.load_accepted): directions that disagree with the paper,\n"
                   "# known and accepted; `python -m stem diff --gate-directions` passes them while they still disagree,\n"
                   "# the report lists them. Add one with `python -m stem diff --accept CELL --reason TEXT`.\n")


def accept(dirs: pd.DataFrame, cells, reason: str, path) -> list[dict]:
    """Write ``path`` (YAML, atomically) with each of ``cells`` ('table/scale/variant/column', '@stage' where
    the cell has several) accepted: its verdict and interval now and ``reason``; an entry for the same cell is
    replaced. One-line error for a cell that does not disagree now."""
    p = Path(path)
    entries = load_accepted(p) if p.is_file() else []
    if not reason or not reason.strip():
        raise ValueError("--accept: needs --reason, a sentence saying why the disagreement is accepted")
    for spec in cells:
        cell, _, stage = spec.partition("@")
        rows = [r for r in dirs.to_dict("records") if cell_name(r) == cell and (not stage or str(r["stage"]) == stage)]
        if len(rows) != 1:
            raise ValueError(f"--accept {spec}: {'no direction' if not rows else 'several directions (add @stage)'} "
                             "of that name; expected table/scale/variant/column[@stage] as the gate names it")
        r = rows[0]
        if r["category"] != "disagree":
            raise ValueError(f"--accept {spec}: its verdict is {r['verdict']!r}; only a disagreement is accepted")
        new = {"cell": cell, "stage": str(r["stage"]), "verdict": "disagree",
               "interval": [float(r["lo"]), float(r["hi"])], "reason": reason.strip()}
        entries = [e for e in entries if _accepted_key(e) != _accepted_key(new)] + [new]
    atomic_write_text(p, ACCEPTED_HEADER + yaml.safe_dump(entries, sort_keys=False, allow_unicode=True, width=110))
    return entries


def check_accepted(exp: Experiment, accepted, path) -> None:
    """One-line error for an accepted disagreement naming a cell that cannot exist: a table the report does not
    build, a scale that is not one, or a variant config/variants.yaml (with the config's sweeps and seeds) does not
    define. A cell that can exist but has no result yet is listed as ``missing`` (``accepted_rows``)."""
    tables = sorted(set(registry.tables()) | {V.LOSS_TABLE})
    for i, a in enumerate(accepted):
        table, scale, variant, _ = a["cell"].split("/", 3)
        where = f"{path}: entry {i + 1}: key 'cell': {a['cell']!r}"
        if table not in tables:
            raise ValueError(f"{where}: no table {table!r}; expected one of {', '.join(tables)}")
        if scale not in C.SCALES:
            raise ValueError(f"{where}: no scale {scale!r}; expected one of {', '.join(C.SCALES)}")
        try:
            C.variant_spec(exp, variant)
        except C.ConfigError as e:
            raise ValueError(f"{where}: no such variant ({e})") from None


def accepted_rows(dirs: pd.DataFrame, accepted) -> list[dict]:
    """Each accepted disagreement with its verdict and interval now (``missing`` where the cell is gone)."""
    now = {tuple(str(r[k]) for k in KEY): r for r in dirs.to_dict("records")}
    out = []
    for a in accepted:
        r = now.get(_accepted_key(a))
        lo, hi = (None, None) if r is None or T.isnan(r["lo"]) else (float(r["lo"]), float(r["hi"]))
        out.append({"cell": a["cell"], "stage": a["stage"], "verdict": a["verdict"], "interval": a["interval"],
                    "reason": a["reason"], "now": "missing" if r is None else r["category"], "now_interval":
                    None if lo is None else [lo, hi]})
    return out


def load_directions(path) -> pd.DataFrame:
    """A diff/directions.csv (as ``directions`` returned it), e.g. a saved baseline; a file without its columns
    is refused with one line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such directions file (expected a reports/<experiment>/diff/directions.csv)")
    dirs = pd.read_csv(p, dtype={k: str for k in ("table", "scale", "variant", "stage", "column", "verdict", "raw_verdict",
                                                   "category", "origin", "source", "paper_effect_resolvable")},
                       keep_default_na=False, na_values={k: [""] for k in NUMBERS})
    missing = [c for c in KEY + ["verdict"] if c not in dirs.columns]
    if missing:
        raise ValueError(f"{path}: not a diff/directions.csv (no column {', '.join(missing)}; expected "
                         f"{', '.join(DIRECTION_COLUMNS)})")
    dirs["category"] = [V.category(v) for v in dirs["verdict"]]
    dirs["paper_effect_resolvable"] = dirs.get("paper_effect_resolvable", pd.Series([""] * len(dirs))).map(
        {"True": True, "False": False}).astype(object).where(lambda x: x.notna(), None)
    for c in NUMBERS:
        dirs[c] = dirs[c].astype(object).where(dirs[c].notna(), None) if c in dirs else None
    dirs["raw_category"] = [V.category(v) for v in (dirs["raw_verdict"] if "raw_verdict" in dirs else dirs["verdict"])]
    return dirs


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
    t3, base = P.load_table("table3"), C.baseline_variant()   # the paper's rows: config/variants.yaml's ids
    printed = {(r.scale, r.variant, r.column): r.value for r in t3.itertuples()}
    for (scale, variant, column), value in printed.items():
        if column != "roi":
            continue
        args = (printed[(scale, variant, "avg")], printed[(scale, variant, "gflops_per_token")],
                printed[(scale, base, "avg")], printed[(scale, base, "gflops_per_token")])
        add("ROI from printed Avg and #GFLOPs", "table3", scale, variant, "roi", value, T.roi(*args), 0.005)
        if paper_acct and (scale, variant) in paper_acct:
            g, gb = paper_acct[(scale, variant)]["gflops_per_token"], paper_acct[(scale, base)]["gflops_per_token"]
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
                        "GFLOPs (exact: 0.752)" if scale == "350m" and variant in (base, "hashmoe", "stem_dagger")
                        else "")
    t1 = T.table1(None)   # the Qwen2.5 rows
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
            top: int = 10, prov: pd.DataFrame | None = None, cut: pd.DataFrame | None = None, control=None) -> dict:
    """``prov``: the provenance table (long; stem.report.provenance), condensed into the summary beside the
    report's own provenance (stem.provenance.record); ``cut``: the truncation table (stem.report.truncation);
    ``control``: the directions' multiple-comparison settings (stem.specs.DirectionControl)."""
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
        "directions": direction_counts(dirs, control),
        "paper_inconsistencies": int((~consistency["consistent"]).sum()) if len(consistency) else 0,
        "provenance": {"report": provenance.record(), "results": results_summary(prov)},
        "truncation": truncation_summary(cut),
    }


# ---- rendering -----------------------------------------------------------------------------------
def _num(x, column="", unit="") -> str:
    return T.fmt(x, column, unit)


def _delta(d: float) -> str:
    return f"{d:+.2f}" if 0.01 <= abs(d) < 1e4 or d == 0 else f"{d:+.3g}"


def side_by_side(cells: pd.DataFrame, table: str, labels: dict) -> str:
    """One table in the paper's layout, each cell 'ours / paper (delta)'; ⚠ beyond tolerance. ``labels``: the
    experiment's row labels of ``table`` (stem.report.tables.row_labels)."""
    df = cells[cells["table"] == table]
    if df.empty:
        return ""
    out = []
    for (scale, variant), g in df.groupby(["scale", "variant"], sort=False):
        label = labels.get(variant) or g["row"].iloc[0]
        r = {"Scale": scale, "Model": label}
        for c in g.itertuples():
            s = f"{_num(c.ours, c.column, c.unit)} / {_num(c.paper, c.column, c.unit)}"
            if not T.isnan(c.delta) and c.delta != 0:
                s += f" ({_delta(c.delta)})"
            r[T.column_label(c.column, table)] = s + (" ⚠" if c.status == "drift" else "")
        out.append(r)
    return T.to_markdown(pd.DataFrame(out).fillna(""))


def summary_blocks(s: dict, dirs: pd.DataFrame, labels: dict, gate_failed: int | None = None, level: int = 2) -> list:
    """The diff's summary as page blocks (diff.md at ``level`` 2; the README and HTML report one level down):
    counts, the largest gaps and the direction check. ``labels``: {variant: label} (stem.config.variant_labels)."""
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
        *direction_lines(s["directions"]),
        *provenance_lines(s.get("provenance")),
        *truncation_lines(s.get("truncation")),
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
    blocks.append(page.Para(
        "Each verdict is the row of `tables/directions.csv` (paired bootstrap over the same items of both models, "
        f"{V.LEVEL:.0%} interval; *agree* / *disagree* only where the interval excludes 0 and the direction "
        "survives the multiple-comparison control over all of the report's directions (`raw_verdict` and `p_adjusted` "
        "in `diff/directions.csv`), *inconclusive* otherwise), or, where no per-item data exist, a point estimate (no "
        "interval, so never a resolved verdict). Resolvable: the interval's half-width is below the paper's |effect|."))
    if len(dirs):
        blocks.append(page.Table(direction_table(dirs, labels)))
    if s.get("accepted"):
        blocks.append(page.Para(f"Accepted disagreements (`{s['accepted']['file']}`; the directions gate passes "
                                "them while they still disagree):"))
        blocks.append(page.Items(tuple(accepted_lines(s["accepted"]["cells"])) or ("none",)))
    return blocks


def accepted_lines(cells) -> list[str]:
    """One line per accepted disagreement: the verdict and interval at acceptance, now, and the reason."""
    def iv(x):
        return "" if not x else f" [{x[0]:+.3g}, {x[1]:+.3g}]"
    out = []
    for c in cells:
        stage = f" ({c['stage']})" if c["stage"] else ""
        out.append(f"`{c['cell']}`{stage}: accepted {c['verdict']}{iv(c['interval'])}, now **{c['now']}**"
                   f"{iv(c['now_interval'])} — {c['reason']}")
    return out


def provenance_lines(p: dict | None) -> list[str]:
    """The summary's provenance: the commits and versions the result files come from (⚠ where more than one),
    the evaluations of a checkpoint trained from another spec, and the commit that built this report."""
    if not p:
        return []
    r, me = p["results"], p["report"]
    commits = ", ".join(f"`{c}` ({n})" for c, n in r["commits"].items()) or "none recorded"
    out = [f"Provenance: {r['files']} result files; commits {commits}"
           + (f", {r['without']} without provenance" if r["without"] else "")
           + (" — ⚠ **the compared results come from different commits**" if len(r["commits"]) > 1 else "")
           + "; versions " + ("; ".join(f"{v} ({n})" for v, n in r["versions"].items()) or "none recorded")
           + (" — ⚠ **different package versions**" if len(r["versions"]) > 1 else "")
           + ("; computed with " + "; ".join(f"{v} ({n})" for v, n in r.get("runtimes", {}).items())
              if r.get("runtimes") else "")
           + (" — ⚠ **on different devices, kernels or threads**" if len(r.get("runtimes") or {}) > 1 else "")
           + f"; this report: `{commit_label(me) or 'no git checkout'}` (table `provenance`)"]
    if r["spec_mismatch"]:
        out.append(f"⚠ **Evaluations of a checkpoint whose job spec differs from its training summary's** "
                   f"({len(r['spec_mismatch'])}): " + ", ".join(f"`{x}`" for x in r["spec_mismatch"]))
    return out


def chance_line(c: dict) -> str:
    """What chance alone gives the directions: the per-cell verdicts' expected false resolutions under no
    difference at all, and the procedure's guarantee for the controlled verdicts."""
    m, a, proc = c.get("tested", 0), c.get("alpha", 1 - V.LEVEL), c.get("procedure", "none")
    raw = c.get("raw") or c["checked"]
    guarantee = {"holm": f"the chance that even one resolved verdict is due to chance alone is at most {a:g}",
                 "bh": f"of the resolved verdicts, at most a fraction {a:g} is expected to be due to chance alone "
                       f"(and under no difference at all, the chance of even one is at most {a:g})",
                 "none": f"no control: about {m * a:.1f} resolved by chance alone"}[proc]
    return (f"Multiple comparisons: **{m}** directions are tested, each with its own {V.LEVEL:.0%} interval; chance "
            f"alone (no variant differing from the baseline) would resolve about **{c.get('chance_raw', 0):.1f}** of "
            f"them. Per cell, uncontrolled: agree {raw['agree']}, disagree {raw['disagree']}. The verdicts above are "
            f"controlled over the family ({V.PROCEDURE_NAMES.get(proc, proc)}, alpha {a:g}): {guarantee}")


def direction_lines(c: dict) -> list[str]:
    """The summary's direction counts (``direction_counts``) as three lines."""
    k, p = c["checked"], c["point_only"]
    return [f"Directions with their uncertainty ({c['source']}, controlled: {c.get('procedure', 'none')}): agree "
            f"**{k['agree']}**, disagree "
            f"**{k['disagree']}**, inconclusive **{k['inconclusive']}**, point estimate only **"
            f"{k['point estimate: agree'] + k['point estimate: disagree']}** (agree {k['point estimate: agree']}, "
            f"disagree {k['point estimate: disagree']}), missing **{k['missing']}** of {k['total']}; the paper's "
            f"effect is resolvable for **{c['paper_effect_resolvable']}** of the {c['paper_effect_sized']} directions "
            "with a printed effect size and an interval",
            f"Directions without per-item data (Table 3 ROI, Tables 5–6, the DSE paper's Table 1; point estimates, no "
            f"verdict): agree **{p['point estimate: agree']}**, disagree **{p['point estimate: disagree']}**, "
            f"tied {p['inconclusive']}, missing **{p['missing']}** of {p['total']}",
            chance_line(c)]


def direction_table(dirs: pd.DataFrame, labels: dict) -> pd.DataFrame:
    """One row per (table, scale, variant): the Avg direction (paper, ours with its interval) and the verdicts;
    each variant by its label (``labels``: {variant: label}, stem.config.variant_labels)."""
    rows = []
    for (table, scale, variant), d in dirs.groupby(["table", "scale", "variant"], sort=False):
        avg = d[d["column"] == "avg"]
        pa = f"{avg['paper_delta'].iloc[0]:+.2f}" if len(avg) else "n/a"
        oa = "n/a"
        if len(avg):
            a = avg.iloc[0]
            oa = "—" if T.isnan(a["ours_delta"]) else f"{a['ours_delta']:+.2f}" + (
                "" if T.isnan(a["lo"]) else f" [{a['lo']:+.2f}, {a['hi']:+.2f}]")
        counts = V.count(d["category"])
        verdicts = " · ".join(f"{c} {counts[c]}" for c in V.CATEGORIES if counts[c])
        res = d["paper_effect_resolvable"].dropna()
        rows.append((table, scale, labels.get(variant, variant), pa, oa, verdicts,
                     f"{int(sum(bool(x) for x in res))}/{len(res)}" if len(res) else "—"))
    return pd.DataFrame(rows, columns=["Table", "Scale", "Variant", "Paper: Avg vs baseline",
                                       "Ours: Avg vs baseline [95% CI]", "Verdicts", "Paper's effect resolvable"])


def render(exp: Experiment, s: dict, cells: pd.DataFrame, dirs: pd.DataFrame, consistency: pd.DataFrame,
           gate_failures: pd.DataFrame | None = None) -> str:
    """diff.md; its rows labelled as the experiment ``exp`` labels its variants (stem.config.variant_labels)."""
    head = f"# Paper diff — {s['label']}\n\n"
    failed = None if gate_failures is None else len(gate_failures)
    md = [markdown(summary_blocks(s, dirs, C.variant_labels(exp), failed))]
    md += ["## Side by side (ours / paper (ours − paper); ⚠ beyond tolerance; — no result yet)", ""]
    for table in registry.compared():
        body = side_by_side(cells, table, T.row_labels(exp, table))
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

