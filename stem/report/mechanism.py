"""Tables, figures and directions of the DSE paper's mechanism analyses (analyses ``logitlens``, ``cka``,
``dse_disabled``; stem.analysis), registered with the report's registry (stem.report.registry, stem.plugins.BUILTIN;
report-only, no paper CSV, not compared):

- table ``logitlens`` and figure ``dse_logitlens``: KL(final || layer) per layer, DSE beside its baseline
  (the DSE paper's Fig. 3a);
- table ``cka`` and figure ``dse_cka``: the CKA matrix S[baseline layer i, DSE layer j] as a heatmap with the
  soft alignment a_j (Eq. 9) over it and, for reference, the baseline's own a_j^self (the diagonal as the top-k
  centroid sees it) (Fig. 3b-c);
- table ``dse_disabled`` and figure ``dse_ablation``: retained performance (% of the full model) per task and
  category with the DSE gate forced to 0 and 1 (App. G, Figs 9-10);
- ``mechanism_directions``: their rows of the ``directions`` table (stem.report.analyses), each against the
  DSE paper's claim with its source (``CLAIMS``).

Tiny-scale values come from 6-layer models trained for minutes: they test the pipeline and say what the tiny
models do, never what the paper's 27B models do.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from stem.config.experiment import Experiment
from stem.report import analyses as AR
from stem.report import figures as F
from stem.report import registry
from stem.report import verdict as V

# The DSE paper's claims each analysis is read against (data with their source).
CLAIMS = {
    "logitlens": ("DSE paper Sec. 6 / Fig. 3a: the DSE model's layer-wise LogitLens KL to its final distribution "
                  "is systematically lower than the baseline's, most in the early layers"),
    "cka": ("DSE paper Sec. 6 / Fig. 3b-c: the soft alignment shifts above the diagonal (a_j > j for a wide range "
            "of layers): DSE layer j resembles a deeper baseline layer"),
    "dse_disabled": ("DSE paper App. G / Fig. 9: with the DSE output suppressed, factual-knowledge tasks retain "
                     "far less of the full model's performance (29-44%) than context-grounded reading comprehension "
                     "(81-93%)"),
    "dse_forced": ("DSE paper App. G / Fig. 10: forcing the DSE gate to 1 recovers factual knowledge relative to "
                   "DSE-disabled (TriviaQA 29% -> 60%)"),
}


# ---- directions ---------------------------------------------------------------------------------------------
def retained_bootstrap(r: dict, stat, n_boot: int = V.N_BOOT, seed: int = 0, level: float = V.LEVEL) -> dict:
    """``stat(ret)`` with ret = {(mode, category): retained %} from a ``dse_disabled`` JSON, and its percentile
    interval: every task's items resampled (the same draw for every mode), each category's retained % = 100 x
    mean over its tasks of the mode's accuracy / the same for the full model."""
    rng = np.random.default_rng(seed)
    items = {m: {t: np.asarray(v, float) for t, v in per.items()} for m, per in r["items"].items()}
    n = {t: len(x) for t, x in items["normal"].items()}
    draw = {t: rng.integers(0, k, size=(n_boot, k)) for t, k in n.items()}

    def retained(pick):   # pick(x, t) -> the task's accuracy (a number, or one per bootstrap draw)
        acc = {m: {t: pick(x, t) for t, x in per.items()} for m, per in items.items()}
        out = {}
        for m in acc:
            for cat, ts in r["categories"].items():
                full = np.mean([acc["normal"][t] for t in ts], axis=0)
                with np.errstate(divide="ignore", invalid="ignore"):
                    out[m, cat] = np.where(full > 0, 100 * np.mean([acc[m][t] for t in ts], axis=0) / full, np.nan)
        return out
    delta = float(stat(retained(lambda x, t: x.mean())))
    boots = np.asarray(stat(retained(lambda x, t: x[draw[t]].mean(axis=1))))
    boots = boots[np.isfinite(boots)]
    if not np.isfinite(delta) or boots.size < n_boot // 2:   # a category the full model scores 0 on
        return {"delta": None, "lo": None, "hi": None, "n": sum(n.values()), "level": level}
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return {"delta": delta, "lo": float(lo), "hi": float(hi), "n": sum(n.values()), "level": level}


def mechanism_directions(all_res: dict) -> list[dict]:
    """One direction per DSE checkpoint and analysis (rows of the ``directions`` table)."""
    rows = []
    for (s, v, st), r in sorted(all_res.get("logitlens", {}).items()):
        # per window, the mean KL over every layer but the last (0 by construction); lower is the paper's side
        a = np.asarray(r["baseline_model"]["window_kl"])[:, :-1].mean(1)
        b = np.asarray(r["model"]["window_kl"])[:, :-1].mean(1)
        ci = V.paired_bootstrap(a, b)
        rows.append({"table": "logitlens", "scale": s, "variant": v, "stage": st,
                     "column": f"mean KL(final||layer) over layers 0..L-2, minus {r['baseline']}'s",
                     "paper_delta": -1.0, **V.ci_cols(ci, -1.0), "source": CLAIMS["logitlens"]})
    for (s, v, st), r in sorted(all_res.get("cka", {}).items()):
        shift = float(np.mean(r["shift"]))
        rows.append({"table": "cka", "scale": s, "variant": v, "stage": st,
                     "column": f"mean over DSE layers of a_j - a_j^self (top-{r['topk']}, vs {r['baseline']})",
                     "paper_delta": 1.0, "ours_delta": shift, "lo": None, "hi": None, "n": r["n_tokens"],
                     "verdict": "agree (point estimate)" if shift > 0 else "disagree (point estimate)",
                     "source": CLAIMS["cka"]})
    for (s, v, st), r in sorted(all_res.get("dse_disabled", {}).items()):
        cats = r["categories"]
        if "disabled" in r["modes"] and {"factual", "context"} <= set(cats):
            ci = retained_bootstrap(r, lambda ret: ret["disabled", "context"] - ret["disabled", "factual"])
            rows.append({"table": "dse_disabled", "scale": s, "variant": v, "stage": st,
                         "column": "retained % (DSE disabled): context - factual", "paper_delta": 1.0,
                         **_cols(ci, 1.0), "source": CLAIMS["dse_disabled"]})
        if {"disabled", "forced"} <= set(r["modes"]) and "factual" in cats:
            ci = retained_bootstrap(r, lambda ret: ret["forced", "factual"] - ret["disabled", "factual"])
            rows.append({"table": "dse_disabled", "scale": s, "variant": v, "stage": st,
                         "column": "retained % of factual tasks: forced - disabled", "paper_delta": 1.0,
                         **_cols(ci, 1.0), "source": CLAIMS["dse_forced"]})
    return rows


def _cols(ci: dict, sign: float) -> dict:
    if ci["delta"] is None:
        return {"ours_delta": None, "lo": None, "hi": None, "n": ci["n"],
                "verdict": "missing (the full model scores 0 on a category)"}
    return V.ci_cols(ci, sign)


# ---- figures ------------------------------------------------------------------------------------------------
def logitlens_fig(exp: Experiment, res: dict, label: str):
    import matplotlib.pyplot as plt   # matplotlib: ~1 s, only when a figure is drawn (keeps the DAG build light)

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for k, ((s, v, st), r) in enumerate(sorted(res.items())):
        for key, name, style in (("model", v, "o-"), ("baseline_model", r["baseline"], "s--")):
            d = r[key]
            ax.plot(d["layers"][:-1], d["kl"][:-1], style, color=F.color(exp, name), alpha=1 - 0.35 * k,
                    label=f"{s} {st}: {name}")
    if res:
        ax.set_xticks(range(max(len(r["model"]["layers"]) for r in res.values()) - 1))   # the last: KL 0
    ax.set(xlabel="layer (0-based block output)", ylabel="KL(final || layer) (nats)", yscale="log",
           title="LogitLens: KL of each layer's early exit to the final distribution (last layer: 0)")
    ax.title.set_fontsize(9)
    AR.legend(ax)
    fig.suptitle(f"DSE paper Fig. 3a (LogitLens), {label}", fontsize=10)
    fig.tight_layout()
    return fig


def cka_fig(res: dict, label: str):
    import matplotlib.pyplot as plt   # matplotlib: ~1 s, only when a figure is drawn (keeps the DAG build light)
    keys = sorted(res) or [None]
    fig, axes = plt.subplots(1, len(keys), figsize=(6.5 * len(keys), 4.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        if key is None:
            continue
        r = res[key]
        S = np.asarray(r["S"])
        im = ax.imshow(S, origin="lower", cmap="viridis", vmin=0, vmax=1, aspect="auto")
        j = np.arange(S.shape[1])
        ax.plot(j, r["alignment"], "w--", lw=2, label=f"soft alignment a_j (top-{r['topk']})")
        ax.plot(j, r["self_alignment"], ":", color="0.85", lw=1.5,
                label=f"a_j of {r['baseline']} vs itself (the diagonal, top-{r['topk']} biased)")
        ax.set(xlabel=f"{key[1]} layer j", ylabel=f"{r['baseline']} layer i",
               title=f"{key[0]} {key[2]}: linear CKA on {r['n_tokens']} "
                     + ("entity-final tokens" if r["tokens"] == "entities" else "held-out tokens"))
        ax.title.set_fontsize(9)
        fig.colorbar(im, ax=ax, fraction=0.046)
        AR.legend(ax)
    fig.suptitle(f"DSE paper Fig. 3b-c (CKA, minibatch unbiased HSIC)\n{label}", fontsize=10)
    fig.tight_layout()
    return fig


def disabled_fig(res: dict, label: str):
    import matplotlib.pyplot as plt   # matplotlib: ~1 s, only when a figure is drawn (keeps the DAG build light)
    from matplotlib.patches import Patch   # likewise
    modes = ("disabled", "forced")
    fig, axes = plt.subplots(1, 2, figsize=(13, 4), sharey=True)
    colors = {"factual": "#d62728", "context": "#1f77b4"}
    for ax, mode, fig_no in zip(axes, modes, ("Fig. 9", "Fig. 10")):
        ax.axhline(100, color="0.6", lw=1, ls=":")
        names, vals, cols = [], [], []
        for (s, v, st), r in sorted(res.items()):
            for row in sorted(r["retained"], key=lambda x: (x["category"] != "factual", x["category"])):
                if row["mode"] == mode:
                    names.append(f"{s} {st}\n{row['task']}")
                    vals.append(np.nan if row["retained"] is None else row["retained"])
                    cols.append(colors.get(row["category"], "0.5"))
        ax.bar(range(len(vals)), vals, color=cols)
        for i, x in enumerate(vals):
            ax.text(i, 0 if np.isnan(x) else x, "n/a" if np.isnan(x) else f"{x:.0f}%", ha="center", va="bottom",
                    fontsize=7)
        ax.set_xticks(range(len(vals)), names, rotation=60, ha="right", fontsize=7)
        ax.set(title=f"DSE-{mode.upper()} ({fig_no}): gate forced to {0 if mode == 'disabled' else 1}",
               ylabel="retained performance (% of the full model)")
        ax.title.set_fontsize(9)
        ax.legend(handles=[Patch(color=c, label=cat) for cat, c in colors.items()], fontsize=7, loc="lower right")
    fig.suptitle(f"DSE paper App. G (DSE module ablation), {label}", fontsize=10)
    fig.tight_layout()
    return fig


# ---- the registry's view: long tables from the JSONs --------------------------------------------------------
def logitlens_long(exp: Experiment, res) -> pd.DataFrame:
    return AR.long_frame("logitlens", exp, "logitlens", AR.load_results(exp, res).get("logitlens", {}), lambda k, r: [
        (f"{k[1]} {k[2]}: {name}", f"L{layer}", kl, "nats")
        for key, name in (("model", k[1]), ("baseline_model", r["baseline"]))
        for layer, kl in zip(r[key]["layers"], r[key]["kl"])])


def cka_long(exp: Experiment, res) -> pd.DataFrame:
    return AR.long_frame("cka", exp, "cka", AR.load_results(exp, res).get("cka", {}), lambda k, r: [
        *[(f"{k[1]} {k[2]}: {r['baseline']} L{i}", f"{k[1]} L{j}", x, "") for i, row in enumerate(r["S"])
          for j, x in enumerate(row)],
        *[(f"{k[1]} {k[2]}: soft alignment a_j (top-{r['topk']})", f"{k[1]} L{j}", a, "")
          for j, a in enumerate(r["alignment"])],
        *[(f"{k[1]} {k[2]}: {r['baseline']} vs itself a_j^self", f"{k[1]} L{j}", a, "")
          for j, a in enumerate(r["self_alignment"])],
        (f"{k[1]} {k[2]}: tokens", "n_tokens", r["n_tokens"], "")])


def disabled_long(exp: Experiment, res) -> pd.DataFrame:
    return AR.long_frame("dse_disabled", exp, "dse_disabled", AR.load_results(exp, res).get("dse_disabled", {}), lambda k, r: [
        (f"{k[1]} {k[2]}: {row['mode']} {row['category']} {row['task']}", c, row[c], "%")
        for row in r["retained"] for c in ("accuracy", "full_accuracy", "retained")])


# ---- this module's tables and figures (after stem.report.analyses', imported above) ---------------------------
GAP = dict(empty="_(no rows: no DSE checkpoint analysed yet, or config `analysis:` does not run this analysis)_")
registry.paper_table(
    "logitlens", "LogitLens (DSE paper Sec. 6, Fig. 3a): mean KL(final || layer) over held-out tokens per layer, "
    "DSE and its baseline" + AR.SEED0, inputs=AR.table_inputs("logitlens"), **GAP)(logitlens_long)
registry.paper_table(
    "cka", "CKA layer alignment (DSE paper Sec. 6, Fig. 3b-c): S[baseline layer i, DSE layer j] and the soft "
    "alignment a_j (Eq. 9)" + AR.SEED0, inputs=AR.table_inputs("cka"), **GAP)(cka_long)
registry.paper_table(
    "dse_disabled", "DSE module ablation (DSE paper App. G, Figs 9-10): accuracy with the DSE gate forced to 0 "
    "(disabled) or 1 (forced), and the retained % of the full model" + AR.SEED0,
    labels={"full_accuracy": "full model", "retained": "retained %"},
    inputs=AR.table_inputs("dse_disabled"), **GAP)(disabled_long)
registry.report_figure(
    "dse_logitlens", "DSE paper Fig. 3a: LogitLens KL(final || layer) per layer for each DSE model (solid) and "
    "its baseline (dashed) on the same held-out tokens; lower is closer to the final prediction.",
    inputs=AR.analysis_inputs("logitlens"))(
    AR.analysis_figure("logitlens", lambda exp, res, got, label, files: logitlens_fig(exp, got, label), "LogitLens"))
registry.report_figure(
    "dse_cka", "DSE paper Fig. 3b-c: linear CKA (minibatch, unbiased HSIC) between baseline layer i and DSE "
    "layer j on the last tokens of entity names, with the soft alignment a_j (dashed white) and the baseline's "
    "own a_j^self (dotted: the diagonal as the top-k centroid sees it); above it: DSE layer j resembles a "
    "deeper baseline layer.", inputs=AR.analysis_inputs("cka"))(
    AR.analysis_figure("cka", lambda exp, res, got, label, files: cka_fig(got, label), "CKA"))
registry.report_figure(
    "dse_ablation", "DSE paper Figs 9-10: retained performance (% of the full model's accuracy) per task and "
    "category with the DSE gate forced to 0 (left) and 1 (right); factual = closed-book world-fact tasks, "
    "context = passage-grounded tasks.", inputs=AR.analysis_inputs("dse_disabled"))(
    AR.analysis_figure("dse_disabled", lambda exp, res, got, label, files: disabled_fig(got, label), "DSE ablation"))

AR.EXTRA_DIRECTIONS.append(mechanism_directions)   # the DSE paper's claims (Sec. 6, App. G) in the directions table
