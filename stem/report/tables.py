"""The paper's tables rebuilt from an experiment's config and results.

Every table is a long DataFrame in the paper's own format (``paper_data.COLUMNS``): one row per cell,
``value`` NaN where the result does not exist yet (a visible gap, never a zero), ``source`` naming the
file or formula the number came from. ``wide()`` turns one into the paper's layout for display.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache

import numpy as np
import pandas as pd

from stem import config as C
from stem import layout
from stem import seeds
from stem.config.experiment import Experiment
from stem.report import paper_data as P
from stem.report import registry
from stem.report.page import Table, md_table
from stem.report.params import model_accounting, model_of
from stem.report.results import Results, as_number, by_length, niah_cells, range_rows, task_score
from stem.specs import ReportSpec

# the baseline's row label where a table prints its own (Table 6 calls it "Base"); every other row is the
# variant's label of the experiment's config (row_labels)
BASELINE_ROW = {"table6": "Base", "dse": "Baseline (dense, iso-active)"}
COMMONSENSE_LABELS = {"arc_easy": "ARC-E", "arc_challenge": "ARC-C", "boolq": "BoolQ", "piqa": "PIQA",
                      "social_iqa": "SIQA", "hellaswag": "HSwag", "openbookqa": "OBQA", "winogrande": "Wino",
                      "avg": "Avg"}
# the columns beside a cell with several seeds (stem.seeds; its accuracies and val loss are the seeds' means)
SEED_LABELS = {"seeds": "seeds", "avg_sd": "Avg sd (seeds)", "avg_min": "Avg min (seeds)",
               "avg_max": "Avg max (seeds)", "val_loss_sd": "val loss sd (seeds)"}
SEED_COLUMNS = tuple(SEED_LABELS)
UNITS = {"p_tot_b": "B params", "p_act_b": "B params", "dse_params_b": "B params", "total_params_b": "B params",
         "total_params_exact_b": "B params", "active_params_b": "B params", "gflops_per_token": "GFLOPs/token",
         "roi": "x (vs same-scale baseline)", "val_loss": "nats", "val_loss_sd": "nats", "seeds": "count"}
INF = math.inf
LONGBENCH = {  # column -> (group, lo, hi) in thousands of tokens
    "lb_multi_lt4k": ("multi", 0, 4), "lb_multi_4_8k": ("multi", 4, 8), "lb_multi_ge8k": ("multi", 8, INF),
    "lb_code_lt4k": ("code", 0, 4), "lb_code_4_8k": ("code", 4, 8), "lb_code_ge8k": ("code", 8, INF),
    "lb_0_2k": ("overall", 0, 2), "lb_2_4k": ("overall", 2, 4), "lb_4_6k": ("overall", 4, 6),
    "lb_6_8k": ("overall", 6, 8), "lb_8_10k": ("overall", 8, 10), "lb_10_12k": ("overall", 10, 12),
    "lb_12k_plus": ("overall", 12, INF),
}


# column -> (groups to read, index of the range) in the harness's by_length[table] rows (stem/eval/harness.py)
POSITIONAL = {
    "table5": {**{c: (("longbench_multi", "multi"), i) for i, c in enumerate(P.TASKS["table5"][2:5])},
               **{c: (("longbench_code", "code"), i) for i, c in enumerate(P.TASKS["table5"][5:8])}},
    "table6": {c: (("longbench", "all", "overall"), i) for i, c in enumerate(P.TASKS["table6"])},
}


def longbench_cell(ev: dict | None, table: str, column: str) -> tuple[float | None, str]:
    """A LongBench range score: by position in the harness's ``by_length[table]`` rows, else by parsing
    range labels (e.g. {"multi": {"<4k": ..}})."""
    rows = range_rows(ev, table)
    if rows is not None:
        names, i = POSITIONAL[table][column]
        if i < len(rows):
            groups = rows[i].get("groups") or {}
            value = next((as_number(groups[n]) for n in names if as_number(groups.get(n)) is not None), None)
            return value, f"range {rows[i].get('range', i)}"
        return None, "range missing"
    return by_length(ev).get(LONGBENCH[column]), "by_length"


def settings(exp: Experiment):
    """The experiment's report settings, checked once (``stem.specs.ReportSpec``: the config's ``report:``
    section over the defaults; each table's stages from its registry entry)."""
    return ReportSpec.from_config(exp.experiment, exp.report)


def row_labels(exp: Experiment, table: str | None = None) -> dict[str, str]:
    """{variant: its row label in ``table``}: the config's variant labels (stem.config.variant_labels, with its
    variant_overrides), the baseline's as the table prints it (``BASELINE_ROW``)."""
    labels = C.variant_labels(exp)
    if table in BASELINE_ROW:
        labels[C.baseline_variant(exp)] = BASELINE_ROW[table]
    return labels


def labelled(df: pd.DataFrame, exp: Experiment) -> pd.DataFrame:
    """``df`` with each cell that names no row of its own given its variant's row label (``row_labels``; the
    variant id for a name the config does not label: a seed, a sweep point)."""
    missing = df["row"].isna()
    if not missing.any():
        return df
    labels = {t: row_labels(exp, t) for t in df.loc[missing, "table"].unique()}
    out = df.copy()
    out.loc[missing, "row"] = [labels[t].get(v, v) for t, v in zip(df.loc[missing, "table"], df.loc[missing, "variant"])]
    return out


def experiment_label(exp_or_name: Experiment | str) -> str:
    name = exp_or_name.experiment if isinstance(exp_or_name, Experiment) else exp_or_name
    if name == "paper":
        return "experiment: paper (paper scale)"
    if name == "tiny":
        return "experiment: tiny (embedded default, not paper scale)"
    if name == "real":   # config/real.yaml, docs/real.md
        return "experiment: real (SmolLM2-135M-Instruct, 4-bit Q4_1 weights dequantised; not paper scale)"
    if name == "knowledge":   # config/knowledge.yaml, docs/knowledge.md
        return "experiment: knowledge (synthetic bioS-style world, CPU scale; not paper scale)"
    return f"experiment: {name} (not paper scale)"


# ---- the paper's arithmetic ----------------------------------------------------------------------
def average(scores: dict) -> float:
    """Avg as the paper defines it: the mean of the eight commonsense tasks (NaN if any is missing)."""
    vals = [scores.get(t) for t in P.COMMONSENSE_TASKS]
    return float(np.mean(vals)) if all(v is not None and not isnan(v) for v in vals) else math.nan


def roi(avg: float, gflops: float, avg_base: float, gflops_base: float) -> float:
    """Training ROI normalised to the same-scale dense baseline: (Avg/GFLOPs) / (Avg_base/GFLOPs_base).
    With equal training tokens this is accuracy per training FLOP relative to the baseline."""
    if any(isnan(x) for x in (avg, gflops, avg_base, gflops_base)) or gflops <= 0 or avg_base <= 0:
        return math.nan
    return (avg / gflops) / (avg_base / gflops_base)


def saving_fraction(d: float, d_ff: float, seq_len: float) -> float:
    """Table 1 / Sec. 3.2.3: d_ff / (4d + 2L + 3 d_ff), in percent."""
    return 100.0 * d_ff / (4 * d + 2 * seq_len + 3 * d_ff)


def isnan(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


# ---- helpers -------------------------------------------------------------------------------------
def cell(table, scale, variant, column, value, source="", row=None, unit=None) -> dict:
    """One cell; ``row`` None: its variant's row label, given by ``labelled`` (build_all) from the config."""
    value = math.nan if value is None else value
    return {"table": table, "scale": scale, "variant": variant, "row": row or None,
            "column": column, "value": value, "unit": UNITS.get(column, "%") if unit is None else unit,
            "source": source}


def frame(cells: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(cells, columns=P.COLUMNS)


def ordered_variants(exp: Experiment, variants) -> list[str]:
    """``variants`` in the config's variant order (config/variants.yaml's; the others after them)."""
    order = list(C.variant_labels(exp))
    return sorted(variants, key=lambda v: order.index(v) if v in order else len(order))


SCALE_ORDER = ("350m", "1b")


def ordered_scales(scales) -> list[str]:
    return sorted(scales, key=lambda s: SCALE_ORDER.index(s) if s in SCALE_ORDER else len(SCALE_ORDER))


def scales_with(exp: Experiment, stage: str) -> list[str]:
    return ordered_scales(str(s) for s, m in exp.matrix.items() if stage in m.stages)


@lru_cache(maxsize=None)
def _accounting(model_key: str) -> dict:
    return model_accounting(*json.loads(model_key))


def accounting(exp: Experiment, scale: str, variant: str) -> dict:
    """Parameter / FLOP accounting of a configured model (from the architecture, no training needed), once per
    architecture and variant spec."""
    return _accounting(json.dumps(model_of(exp, scale, variant), sort_keys=True))


# ---- Table 3 / 4: commonsense accuracy, parameters, FLOPs, ROI -----------------------------------
def accuracy_table(table: str, rows: list[tuple], extra_columns=(), baseline: str | None = None) -> pd.DataFrame:
    """Pure aggregation behind Tables 3 and 4. ``rows``: (scale, variant, scores, acct, source) where
    scores is {task: percent} and acct {total_params, paper_total_params, active_params,
    gflops_per_token} (or None). Adds Avg and, for Table 3, ROI against the same scale's ``baseline`` row
    (default: config/variants.yaml's, stem.config.baseline_variant)."""
    baseline = baseline or C.baseline_variant()
    cells, avgs = [], {}
    for scale, variant, scores, acct, src in rows:
        avgs[(scale, variant)] = average(scores), (acct or {}).get("gflops_per_token", math.nan)
    for scale, variant, scores, acct, src in rows:
        if table == "table3" and acct:
            where = acct.get("source", "accounting")
            cells += [cell(table, scale, variant, "total_params_b", acct["paper_total_params"] / 1e9, where),
                      cell(table, scale, variant, "total_params_exact_b", acct["total_params"] / 1e9, where),
                      cell(table, scale, variant, "active_params_b", acct["active_params"] / 1e9, where)]
        for task in P.TASKS[table]:
            cells.append(cell(table, scale, variant, task, scores.get(task), src))
        avg, gflops = avgs[(scale, variant)]
        cells.append(cell(table, scale, variant, "avg", avg, "mean of the 8 commonsense tasks"))
        if table == "table3":
            base_avg, base_gflops = avgs.get((scale, baseline), (math.nan, math.nan))
            cells += [cell(table, scale, variant, "gflops_per_token", gflops, "accounting: 2 x active params"),
                      cell(table, scale, variant, "roi", roi(avg, gflops, base_avg, base_gflops),
                           "(Avg/GFLOPs) / (Avg_base/GFLOPs_base), same scale")]
        for column, value, source in extra_columns and extra_columns(scale, variant) or []:
            cells.append(cell(table, scale, variant, column, value, source))
    return frame(cells)


def _scores(res: Results, scale, variant, stages, suites) -> tuple[dict, str]:
    scores, sources = {}, []
    for suite, tasks in suites.items():
        ev, stage = res.first_eval(scale, variant, stages, suite)
        if ev is not None:
            sources.append(f"{scale}/{variant}/{stage}/eval/{suite}.json")
        for task in tasks:
            v = task_score(ev, task)
            if v is not None:
                scores[task] = v
    return scores, "; ".join(sources) or "missing"


def trained_accounting(exp: Experiment, res: Results, scale: str, variant: str, stages) -> dict:
    """The accounting written with the model's checkpoint (first of ``stages`` that has one); before there
    is a checkpoint, the configured architecture's (marked so in ``source``)."""
    acct, stage = res.first_accounting(scale, variant, stages)
    if acct is not None:
        return {**acct, "source": f"{scale}/{variant}/{stage}/checkpoint/accounting.json"}
    return {**accounting(exp, scale, variant),
            "source": "accounting of the configured architecture (no checkpoint yet)"}


def checkpoints_of(table: str):
    """inputs(exp) of a registry entry: the checkpoints of the stages feeding ``table`` (their accounting)."""
    def inputs(exp: Experiment) -> list[str]:
        stages = settings(exp).stages[table]
        return [layout.checkpoint(exp.experiment, s, v, st) for s, v, st in C.train_targets(exp) if st in stages]
    return inputs


def seed_scores(exp: Experiment, res: Results, scale, variant, stages, suites) -> tuple[dict, str, list[float]]:
    """A matrix cell's scores over its seeds (stem.seeds): the per-task mean over the seeds that have the task,
    their sources, and each seed's Avg (seeds with a complete Avg only). One seed: ``_scores`` and its Avg."""
    per = [_scores(res, scale, seeds.JobId(scale, variant, "", k).slot, stages, suites)
           for k in seeds.seeds_of(exp, scale, variant)]
    tasks = {t for sc, _ in per for t in sc}
    mean = {t: float(np.mean([sc[t] for sc, _ in per if t in sc])) for t in tasks}
    avgs = [a for a in (average(sc) for sc, _ in per) if not isnan(a)]
    return mean, "; ".join(src for _, src in per if src != "missing") or "missing", avgs


def seed_spread(exp: Experiment, scale, variant, avgs) -> list[tuple]:
    """The columns beside a cell with several seeds (its Avg is their mean): how many seeds have a complete Avg,
    their sd, lowest and highest. None for a cell with one seed."""
    if len(seeds.seeds_of(exp, scale, variant)) == 1:
        return []
    return [("seeds", len(avgs), "seeds with a complete Avg (stem.seeds)"),
            ("avg_sd", float(np.std(avgs, ddof=1)) if len(avgs) > 1 else None, "sd of the seeds' Avg"),
            ("avg_min", min(avgs) if avgs else None, "lowest seed's Avg"),
            ("avg_max", max(avgs) if avgs else None, "highest seed's Avg")]


def seed_val_loss(exp: Experiment, res: Results, scale, variant, stage) -> tuple[list[float], str]:
    """Each seed's final validation loss (training summaries of ``stage`` that have one) and their sources."""
    vids = [seeds.JobId(scale, variant, stage, k).slot for k in seeds.seeds_of(exp, scale, variant)]
    got = [(v, (res.summary(scale, v, stage) or {}).get("final_val_loss")) for v in vids]
    got = [(v, x) for v, x in got if x is not None]
    return [x for _, x in got], "; ".join(f"{scale}/{v}/{stage}/summary.json" for v, _ in got) or "missing"


def val_loss_cells(exp: Experiment, res: Results, scale, variant, stage) -> list[tuple]:
    """(column, value, source) of a cell's validation loss: the mean over its seeds, and with several seeds
    their sd (``val_loss_sd``)."""
    loss, src = seed_val_loss(exp, res, scale, variant, stage)
    if len(seeds.seeds_of(exp, scale, variant)) == 1:
        return [("val_loss", loss[0] if loss else None, src)]
    return [("val_loss", float(np.mean(loss)) if loss else None, f"mean over seeds: {src}"),
            ("val_loss_sd", float(np.std(loss, ddof=1)) if len(loss) > 1 else None, "sd of the seeds' val loss")]


def table3(exp: Experiment, res: Results) -> pd.DataFrame:
    stages = settings(exp).stages["table3"]
    rows, spread = [], {}
    trained = set(C.train_targets(exp))
    for scale in scales_with(exp, stages[0]):
        for v in ordered_variants(exp, exp.matrix[scale].variants):
            if (scale, v, stages[0]) not in trained:
                continue   # a mid-training insertion (stem_insert) has no pretraining of its own
            scores, src, spread[scale, v] = seed_scores(exp, res, scale, v, stages, {"commonsense": P.COMMONSENSE_TASKS})
            rows.append((scale, v, scores, trained_accounting(exp, res, scale, v, stages), src))

    def val_loss(scale, variant):   # Avg and val loss are means over seeds; their spread beside them
        return (val_loss_cells(exp, res, scale, variant, stages[0])
                + seed_spread(exp, scale, variant, spread[scale, variant]))
    return accuracy_table("table3", rows, val_loss, C.baseline_variant(exp))


def table4(exp: Experiment, res: Results) -> pd.DataFrame:
    stages = settings(exp).stages["table4"]
    rows, spread = [], {}
    for scale in scales_with(exp, stages[0]):
        for v in ordered_variants(exp, exp.matrix[scale].variants):
            scores, src, spread[scale, v] = seed_scores(
                exp, res, scale, v, stages, {"commonsense": P.COMMONSENSE_TASKS, "gsm8k": ["gsm8k"], "mmlu": ["mmlu"]})
            rows.append((scale, v, scores, None, src))
    return accuracy_table("table4", rows, lambda scale, v: seed_spread(exp, scale, v, spread[scale, v]),
                          C.baseline_variant(exp))


def table5(exp: Experiment, res: Results) -> pd.DataFrame:
    return longbench_table("table5", exp, res)


def table6(exp: Experiment, res: Results) -> pd.DataFrame:
    return longbench_table("table6", exp, res)


def longbench_table(table: str, exp: Experiment, res: Results) -> pd.DataFrame:
    stages = settings(exp).stages[table]
    cells = []
    for scale in scales_with(exp, stages[0]):
        for v in ordered_variants(exp, exp.matrix[scale].variants):
            lb, lb_stage = res.first_eval(scale, v, stages, "longbench")
            for col in P.TASKS[table]:
                if col in LONGBENCH:
                    value, where = longbench_cell(lb, table, col)
                    src = f"{scale}/{v}/{lb_stage}/eval/longbench.json {where}" if lb else "missing"
                else:  # bbh, musr
                    ev, stage = res.first_eval(scale, v, stages, col)
                    value, src = task_score(ev, col), (f"{scale}/{v}/{stage}/eval/{col}.json" if ev else "missing")
                cells.append(cell(table, scale, v, col, value, src, unit="score"))
    return frame(cells)


def figure1b(exp: Experiment, res: Results) -> pd.DataFrame:
    """NIAH accuracy per context length (mean over depths) and STEM's gap over the baseline at the
    shortest and longest length (the numbers quoted in Sec. 1)."""
    stages, baseline = settings(exp).stages["figure1b"], C.baseline_variant(exp)
    cells = []
    for scale in scales_with(exp, stages[0]):
        per_len = {}
        for v in ordered_variants(exp, exp.matrix[scale].variants):
            ev, stage = res.first_eval(scale, v, stages, "niah")
            df = niah_cells(ev)
            per_len[v] = df.groupby("length")["accuracy"].mean() if len(df) else pd.Series(dtype=float)
            for length, acc in per_len[v].items():
                cells.append(cell("figure1b", scale, v, f"niah_{length}", acc, f"{scale}/{v}/{stage}/eval/niah.json"))
        base = per_len.get(baseline, pd.Series(dtype=float))
        for v, s in per_len.items():
            if v == baseline:
                continue
            common = sorted(set(s.index) & set(base.index))
            gaps = [s[common[0]] - base[common[0]], s[common[-1]] - base[common[-1]]] if common else [None, None]
            cells += [cell("figure1b", scale, v, "niah_gap_shortest", gaps[0], "STEM - Baseline, shortest length"),
                      cell("figure1b", scale, v, "niah_gap_longest", gaps[1], "STEM - Baseline, longest length")]
    return frame(cells)


# ---- the DSE paper's comparison (its Table 1) at this experiment's scales -----------------------------------
DSE_PARAMS = {"p_tot_b": "p_tot", "p_act_b": "p_act", "dse_params_b": "dse_params"}   # column -> accounting key
# Our rows and the DSE paper's models they stand for in the direction check: the iso-active dense baseline
# (Dense-4B) and DSE (DSE-27B; its claim also holds against the iso-parameter MoE-27B, which has no tiny
# counterpart here): the baseline's model, then DSE's.
DSE_PAPER_MODEL = ("dense_4b", "dse_27b")


def dse_accounting(exp: Experiment, res: Results, scale: str, variant: str, stages) -> dict:
    """``trained_accounting``; a checkpoint written before the DSE-convention keys existed (p_tot, p_act,
    dse_params) gets them from the configured architecture, provided its exact total is the same model's."""
    acct = trained_accounting(exp, res, scale, variant, stages)
    if all(k in acct for k in DSE_PARAMS.values()):
        return acct
    conf = accounting(exp, scale, variant)
    if conf["total_params"] != acct["total_params"]:
        return {**acct, "source": f"{acct['source']} (no P_tot/P_act keys; the configured architecture differs)"}
    return {**conf, **acct, "source": f"{acct['source']}; P_tot / P_act / DSE params from the configured "
                                      "architecture (same total_params)"}


def dse_table(exp: Experiment, res: Results) -> pd.DataFrame:
    """Per scale with a ``dse`` model: the dense baseline and DSE, with the DSE paper's parameter convention
    (Sec. 3.1: P_tot, P_act without embedding and head; DSE params = the hashed tables), GFLOPs/token,
    the validation loss and the zero-shot commonsense accuracies (the pretrain eval JSONs, as Table 3)."""
    stages, baseline = settings(exp).stages["dse"], C.baseline_variant(exp)
    cells = []
    for scale in scales_with(exp, stages[0]):
        if "dse" not in exp.matrix[scale].variants:
            continue
        for v in [v for v in (baseline, "dse") if v in exp.matrix[scale].variants]:
            acct = dse_accounting(exp, res, scale, v, stages)
            for column, key in DSE_PARAMS.items():   # a gap where the accounting lacks the key
                cells.append(cell("dse", scale, v, column, acct[key] / 1e9 if key in acct else None, acct["source"]))
            cells.append(cell("dse", scale, v, "gflops_per_token", acct["gflops_per_token"],
                              "accounting: 2 x active params (embedding and head included, as Table 3)"))
            loss = val_loss_cells(exp, res, scale, v, stages[0])   # the seeds' mean (and sd) where there are seeds
            scores, src, avgs = seed_scores(exp, res, scale, v, stages, {"commonsense": P.COMMONSENSE_TASKS})
            cells.append(cell("dse", scale, v, *loss[0]))
            cells += [cell("dse", scale, v, task, scores.get(task), src) for task in P.COMMONSENSE_TASKS]
            cells.append(cell("dse", scale, v, "avg", average(scores), "mean of the 8 commonsense tasks"))
            cells += [cell("dse", scale, v, *c) for c in loss[1:] + seed_spread(exp, scale, v, avgs)]
    return frame(cells)


def dse_paper_directions(df: pd.DataFrame, scales) -> pd.DataFrame:
    """The DSE paper's Table 1 as the direction check reads it: at each of our ``scales``, Dense-4B as our
    baseline row (stem.config.baseline_variant) and DSE-27B as our ``dse`` row (the sign of DSE-27B - Dense-4B is
    the claim checked), in the columns both tables have (the validation loss and five commonsense tasks)."""
    keep = df[df["variant"].isin(DSE_PAPER_MODEL) & df["column"].isin(["val_loss", *P.COMMONSENSE_TASKS])]
    back = dict(zip(DSE_PAPER_MODEL, (C.baseline_variant(), "dse")))
    return pd.concat([keep.assign(scale=s, variant=keep["variant"].map(back)) for s in scales] or [keep.iloc[:0]],
                     ignore_index=True)


# ---- the DSE paper's Table 2: long context (LongPPL, RULER) after context extension -------------------------
LONGPPL_COLUMNS = ("longppl_book", "longppl_paper", "longppl_code", "longppl_lcot")   # = longppl_{category} tasks
# RULER's 13 lm-eval tasks in the paper's 8 categories; a category is the mean of its tasks' scores (the paper
# names 14 subsets and does not say how they are pooled; lm-eval ships 13, RULER's own set)
RULER_CATEGORIES = {"ruler_s": ("niah_single_1", "niah_single_2", "niah_single_3"),
                    "ruler_mk": ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3"),
                    "ruler_mv": ("niah_multivalue",), "ruler_mq": ("niah_multiquery",), "ruler_vt": ("ruler_vt",),
                    "ruler_cwe": ("ruler_cwe",), "ruler_fwe": ("ruler_fwe",),
                    "ruler_qa": ("ruler_qa_squad", "ruler_qa_hotpot")}
# the direction check: our baseline row (stem.config.baseline_variant) stands for the paper's baseline there,
# MoE-27B (50k steps, iso-FLOPs with DSE-27B; the table has no dense model), and our dse row for DSE-27B (50k)
DSE_LONG_MODEL = ("moe_27b_50k", "dse_27b_50k")


def dse_long_table(exp: Experiment, res: Results) -> pd.DataFrame:
    """Per scale whose ``dse_long`` stage is trained: the dense and DSE rows (those of the matrix), LongPPL per
    document category (suite ``longppl``, perplexity) and RULER per category (suite ``ruler``, %), seeds' means
    where a variant has seeds. A column whose category or tasks were not evaluated is a gap."""
    stages = settings(exp).stages["dse_long"]
    ruler_tasks = [t for ts in RULER_CATEGORIES.values() for t in ts]
    cells = []
    for scale in scales_with(exp, stages[0]):
        for v in [v for v in (C.baseline_variant(exp), "dse") if v in exp.matrix[scale].variants]:
            scores, src, _ = seed_scores(exp, res, scale, v, stages, {"longppl": LONGPPL_COLUMNS, "ruler": ruler_tasks})
            cells += [cell("dse_long", scale, v, c, scores.get(c), src, unit="perplexity") for c in LONGPPL_COLUMNS]
            for column, tasks in RULER_CATEGORIES.items():
                got = [scores[t] for t in tasks if t in scores]
                cells.append(cell("dse_long", scale, v, column, float(np.mean(got)) if len(got) == len(tasks) else None,
                                  f"mean of {', '.join(tasks)}: {src}" if len(tasks) > 1 else src))
    return frame(cells)


def dse_long_directions(df: pd.DataFrame, scales) -> pd.DataFrame:
    """The DSE paper's Table 2 as the direction check reads it: at each of our ``scales``, MoE-27B (50k) as our
    baseline row (stem.config.baseline_variant) and DSE-27B (50k) as our ``dse`` row."""
    keep = df[df["variant"].isin(DSE_LONG_MODEL)]
    back = dict(zip(DSE_LONG_MODEL, (C.baseline_variant(), "dse")))
    return pd.concat([keep.assign(scale=s, variant=keep["variant"].map(back)) for s in scales] or [keep.iloc[:0]],
                     ignore_index=True)


# ---- Table 1 and Table 2: from the configuration -------------------------------------------------
def table1(exp: Experiment | None, res: Results | None = None) -> pd.DataFrame:
    """Per-layer, per-token costs (Table 1 with B = L = 1) and the saving fraction for each configured
    architecture (L = the pretraining sequence length), plus the Qwen2.5 models the paper quotes (only those
    for ``exp`` None)."""
    cells, archs = [], []
    if exp is not None:
        pretrain = exp.stages.get("pretrain", {})
        archs = [(s, "arch", f"{exp.experiment} {s}", a.d_model, a.d_ff,
                  pretrain[s].seq_len if s in pretrain else a.max_seq_len)
                 for s, a in ((s, exp.archs[s]) for s in ordered_scales(map(str, exp.archs)))]
    for (v, row), g in P.load_table("qwen25_architectures").groupby(["variant", "row"], sort=False):
        r = dict(zip(g["column"], g["value"]))
        archs.append(("", v, row, r["d_model"], r["d_ff"], r["seq_len"]))
    printed = P.load_table("table1_saving_fractions").set_index("variant")["value"]
    for scale, variant, label, d, d_ff, L in archs:
        d, d_ff, L = int(d), int(d_ff), int(L)
        for col, val, unit in [("d_model", d, ""), ("d_ff", d_ff, ""), ("seq_len", L, "tokens"),
                               ("ffn_flops", 3 * d_ff * d + d_ff, "FLOPs/token/layer"),
                               ("stem_flops", 2 * d_ff * d + d_ff, "FLOPs/token/layer"),
                               ("saved_flops", d * d_ff, "FLOPs/token/layer"),
                               ("ffn_param_loading", 3 * d * d_ff, "params/step/layer"),
                               ("stem_param_loading", 2 * d * d_ff, "params/step/layer"),
                               ("saving_fraction", saving_fraction(d, d_ff, L), "%")]:
            cells.append(cell("table1", scale, variant, col, val, "Table 1 formulas", row=label, unit=unit))
        if variant in printed.index:
            cells.append(cell("table1", scale, variant, "saving_fraction_paper", printed[variant],
                              "Sec. 3.2.3 (printed)", row=label, unit="%"))
    return frame(cells)


TABLE2_STAGE = {"pretrain": "pretrain", "midtrain": "midtrain", "extend": "context_extend"}


def table2(exp: Experiment, res: Results | None = None) -> pd.DataFrame:
    """This experiment's training hyperparameters in Table 2's rows and columns."""
    cells = []
    for stage, per_scale in exp.stages.items():
        for scale, st in ((str(s), st) for s, st in per_scale.items()):
            label = f"{scale.upper()} {stage}"
            beta1, beta2 = exp.optim.betas
            for col, val, unit in [
                    ("peak_lr", st.lr, "lr"), ("lr_schedule", str(st.schedule), "text"),
                    ("batch_size", st.batch_size, "sequences"), ("max_seq_len", st.seq_len, "tokens"),
                    ("train_steps", st.steps, "steps"),
                    ("cross_doc_masking", "Yes" if st.cross_doc_mask else "No", "text"),
                    ("train_tokens", st.steps * st.batch_size * st.seq_len, "tokens"),
                    ("weight_decay", exp.optim.weight_decay, ""), ("beta1", beta1, ""), ("beta2", beta2, ""),
                    ("warmup_ratio", st.warmup, "ratio"), ("min_lr_ratio", st.min_lr_ratio, "ratio of peak LR")]:
                cells.append(cell("table2", scale, TABLE2_STAGE[stage], col, val, f"config stages.{stage}.{scale}",
                                  row=label, unit=unit))
    return frame(cells)


def table2_paper_cells(df: pd.DataFrame) -> pd.DataFrame:
    """Table 2's cells as compared: its common row (optimizer, warmup, ...) repeated for every stage row."""
    stages = df[df["scale"] != ""][["scale", "variant", "row"]].drop_duplicates()
    common = df[df["variant"] == "common"]
    spread = [common.assign(scale=s.scale, variant=s.variant, row=s.row) for s in stages.itertuples()]
    return pd.concat([df[df["scale"] != ""], *spread], ignore_index=True)


def build_all(exp: Experiment, res: Results) -> dict[str, pd.DataFrame]:
    """Every registered table, in the registry's order, each cell's row labelled from the config (``labelled``)."""
    return {name: labelled(t.build(exp, res), exp) for name, t in registry.tables().items()}


# ---- display -------------------------------------------------------------------------------------
def fmt(value, column: str, unit: str = "") -> str:
    """A cell as printed; a missing value is an em dash (a visible gap)."""
    if isinstance(value, str):
        return value
    if isnan(value):
        return "—"
    if column == "roi":
        return f"{value:.2f}x"
    if unit in ("B params", "GFLOPs/token"):  # tiny models: in millions, with an explicit suffix
        return "0" if value == 0 else f"{value:.2f}" if value >= 0.1 else f"{value * 1e3:.3g}M"
    if unit in ("%", "score", "nats", "ratio"):
        return f"{value:.2f}"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.3g}"
    return f"{int(value):,}" if abs(value) >= 1e4 else f"{int(value)}"


def wide(df: pd.DataFrame) -> pd.DataFrame:
    """The paper's layout: one row per (scale, variant), one column per metric, printed cells."""
    if df.empty:
        return pd.DataFrame(columns=["Scale", "Model"])  # its CSV still has a header
    out = []
    for (scale, variant, row), g in df.groupby(["scale", "variant", "row"], sort=False):
        r = {"Scale": scale, "Model": row}
        for _, c in g.iterrows():
            r[column_label(c["column"], c["table"])] = fmt(c["value"], c["column"], c["unit"])
        out.append(r)
    return pd.DataFrame(out).fillna("—")


def column_label(column: str, table: str | None = None) -> str:
    """The printed label of a column: its table's registry entry's, else any registered table's."""
    if column.startswith("niah_") and column[5:].isdigit():
        return f"NIAH @{column[5:]}"
    tables = registry.tables()
    if table in tables and column in tables[table].labels:
        return tables[table].labels[column]
    return next((t.labels[column] for t in tables.values() if column in t.labels), column)


def to_markdown(w: pd.DataFrame, empty: str | None = None) -> str:
    return md_table(w, empty or Table.empty)


def to_latex(w: pd.DataFrame, caption: str) -> str:
    def esc(s):
        s = str(s).replace("\\", r"\textbackslash{}")
        for a, b in [("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"), ("†", r"$^\dagger$"),
                     ("—", "--"), (">=", r"$\geq$"), ("<", r"$<$")]:
            s = s.replace(a, b)
        return s
    if w.empty:
        return f"% {esc(caption)}: no rows\n"
    body = [" & ".join(esc(c) for c in w.columns) + r" \\", r"\midrule"]
    body += [" & ".join(esc(x) for x in r) + r" \\" for r in w.itertuples(index=False)]
    return "\n".join([r"\begin{table}[t]", r"\centering", r"\small", f"\\caption{{{esc(caption)}}}",
                      r"\begin{tabular}{" + "l" * 2 + "r" * (len(w.columns) - 2) + "}", r"\toprule", *body,
                      r"\bottomrule", r"\end{tabular}", r"\end{table}"]) + "\n"


# ---- the paper's tables, in the report's order (one entry each; stem.report.registry) ---------------
registry.paper_table(
    "table1", "Table 1: per-layer FFN vs STEM cost per token (FLOPs; parameter loads per decode step) and saving "
    "fraction d_ff/(4d+2L+3d_ff)",
    labels={"d_model": "d", "d_ff": "d_ff", "seq_len": "L", "ffn_flops": "FFN FLOPs", "stem_flops": "STEM FLOPs",
            "saved_flops": "Saved FLOPs", "ffn_param_loading": "FFN param loads",
            "stem_param_loading": "STEM param loads", "saving_fraction": "Saving % (formula)",
            "saving_fraction_paper": "Saving % (paper)"})(table1)
registry.paper_table(
    "table2", "Table 2: training hyperparameters (this experiment's config)", csv="table2", compared=True,
    paper_cells=table2_paper_cells,
    labels={"peak_lr": "Peak LR", "lr_schedule": "LR schedule", "batch_size": "Batch size",
            "max_seq_len": "Max seq len", "train_steps": "Steps", "cross_doc_masking": "Cross-doc masking",
            "train_tokens": "Tokens", "weight_decay": "WD", "beta1": "beta1", "beta2": "beta2",
            "warmup_ratio": "Warmup", "min_lr_ratio": "Min LR ratio"},
    notes={("", "warmup_ratio"): "The paper contradicts itself: Table 2 says 0.01, Sec. 4.1 says 10%."})(table2)
registry.paper_table(
    "table3", "Table 3: pretrained models, zero-shot commonsense accuracy (%), parameters, GFLOPs/token, ROI",
    csv="table3", stages=("pretrain",), compared=True, direction_checked=True, inputs=checkpoints_of("table3"),
    undirected=("total_params_b", "total_params_exact_b", "active_params_b", "gflops_per_token", "val_loss",
                *SEED_COLUMNS),
    notes={("350m", "total_params_b"):
           "Convention: #Total = dense total + n_STEM x V x d_ff (removed up-projections not subtracted), which "
           "reproduces the 1B row exactly; the paper's 350M #Total column (1.14/1.85/3.25, Hash-MoE 1.22) fits no "
           "consistent table shape, so ours differs by construction (research notes A). Hash-MoE: 12 experts per "
           "MoE layer, sized to STEM's total as Sec. 4.1 says (1.19 B; the caption's 16 experts would give 1.48 B).",
           ("", "roi"): "Ours uses exact GFLOPs/token (2 x active params); the paper's ROI follows from its rounded "
                        "#GFLOPs column."},
    labels={"total_params_b": "#Total Params (B)", "total_params_exact_b": "#Total exact (B)",
            "active_params_b": "#Active Params (B)", **COMMONSENSE_LABELS, "gflops_per_token": "#GFLOPs",
            "roi": "ROI", "val_loss": "val loss", **SEED_LABELS})(table3)
registry.paper_table(
    "table4", "Table 4: mid-trained models (%)", csv="table4", stages=("midtrain",), compared=True,
    direction_checked=True, undirected=SEED_COLUMNS,
    labels={**COMMONSENSE_LABELS, "gsm8k": "GSM8K", "mmlu": "MMLU", **SEED_LABELS})(table4)
registry.paper_table(
    "table5", "Table 5: contextual reasoning (BBH, MuSR, LongBench multi-hop / code by context length)",
    csv="table5", stages=("extend", "midtrain"), compared=True, direction_checked=True,
    labels={"bbh": "BBH", "musr": "MuSR", "lb_multi_lt4k": "Multi-hop <4k", "lb_multi_4_8k": "Multi-hop 4-8k",
            "lb_multi_ge8k": "Multi-hop >=8k", "lb_code_lt4k": "Code <4k", "lb_code_4_8k": "Code 4-8k",
            "lb_code_ge8k": "Code >=8k"})(table5)
registry.paper_table(
    "table6", "Table 6: LongBench average by context length", csv="table6", stages=("extend",), compared=True,
    direction_checked=True,
    labels={"lb_0_2k": "0-2k", "lb_2_4k": "2-4k", "lb_4_6k": "4-6k", "lb_6_8k": "6-8k", "lb_8_10k": "8-10k",
            "lb_10_12k": "10-12k", "lb_12k_plus": "12k+"})(table6)
registry.paper_table(
    "figure1b", "Figure 1b data: NIAH accuracy (%) per context length", csv="figure1b", stages=("extend",),
    compared=True, labels={"niah_gap_shortest": "STEM gap, shortest", "niah_gap_longest": "STEM gap, longest"},
)(figure1b)
registry.paper_table(
    "dse", "DSE (Cheng et al., \"Conditional Memory via Scalable Lookup\"): pretrained dense baseline vs DSE per "
    "scale, parameters in the DSE paper's convention, GFLOPs/token, validation loss, zero-shot commonsense "
    "accuracy (%)", csv="dse_paper/table1", stages=("pretrain",), direction_checked=True,
    inputs=checkpoints_of("dse"), paper_directions=dse_paper_directions, lower_better=("val_loss",),
    undirected=("p_tot_b", "p_act_b", "dse_params_b", "gflops_per_token", *SEED_COLUMNS),
    notes={("", "p_tot_b"): "Parameters as the DSE paper counts them (its Sec. 3.1): P_tot = trainable parameters "
                            "without the vocabulary embedding and LM head; P_act = those used per token (they set "
                            "the FLOPs); DSE params = the hashed N-gram tables (Table 1's '# DSE Parameters'). "
                            "GFLOPs/token = 2 x active parameters with embedding and head, as in Table 3.",
           ("", "val_loss"): "Direction check: the DSE paper's Table 1 claims DSE-27B beats both the dense model "
                             "(Dense-4B) and the iso-parameter MoE-27B on every listed benchmark, with a lower "
                             "validation loss; here the baseline is the iso-active dense model (the tiny matrix has "
                             "no routed MoE), so each DSE cell is compared in the sign of DSE-27B - Dense-4B. "
                             "Absolute values are never compared with the paper's 27B numbers (a different model "
                             "family: 30-layer MLA + mHC backbone, 262B tokens); the overlapping benchmarks are "
                             "ARC-E, ARC-C, HellaSwag, PIQA, WinoGrande and the validation loss (the paper has no "
                             "BoolQ, SIQA, OBQA or our 8-task Avg)."},
    labels={"p_tot_b": "P_tot (B)", "p_act_b": "P_act (B)", "dse_params_b": "DSE params (B)",
            "gflops_per_token": "GFLOPs/token", "val_loss": "val loss", **COMMONSENSE_LABELS, **SEED_LABELS},
)(dse_table)
registry.paper_table(
    "dse_long", "DSE (Cheng et al.) Table 2: long context after context extension, dense baseline vs DSE: LongPPL "
    "(key-token perplexity, lower is better) per document category and RULER accuracy (%) per category",
    csv="dse_paper/table2", stages=("extend",), direction_checked=True, paper_directions=dse_long_directions,
    lower_better=LONGPPL_COLUMNS,
    notes={("", "longppl_book"): "LongPPL as the longppl package defines it (stem/eval/longppl.py; key tokens from the "
                                 "same scale's dense model, docs/evaluation.md). The paper's baseline here is "
                                 "MoE-27B (iso-FLOPs), ours the iso-active dense model, so each DSE cell is checked "
                                 "in the sign of DSE-27B (50k) - MoE-27B (50k); absolute values are never compared "
                                 "(27B models at 32k tokens). The paper does not name its Book / Paper / Code / "
                                 "L-CoT sets: a category without a configured source is a gap.",
           ("", "ruler_s"): "RULER through lm-eval's 13 `ruler` tasks (the paper counts 14 subsets); a category is "
                            "the mean of its tasks (S: 3 single-needle tasks, MK: 3 multi-key, QA: SQuAD and "
                            "HotpotQA). The tiny experiment runs them on an offline stand-in sized to 1,024 tokens "
                            "(stem/eval/ruler_data.py)."},
    labels={"longppl_book": "LongPPL Book", "longppl_paper": "LongPPL Paper", "longppl_code": "LongPPL Code",
            "longppl_lcot": "LongPPL L-CoT", "ruler_s": "S", "ruler_mk": "MK", "ruler_mv": "MV", "ruler_mq": "MQ",
            "ruler_vt": "VT", "ruler_cwe": "CWE", "ruler_fwe": "FWE", "ruler_qa": "QA"},
    empty="no dense or DSE model with a context-extension stage in this experiment's matrix",
)(dse_long_table)
