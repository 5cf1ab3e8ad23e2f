"""The report of the experiment ``real`` (config/real.yaml, docs/real.md): SmolLM2-135M-Instruct (4-bit Q4_1 weights
dequantised) imported, STEM inserted into it, continued on the Paul Graham essays. Report-only tables (no paper CSV,
not compared), empty for an experiment that has no such results; the figure is drawn for ``real`` only.

- table ``real_import``: the import stage's parity against transformers' forward (the train job's summary,
  ``import_parity``) and the imported model's held-out loss;
- table ``real_step0``: the held-out loss at step 0 of each placement x init (analysis ``insertion_step0``), its
  difference from the dense model with a 95 % paired bootstrap interval over the windows;
- table ``real_heldout``: per continued model, the held-out loss before and after, the tokens trained, the held-out
  perplexity (suite kind ``ppl``, ``split: val``);
- table ``real_niah``: needle-in-a-haystack on the essays per model, length and depth (suite kind ``niah``);
- table ``real_editing``: knowledge editing over the prompt set (analysis ``editing``, reference/real/facts.yaml) per
  model, site (the STEM tables or the token embedding) and scheme: how often the completion moved to the other
  country's capital, the two answers' first-token probabilities before and after, the unedited completions;
- table ``real_hf_parity``: the export-hf folder under lm-eval's stock ``hf`` model vs the ``stem`` model (analysis
  ``hf_parity``);
- figure ``real_loss_curves``: held-out and training loss vs tokens of the continued models.
"""
from __future__ import annotations

from stem import config as C
from stem import layout as L
from stem.analysis.workflow import targets
from stem.config.experiment import Experiment
from stem.report import figures as F
from stem.report import registry
from stem.report import tables as T
from stem.report.analyses import load_all
from stem.report.results import niah_cells
from stem.report.verdict import paired_bootstrap

IMPORT_STAGE, CONTINUED_STAGE = "pretrain", "midtrain"   # config/real.yaml's stages
WHAT = ("`real`: SmolLM2-135M-Instruct (4-bit Q4_1 weights dequantised to fp32) on the Paul Graham essays; "
        "not the paper's models or scale")


def _stage_targets(exp: Experiment, stage: str) -> list[tuple[str, str]]:
    return [(s, v) for s, v, st in C.train_targets(exp) if st == stage]


def import_long(exp: Experiment, res):
    cells = []
    for scale, variant in _stage_targets(exp, IMPORT_STAGE):
        s = res.summary(scale, variant, IMPORT_STAGE)
        if not s or not s.get("import_parity"):
            continue
        p, src = s["import_parity"], str(res.stage_dir(scale, variant, IMPORT_STAGE) / "summary.json")
        row = f"{variant} {IMPORT_STAGE}: {p['source']}"
        cells += [T.cell("real_import", scale, variant, c, p[c], src, row=row, unit="")
                  for c in ("tokens", "max_abs_logit_diff", "max_abs_logit", "argmax_agreement")]
        cells += [T.cell("real_import", scale, variant, "parameters", s.get("total_params"), src, row=row, unit=""),
                  T.cell("real_import", scale, variant, "heldout_loss", s.get("final_val_loss"), src, row=row,
                         unit="nats/token")]
    return T.frame(cells)


def step0_long(exp: Experiment, res):
    cells = []
    for (scale, variant, stage), r in sorted(load_all(exp, results=res.root).get("insertion_step0", {}).items()):
        path = L.analysis_json(exp.experiment, scale, variant, stage, "insertion_step0")
        dense = r["rows"][0]["window_loss"]
        for row in r["rows"]:
            name = "dense (no insertion)" if row["init"] is None else f"{row['placement']} x {row['init']}"
            if row.get("choice"):   # init calibrated's other choices (calibration.compare)
                c = row["choice"]
                name += f" ({c['unseen']}{', sequential' if c['sequential'] else ''})"
            ci = paired_bootstrap(dense, row["window_loss"])   # over the windows: coarse with a few of them
            vals = {"stem_layers": len(row["stem_layers"]), "layers": " ".join(map(str, row["stem_layers"])) or "-",
                    "heldout_loss": row["mean_loss"], "vs_dense": row["delta_vs_dense"],
                    "vs_dense_lo": ci["lo"], "vs_dense_hi": ci["hi"], "windows": len(row["window_loss"]),
                    "window_min": min(row["window_loss"]), "window_max": max(row["window_loss"])}
            cells += [T.cell("real_step0", scale, variant, c, x, path, row=name, unit="") for c, x in vals.items()]
    return T.frame(cells)


def heldout_long(exp: Experiment, res):
    cells = []
    for scale, variant in _stage_targets(exp, CONTINUED_STAGE):
        s = res.summary(scale, variant, CONTINUED_STAGE)
        m = res.metrics(scale, variant, CONTINUED_STAGE)
        src = str(res.stage_dir(scale, variant, CONTINUED_STAGE) / "summary.json")
        first = m.dropna(subset=["val_loss"]) if m is not None and "val_loss" in m else None
        vals = {"tokens": s.get("tokens") if s else None,
                "first_heldout_loss": float(first["val_loss"].iloc[0]) if first is not None and len(first) else None,
                "first_eval_tokens": int(first["tokens"].iloc[0]) if first is not None and len(first) else None,
                "final_heldout_loss": s.get("final_val_loss") if s else None}
        ev, _ = res.first_eval(scale, variant, [CONTINUED_STAGE], "ppl")
        ppl = ((ev or {}).get("tasks") or {}).get("ppl") or {}
        vals.update(ppl_documents=ppl.get("n"), token_perplexity=ppl.get("value"),
                    bits_per_byte=(ppl.get("all_metrics") or {}).get("bits_per_byte"))
        cells += [T.cell("real_heldout", scale, variant, c, x, src, row=f"{variant} {CONTINUED_STAGE}", unit="")
                  for c, x in vals.items()]
    return T.frame(cells)


def niah_long(exp: Experiment, res):
    cells = []
    for scale, variant in _stage_targets(exp, CONTINUED_STAGE):
        ev, _ = res.first_eval(scale, variant, [CONTINUED_STAGE], "niah")
        df = niah_cells(ev)
        src = str(res.stage_dir(scale, variant, CONTINUED_STAGE) / "eval" / "niah.json")
        for (length, depth), acc in df.groupby(["length", "depth"])["accuracy"].mean().items():
            cells.append(T.cell("real_niah", scale, variant, f"depth {depth:g}", acc, src,
                                row=f"{variant} {CONTINUED_STAGE}: {length} tokens", unit="%"))
        if len(df):   # every cell: the accuracy and how many cells it is over
            cells += [T.cell("real_niah", scale, variant, c, x, src, row=f"{variant} {CONTINUED_STAGE}: all cells",
                             unit=u) for c, x, u in (("accuracy", df["accuracy"].mean(), "%"), ("cells", len(df), ""))]
    return T.frame(cells)


def _analysis_cells(exp: Experiment, res, table: str, name: str, rows) -> list:
    """Cells of ``table`` from every ``name`` analysis JSON: ``rows(result) -> [(row, {column: value})]``."""
    cells = []
    for (scale, variant, stage), r in sorted(load_all(exp, results=res.root).get(name, {}).items()):
        path = L.analysis_json(exp.experiment, scale, variant, stage, name)
        cells += [T.cell(table, scale, variant, c, x, path, row=f"{variant} {stage}{row}", unit="")
                  for row, vals in rows(r) for c, x in vals.items()]
    return cells


def editing_long(exp: Experiment, res):
    def rows(r):
        completed = {rel: k["completed"] for rel, k in r["known"].items()}
        return [(f": {s['site']} {s['scheme']}", {
            "edits": s["n"], "moved": s["moves"], "moved_before": s["moves_before"],
            "p_target_before": s["p_target_before"], "p_target": s["p_target"],
            "p_source_before": s["p_source_before"], "p_source": s["p_source"],
            "unedited_completed": min(completed.values()),
            "restored_bitwise": r["restored_bit_identical"] and r["restored_logits_bit_identical"]})
            for s in r["summary"] if s["case"] == "all"]
    return T.frame(_analysis_cells(exp, res, "real_editing", "editing", rows))


def hf_parity_long(exp: Experiment, res):
    return T.frame(_analysis_cells(exp, res, "real_hf_parity", "hf_parity", lambda r: [("", {
        "documents": r["documents"], "stem_acc": r["stem"]["acc"], "hf_acc": r["hf"]["acc"],
        "stem_perplexity": r["stem"]["perplexity"], "hf_perplexity": r["hf"]["perplexity"],
        "max_abs_loglik_diff": r["max_abs_loglik_diff"], "tolerance": r["tolerance"]})]))


def loss_curves(exp, res, ours=None, files=None):
    """Held-out loss (left) and training loss (right) vs tokens of every continued model; the imported model's
    held-out loss on the same windows at 0 tokens."""
    fig, (ax, bx) = F.pyplot().subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    drawn = 0
    for scale, variant in _stage_targets(exp, CONTINUED_STAGE):
        m = res.metrics(scale, variant, CONTINUED_STAGE)
        if m is None:
            continue
        v = m.dropna(subset=["val_loss"]) if "val_loss" in m else m.iloc[:0]
        base = C.baseline_variant(exp)
        start = res.summary(scale, base, IMPORT_STAGE) if variant == base else None
        xs, ys = list(v["tokens"]), list(v["val_loss"])
        if start and start.get("final_val_loss") is not None:
            xs, ys = [0, *xs], [start["final_val_loss"], *ys]
        ax.plot(xs, ys, "o-", color=F.color(exp, variant), label=F.legend_label(exp, variant), ms=3)
        bx.plot(m["tokens"], m["loss"], color=F.color(exp, variant), label=F.legend_label(exp, variant), lw=1)
        drawn += 1
    for a, what in ((ax, "held-out loss (nats/token)"), (bx, "training loss (nats/token)")):
        if drawn:
            a.set_xlabel("tokens of continued training")
            a.set_ylabel(what)
            a.grid(alpha=0.3)
            a.legend(fontsize=9)
        else:
            F.mark_missing(a, f"no {CONTINUED_STAGE} metrics yet")
    F.set_title(fig, "Continued training on the essays' train split (held-out: the essays' held-out split)", exp)
    return fig


# ---- registered at import, like the built-in tables (stem.plugins loads this module)
GAP = dict(empty="_(no rows: no results of the experiment `real` (config/real.yaml) here)_")
registry.paper_table("real_import", "Import of the packaged SmolLM2 GGUF: max |logit difference| against "
                     f"transformers' forward on held-out essay tokens, and its held-out loss ({WHAT})",
                     **GAP)(import_long)
registry.paper_table("real_step0", "Held-out loss at step 0 of STEM inserted into the imported model, placement "
                     f"x table init, against the dense model on the same windows ({WHAT})",
                     inputs=lambda exp: [p for p in targets(exp) if p.endswith("/analysis/insertion_step0.json")],
                     **GAP)(step0_long)
registry.paper_table("real_heldout", "Continued training: held-out loss at the first evaluation and at the end, "
                     f"and held-out perplexity of the continued models ({WHAT})", **GAP)(heldout_long)
registry.paper_table("real_niah", "Needle in a haystack on the essays (the original test's needle and question): "
                     f"accuracy per context length and needle depth ({WHAT})", **GAP)(niah_long)
registry.paper_table("real_editing", "Knowledge editing over the prompt set (Fig. 7 on real weights): a country's "
                     "rows replaced by the next country's at every STEM layer (or in the token embedding): share "
                     "of prompts whose next token became the other capital's first token, the two capitals' "
                     f"first-token probabilities, undo bit for bit ({WHAT})",
                     inputs=lambda exp: [p for p in targets(exp) if p.endswith("/analysis/editing.json")],
                     **GAP)(editing_long)
registry.paper_table("real_hf_parity", "The export-hf folder under lm-eval's stock `hf` model vs the `stem` model "
                     f"on the prompt set as a loglikelihood task ({WHAT})",
                     inputs=lambda exp: [p for p in targets(exp) if p.endswith("/analysis/hf_parity.json")],
                     **GAP)(hf_parity_long)
registry.report_figure("real_loss_curves", "Held-out and training loss of the continued models vs tokens "
                       f"({WHAT}); the dense curve starts at the imported model's held-out loss.",
                       experiments=("real",))(loss_curves)

