"""The paper's figures from an experiment's results (matplotlib, Agg backend; PNG and PDF).

Every figure names the experiment in its title; a figure whose data do not exist yet is still drawn,
with the missing panel saying so (so the workflow and the report always have an image to show).
"""
from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd

from stem import config as C
from stem import layout as L
from stem.config.experiment import Experiment
from stem.io import atomic_path
from stem.report import paper_data as P
from stem.report import registry
from stem.report import tables as T
from stem.report.results import Results, niah_cells

FIGURES = registry.FIGURES  # name -> registry.Figure; the entries are at the end of this module


def legend_label(exp: Experiment, variant: str) -> str:
    """A variant's legend label: the experiment's ``figure_label`` or ``label`` (config/variants.yaml with its
    variant_overrides; the variant id for a sweep point or an unknown name)."""
    return C.variant_figure_labels(exp).get(variant, variant)


def color(exp: Experiment, variant: str) -> str | None:
    """A variant's colour: the experiment's ``color`` (config/variants.yaml with its variant_overrides; None:
    matplotlib's colour cycle)."""
    return C.variant_colors(exp).get(variant)


def pyplot():
    """matplotlib.pyplot on the Agg backend, imported when a figure is drawn (lazy: a heavy optional import, ~1 s,
    that the workflow, which only lists the figures, does not need)."""
    import matplotlib   # heavy optional (~1 s): only when a figure is drawn (keeps the DAG build light)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # likewise
    return plt


# ---- loss spikes ---------------------------------------------------------------------------------
def loss_spikes(loss, window: int = 50, k: float = 6.0) -> np.ndarray:
    """Boolean mask of spikes: loss > median + k * 1.4826 * MAD of the previous ``window`` steps
    (steps before window // 2 of history are never spikes)."""
    s = pd.Series(np.asarray(loss, dtype=float))
    past = s.shift(1).rolling(window, min_periods=max(2, window // 2))
    med = past.median()
    mad = past.apply(lambda w: np.median(np.abs(w - np.median(w))), raw=True)
    return (s > med + k * 1.4826 * mad).fillna(False).to_numpy(dtype=bool) & (mad > 0).to_numpy()


# ---- helpers -------------------------------------------------------------------------------------
def _scaled(values, unit: str):
    """(values / 10^k, 'unit (M)') so that axes read in plain numbers."""
    top = float(np.nanmax(values)) if len(values) else 0.0
    for div, name in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if top >= div:
            return np.asarray(values) / div, f"{unit} ({name})"
    return np.asarray(values), unit


def _tokens(n) -> str:
    return f"{n / 1024:g}K" if n >= 1024 and n % 1024 == 0 else f"{n / 1000:g}k" if n >= 1000 else f"{n:g}"


def mark_missing(ax, text: str):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4", wrap=True, fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])


def set_title(fig, title: str, exp: Experiment):
    fig.suptitle(f"{title}\n{T.experiment_label(exp)}", fontsize=11)


def _variants(exp, scale, wanted):
    have = exp.matrix[scale].variants if scale in exp.matrix else ()
    return [v for v in wanted if v in have]


def _curve_figure(exp, res: Results, name: str, x: str, y: str, xlabel: str, ylabel: str, title: str,
                  stage: str, mark_spikes=False, logy=False):
    scale, wanted = registry.figure(name).scale, C.figure_variants(exp, name)
    sp = T.settings(exp).spikes
    fig, ax = pyplot().subplots(figsize=(7, 4.5), layout="constrained")
    drawn = 0
    for v in _variants(exp, scale, wanted):
        m = res.metrics(scale, v, stage)
        if m is None or y not in m or x not in m:
            continue
        m = m.dropna(subset=[y])
        xs, xl = _scaled(m[x].to_numpy(), xlabel)
        label = legend_label(exp, v)
        if mark_spikes:
            spikes = loss_spikes(m[y], sp.window, sp.k)
            label += f" ({int(spikes.sum())} spikes)"
            ax.plot(xs[spikes], m[y].to_numpy()[spikes], "x", color=color(exp, v), ms=8, mew=2)
        ax.plot(xs, m[y], color=color(exp, v), lw=1.2, label=label, alpha=0.9)
        ax.set_xlabel(xl)
        drawn += 1
    if drawn:
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
        if logy:
            ax.set_yscale("log")
        if x == "train_flops":
            ax.set_xscale("log")
    else:
        names = ", ".join(legend_label(exp, v) for v in wanted)
        mark_missing(ax, f"no {stage} metrics yet for {names} at scale {scale}")
    if mark_spikes and drawn:
        ax.text(0.99, 0.98, f"spike: loss > trailing median + {sp.k:g} x 1.4826 x MAD (window {sp.window} steps)",
                transform=ax.transAxes, ha="right", va="top", fontsize=7, color="0.3")
    set_title(fig, title, exp)
    return fig


# ---- the figures ---------------------------------------------------------------------------------
def fig5a_loss_vs_tokens(exp, res, ours=None, files=None):
    return _curve_figure(exp, res, "fig5a_loss_vs_tokens", "tokens", "loss", "training tokens",
                         "training loss (nats/token)", "Fig. 5a: training loss vs tokens, 350M",
                         T.settings(exp).stages["table3"][0], mark_spikes=True)


def fig5b_loss_vs_flops(exp, res, ours=None, files=None):
    return _curve_figure(exp, res, "fig5b_loss_vs_flops", "train_flops", "loss", "training FLOPs",
                         "training loss (nats/token)", "Fig. 5b: training loss vs training FLOPs, 350M",
                         T.settings(exp).stages["table3"][0])


def fig1a_val_ppl_vs_tokens(exp, res, ours=None, files=None):
    return _curve_figure(exp, res, "fig1a_val_ppl_vs_tokens", "tokens", "val_ppl", "training tokens",
                         "validation perplexity", "Fig. 1a: validation perplexity vs tokens, 1B",
                         T.settings(exp).stages["table3"][0])


def table_update_loss(exp, res, ours=None, files=None):
    """Dense vs sparse table update: the two loss curves overlaid, the final-loss gap printed on the plot."""
    stage = T.settings(exp).stages["table3"][0]
    fig = _curve_figure(exp, res, "table_update_loss", "tokens", "loss", "training tokens",
                        "training loss (nats/token)", "STEM: dense vs sparse table update, 350M", stage)
    entry = registry.figure("table_update_loss")
    scale, (dense, sparse) = entry.scale, C.figure_variants(exp, "table_update_loss")
    ax = fig.axes[0]
    for line in ax.get_lines():   # the dense update drawn wider, underneath: the curves nearly coincide
        if line.get_label() == legend_label(exp, dense):
            line.set(label="STEM (dense update, the paper)", lw=3, alpha=0.6)
    if ax.get_legend() is not None:
        ax.legend(fontsize=9)
    a, b = res.summary(scale, dense, stage), res.summary(scale, sparse, stage)
    if a and b:
        gap = [f"{what}: sparse {b[k]:.4f} - dense {a[k]:.4f} = {b[k] - a[k]:+.4f}"
               for what, k in (("final train loss", "final_train_loss"), ("final val loss", "final_val_loss"))
               if a.get(k) is not None and b.get(k) is not None]
        ax.text(0.02, 0.04, "\n".join(gap), transform=ax.transAxes, fontsize=8, va="bottom", family="monospace")
    return fig


def fig1b_niah(exp, res, ours=None, files=None):
    scale, wanted = registry.figure("fig1b_niah").scale, C.figure_variants(exp, "fig1b_niah")
    stages = T.settings(exp).stages["figure1b"]
    variants = _variants(exp, scale, wanted)
    data = {v: niah_cells(res.first_eval(scale, v, stages, "niah")[0]) for v in variants}
    fig, axes = pyplot().subplots(1, 1 + max(1, len(variants)), figsize=(5 + 4 * max(1, len(variants)), 4.2),
                             layout="constrained")
    ax = axes[0]
    drawn = [v for v in variants if len(data[v])]
    for v in drawn:
        per_len = data[v].groupby("length")["accuracy"].mean()
        ax.plot(per_len.index, per_len.values, "o-", color=color(exp, v), label=legend_label(exp, v))
    if drawn:
        lengths = sorted({L for v in drawn for L in data[v]["length"]})
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [_tokens(L) for L in lengths])
        ax.minorticks_off()
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("NIAH accuracy (%, mean over depths)")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    else:
        mark_missing(ax, f"no NIAH results yet ({scale}, stage {'/'.join(stages)})")
    for hax, v in zip(axes[1:], variants or [None]):
        df = data.get(v, pd.DataFrame())
        if v is None or not len(df):
            mark_missing(hax, f"no NIAH cells for {legend_label(exp, v) if v else 'any variant'}")
            continue
        grid = df.pivot_table(index="depth", columns="length", values="accuracy", aggfunc="mean")
        im = hax.imshow(grid.values, aspect="auto", origin="lower", vmin=0, vmax=100, cmap="RdYlGn")
        hax.set_xticks(range(len(grid.columns)), [_tokens(c) for c in grid.columns], fontsize=8)
        hax.set_yticks(range(len(grid.index)), [f"{d:g}" for d in grid.index], fontsize=8)
        for (i, j), acc in np.ndenumerate(grid.values):
            if not np.isnan(acc):
                hax.text(j, i, f"{acc:.0f}", ha="center", va="center", fontsize=8)
        hax.set_xlabel("context length (tokens)")
        hax.set_ylabel("needle depth (% of context)")
        hax.set_title(legend_label(exp, v), fontsize=10)
        fig.colorbar(im, ax=hax, label="accuracy (%)")
    set_title(fig, "Fig. 1b: Needle-in-a-Haystack accuracy, 1B after context extension", exp)
    return fig


def roi_by_scale(exp, res, ours, files=None):
    t3 = ours.get("table3", T.frame([]))
    paper = P.load_table("table3")
    scales = list(dict.fromkeys(list(t3["scale"]) or ["350m", "1b"]))
    per_scale = {s: T.ordered_variants(exp, {*t3[t3["scale"] == s]["variant"], *paper[paper["scale"] == s]["variant"]})
                 for s in scales}
    widths = [max(2, len(v)) for v in per_scale.values()]
    fig, axes = pyplot().subplots(1, len(scales), figsize=(2 + 1.1 * sum(widths), 4.8), layout="constrained",
                             squeeze=False, gridspec_kw={"width_ratios": widths})
    for ax, scale in zip(axes[0], scales):
        mine = t3[(t3["scale"] == scale) & (t3["column"] == "roi")]
        variants = per_scale[scale]
        x = np.arange(len(variants))
        ours_v = [_get(mine, v) for v in variants]
        paper_v = [_get(paper[(paper["scale"] == scale) & (paper["column"] == "roi")], v) for v in variants]
        ax.bar(x - 0.2, np.nan_to_num(ours_v), 0.4, label=f"{exp.experiment} (this run)", color="#1f77b4")
        ax.bar(x + 0.2, np.nan_to_num(paper_v), 0.4, label="paper", color="0.7")
        for xi, v, pv in zip(x, ours_v, paper_v):
            ax.text(xi - 0.2, (0 if math.isnan(v) else v) + 0.01, "n/a" if math.isnan(v) else f"{v:.2f}",
                    ha="center", va="bottom", fontsize=7, rotation=90 if not math.isnan(v) else 0)
            if not math.isnan(pv):
                ax.text(xi + 0.2, pv + 0.01, f"{pv:.2f}", ha="center", va="bottom", fontsize=7, color="0.35")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(x, [legend_label(exp, v) for v in variants], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("training ROI (x, dense baseline = 1)")
        ax.set_title(f"scale {scale}", fontsize=10)
        ax.set_ylim(0, max(1.5, np.nanmax(np.r_[ours_v, paper_v, 1.0]) * 1.15))
        ax.legend(fontsize=8, loc="upper left")
    set_title(fig, "Training ROI per scale (Table 3)", exp)
    return fig


def _get(df, variant):
    s = df[df["variant"] == variant]["value"]
    return float(s.iloc[0]) if len(s) and not T.isnan(s.iloc[0]) else math.nan


def paper_vs_ours(exp, res, ours, files=None, table: str = "table3"):
    # lazy: stem.report.diff imports stem.report.provenance, whose tables would then register before this
    # module's (the registration order is stem.plugins.BUILTIN's)
    from stem.report.diff import compare
    cells = compare(ours, T.settings(exp).tolerance)
    cells = cells[(cells["table"] == table) & cells["unit"].isin(["%", "score"])]
    have = cells.dropna(subset=["delta"])
    fig, ax = pyplot().subplots(figsize=(6, 5.5), layout="constrained")
    if len(have):
        for v, g in have.groupby("variant", sort=False):
            ax.scatter(g["paper"].astype(float), g["ours"].astype(float), color=color(exp, v),
                       label=legend_label(exp, v), s=28, alpha=0.85)
        lo = min(have["paper"].astype(float).min(), have["ours"].astype(float).min(), 0)
        hi = max(have["paper"].astype(float).max(), have["ours"].astype(float).max()) * 1.05
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="ours = paper")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("paper (% / score)")
        ax.set_ylabel(f"reproduced, experiment {exp.experiment} (% / score)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    else:
        mark_missing(ax, f"no reproduced cells yet for {table} ({len(cells)} published cells)")
    n_missing = int((cells["status"] == "missing").sum())
    ax.text(0.01, 0.99, f"{len(have)} cells compared, {n_missing} missing", transform=ax.transAxes, va="top",
            fontsize=8, color="0.3")
    set_title(fig, f"Paper vs reproduced: {table}", exp)
    return fig


def draw(name: str, exp: Experiment, res: Results, ours: dict, files: dict | None = None):
    """Figure ``name`` (registry entry) drawn from the results, the reproduced tables and its input files."""
    return registry.figure(name).draw(exp, res, ours, files or {})


def save(fig, png, pdf=None):
    """Write PNG (and PDF) atomically (temp name + rename)."""
    for path, fmt in ((png, "png"), (pdf, "pdf")):
        if path is None:
            continue
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=fmt, dpi=130)
    pyplot().close(fig)


# ---- the report's figures, in its order (one entry each; stem.report.registry) --------------------------
def pretrain_metrics(exp: Experiment, evals: list[str], scale: str, variants) -> dict:
    """inputs of a curve figure: the metrics.jsonl of the pretraining runs it plots."""
    stage = T.settings(exp).stages["table3"][0]  # the curves are of the pretraining runs
    return {"metrics": [L.metrics(exp.experiment, s, v, st) for s, v, st in C.train_targets(exp)
                        if s == scale and v in variants and st == stage]}


def _curves(name: str, scale: str) -> dict:
    """A curve figure's scale and inputs (its variants: stem.config.figure_variants, config/variants.yaml's
    ``figures:``)."""
    return {"scale": scale,
            "inputs": lambda exp, evals: pretrain_metrics(exp, evals, scale, C.figure_variants(exp, name))}


registry.report_figure(
    "fig5a_loss_vs_tokens", "Figure 5a: training loss vs training tokens at the 350M scale for the dense baseline, "
    "Hash-MoE and STEM. Crosses mark loss spikes (loss above the trailing median by more than k robust standard "
    "deviations, 1.4826 x MAD).", **_curves("fig5a_loss_vs_tokens", "350m"))(fig5a_loss_vs_tokens)
registry.report_figure(
    "fig5b_loss_vs_flops", "Figure 5b: training loss vs training FLOPs for STEM replacing 1/3, 1/2 and all-but-one "
    "FFN up-projections (350M scale).", **_curves("fig5b_loss_vs_flops", "350m"))(fig5b_loss_vs_flops)
registry.report_figure(
    "fig1a_val_ppl_vs_tokens", "Figure 1a: validation perplexity vs training tokens at the 1B scale (pretraining).",
    **_curves("fig1a_val_ppl_vs_tokens", "1b"))(fig1a_val_ppl_vs_tokens)
registry.report_figure(
    "fig1b_niah", "Figure 1b: Needle-in-a-Haystack accuracy per context length (mean over needle depths) after "
    "context extension, and the per-cell accuracy as a length x depth heatmap.", scale="1b",
    inputs=lambda exp, evals: {"niah": [p for p in evals if p.endswith("eval/niah.json")]})(fig1b_niah)
registry.report_figure(
    "roi_by_scale", "Training ROI per scale ((Avg/GFLOPs) / (Avg_base/GFLOPs_base), Table 3): this experiment's "
    "models next to the paper's.")(roi_by_scale)
for _t in ("table3", "table4", "table5", "table6"):
    registry.report_figure(
        f"paper_vs_ours_{_t}", f"{registry.TABLES.registered(_t).title}: every published cell, the paper's value (x) "
        "against this experiment's (y); on the diagonal = reproduced exactly.")(partial(paper_vs_ours, table=_t))


def hit_rate_figure(r: dict):
    """Hit rate vs cache rows of an offload benchmark's result (stem.bench.offload), with the paper's 80 % and
    the removed up-projection's memory marked: the report's offload_hit_rate and `bench offload --figure`."""
    xs = [x["cache_rows"] for x in r["hit_rate_curve"]]
    ys = [100 * x["hit_rate"] for x in r["hit_rate_curve"]]
    fig, ax = pyplot().subplots(figsize=(6, 4))
    ax.plot(xs, ys, "o-", color="#1f77b4", label="LFU (LRU tie-break), held-out decode, cold start")
    ax.plot(xs, [100 * x["hit_rate_warm"] for x in r["hit_rate_curve"]], "s--", color="#2ca02c",
            label="same, counts warmed on the training split")
    ax.axhline(80, color="#d62728", ls="--", lw=1, label="paper: > 80 % (Sec. 3.4)")
    dse = not r["shapes"]["stem_layers"]   # a DSE checkpoint: rows per hashed table, no removed projection
    if r["memory"].get("cache_budget_rows"):
        ax.axvline(r["memory"]["cache_budget_rows"], color="0.4", ls=":", lw=1,
                   label="d_model rows = removed up-projection's memory")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 100)
    ax.set_xlabel("cache rows per DSE table (hashed N-gram rows)" if dse else
                  f"cache rows per STEM layer (V = {r['shapes']['vocab']})")
    ax.set_ylabel("hit rate (%)")
    ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Offloaded {'DSE' if dse else 'STEM'} tables: hit rate vs cache size\n"
                 f"{T.experiment_label(r['experiment'] or '?')}", fontsize=10)
    fig.tight_layout()
    return fig


def offload_hit_rate(exp, res, ours, files):
    """The offload benchmark's hit rate vs cache rows (rule bench_offload, stem.bench.offload); it runs on the
    350M STEM pretrain checkpoint, so an experiment without that run shows the gap."""
    if "offload" not in files:
        fig, ax = pyplot().subplots(figsize=(6, 4))
        mark_missing(ax, "no 350m stem pretrain run in this experiment's matrix: nothing to benchmark")
        set_title(fig, "Offloaded STEM tables: hit rate vs cache size", exp)
        return fig
    return hit_rate_figure(json.loads(Path(files["offload"]).read_text()))


def _offload_inputs(exp, evals) -> dict:
    if "350m" not in exp.matrix or "stem" not in exp.matrix["350m"].variants:
        return {}
    return {"offload": L.offload_file(exp.experiment, "json")}


registry.report_figure(
    "offload_hit_rate", "Offloaded STEM tables (paper Sec. 3.4): LFU cache hit rate vs cache rows per STEM layer "
    "while decoding held-out text with the 350M STEM checkpoint, beside the paper's > 80 %; offload/offload.md "
    "holds the throughput, bytes moved, memory and uniq(BL) figures.",
    inputs=_offload_inputs)(offload_hit_rate)


def _table_update_inputs(exp, evals) -> dict:
    """The two pretraining runs' metrics.jsonl (curves) and summary.json (the final-loss gap)."""
    stage = T.settings(exp).stages["table3"][0]
    scale, variants = registry.figure("table_update_loss").scale, C.figure_variants(exp, "table_update_loss")
    runs = [(s, v) for s, v, st in C.train_targets(exp) if s == scale and v in variants and st == stage]
    return {"metrics": [L.metrics(exp.experiment, s, v, stage) for s, v in runs],
            "summaries": [L.summary(exp.experiment, s, v, stage) for s, v in runs]}


registry.report_figure(
    "table_update_loss", "STEM trained with the paper's dense table update (AdamW on every row) and with "
    "optim.table_update: sparse (row-wise AdamW on the rows each batch touches; untouched rows do not move), same "
    "data and seed: training loss vs tokens and the final-loss gap (mean of the last 10 steps, and validation "
    "loss). Not a paper figure (issue 13, item 5).", scale="350m",
    inputs=_table_update_inputs)(table_update_loss)
