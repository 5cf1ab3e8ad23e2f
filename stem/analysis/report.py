"""Tables and figures of the analyze stage, from the per-checkpoint analysis JSONs.

``build(cfg, out_dir, root)`` writes ``reports/{experiment}/analysis/``:

- ``editing.{csv,md}``: per scale/stage/variant, site (``stem`` tables or the ``embedding``) and scheme: edit
  success (the target's answer ranks first), flip (target answer above the source's), top-k overlap with
  the control prompt and KL(control || edited) next to their unedited values (Fig. 7), collateral change;
- ``spread.{csv,md}`` and ``fig6_spread.{png,pdf}``: Fig. 6a-c histograms and their statistics;
- ``heaps.{csv,md}`` and ``heaps.{png,pdf}``: L_uniq vs L with the fit's K and beta, activated STEM params;
- ``capacity.{csv,md}``: recall per relation and entity-frequency bucket (chance level beside it);
- ``directions.{csv,md}``: every direction with its confidence (stem.analysis.verdict): Tables 3/4 accuracy
  per task, held-out loss, and one per analysis, each against the paper's claim (source named).

Registering it with the report's registry: ``OUTPUTS`` lists the files, ``build`` is the one entry point.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from stem.analysis import verdict as V
from stem.analysis.workflow import analyses, checkpoints

OUTPUTS = [f"{n}.{ext}" for n in ("editing", "spread", "heaps", "capacity", "directions") for ext in ("csv", "md")] \
    + [f"{n}.{ext}" for n in ("fig6_spread", "heaps") for ext in ("png", "pdf")] + ["README.md"]

# The paper's claims each analysis is read against (data with their source).
CLAIMS = {
    "editing": ("Sec. 5.2 / Fig. 7: swapping e_{source,l} <- e_{target,l} at every STEM layer makes the top-k "
                "next-token distribution of the source prompt match the target (control) prompt's"),
    "spread": ("Sec. 5.1 / Fig. 6b: STEM table vectors have a larger angular spread (pairwise cosine nearer 0) "
               "than the dense model's up-projection outputs over the same tokens"),
    "capacity": "Sec. 3.2.1 / Sec. 5.1: STEM's larger angular spread increases its knowledge storage capacity",
    "heaps": ("Sec. 3.2.5: L_uniq grows sublinearly (Heaps-like, beta < 1) and the activated STEM parameters "
              "|S| d_ff L_uniq keep growing with the context length"),
}


def load_all(cfg: dict, root=".") -> dict[str, dict]:
    """{analysis: {(scale, variant, stage): JSON}} for every analysis JSON that exists."""
    out: dict[str, dict] = {n: {} for n in analyses(cfg)}
    for scale, variant, stage in checkpoints(cfg):
        for name in out:
            p = Path(root) / "results" / cfg["experiment"] / scale / variant / stage / "analysis" / f"{name}.json"
            if p.is_file():
                r = json.loads(p.read_text())
                if (r.get("analysis"), r.get("scale"), r.get("variant"), r.get("stage")) != (name, scale, variant, stage):
                    raise ValueError(f"{p}: records {r.get('analysis')}/{r.get('scale')}/{r.get('variant')}/"
                                     f"{r.get('stage')}, expected {name}/{scale}/{variant}/{stage}")
                out[name][scale, variant, stage] = r
    return out


def editing_table(res: dict) -> pd.DataFrame:
    rows = [{"scale": s, "stage": st, "variant": v, **row}
            for (s, v, st), r in res.items() for row in r["summary"] if row["case"] == "all"]
    return pd.DataFrame(rows)


def spread_table(res: dict) -> pd.DataFrame:
    rows = []
    for (s, v, st), r in res.items():
        for layer in r["layers"]:
            for key in ("table", "up_proj", "down_input"):
                if key in layer:
                    d = layer[key]
                    rows.append({"scale": s, "stage": st, "variant": v, "layer": layer["layer"], "ffn": layer["ffn"],
                                 "vectors": key, "pairs": d["pairs"], "mean_abs_cos": d["mean_abs"],
                                 "mean_cos": d["mean"], **d["quantiles"]})
    return pd.DataFrame(rows)


def heaps_table(res: dict) -> pd.DataFrame:
    rows = []
    for (s, v, st), r in res.items():
        for L, u, a in zip(r["lengths"], r["unique"], r["activated_stem_params"]):
            rows.append({"scale": s, "stage": st, "variant": v, "L": L, "L_uniq": u, "activated_stem_params": a,
                         "K": r["fit"]["K"], "beta": r["fit"]["beta"], "r2": r["fit"]["r2"],
                         "n_stem_layers": r["n_stem_layers"]})
    return pd.DataFrame(rows)


def capacity_table(res: dict) -> pd.DataFrame:
    return pd.DataFrame([{"scale": s, "stage": st, "variant": v, "relation": rel, **row}
                         for (s, v, st), r in res.items() for rel, row in r["table"].items()])


def analysis_directions(all_res: dict) -> list[dict]:
    """One direction per analysis and STEM variant, each with its confidence where items allow one."""
    rows = []
    cap = all_res.get("capacity", {})
    for (s, v, st), r in sorted(cap.items()):
        base = cap.get((s, "dense", st))
        if v == "dense" or base is None:
            continue
        a = {(i["relation"], i["entity"]): float(i["hit"]) for i in base["items"]}
        b = {(i["relation"], i["entity"]): float(i["hit"]) for i in r["items"]}
        ci = V.paired_bootstrap(*V._paired(a, b))
        rows.append({"table": "capacity", "scale": s, "variant": v, "column": "recall", "stage": st,
                     "paper_delta": 1.0, **V._ci_cols(ci, 1.0), "source": CLAIMS["capacity"]})
    for (s, v, st), r in sorted(all_res.get("editing", {}).items()):
        es = [e for e in r["edits"] if e["site"] == "stem"]
        if not es:
            continue  # no STEM tables: the embedding swap is the reference, not a STEM claim
        ci = V.paired_bootstrap([e["kl_control"] for e in es], [e["kl_control_before"] for e in es])
        rows.append({"table": "editing", "scale": s, "variant": v, "column": "KL(control||edited) reduction",
                     "stage": st, "paper_delta": 1.0, **V._ci_cols(ci, 1.0), "source": CLAIMS["editing"]})
    sp = all_res.get("spread", {})
    for (s, v, st), r in sorted(sp.items()):
        base = sp.get((s, "dense", st))
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
    return rows


def _write(df: pd.DataFrame, out: Path, name: str, title: str, label: str):
    from stem.io import atomic_write_text
    atomic_write_text(out / f"{name}.csv", df.to_csv(index=False))
    body = df.to_markdown(index=False, floatfmt=".4g") if len(df) else "(no results yet)"
    atomic_write_text(out / f"{name}.md", f"# {title}\n\n{label}\n\n{body}\n")


def _save(fig, out: Path, name: str):
    from stem.report.figures import save
    save(fig, out / f"{name}.png", out / f"{name}.pdf")


def _legend(ax):
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def fig6(res: dict, label: str):
    import matplotlib.pyplot as plt

    from stem.report.figures import COLORS
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
                axes[1].plot(mid, dens(layer["table"]["hist"]), color=COLORS["stem"], alpha=0.7,
                             label=f"{s} STEM tables" if layer is next(x for x in r["layers"] if "table" in x) else None)
            if v in ("dense", "stem") and "down_input" in layer:
                axes[2].plot(mid, dens(layer["down_input"]["hist"]), color=COLORS[v], alpha=0.5,
                             label=f"{s} {v}" if layer is r["layers"][0] else None)
        stem_layers = {layer["layer"] for (s2, v2, st2), r2 in res.items() if v2 == "stem" and s2 == s
                       for layer in r2["layers"] if "table" in layer}
        if v == "dense":
            for layer in r["layers"]:
                if layer["layer"] in stem_layers and "up_proj" in layer:
                    axes[1].plot(mid, dens(layer["up_proj"]["hist"]), color=COLORS["dense"], alpha=0.7,
                                 label=f"{s} dense up-proj" if layer["layer"] == min(stem_layers) else None)
    for ax in axes:
        _legend(ax)
    fig.suptitle(f"Figure 6 (angular spread), {label}", fontsize=10)
    fig.tight_layout()
    return fig


def niah_curves(cfg: dict, root=".") -> dict[str, tuple[list, list]]:
    """{variant: (lengths, mean NIAH accuracy over depths)} of the 1B models at Fig. 1b's stage, where present."""
    from stem.report.results import niah_cells
    out = {}
    stage = ((cfg.get("report") or {}).get("stages") or {}).get("figure1b", ["extend"])[0]
    for v in ("dense", "stem"):
        p = Path(root) / "results" / cfg["experiment"] / "1b" / v / stage / "eval" / "niah.json"
        if p.is_file():
            cells = niah_cells(json.loads(p.read_text()))
            if len(cells):
                m = cells.groupby("length")["accuracy"].mean()
                out[v] = (m.index.tolist(), m.tolist())
    return out


def heaps_fig(res: dict, label: str, niah: dict | None = None):
    import matplotlib.pyplot as plt

    from stem.report.figures import COLORS
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4))
    for (s, v, st), r in sorted(res.items()):
        if v != "stem":  # the curve depends on the scale's tokenizer and held-out text only
            continue
        f, L = r["fit"], np.asarray(r["lengths"], float)
        a.loglog(L, r["unique"], "o", label=f"{s}: held-out {r['source']}")
        a.loglog(L, f["K"] * L ** f["beta"], "-", label=f"{s}: K={f['K']:.3g}, beta={f['beta']:.3f}")
    for (s, v, st), r in sorted(res.items()):
        b.loglog(r["lengths"], r["activated_stem_params"], "o-", color=COLORS.get(v), alpha=0.5 if s == "350m" else 1,
                 label=f"{s} {v}, |S|={r['n_stem_layers']}")
    a.set(xlabel="context length L (tokens)", ylabel="unique token ids L_uniq", title="Heaps fit L_uniq = K L^beta")
    b.set(xlabel="context length L (tokens)", ylabel="|S| d_ff L_uniq",
          title="activated STEM parameters per sequence")
    for v, (lengths, acc) in (niah or {}).items():
        c.plot(lengths, acc, "o-", color=COLORS[v], label=f"1b {v}")
    c.set(xscale="log", xlabel="context length (tokens)", ylabel="NIAH accuracy (%)", ylim=(-2, 102),
          title="beside it: Fig. 1b, NIAH accuracy vs length" + ("" if niah else " (no results)"))
    for ax in (a, b, c):
        _legend(ax)
    fig.suptitle(f"Sec. 3.2.5 context-length adaptive parameter usage, {label}", fontsize=10)
    fig.tight_layout()
    return fig


def build(cfg: dict, out_dir, root=".") -> dict:
    from stem.io import atomic_write_text
    from stem.report.tables import experiment_label
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    label = experiment_label(cfg["experiment"])
    res = load_all(cfg, root)
    empty: dict = {}
    _write(editing_table(res.get("editing", empty)), out, "editing", "Knowledge editing (Sec. 3.3, 5.2; Fig. 7)", label)
    _write(spread_table(res.get("spread", empty)), out, "spread", "Angular spread (Sec. 5.1; Fig. 6)", label)
    _write(heaps_table(res.get("heaps", empty)), out, "heaps", "Heaps law and activated STEM parameters (Sec. 3.2.5)", label)
    _write(capacity_table(res.get("capacity", empty)), out, "capacity", "Knowledge capacity probe", label)
    dirs = V.table_directions(cfg, root) + V.loss_directions(res.get("heldout", empty)) + analysis_directions(res)
    dirs_df = pd.DataFrame(dirs)
    if len(dirs_df):
        # Only Tables 3/4 print an effect size; elsewhere the paper states a direction (paper_delta is its sign).
        half = (dirs_df["hi"].astype(float) - dirs_df["lo"].astype(float)) / 2
        sized = dirs_df["table"].isin(["table3", "table4"]) & half.notna()
        dirs_df["paper_effect_resolvable"] = np.where(sized, half < dirs_df["paper_delta"].abs(), None)
    _write(dirs_df, out, "directions", "Directions with confidence (paired bootstrap, 95%)", label)
    _save(fig6(res.get("spread", empty), label), out, "fig6_spread")
    _save(heaps_fig(res.get("heaps", empty), label, niah_curves(cfg, root)), out, "heaps")
    counts = dirs_df["verdict"].value_counts().to_dict() if len(dirs_df) else {}
    atomic_write_text(out / "README.md", readme(label, counts, res))
    return counts


def readme(label: str, counts: dict, res: dict) -> str:
    ex, where = next(((r["example"], k) for k, r in sorted(res.get("editing", {}).items())
                      if r.get("example") and r["variant"] == "stem"), (None, None))  # "1b" sorts first
    lines = [f"# Analyses ({label})", "",
             "Knowledge editing, angular spread, Heaps-law parameter usage and the capacity probe "
             "(rules/analyze.smk, stem/analysis). Direction verdicts: " +
             ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ".", ""]
    if ex:
        lines += [f"Edit example ({'/'.join(where)}):", ""] + example_md(ex) + [""]
    lines += [f"- {k}: {v}" for k, v in CLAIMS.items()]
    return "\n".join(lines) + "\n"


def example_md(ex: dict) -> list[str]:
    """The README's edit example: Fig. 7's three top-k columns and the greedy continuations."""
    row = lambda name, prompt, d: (f"| {name} | `{prompt}` | "  # noqa: E731
                                   + ", ".join(f"`{t!r}` {p:.3f}" for t, p in d["topk"]) + f" | `{d['greedy']!r}` |")
    return [f"Edit: {ex['source']} -> {ex['target']} ({ex['scheme']} of the {ex['site']} vectors; answers "
            f"`{ex['source_answer']}` / `{ex['target_answer']}`)", "",
            "| model | prompt | top next tokens (probability) | greedy continuation |", "|---|---|---|---|",
            row("original", ex["prompt"], ex["original"]), row("control (target prompt)", ex["control_prompt"], ex["control"]),
            row("edited", ex["prompt"], ex["edited"])]
