"""Direction verdicts with a confidence: agree / disagree / inconclusive.

A direction compares a variant with the dense baseline on the *same items* (benchmark questions, held-out
windows, probe facts). ``paired_bootstrap`` resamples the items (with replacement, the same draw for both
models) and gives the mean difference b - a with a percentile interval; ``classify`` reads it against the
sign the paper reports: the interval above zero (or below) is a direction, one that contains zero is
*inconclusive* (the tiny fixtures cannot tell). ``grouped_bootstrap`` is the same for a mean of per-group
means (the commonsense average: each task resampled within itself); ``seeded_bootstrap`` folds several
seeds of a matrix cell in (stem.seeds; two levels: seeds resampled, then each picked seed's items afresh).

``table_directions`` applies it to the diff's accuracy directions (Tables 3 and 4, per task and the average)
from the per-item lm-eval samples; ``loss_directions`` to the held-out loss (analysis ``heldout``).

``category`` folds every verdict string into one of ``CATEGORIES``; ``count`` counts them. The report's
``directions`` table (tables/directions.csv) is the one source of verdicts: the diff summary, the README/HTML
direction table and ``python -m stem diff`` count its rows with these (stem.report.diff.directions).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from stem import config as C
from stem import seeds
from stem.config.experiment import Experiment
from stem.models.registry import ffn_facts
from stem.report import paper_data as P

LEVEL = 0.95
N_BOOT = 2000


def paired_bootstrap(a, b, n_boot: int = N_BOOT, seed: int = 0, level: float = LEVEL) -> dict:
    """Mean of b - a over paired items, with a percentile bootstrap interval."""
    return grouped_bootstrap([(a, b)], n_boot, seed, level)


def grouped_bootstrap(groups, n_boot: int = N_BOOT, seed: int = 0, level: float = LEVEL) -> dict:
    """Mean over groups of (mean b - mean a) within each group; every group resampled on its own items."""
    delta, boots, n = _resample_groups(groups, np.random.default_rng(seed), n_boot)
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return {"delta": delta, "lo": float(lo), "hi": float(hi), "n": n, "level": level, "boots": boots,
            "se": _se(boots)}


def _se(boots) -> float:
    """The bootstrap standard error (sd of the draws)."""
    return float(np.std(boots, ddof=1)) if len(boots) > 1 else 0.0


def p_value(ci: dict) -> float:
    """Two-sided p-value of 'no difference' from a bootstrap: the normal approximation to the draws,
    2 (1 - Phi(|delta| / se)), se their sd. Not the percentile p-value: 2000 draws cannot resolve p below
    1/2000, while Holm over a report's ~130 directions needs p < 0.05/130 for its first rejection. A zero se:
    1 for a zero difference, 0 otherwise (every draw the same, non-zero)."""
    delta, se = float(ci["delta"]), float(ci.get("se") or 0.0)
    if se <= 0 or not math.isfinite(se):
        return 1.0 if delta == 0 else 0.0
    return float(math.erfc(abs(delta) / se / math.sqrt(2)))


def _resample_groups(groups, rng, n_boot: int):
    """(point estimate, ``n_boot`` independent item resamples of it, items): the statistic is the mean over
    groups of (mean b - mean a), each group's items drawn with replacement on their own."""
    deltas, boots, n = [], np.zeros(n_boot), 0
    for a, b in groups:
        d = np.asarray(b, float) - np.asarray(a, float)
        if d.ndim != 1 or d.size == 0 or np.asarray(a).shape != np.asarray(b).shape:
            raise ValueError(f"paired bootstrap: need two equal-length non-empty item lists, got {np.shape(a)} "
                             f"and {np.shape(b)}")
        deltas.append(d.mean())
        boots += d[rng.integers(0, d.size, size=(n_boot, d.size))].mean(axis=1)
        n += d.size
    return float(np.mean(deltas)), boots / len(groups), n


# Every verdict is one of these (a verdict string such as "missing (the full model scores 0 ...)" or
# "agree (point estimate)" folds into its category): agree / disagree only where the interval excludes 0.
CATEGORIES = ("agree", "disagree", "inconclusive", "point estimate: agree", "point estimate: disagree", "missing")


def category(verdict) -> str:
    """The category of a verdict string (CATEGORIES); a missing value is 'missing'."""
    v = "" if verdict is None or (isinstance(verdict, float) and np.isnan(verdict)) else str(verdict).strip()
    word = v.split(" ")[0] if v else "missing"
    if "(point estimate)" in v and word in ("agree", "disagree"):
        return f"point estimate: {word}"
    if word in ("agree", "disagree", "inconclusive", "missing"):
        return word
    raise ValueError(f"direction verdict {verdict!r}: expected one of {', '.join(CATEGORIES)}")


def count(categories) -> dict:
    """{category: how many} over CATEGORIES (zeros included) and 'total'."""
    cats = list(categories)
    return {c: sum(x == c for x in cats) for c in CATEGORIES} | {"total": len(cats)}


def seeded_bootstrap(per_seed, n_boot: int = N_BOOT, seed: int = 0, level: float = LEVEL) -> dict:
    """``grouped_bootstrap`` folded over seeds (stem.seeds): ``per_seed`` = one list of (a, b) groups per seed
    (the dense and the variant model of the same seed index). A two-level bootstrap: each draw picks as many
    seeds as there are, with replacement, and every pick (a seed picked twice included) gets its own resample
    of every group's items; the statistic is the mean over the picks. One seed: the plain
    ``grouped_bootstrap``."""
    if len(per_seed) == 1:
        return grouped_bootstrap(per_seed[0], n_boot, seed, level)
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(per_seed), size=(n_boot, len(per_seed)))
    stats, point, n = np.empty(pick.shape), [], 0
    for s, groups in enumerate(per_seed):
        where = pick == s
        delta, stats[where], n_s = _resample_groups(groups, rng, int(where.sum()))
        point.append(delta)
        n += n_s
    boots = stats.mean(axis=1)
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return {"delta": float(np.mean(point)), "lo": float(lo), "hi": float(hi), "n": n, "level": level,
            "seeds": len(per_seed), "se": _se(boots)}


def classify(ci: dict, paper_sign: float) -> str:
    """agree / disagree when the interval excludes zero, inconclusive when it does not (or the paper ties)."""
    observed = 1 if ci["lo"] > 0 else -1 if ci["hi"] < 0 else 0
    expected = int(np.sign(paper_sign))
    if observed == 0 or expected == 0:
        return "inconclusive"
    return "agree" if observed == expected else "disagree"


# ---- applied to the experiment's results -------------------------------------------------------------------
def item_scores(raw_json, task: str, metric: str) -> dict[int, float]:
    """{doc_id: per-item score} of one task from lm-eval's raw output (``metric`` as 'acc_norm,none')."""
    name, _, filt = metric.partition(",")
    raw = json.loads(Path(raw_json).read_text())
    samples = (raw.get("samples") or {}).get(task)
    if samples is None:
        raise ValueError(f"{raw_json}: no per-item samples for task {task!r}")
    out = {int(s["doc_id"]): float(s[name]) for s in samples if s.get("filter", "none") == (filt or "none")}
    if not out:
        raise ValueError(f"{raw_json}: task {task!r} has no items with metric {metric!r}")
    return out


def paired(a: dict, b: dict):
    keys = sorted(set(a) & set(b))
    return [a[k] for k in keys], [b[k] for k in keys]


def _task_items(results, exp, scale, variant, stage, suite, task, subtasks=None):
    """Per-item scores of a task (a group's subtasks pooled by item), or None if the results are missing."""
    d = Path(results) / exp / scale / variant / stage / "eval"
    res, raw = d / f"{suite}.json", d / "raw" / f"{suite}.json"
    if not (res.is_file() and raw.is_file()):
        return None
    info = json.loads(res.read_text())["tasks"].get(task)
    if info is None:
        return None
    out = {}
    for sub in subtasks or [task]:
        out.update({(sub, k): v for k, v in item_scores(raw, sub, info["metric"]).items()})
    return out


def table_directions(exp: Experiment, root=".", results=None) -> list[dict]:
    """Each Table 3/4 accuracy direction (variant vs the baseline, per task and the commonsense average) with its
    paired-bootstrap interval over items and a verdict against the paper's sign. ``results``: the results
    folder (default ``{root}/results``)."""
    results = Path(results) if results is not None else Path(root) / "results"
    name = exp.experiment
    stages = (exp.report or {}).get("stages") or {}   # the untyped sections, as written
    groups = ((exp.eval or {}).get("fixtures") or {}).get("groups") or {}
    suite_of = {t: "commonsense" for t in P.COMMONSENSE_TASKS} | {"mmlu": "mmlu", "gsm8k": "gsm8k"}
    rows, base = [], C.baseline_variant(exp)
    for table in ("table3", "table4"):
        paper = P.load_table(table).set_index(["scale", "variant", "column"])["value"]
        for (scale, variant, column), pv in paper.items():
            if variant == base or (scale, base, column) not in paper.index:
                continue
            if column not in suite_of and column != "avg":
                continue
            p_delta = float(pv - paper[(scale, base, column)])
            stage = next((st for st in stages.get(table, []) if (results / name / scale / variant / st
                                                                  / "eval").is_dir()), None)
            ci, per_seed = None, []
            if stage is not None:
                tasks = P.COMMONSENSE_TASKS if column == "avg" else [column]
                # every seed both models ran (stem.seeds; seed k of the baseline paired with seed k of the variant)
                both = set(seeds.seeds_of(exp, scale, base)) & set(seeds.seeds_of(exp, scale, variant))
                for k in sorted(both):
                    pairs = []
                    for t in tasks:
                        a = _task_items(results, name, scale, seeds.JobId(scale, base, stage, k).slot, stage, suite_of[t], t,
                                        groups.get(t))
                        b = _task_items(results, name, scale, seeds.JobId(scale, variant, stage, k).slot, stage, suite_of[t], t,
                                        groups.get(t))
                        if a is None or b is None:
                            pairs = []
                            break
                        pairs.append(paired(a, b))
                    if pairs:
                        per_seed.append([(np.asarray(x) * 100, np.asarray(y) * 100) for x, y in pairs])
                if per_seed:
                    ci = seeded_bootstrap(per_seed)
            rows.append({"table": table, "scale": scale, "variant": variant, "column": column, "stage": stage,
                         "paper_delta": p_delta, **ci_cols(ci, p_delta), "seeds": len(per_seed),
                         "source": f"{table.capitalize()}, {scale}, {variant} vs {base}, column {column}"})
    return rows


def ci_cols(ci, sign) -> dict:
    if ci is None:
        return {"ours_delta": None, "lo": None, "hi": None, "n": 0, "p": None, "verdict": "missing"}
    return {"ours_delta": ci["delta"], "lo": ci["lo"], "hi": ci["hi"], "n": ci["n"], "p": p_value(ci),
            "verdict": classify(ci, sign)}


# ---- multiple comparisons: the verdicts of one report are one family ------------------------------------
def adjust(p, procedure: str) -> np.ndarray:
    """Adjusted p-values of ``p`` (one family): 'holm' (Holm 1979, step-down; controls the family-wise error),
    'bh' (Benjamini-Hochberg 1995, step-up; controls the false discovery rate), 'none' (``p`` itself). A
    hypothesis is rejected at level alpha when its adjusted p-value is <= alpha."""
    p = np.asarray(p, float)
    if procedure == "none" or p.size == 0:
        return p.copy()
    m, order = p.size, np.argsort(p, kind="stable")
    ranked = p[order]
    if procedure == "holm":
        adj = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * ranked))
    elif procedure == "bh":
        adj = np.minimum.accumulate(np.minimum(1.0, m / np.arange(1, m + 1) * ranked)[::-1])[::-1]
    else:
        raise ValueError(f"multiple-comparison procedure {procedure!r}: expected holm, bh or none")
    out = np.empty(m)
    out[order] = adj
    return out


PROCEDURE_NAMES = {"holm": "Holm, family-wise error", "bh": "Benjamini-Hochberg, false discovery rate",
                   "none": "none: each cell's own interval"}


def control(rows: list[dict], procedure: str = "holm", alpha: float = 1 - LEVEL) -> list[dict]:
    """The controlled verdicts of one report's directions (``rows`` as ``ci_cols`` made them): every row with a
    p-value is one hypothesis of the family; its verdict stays agree / disagree only where the raw interval
    resolves it and its adjusted p-value (``adjust``) is <= ``alpha``, else it becomes inconclusive. Each row
    keeps its raw verdict (``raw_verdict``: the per-cell interval's) and gets ``p_adjusted``; rows without a
    p-value (point estimates, missing) keep theirs."""
    tested = [i for i, r in enumerate(rows) if r.get("p") is not None and not _nan(r["p"])]
    adj = adjust([rows[i]["p"] for i in tested], procedure)
    out = [{**r, "raw_verdict": r.get("verdict"), "p_adjusted": None} for r in rows]
    for i, a in zip(tested, adj):
        r = out[i]
        r["p_adjusted"] = float(a)
        if category(r["raw_verdict"]) in ("agree", "disagree") and a > alpha:
            r["verdict"] = "inconclusive"
    return out


def _nan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


# The paper's loss claim: STEM variants train to a lower loss than the dense baseline (Sec. 4.4, Fig. 5a/5b);
# a lower loss is the "better" direction, so the expected sign of (variant - dense) is negative.
LOSS_SOURCE = "Sec. 4.4 / Fig. 5a-5b: STEM variants reach a lower training loss than the dense baseline"


def dse_loss_claim() -> tuple[float, str]:
    """The DSE paper's loss direction: (DSE-27B - Dense-4B validation loss, its source), from
    reference/dse_paper/table1.csv."""
    t = P.load_table("dse_paper/table1").set_index(["variant", "column"])["value"]
    delta = float(t[("dse_27b", "val_loss")] - t[("dense_4b", "val_loss")])
    return delta, (f"DSE paper Table 1, 'Validation Set (loss)': DSE-27B {t[('dse_27b', 'val_loss')]:g} vs "
                   f"Dense-4B {t[('dense_4b', 'val_loss')]:g} (MoE-27B {t[('moe_27b', 'val_loss')]:g}); "
                   "here vs the iso-active dense model")


def loss_claim(exp: Experiment, variant: str) -> tuple[float, str] | None:
    """(sign, source) of the paper's loss claim ``variant`` is read against: the DSE paper's for a variant with a
    DSE memory, the STEM paper's for one whose FFN kind has a token-indexed table (its registered facts,
    stem.models.registry); None for the others (no claim)."""
    spec = C.variant_spec(exp, variant)
    if spec.dse:
        return dse_loss_claim()
    return (-1.0, LOSS_SOURCE) if ffn_facts(spec.ffn).table else None


LOSS_TABLE = "heldout_loss"   # the held-out loss directions' table name (no paper table of its own)


def loss_directions(exp: Experiment, analyses: dict) -> list[dict]:
    """``analyses``: {(scale, variant, stage): heldout JSON}; each variant with a claim (``loss_claim``) vs the
    experiment's baseline (stem.config.baseline_variant) of its scale/stage."""
    rows, baseline = [], C.baseline_variant(exp)
    for (scale, variant, stage), r in sorted(analyses.items()):
        base = analyses.get((scale, baseline, stage))
        claim = None if variant == baseline or base is None else loss_claim(exp, variant)
        if claim is None:
            continue
        sign, source = claim
        ci = paired_bootstrap(base["window_loss"], r["window_loss"])
        rows.append({"table": LOSS_TABLE, "scale": scale, "variant": variant, "column": "val_loss",
                     "stage": stage, "paper_delta": sign, **ci_cols(ci, sign), "source": source})
    return rows
