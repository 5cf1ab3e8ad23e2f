"""Tables and figures of the analyze stage, from the per-checkpoint analysis JSONs, registered with the
report's registry (stem.report.registry; report-only tables, no paper CSV, not compared) at the end of this
module, when it is imported, so they land in ``reports/{experiment}/tables/`` and ``figures/``, the report's
README and HTML:

- table ``editing``: per scale/stage/variant, site (``stem`` tables or the ``embedding``) and scheme: edit
  success (the target's answer ranks first), flip (target answer above the source's), top-k overlap with
  the control prompt and KL(control || edited) next to their unedited values (Fig. 7), collateral change;
- table ``spread`` (statistics per layer) and figure ``fig6_spread``: Fig. 6a-c histograms;
- table ``heaps`` (the fit's K, beta, r2 and the activated STEM params at the longest L) and figure
  ``heaps_law``: L_uniq vs L with the fit, activated STEM params vs L, NIAH accuracy beside it;
- table ``capacity``: recall per relation and entity-frequency bucket (chance level beside it);
- table ``directions``: every direction with its confidence (stem.report.verdict): Tables 3/4 accuracy
  per task, held-out loss, and one per analysis, each against the paper's claim (source named), the DSE
  paper's mechanism analyses included (stem.report.mechanism, which registers their tables/figures).

An experiment without an ``analysis:`` section (or without one analysis) gets empty tables (a visible gap) and
figures that say so.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from stem import config as C
from stem import layout as L
from stem.analysis.workflow import analyses, checkpoints, targets
from stem.config.experiment import Experiment
from stem.report import figures as F
from stem.report import registry
from stem.report import tables as T
from stem.report import verdict as V
from stem.report.results import niah_cells

# The paper's claims each analysis is read against (data with their source).
CLAIMS = {
    "editing": ("Sec. 5.2 / Fig. 7: swapping e_{source,l} <- e_{target,l} at every STEM layer makes the top-k "
                "next-token distribution of the source prompt match the target (control) prompt's"),
    "spread": ("Sec. 5.1 / Fig. 6b: STEM table vectors have a larger angular spread (pairwise cosine nearer 0) "
               "than the dense model's up-projection outputs over the same tokens"),
    "capacity": "Sec. 3.2.1 / Sec. 5.1: STEM's larger angular spread increases its knowledge storage capacity",
    "capacity_dse": ("DSE paper Sec. 4.2 / Table 1: the lookup memory improves knowledge-intensive tasks (MMLU +3.0, "
                     "CMMLU +4.0, TriviaQA +1.9 over MoE-27B; all above Dense-4B)"),
    "heaps": ("Sec. 3.2.5: L_uniq grows sublinearly (Heaps-like, beta < 1) and the activated STEM parameters "
              "|S| d_ff L_uniq keep growing with the context length"),
}


def load_all(exp: Experiment, root=".", results=None) -> dict[str, dict]:
    """{analysis: {(scale, variant, stage): JSON}} for every analysis JSON that exists (``results``: the
    results folder, default ``{root}/results``)."""
    results = Path(results) if results is not None else Path(root) / "results"
    out: dict[str, dict] = {n: {} for n in analyses(exp)}
    for scale, variant, stage in checkpoints(exp):
        for name in out:
            p = results / exp.experiment / scale / variant / stage / "analysis" / f"{name}.json"
            if p.is_file():
                r = json.loads(p.read_text())
                if (r.get("analysis"), r.get("scale"), r.get("variant"), r.get("stage")) != (name, scale, variant, stage):
                    raise ValueError(f"{p}: records {r.get('analysis')}/{r.get('scale')}/{r.get('variant')}/"
                                     f"{r.get('stage')}, expected {name}/{scale}/{variant}/{stage}")
                out[name][scale, variant, stage] = r
    return out


def analysis_directions(all_res: dict, baseline: str) -> list[dict]:
    """One direction per analysis and STEM variant against ``baseline`` (stem.config.baseline_variant), each with
    its confidence where items allow one."""
    rows = []
    cap = all_res.get("capacity", {})
    for (s, v, st), r in sorted(cap.items()):
        base = cap.get((s, baseline, st))
        if v == baseline or base is None:
            continue
        a = {(i["relation"], i["entity"]): float(i["hit"]) for i in base["items"]}
        b = {(i["relation"], i["entity"]): float(i["hit"]) for i in r["items"]}
        ci = V.paired_bootstrap(*V.paired(a, b))
        rows.append({"table": "capacity", "scale": s, "variant": v, "column": "recall", "stage": st,
                     "paper_delta": 1.0, **V.ci_cols(ci, 1.0),
                     "source": CLAIMS["capacity_dse" if v == "dse" else "capacity"]})
    for (s, v, st), r in sorted(all_res.get("editing", {}).items()):
        es = [e for e in r["edits"] if e["site"] == "stem"]
        if not es:
            continue  # no STEM tables: the embedding swap is the reference, not a STEM claim
        ci = V.paired_bootstrap([e["kl_control"] for e in es], [e["kl_control_before"] for e in es])
        rows.append({"table": "editing", "scale": s, "variant": v, "column": "KL(control||edited) reduction",
                     "stage": st, "paper_delta": 1.0, **V.ci_cols(ci, 1.0), "source": CLAIMS["editing"]})
    sp = all_res.get("spread", {})
    for (s, v, st), r in sorted(sp.items()):
        base = sp.get((s, baseline, st))
        tables = [layer for layer in r["layers"] if "table" in layer]
        if base is None or not tables:
            continue
        ours = np.mean([layer["table"]["mean_abs"] for layer in tables])
        dense = np.mean([base["layers"][layer["layer"]]["up_proj"]["mean_abs"] for layer in tables
                         if "up_proj" in base["layers"][layer["layer"]]])
        delta = float(dense - ours)  # > 0: STEM's vectors are more spread (smaller mean |cos|)
        rows.append({"table": "spread", "scale": s, "variant": v, "column": "dense mean|cos| - STEM mean|cos|",
                     "stage": st, "paper_delta": 1.0, "ours_delta": delta, "lo": None, "hi": None,
                     "n": sum(layer["table"]["pairs"] for layer in tables),
                     "verdict": "agree (point estimate)" if delta > 0 else "disagree (point estimate)",
                     "source": CLAIMS["spread"]})
    for (s, v, st), r in sorted(all_res.get("heaps", {}).items()):
        if r["n_stem_layers"] == 0:
            continue
        beta = r["fit"]["beta"]
        grows = all(b > a for a, b in zip(r["activated_stem_params"], r["activated_stem_params"][1:]))
        rows.append({"table": "heaps", "scale": s, "variant": v, "column": "1 - beta", "stage": st,
                     "paper_delta": 1.0, "ours_delta": 1 - beta, "lo": None, "hi": None, "n": len(r["lengths"]),
                     "verdict": "agree" if 0 < beta < 1 and grows else "disagree", "source": CLAIMS["heaps"]})
    return rows + [row for more in EXTRA_DIRECTIONS for row in more(all_res)]


# What every table of the analyze stage says about seeds: the analyses (and the held-out loss direction) are
# jobs of the matrix's own checkpoints, so a cell with several seeds (stem.seeds) is analysed at seed 0 only.
SEED0 = ("; seed 0 of each matrix cell (the analyze stage runs on the matrix's own checkpoints, not on the extra "
         "seeds of stem.seeds)")


# Direction rows of other report modules, each a function (all results -> rows) they append here when imported
# (the report registry imports every built-in module, stem.plugins.BUILTIN): stem.report.mechanism's
# DSE paper claims.
EXTRA_DIRECTIONS: list = []
# ... and those that read the experiment's own results, each (experiment tree, results folder) -> rows:
# stem.report.knowledge's (the knowledge experiment's points are not the matrix's checkpoints).
EXPERIMENT_DIRECTIONS: list = []


def legend(ax):
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def fig6(exp: Experiment, res: dict, label: str):
    import matplotlib.pyplot as plt   # matplotlib: ~1 s, only when a figure is drawn (keeps the DAG build light)

    base = C.baseline_variant(exp)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    titles = ("(a) STEM table vectors, per STEM layer", "(b) dense up-projection outputs vs STEM vectors",
              "(c) down-projection inputs after gating")
    for ax, t in zip(axes, titles):
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("pairwise cosine similarity")
    for (s, v, st), r in sorted(res.items()):
        edges = np.linspace(*r["range"], r["bins"] + 1)
        mid = (edges[:-1] + edges[1:]) / 2

        def dens(h, edges=edges):
            h = np.asarray(h, float)
            return h / max(1.0, h.sum()) / (edges[1] - edges[0])
        for layer in r["layers"]:
            tag = f"{s} {v} L{layer['layer']}"
            if "table" in layer and v == "stem":
                axes[0].plot(mid, dens(layer["table"]["hist"]), label=tag)
                axes[1].plot(mid, dens(layer["table"]["hist"]), color=F.color(exp, "stem"), alpha=0.7,
                             label=f"{s} STEM tables" if layer is next(x for x in r["layers"] if "table" in x) else None)
            if v in (base, "stem") and "down_input" in layer:
                axes[2].plot(mid, dens(layer["down_input"]["hist"]), color=F.color(exp, v), alpha=0.5,
                             label=f"{s} {v}" if layer is r["layers"][0] else None)
        stem_layers = {layer["layer"] for (s2, v2, st2), r2 in res.items() if v2 == "stem" and s2 == s
                       for layer in r2["layers"] if "table" in layer}
        if v == base:
            for layer in r["layers"]:
                if layer["layer"] in stem_layers and "up_proj" in layer:
                    axes[1].plot(mid, dens(layer["up_proj"]["hist"]), color=F.color(exp, base), alpha=0.7,
                                 label=f"{s} {base} up-proj" if layer["layer"] == min(stem_layers) else None)
    for ax in axes:
        legend(ax)
    fig.suptitle(f"Figure 6 (angular spread), {label}", fontsize=10)
    fig.tight_layout()
    return fig


def niah_curves(exp: Experiment, results="results") -> dict[str, tuple[list, list]]:
    """{variant: (lengths, mean NIAH accuracy over depths)} of the 1B models at Fig. 1b's stage, where present."""
    out = {}
    stage = ((exp.report or {}).get("stages") or {}).get("figure1b", ["extend"])[0]
    for v in (C.baseline_variant(exp), "stem"):
        p = Path(results) / exp.experiment / "1b" / v / stage / "eval" / "niah.json"
        if p.is_file():
            cells = niah_cells(json.loads(p.read_text()))
            if len(cells):
                m = cells.groupby("length")["accuracy"].mean()
                out[v] = (m.index.tolist(), m.tolist())
    return out


def heaps_fig(exp: Experiment, res: dict, label: str, niah: dict | None = None):
    import matplotlib.pyplot as plt   # matplotlib: ~1 s, only when a figure is drawn (keeps the DAG build light)

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4))
    for (s, v, st), r in sorted(res.items()):
        if v != "stem":  # the curve depends on the scale's tokenizer and held-out text only
            continue
        f, L = r["fit"], np.asarray(r["lengths"], float)
        a.loglog(L, r["unique"], "o", label=f"{s}: held-out {r['source']}")
        a.loglog(L, f["K"] * L ** f["beta"], "-", label=f"{s}: K={f['K']:.3g}, beta={f['beta']:.3f}")
    for (s, v, st), r in sorted(res.items()):
        b.loglog(r["lengths"], r["activated_stem_params"], "o-", color=F.color(exp, v), alpha=0.5 if s == "350m" else 1,
                 label=f"{s} {v}, |S|={r['n_stem_layers']}")
    a.set(xlabel="context length L (tokens)", ylabel="unique token ids L_uniq", title="Heaps fit L_uniq = K L^beta")
    b.set(xlabel="context length L (tokens)", ylabel="|S| d_ff L_uniq",
          title="activated STEM parameters per sequence")
    for v, (lengths, acc) in (niah or {}).items():
        c.plot(lengths, acc, "o-", color=F.color(exp, v), label=f"1b {v}")
    c.set(xscale="log", xlabel="context length (tokens)", ylabel="NIAH accuracy (%)", ylim=(-2, 102),
          title="beside it: Fig. 1b, NIAH accuracy vs length" + ("" if niah else " (no results)"))
    for ax in (a, b, c):
        legend(ax)
    fig.suptitle(f"Sec. 3.2.5 context-length adaptive parameter usage, {label}", fontsize=10)
    fig.tight_layout()
    return fig


def directions_frame(exp: Experiment, results, res: dict) -> pd.DataFrame:
    """Every direction with its confidence: Tables 3/4 accuracy, held-out loss and one per analysis; verdicts
    controlled over the family (stem.report.verdict.control, the config's report.directions), the raw one
    beside each."""
    rows = V.table_directions(exp, results=results) + V.loss_directions(exp, res.get("heldout", {})) \
        + analysis_directions(res, C.baseline_variant(exp)) \
        + [row for more in EXPERIMENT_DIRECTIONS for row in more(exp, results)]
    ctl = T.settings(exp).directions   # one family: every direction of this report with a p-value
    dirs_df = pd.DataFrame(V.control(rows, ctl.procedure, ctl.alpha))
    if len(dirs_df):
        # Tables 3/4 (and the knowledge rows) fold each cell's seeds; the held-out loss and the analyses read
        # seed 0 (SEED0)
        accuracy = dirs_df["table"].isin(["table3", "table4", "knowledge", "knowledge_edit", "knowledge_inject"])
        dirs_df["seeds"] = dirs_df["seeds"].where(accuracy, 1) if "seeds" in dirs_df else np.where(accuracy, 0, 1)
        # Only Tables 3/4 print an effect size; elsewhere the paper states a direction (paper_delta is its sign).
        half = (dirs_df["hi"].astype(float) - dirs_df["lo"].astype(float)) / 2
        sized = dirs_df["table"].isin(["table3", "table4"]) & half.notna()
        dirs_df["paper_effect_resolvable"] = np.where(sized, half < dirs_df["paper_delta"].abs(), None)
    return dirs_df


def example_rows(ex: dict) -> list[tuple[str, str, str, str]]:
    """Fig. 7's three top-k columns and the greedy continuations: (model, prompt, top next tokens, greedy)."""
    topk = lambda d: ", ".join(f"{t!r} {p:.3f}" for t, p in d["topk"])  # noqa: E731
    return [(name, prompt, topk(d), repr(d["greedy"])) for name, prompt, d in
            (("original", ex["prompt"], ex["original"]), ("control (target prompt)", ex["control_prompt"], ex["control"]),
             ("edited", ex["prompt"], ex["edited"]))]


# ---- the registry's view (stem.report.registry): long tables in paper_data.COLUMNS, figures from the JSONs ----
def load_results(exp: Experiment, res) -> dict:
    """``load_all`` of the results ``res`` (a stem.report.results.Results) reads."""
    return load_all(exp, results=res.root)


def _json_path(exp: Experiment, key: tuple, name: str) -> str:
    return L.analysis_json(exp.experiment, *key, name)


def long_frame(table: str, exp: Experiment, name: str, res: dict, rows) -> pd.DataFrame:
    """rows(key, JSON) -> [(row, column, value, unit)] per checkpoint; ``row`` names the model first."""
    return T.frame([T.cell(table, k[0], k[1], c, val, _json_path(exp, k, name), row=row, unit=unit)
                    for k, r in sorted(res.items()) for row, c, val, unit in rows(k, r)])


def editing_long(exp: Experiment, res) -> pd.DataFrame:
    skip = ("site", "scheme", "case")
    return long_frame("editing", exp, "editing", load_results(exp, res).get("editing", {}), lambda k, r: [
        (f"{k[1]} {k[2]}: {row['site']} {row['scheme']}", c, x, "") for row in r["summary"] if row["case"] == "all"
        for c, x in row.items() if c not in skip])


def spread_long(exp: Experiment, res) -> pd.DataFrame:
    return long_frame("spread", exp, "spread", load_results(exp, res).get("spread", {}), lambda k, r: [
        (f"{k[1]} {k[2]}: L{layer['layer']} {layer['ffn']} {key}", c, x, "") for layer in r["layers"]
        for key in ("table", "up_proj", "down_input") if key in layer
        for c, x in (("pairs", layer[key]["pairs"]), ("mean_abs_cos", layer[key]["mean_abs"]),
                     ("mean_cos", layer[key]["mean"]), *layer[key]["quantiles"].items())])


def heaps_long(exp: Experiment, res) -> pd.DataFrame:
    return long_frame("heaps", exp, "heaps", load_results(exp, res).get("heaps", {}), lambda k, r: [
        (f"{k[1]} {k[2]}", c, x, "") for c, x in
        (("K", r["fit"]["K"]), ("beta", r["fit"]["beta"]), ("r2", r["fit"]["r2"]), ("n_stem_layers", r["n_stem_layers"]),
         ("L", r["lengths"][-1]), ("L_uniq", r["unique"][-1]), ("activated_stem_params", r["activated_stem_params"][-1]))])


def capacity_long(exp: Experiment, res) -> pd.DataFrame:
    return long_frame("capacity", exp, "capacity", load_results(exp, res).get("capacity", {}), lambda k, r: [
        (f"{k[1]} {k[2]}: {rel}", c, x, "") for rel, row in r["table"].items() for c, x in row.items()])


def directions_long(exp: Experiment, res) -> pd.DataFrame:
    df = directions_frame(exp, res.root, load_results(exp, res))
    # stage, check_table and check_column: the key the diff reads each verdict back by (stem.report.diff.directions)
    cols = ("paper_delta", "ours_delta", "lo", "hi", "n", "seeds", "p", "p_adjusted", "raw_verdict", "verdict",
            "paper_effect_resolvable", "stage", "check_table", "check_column")
    records = [{**r, "check_table": r["table"], "check_column": r["column"]} for r in df.to_dict("records")]
    return T.frame([T.cell("directions", r["scale"], r["variant"], c, None if pd.isna(r.get(c)) else r.get(c),
                           r["source"], row=f"{r['variant']} {r['stage'] if isinstance(r['stage'], str) else '(no stage)'}: "
                           f"{r['table']} {r['column']}", unit="")
                    for r in records for c in cols if c in r])


def edit_example_long(exp: Experiment, res) -> pd.DataFrame:
    ed = load_results(exp, res).get("editing", {})
    k, ex = next(((k, r["example"]) for k, r in sorted(ed.items())
                  if (r.get("example") or {}).get("site") == "stem"), (None, None))  # "1b", then "stem", sort first
    if ex is None:
        return T.frame([])
    row0 = f"{ex['source']} -> {ex['target']} ({ex['scheme']} of the {ex['site']} vectors)"
    return T.frame([T.cell("edit_example", k[0], k[1], c, x, _json_path(exp, k, "editing"),
                           row=f"{row0}: {model}", unit="")
                    for model, *vals in example_rows(ex) for c, x in zip(("prompt", "topk", "greedy"), vals)])


def table_inputs(name: str):
    return lambda exp: [p for p in targets(exp) if p.endswith(f"/analysis/{name}.json")]


def all_inputs(exp: Experiment) -> list[str]:
    return targets(exp)


def analysis_figure(name: str, draw_fn, what: str):
    """draw(exp, res, ours, files): the analysis JSONs ``files["analysis"]`` (keyed by what each records)."""
    def draw(exp, res, ours, files):
        got = {}
        for path in files.get("analysis", []):
            r = json.loads(Path(path).read_text())
            got[r["scale"], r["variant"], r["stage"]] = r
        fig = draw_fn(exp, res, got, T.experiment_label(exp), files)
        if not got:
            F.mark_missing(fig.axes[0], f"no {what} results: this experiment's config has no analysis.{name}" if name not in
                     analyses(exp) else f"no {what} results yet")
        return fig
    return draw


def analysis_inputs(name: str, niah=False):
    def inputs(exp, evals):
        out = {"analysis": table_inputs(name)(exp)}
        if niah:
            out["niah"] = [p for p in evals if p.endswith("eval/niah.json")]
        return out
    return inputs


def _niah(exp: Experiment, res, files: dict) -> dict:
    """niah_curves where the figure was given NIAH JSONs (an experiment without them: the panel says so)."""
    return niah_curves(exp, res.root) if files.get("niah") else {}


# ---- this module's tables and figures, after the paper's (stem.report.figures, imported above) ----------------
GAP = dict(empty="_(no rows: no analysis results for this table yet, or config `analysis:` does not run it)_")
SPREAD_LABELS = {"pairs": "pairs", "mean_abs_cos": "mean |cos|", "mean_cos": "mean cos"}
registry.paper_table(
    "editing", "Knowledge editing (Sec. 3.3, 5.2; Fig. 7): edit success, flip, top-k overlap and "
    "KL(control || edited) beside their unedited values, per site and scheme (all cases)" + SEED0,
    inputs=table_inputs("editing"), **GAP)(editing_long)
registry.paper_table("edit_example", "Knowledge editing: one edit example (Fig. 7's columns)" + SEED0,
                     labels={"topk": "top next tokens (probability)", "greedy": "greedy continuation"},
                     inputs=table_inputs("editing"), **GAP)(edit_example_long)
registry.paper_table(
    "spread", "Angular spread (Sec. 5.1; Fig. 6): pairwise cosine statistics per layer and vector set" + SEED0,
    labels=SPREAD_LABELS, inputs=table_inputs("spread"), **GAP)(spread_long)
registry.paper_table(
    "heaps", "Heaps law and activated STEM parameters (Sec. 3.2.5) at the longest context length L" + SEED0,
    labels={"activated_stem_params": "|S| d_ff L_uniq"}, inputs=table_inputs("heaps"), **GAP)(heaps_long)
registry.paper_table("capacity", "Knowledge capacity probe: recall per relation (chance level beside it)" + SEED0,
                     inputs=table_inputs("capacity"), **GAP)(capacity_long)
registry.paper_table(
    "directions", "Directions with confidence (paired bootstrap, 95% per cell; verdicts controlled over the "
    "report's directions, report.directions, raw verdict beside): Tables 3/4 accuracy, held-out loss and "
    "each analysis against the paper's claim; Tables 3/4 fold each cell's seeds (two-level bootstrap, column "
    "seeds), the held-out loss and the analyses read seed 0 (seeds 1: the analyze stage runs on the matrix's "
    "own checkpoints, not on the extra seeds of stem.seeds)", inputs=all_inputs,
    labels={"check_table": "table", "check_column": "column"}, **GAP)(directions_long)
registry.report_figure(
    "fig6_spread", "Figure 6a-c (angular spread): pairwise cosine similarity of (a) the STEM table vectors, "
    "(b) the dense up-projection outputs beside the STEM vectors at the same layers, (c) the down-projection "
    "inputs after gating.", inputs=analysis_inputs("spread"))(
    analysis_figure("spread", lambda exp, res, got, label, files: fig6(exp, got, label), "angular spread"))
registry.report_figure(
    "heaps_law", "Sec. 3.2.5: unique tokens L_uniq vs context length L with the Heaps fit K L^beta, the "
    "activated STEM parameters |S| d_ff L_uniq, and Fig. 1b's NIAH accuracy beside it.",
    inputs=analysis_inputs("heaps", niah=True))(
    analysis_figure("heaps", lambda exp, res, got, label, files: heaps_fig(exp, got, label, _niah(exp, res, files)),
                    "Heaps-law"))
