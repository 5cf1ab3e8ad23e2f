"""A DSE sweep's result from its points' training summaries (rule sweep_report): the counts checked against each
trained model, the losses, the optimum (rho) or the log-linear fit (slots), as JSON, Markdown and Fig. 2's
figure. In the report layer (it reads results through stem.report.results); the points themselves are
stem.sweeps, below stem.config."""
from __future__ import annotations

import math

import numpy as np

from stem import provenance
from stem.report.results import ResultError, Results
from stem.report.tables import experiment_label
from stem.sweeps import CLAIMS, TOLERANCE, points, train_settings


def fit_loglinear(x, y) -> dict:
    """Least squares y = a + b log10(x): slope b (per decade of x), intercept a, r^2."""
    lx, y = np.log10(np.asarray(x, float)), np.asarray(y, float)
    if len(lx) < 2 or np.ptp(lx) == 0:
        raise ValueError(f"log-linear fit: expected at least two distinct x values, got {list(x)}")
    b, a = np.polyfit(lx, y, 1)
    ss_res, ss_tot = float(((y - (a + b * lx)) ** 2).sum()), float(((y - y.mean()) ** 2).sum())
    return {"slope_per_decade": float(b), "intercept": float(a), "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0,
            "n": int(len(lx))}


def collect(cfg: dict, kind: str, results_root="results") -> dict:
    """The sweep's result: every point's counts (the config's arithmetic, equal to the trained model's accounting
    in its summary.json, total and active, or a one-line error) and final validation loss, the optimum (rho) or the log-linear fit (slots).
    ``cfg``: the sweep job's spec (rules/sweep.smk: the config's experiment, archs, variant_overrides and sweeps as
    written; its hash is the result's provenance)."""
    sw = cfg["sweeps"]
    scale, stage = sw["scale"], sw["stage"]
    res = Results(cfg["experiment"], results_root)
    d, V = cfg["archs"][scale]["d_model"], cfg["archs"][scale]["vocab_size"]
    rows = []
    for p in points(cfg, kind):
        s = res.summary(scale, p["variant"], stage)
        where = res.stage_dir(scale, p["variant"], stage) / "summary.json"
        if s is None:
            raise ResultError(f"{where}: missing (sweep point {p['variant']} has not been trained)")
        built = {"p_tot": s.get("total_params", 0) - 2 * V * d, "p_act": s.get("active_params", 0) - 2 * V * d}
        for key, name in (("p_tot", "total_params"), ("p_act", "active_params")):
            if built[key] != p[key]:
                raise ResultError(f"{where}: key '{name}': {s.get(name)!r} is not the sweep's count "
                                  f"{p[key] + 2 * V * d:,} ({key.replace('p_', 'P_')} {p[key]:,} + embedding and head)")
        row = {k: v for k, v in p.items() if k != "spec"}
        row.update(val_loss=s["final_val_loss"], train_loss=s["final_train_loss"], steps=s["steps"],
                   tokens=s["tokens"], wall_seconds=s.get("wall_seconds"))
        rows.append(row)
    out = {"experiment": cfg["experiment"], "label": experiment_label(cfg["experiment"]), "kind": kind,
           "scale": scale,
           "stage": stage, "base": sw[kind]["base"], "memory": sw[kind]["memory"], "train": train_settings(cfg),
           "claim": CLAIMS[kind], "points": rows, "provenance": provenance.record(cfg)}
    losses = [r["val_loss"] for r in rows]
    if any(x is None or not math.isfinite(x) for x in losses):
        raise ResultError(f"sweep {kind}: a point has no validation loss ({[r['variant'] for r in rows]}: {losses})")
    if kind == "rho":
        best = min(rows, key=lambda r: r["val_loss"])
        pure = next((r for r in rows if r["rho"] == 1), None)
        out["target"] = {"p_tot": rows[0]["ref_p_tot"], "p_act": rows[0]["ref_p_act"]}
        out["tolerance"] = {**TOLERANCE, **(sw["rho"].get("tolerance") or {})}
        out["optimum"] = {"variant": best["variant"], "rho": best["rho"], "rho_actual": best["rho_actual"],
                          "val_loss": best["val_loss"],
                          "gain_vs_pure_moe": pure["val_loss"] - best["val_loss"] if pure else None}
    else:
        out["fit"] = fit_loglinear([r["dse_slots"] for r in rows], losses)
    return out


def _fmt(n: float) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.3f}M" if n >= 1e6 else f"{n:,}"


def markdown(r: dict) -> str:
    kind = r["kind"]
    title = ("Sparsity allocation: validation loss vs rho (DSE paper Sec. 3.1, Fig. 2 left)" if kind == "rho"
             else "Memory scaling: validation loss vs DSE slots (DSE paper Sec. 3.2, Fig. 2 right)")
    lines = [f"# {title}", "", f"_{r['label']}; scale {r['scale']}, stage {r['stage']}, base `{r['base']}`, memory "
             f"`{r['memory']}`, sweep settings {r['train'] or 'as the stage'}_", "", f"Paper: {r['claim']}.", ""]
    if kind == "rho":
        t = r["target"]
        lines += [f"Target (rho = 1): P_tot {t['p_tot']:,}, P_act {t['p_act']:,} (no embedding, no LM head); "
                  f"tolerance {r['tolerance']}.", "",
                  "| variant | rho | rho actual | routed experts | DSE rows/head | P_tot | dP_tot | P_act | dP_act | "
                  "MoE free | DSE tables | val loss |", "|" + "---|" * 12]
        for p in r["points"]:
            lines.append(f"| {p['variant']} | {p['rho']:g} | {p['rho_actual']:.3f} | {p['moe_experts']} | "
                         f"{p['rows_per_head'] or '-'} | {p['p_tot']:,} | {100 * p['p_tot_dev']:+.3f}% | {p['p_act']:,} "
                         f"| {100 * p['p_act_dev']:+.2f}% | {p['moe_free']:,} | {p['dse_tables']:,} | "
                         f"{p['val_loss']:.4f} |")
        o = r["optimum"]
        gain = "" if o["gain_vs_pure_moe"] is None else \
            f"; pure MoE (rho = 1) minus this: {o['gain_vs_pure_moe']:+.4f}"
        lines += ["", f"Lowest validation loss: **{o['variant']}** (rho {o['rho']:g}, actual {o['rho_actual']:.3f}) "
                      f"at {o['val_loss']:.4f}{gain}."]
    else:
        lines += ["| variant | DSE rows/head | slots M | DSE tables | P_tot | P_act | val loss |", "|" + "---|" * 7]
        for p in r["points"]:
            lines.append(f"| {p['variant']} | {p['rows_per_head']} | {p['dse_slots']:,} | {p['dse_tables']:,} | "
                         f"{p['p_tot']:,} | {p['p_act']:,} | {p['val_loss']:.4f} |")
        f = r["fit"]
        lines += ["", f"Least-squares fit val loss = a + b log10(M): b = **{f['slope_per_decade']:+.4f}** per decade of "
                      f"slots, a = {f['intercept']:.4f}, r^2 = {f['r2']:.3f} ({f['n']} points)."]
    lines += ["", "Validation loss: each run's final_val_loss (summary.json). Counts: stem.sweeps arithmetic, equal to "
                  "the built model's (checked). Not a paper-scale result unless the experiment is `paper`."]
    return "\n".join(lines) + "\n"


def figure(r: dict):
    """Fig. 2 left (rho, optimum marked) or right (log slots with the fit), from a ``collect`` result."""
    import matplotlib   # ~1 s, only when a figure is drawn (keeps the DAG build light)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # likewise
    fig, ax = plt.subplots(figsize=(6.5, 4.5), layout="constrained")
    pts, label = r["points"], r["label"]
    if r["kind"] == "rho":
        xs, ys = [p["rho_actual"] for p in pts], [p["val_loss"] for p in pts]
        order = np.argsort(xs)
        ax.plot(np.asarray(xs)[order], np.asarray(ys)[order], "o-", color="#17becf",
                label="MoE + DSE at iso P_tot (rho = 1: pure MoE; E = routed experts)")
        for p in pts:
            ax.annotate(f"E={p['moe_experts']}", (p["rho_actual"], p["val_loss"]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=7, color="0.35")
        o = r["optimum"]
        ax.plot([o["rho_actual"]], [o["val_loss"]], "*", ms=16, color="#d62728",
                label=f"optimum: rho = {o['rho_actual']:.3f}, loss {o['val_loss']:.4f}")
        ax.set_xlabel("allocation ratio rho (fraction of P_free in routed experts; 1 = pure MoE)")
        ax.set_title(f"Sparsity allocation at P_tot {_fmt(r['target']['p_tot'])}, P_act {_fmt(r['target']['p_act'])}"
                     f"\n{label}", fontsize=9)
    else:
        xs, ys = [p["dse_slots"] for p in pts], [p["val_loss"] for p in pts]
        ax.semilogx(xs, ys, "o", color="#17becf", label="DSE (fixed backbone)")
        f = r["fit"]
        grid = np.logspace(np.log10(min(xs)), np.log10(max(xs)), 50)
        ax.semilogx(grid, f["intercept"] + f["slope_per_decade"] * np.log10(grid), "--", color="0.3",
                    label=f"fit: slope {f['slope_per_decade']:+.4f} / decade, r$^2$ = {f['r2']:.3f}")
        ax.text(0.02, 0.04, f"loss = {f['intercept']:.4f} {f['slope_per_decade']:+.4f} log10(M)\n"
                            f"r^2 = {f['r2']:.3f}, {f['n']} points", transform=ax.transAxes, fontsize=8,
                color="0.2", va="bottom")
        ax.set_xlabel("DSE slots M (table rows over all tables and DSE layers, log scale)")
        ax.set_title(f"Memory scaling: backbone {r['base']}, memory {r['memory']}\n{label}", fontsize=9)
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return fig
