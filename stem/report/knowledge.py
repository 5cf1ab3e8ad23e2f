"""The knowledge experiment's report (config ``knowledge:``; docs/knowledge.md), registered with the report's
registry like the analyses' tables and figures:

- table ``knowledge``: per bios source (N, name kind, exposures) and variant, over its seeds: bits stored (the
  capacity lower bound, stem.analysis.knowledge), the world's bits, exact-match recall, parameters counted both
  ways and bits per parameter both ways, and whether the point is valid (recall >= knowledge.min_recall);
  the experiment's validity (every variant learns the capacity sweep's smallest world) in a row of its own;
- figure ``knowledge_bits``: bits stored against N per variant (the shape of Allen-Zhu & Li's capacity plots),
  the world's information content as the ceiling;
- direction rows (table ``directions``): STEM/dense bits stored at each N of the capacity sweep (the sources of
  ``knowledge.capacity_names``' kind) with a 95 % interval (two-level
  bootstrap: seeds, then facts), against Sec. 3.2.1's claim that STEM stores more.
A capacity is reported only where the experiment is valid; otherwise each row says it is invalid.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from stem import knowledge as K
from stem import layout as L
from stem.config.experiment import Experiment
from stem.options import NameKind
from stem.report import analyses as A
from stem.report import figures as F
from stem.report import registry
from stem.report import tables as T
from stem.report import verdict as V

CLAIM = ("Sec. 3.2.1: STEM's token-indexed tables (address vectors with a large angular spread) give it a larger "
         "knowledge storage capacity than the dense model (bits stored, {names} names; ours_delta = ratio - 1)")
NAMES = {NameKind.ONE: "one-token", NameKind.PAIR: "two-token (pair)", NameKind.MULTI: "multi-token"}
COLUMNS = ("n", "exposures", "seeds", "bits", "bits_max", "recall", "params_total", "params_activated",
           "bits_per_param_total", "bits_per_param_activated", "valid")
N_BOOT = 1000


def claim(exp: Experiment, text: str) -> str:
    """A direction row's claim, labelled with the run it comes from where that is not the knowledge experiment (the
    tiny run's reduced world: config/tiny.yaml's knowledge section)."""
    if exp.experiment == "knowledge":
        return text
    return f"{text} [{exp.experiment} run's reduced knowledge world: synthetic, CPU scale]"


def load(exp: Experiment, root, name: str = K.ANALYSIS) -> dict[str, dict]:
    """{point id: its ``name`` analysis JSON} for every point whose JSON exists under ``root`` (results)."""
    kn, out = exp.knowledge, {}
    for p in K.points(exp):
        path = Path(root) / Path(L.analysis_json(exp.experiment, kn.scale, p, kn.stage, name)).relative_to("results")
        if path.is_file():
            out[p] = json.loads(path.read_text())
    return out


def groups(got: dict[str, dict]) -> dict[tuple[str, str], list[dict]]:
    """{(source, base variant): [JSON per seed]}."""
    out: dict = {}
    for p, r in sorted(got.items()):
        source, variant, _ = K.split(p)
        out.setdefault((source, variant), []).append(r)
    return out


def validity(exp: Experiment, got: dict) -> tuple[bool, str]:
    """Every variant recalls >= min_recall of the capacity sweep's smallest world (knowledge.capacity_names' kind;
    all its seeds), or why not."""
    kn = exp.knowledge
    sweep = K.capacity_sources(exp)
    if not sweep:
        return False, f"no {kn.capacity_names} world in knowledge.sources"
    smallest = sweep[0]
    g = groups(got)
    variants = K.variants_at(exp, smallest)
    missing = [v for v in variants if (smallest, v) not in g]
    if missing:
        return False, f"{smallest}: no results yet for {', '.join(missing)}"
    low = [f"{v} {min(r['recall'] for r in g[smallest, v]):.2f}" for v in variants
           if min(r["recall"] for r in g[smallest, v]) < kn.min_recall]
    if low:
        return False, f"invalid: the smallest world ({smallest}) is not learnt (recall {', '.join(low)} < {kn.min_recall})"
    return True, f"valid: every variant recalls >= {kn.min_recall} of {smallest}"


def knowledge_long(exp: Experiment, res) -> pd.DataFrame:
    if exp.knowledge is None:
        return T.frame([])
    got = load(exp, res.root)
    ok, why = validity(exp, got)
    cells = [T.cell("knowledge", str(exp.knowledge.scale), "all", "validity", why, "", row="experiment", unit="")]
    for (source, variant), rs in groups(got).items():
        src = L.analysis_json(exp.experiment, exp.knowledge.scale, K.point_id(source, variant), exp.knowledge.stage,
                              K.ANALYSIS)
        vals = {"n": rs[0]["n"], "exposures": rs[0]["exposures"], "seeds": len(rs),
                "bits": float(np.mean([r["bits"] for r in rs])), "bits_max": rs[0]["bits_max"],
                "recall": float(np.mean([r["recall"] for r in rs])), "params_total": rs[0]["params_total"],
                "params_activated": rs[0]["params_activated"],
                "bits_per_param_total": float(np.mean([r["bits_per_param_total"] for r in rs])) if ok else None,
                "bits_per_param_activated": float(np.mean([r["bits_per_param_activated"] for r in rs])) if ok else None,
                "valid": "yes" if all(r["valid"] for r in rs) else "no"}
        row = f"{source} ({rs[0]['name_kind']} names) {variant}"
        cells += [T.cell("knowledge", str(exp.knowledge.scale), variant, c, vals[c], src, row=row, unit="")
                  for c in COLUMNS]
    return T.frame(cells)


def ratio_ci(base: list[dict], other: list[dict], seed: int = 0) -> dict:
    """sum(bits other) / sum(bits base) over the same facts, mean over seed pairs, with a 95 % two-level
    bootstrap interval (seeds drawn with replacement, then facts); reported as ratio - 1."""
    pairs = [(np.array([i["bits"] for i in a["items"]]), np.array([i["bits"] for i in b["items"]]))
             for a, b in zip(base, other)]
    stat = lambda ps, idx: float(np.mean([b[idx].sum() / a[idx].sum() for a, b in ps]))   # noqa: E731
    n = len(pairs[0][0])
    est = stat(pairs, np.arange(n))
    rng, boots = np.random.default_rng(seed), []
    for _ in range(N_BOOT):
        ps = [pairs[k] for k in rng.integers(0, len(pairs), len(pairs))]
        boots.append(stat(ps, rng.integers(0, n, n)))
    lo, hi = np.quantile(boots, [0.025, 0.975])
    return {"delta": est - 1, "lo": float(lo) - 1, "hi": float(hi) - 1, "n": n * len(pairs), "seeds": len(pairs),
            "se": float(np.std(boots))}


def directions(exp: Experiment, got: dict) -> list[dict]:
    """STEM (each STEM variant) / dense bits stored at each N with its interval; invalid points are skipped."""
    if exp.knowledge is None or not validity(exp, got)[0]:
        return []
    g, rows, sweep = groups(got), [], K.capacity_sources(exp)
    for (source, variant), rs in sorted(g.items()):
        base = g.get((source, "dense"))
        if variant == "dense" or base is None or not variant.startswith("stem") or source not in sweep:
            continue   # the ratio rows: the capacity sweep's worlds only (knowledge.capacity_names)
        k = min(len(base), len(rs))
        ci = ratio_ci(base[:k], rs[:k])
        verdict = V.classify(ci, 1.0)
        rows.append({"table": "knowledge", "scale": str(exp.knowledge.scale), "variant": variant,
                     "column": f"bits ratio vs dense - 1 at {source} (N {rs[0]['n']}, {rs[0]['name_kind']} names)",
                     "stage": str(exp.knowledge.stage), "paper_delta": 1.0, "ours_delta": ci["delta"], "lo": ci["lo"],
                     "hi": ci["hi"], "n": ci["n"], "seeds": ci["seeds"], "p": V.p_value(ci), "verdict": verdict,
                     "source": claim(exp, CLAIM.format(names=NAMES[exp.knowledge.capacity_names]))})
    return [seeded(exp, r) for r in rows]


def seeded(exp: Experiment, row: dict) -> dict:
    """A direction row from fewer seeds than ``knowledge.seeds``: a point estimate (no interval, no p-value, so never
    a resolved verdict), since its interval would hold the facts' (items') variance only, not the seeds'. Measured
    (docs/knowledge.md, fifth run): at p0200 the one-seed intervals of the STEM/dense ratio, -0.085 [-0.109, -0.061]
    and -0.113 [-0.137, -0.089], excluded the three-seed estimates, -0.043 and -0.040."""
    if row.get("ours_delta") is None or row["seeds"] >= len(exp.knowledge.seeds):
        return row
    d = np.sign(row["ours_delta"]) * np.sign(row["paper_delta"])
    word = "agree" if d > 0 else "disagree" if d < 0 else "inconclusive"
    return {**row, "lo": None, "hi": None, "p": None, "verdict": f"{word} (point estimate)"}


EDIT_CLAIM = ("Sec. 3.3 / Fig. 7: replacing the source entity's STEM rows (every STEM layer) by the target's moves "
              "the answer to the target's; compared with the same edit of dense's only token-indexed rows, the token "
              "embedding (our reading of the comparison: edit success STEM rows - dense embedding rows)")
EDIT_COLUMNS = ("success", "b_unaffected", "collateral")


def edit_long(exp: Experiment, res) -> pd.DataFrame:
    """Per source, variant and site, mean over seeds and pairs: success, B unaffected, collateral, undo exact."""
    if exp.knowledge is None:
        return T.frame([])
    cells = []
    for (source, variant), rs in groups(load(exp, res.root, K.EDIT)).items():
        src = L.analysis_json(exp.experiment, exp.knowledge.scale, K.point_id(source, variant), exp.knowledge.stage,
                              K.EDIT)
        for site in rs[0]["sites"]:
            vals = {c: float(np.mean([r["sites"][site][c] for r in rs])) for c in EDIT_COLUMNS}
            vals.update(recall_before=float(np.mean([r["recall_before"] for r in rs])), seeds=len(rs),
                        pairs=sum(r["pairs"] for r in rs), undo_bit_exact="yes" if all(r["undo_bit_exact"] for r in rs)
                        else "NO")
            cells += [T.cell("knowledge_edit", str(exp.knowledge.scale), variant, c, v, src,
                             row=f"{source} {variant}: {site} rows", unit="") for c, v in vals.items()]
    return T.frame(cells)


def edit_directions(exp: Experiment, results) -> list[dict]:
    """Edit success (and collateral) of a STEM variant's STEM rows against dense's embedding rows, paired over the
    same (A, B) pairs and seeds (the pairs are drawn by the analysis seed, the same for every variant)."""
    g, rows = groups(load(exp, results, K.EDIT)), []
    for (source, variant), rs in sorted(g.items()):
        base = g.get((source, "dense"))
        if base is None or "stem" not in rs[0]["sites"] or \
                min(r["recall_before"] for r in base + rs) < exp.knowledge.min_recall:
            continue   # no STEM rows, or a model that does not know its facts (issue 40: edits need >= 90 %)
        for col, sign in (("success", 1.0), ("collateral", -1.0)):
            a = [e[col] for r in base for e in r["sites"]["embedding"]["edits"]]
            b = [e[col] for r in rs for e in r["sites"]["stem"]["edits"]]
            k = min(len(a), len(b))
            ci = V.paired_bootstrap(a[:k], b[:k])
            rows.append({"table": "knowledge_edit", "scale": str(exp.knowledge.scale), "variant": variant,
                         "column": f"{col}: STEM rows - dense embedding rows at {source}", "stage": str(exp.knowledge.stage),
                         "paper_delta": sign, **V.ci_cols(ci, sign), "seeds": min(len(base), len(rs)),
                         "source": claim(exp, EDIT_CLAIM)})
    return [seeded(exp, r) for r in rows]


INJECT_CLAIM = ("Sec. 3.3 / Fig. 3 (knowledge injection, our reading): an individual the model never saw is given "
                "knowledge through its token's rows alone; its rows fitted on its biography, all else frozen: recall "
                "of its facts with the new token's rows (STEM: embedding + STEM rows) - dense's (its embedding row)")
INJECT_COLUMNS = ("before_recall", "copy_recall", "copy_collateral", "fit_recall", "fit_bits", "fit_collateral")


def inject_long(exp: Experiment, res) -> pd.DataFrame:
    """Per source, variant and site, mean over seeds and held-out individuals: recall before, after a donor's rows
    (copy: the donor's facts) and after fitting its rows on its biography (fit: its own facts), collateral."""
    if exp.knowledge is None:
        return T.frame([])
    cells = []
    for (source, variant), rs in groups(load(exp, res.root, K.EDIT)).items():
        rs = [r for r in rs if r.get("inject")]
        src = L.analysis_json(exp.experiment, exp.knowledge.scale, K.point_id(source, variant), exp.knowledge.stage,
                              K.EDIT)
        for site in (rs[0]["inject"]["sites"] if rs else ()):
            vals = {c: float(np.mean([r["inject"]["sites"][site][c] for r in rs])) for c in INJECT_COLUMNS}
            i = rs[0]["inject"]
            vals.update(seeds=len(rs), people=sum(r["inject"]["people"] for r in rs),
                        budget=f"{i['steps']} steps x {i['docs']} bios, lr {i['lr']}",
                        undo_bit_exact="yes" if all(r["inject"]["undo_bit_exact"] for r in rs) else "NO")
            cells += [T.cell("knowledge_inject", str(exp.knowledge.scale), variant, c, v, src,
                             row=f"{source} {variant}: {site} rows", unit="") for c, v in vals.items()]
    return T.frame(cells)


def _person_values(rs: list[dict], site: str, how: str, col: str) -> list[float]:
    return [p[how][col] for r in rs for p in r["inject"]["sites"][site]["people"]]


def inject_directions(exp: Experiment, results) -> list[dict]:
    """Fitted recall (and collateral) of a STEM variant's new-token rows (embedding + STEM) against dense's
    (embedding), paired over the same held-out individuals and seeds, where both models know their world."""
    g, rows = groups(load(exp, results, K.EDIT)), []
    for (source, variant), rs in sorted(g.items()):
        base = [r for r in g.get((source, "dense"), []) if r.get("inject")]
        rs = [r for r in rs if r.get("inject")]
        if not base or not rs or "all" not in rs[0]["inject"]["sites"] or \
                min(r["recall_before"] for r in base + rs) < exp.knowledge.min_recall:
            continue
        k = min(len(base), len(rs))
        for col, sign in (("recall", 1.0), ("collateral", -1.0)):
            a = _person_values(base[:k], "embedding", "fit", col)
            b = _person_values(rs[:k], "all", "fit", col)
            ci = V.paired_bootstrap(a, b) if len(a) == len(b) else None
            rows.append({"table": "knowledge_inject", "scale": str(exp.knowledge.scale), "variant": variant,
                         "column": f"fitted {col}: new token's rows STEM - dense at {source}",
                         "stage": str(exp.knowledge.stage), "paper_delta": sign, **V.ci_cols(ci, sign), "seeds": k,
                         "source": claim(exp, INJECT_CLAIM)})
    return [seeded(exp, r) for r in rows]


def draw(exp: Experiment, res, ours, files):
    import matplotlib.pyplot as plt   # matplotlib: only when a figure is drawn (keeps the DAG build light)

    fig, ax = plt.subplots(figsize=(6, 4.2))
    got = load(exp, res.root) if exp.knowledge is not None else {}
    g = groups(got)
    sweep = K.capacity_sources(exp) if exp.knowledge is not None else []
    for variant in T.ordered_variants(exp, {v for _, v in g}):
        pts = sorted((rs[0]["n"], np.mean([r["bits"] for r in rs])) for (s, v), rs in g.items()
                     if v == variant and s in sweep)
        if pts:
            line, = ax.plot(*zip(*pts), marker="o", label=variant)
            seeds = [(rs[0]["n"], r["bits"]) for (s, v), rs in g.items() if v == variant and s in sweep and len(rs) > 1
                     for r in rs]
            if seeds:   # each seed's bits: past the knee the spread between trainings is what the intervals hold
                ax.scatter(*zip(*seeds), s=9, color=line.get_color(), alpha=0.45)
    ceiling = sorted({(rs[0]["n"], rs[0]["bits_max"]) for (s, _), rs in g.items() if s in sweep})
    if ceiling:
        ax.plot(*zip(*ceiling), "k:", label="the world's bits")
    ax.set_xscale("log")
    ax.set_xlabel(f"individuals N ({exp.knowledge.capacity_names if exp.knowledge is not None else ''} names)")
    ax.set_ylabel("bits stored (lower bound)")
    ax.set_title(f"{T.experiment_label(exp)}\n{validity(exp, got)[1] if exp.knowledge is not None else ''}",
                 fontsize=7)
    A.legend(ax)
    if not g:
        F.mark_missing(ax, "no knowledge results (config knowledge: not set, or not run yet)")
    return fig


def inputs(exp: Experiment) -> list[str]:
    return [p for p in K.targets(exp) if p.endswith((f"/analysis/{K.ANALYSIS}.json", f"/analysis/{K.EDIT}.json"))]


A.EXPERIMENT_DIRECTIONS.append(lambda exp, results: directions(exp, load(exp, results)) + edit_directions(exp, results)
                               + inject_directions(exp, results) if exp.knowledge else [])
registry.paper_table("knowledge", "Knowledge capacity (bioS-style world, docs/knowledge.md): bits stored (lower "
                     "bound), recall and bits per parameter counted both ways, per world size N and variant, mean "
                     "over seeds", inputs=inputs,
                     empty="_(no rows: config `knowledge:` not set, or no knowledge results yet)_")(knowledge_long)
registry.paper_table("knowledge_edit", "Knowledge editing with a positive control (docs/knowledge.md): A's rows "
                     "<- B's at a site (STEM tables, token embedding, both), mean over pairs and seeds: A now answered "
                     "with B's values (success), B's own facts kept, other individuals' facts changed (collateral), "
                     "undo bit-exact", inputs=inputs,
                     empty="_(no rows: config `analysis.knowledge_edit` not set, or no results yet)_")(edit_long)
registry.paper_table("knowledge_inject", "Knowledge injection (docs/knowledge.md): individuals the model never saw "
                     "(held out of its world) given a known donor's rows (copy: recall of the donor's facts) or their "
                     "own rows fitted on their biography with everything else frozen (fit: recall and bits of their "
                     "own facts), per site, mean over individuals and seeds; collateral on the known individuals",
                     inputs=inputs, empty="_(no rows: `analysis.knowledge_edit.inject` not set, or no results yet)_"
                     )(inject_long)
registry.report_figure("knowledge_bits", "Knowledge capacity: bits stored (Allen-Zhu & Li's lower bound) against "
                       "the number of individuals N per variant on the capacity sweep (knowledge.capacity_names), "
                       "the mean over seeds (small points: each seed, where there are several); dotted: the world's "
                       "bits.",
                       experiments=("knowledge",))(draw)
