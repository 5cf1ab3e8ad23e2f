"""Aggregate stage: tables from results, the paper diff, figures and the README.

Results are synthetic (``write_results`` below writes summaries, metrics and eval JSONs in the agreed
format for the tiny experiment), so these tests do not need a trained model and run in seconds.
"""
import json
import math
import shutil

import numpy as np
import pandas as pd
import pytest

from stem import config as C
from stem.config import experiment
from stem import seeds
from stem.eval import spec as ES
from stem.report import build as B
from stem.report import diff
from stem.report import figures as F
from stem.report import paper_data as P
from stem.report import registry
from stem.report import tables as T
from stem.report.results import Results, by_length, parse_range, task_score

MISSING = ("350m", "stem_gate")  # no commonsense eval for this model in the fixture: a gap, not a zero


# ---- fixtures ------------------------------------------------------------------------------------
def paper_scores(table, scale, variant, offset=0.0):
    df = P.load_table(table)
    df = df[(df["scale"] == scale) & (df["variant"] == variant)]
    return {c: v + offset for c, v in zip(df["column"], df["value"])}


def eval_json(cfg, scale, variant, stage, suite, offset):
    base = {"experiment": cfg.experiment, "scale": scale, "variant": variant, "stage": stage, "suite": suite,
            "checkpoint": "x", "limit": None, "tasks": {}, "groups": {}}
    entry = lambda v: {"metric": "acc,none", "value": v, "stderr": 1.0, "n": 40}  # noqa: E731
    named = seeds.JobId.parse("", variant, "").variant   # a seed job (stem.seeds) scores like its variant
    paper_row = {"dse": "dense", "stem_sparse": "stem", "stem_insert": "stem"}.get(named, named)   # not paper variants
    p3 = paper_scores("table3", "1b" if scale == "1b" else "350m", paper_row, offset)
    p5 = paper_scores("table5", "1b", "stem" if named != "dense" else "dense", offset)
    p6 = paper_scores("table6", "1b", "stem" if named != "dense" else "dense", offset)
    if suite == "commonsense":
        base["tasks"] = {t: entry(p3[t]) for t in P.COMMONSENSE_TASKS}
    elif suite in ("mmlu", "bbh"):
        base["groups"] = {suite: entry(p5.get(suite, 30.0))}
        base["tasks"] = {f"{suite}_sub": entry(1.0)}
    elif suite == "musr":
        base["groups"] = {"leaderboard_musr": entry(p5["musr"])}
    elif suite == "gsm8k":
        base["tasks"] = {"gsm8k": entry(40.0 + offset)}
    elif suite == "longbench":
        t5 = P.TASKS["table5"]
        base["by_length"] = {
            "field": "length", "metric": "score",
            "table5": [{"range": r, "groups": {"longbench_multi": p5[m], "longbench_code": p5[c]}}
                       for r, m, c in zip(["0-200", "200-400", "400+"], t5[2:5], t5[5:8])],
            "table6": [{"range": f"{i}", "groups": {"longbench": p6[c], "all": 0.0}}
                       for i, c in enumerate(P.TASKS["table6"])]}
    elif suite == "niah":
        acc = 60.0 + offset
        base["cells"] = [{"length": L, "depth": d, "accuracy": max(0.0, acc - L / 64 + d / 10), "n": 4}
                         for L in (256, 512, 1024) for d in (0, 50, 100)]
    if suite != "mmlu":   # the eval JSON's truncation counts (stem.eval.run); mmlu's as written before they existed
        cut = {"bbh_sub": {"requests": 40, "truncated": 3, "tokens_dropped": 120}} if suite == "bbh" else {}
        base["truncation"] = {"policy": "left", "context": 1024, "tasks": {
            **{t: {"requests": 40, "truncated": 0, "tokens_dropped": 0} for t in base["tasks"]}, **cut}}
    return base


def summary_json(cfg, scale, variant, stage, loss):
    """The keys of stem.train.loop's summary.json that the report reads or checks."""
    return {"experiment": cfg.experiment, "scale": scale, "variant": variant, "stage": stage,
            "final_val_loss": float(loss[-1]), "final_train_loss": float(np.mean(loss[-10:])),
            "steps": len(loss), "tokens": 2048 * len(loss)}


def write_results(root, cfg, skip=(MISSING,)):
    rng = np.random.default_rng(0)
    stage_suites = {"pretrain": ["commonsense"], "midtrain": ["commonsense", "mmlu", "gsm8k"],
                    "extend": ["niah", "bbh", "musr", "longbench"]}
    for scale, variant, stage in C.train_targets(cfg) + C.seed_targets(cfg):
        d = root / cfg.experiment / scale / variant / stage
        (d / "eval").mkdir(parents=True)
        steps = np.arange(1, 201)
        loss = 7 * np.exp(-steps / 40) + 3 + 0.02 * rng.standard_normal(len(steps))
        if variant == "hashmoe":
            loss[[120, 160]] += 1.0  # two spikes
        with open(d / "metrics.jsonl", "w") as f:
            for s, l in zip(steps, loss):
                row = {"step": int(s), "tokens": int(s) * 2048, "loss": float(l), "train_flops": float(s) * 1e10}
                if s % 50 == 0:
                    row.update(val_loss=float(l), val_ppl=float(np.exp(l)))
                f.write(json.dumps(row) + "\n")
        (d / "summary.json").write_text(json.dumps(summary_json(cfg, scale, variant, stage, loss)))
        (d / "checkpoint").mkdir()  # what stem.checkpoint writes besides the weights: job spec, accounting
        (d / "checkpoint" / "config.json").write_text(json.dumps(
            {"experiment": cfg.experiment, "scale": scale, "variant": variant, "stage": stage}))
        (d / "checkpoint" / "accounting.json").write_text(json.dumps(T.accounting(cfg, scale, variant)))
        named = seeds.JobId.parse(scale, variant, stage).variant   # a seed job scores like its variant
        long_context = [s for s in ("longppl", "ruler") if s in ES.suites_for(cfg, stage, named)]
        for suite in stage_suites[stage] + long_context:   # the DSE paper's Table 2: dense and DSE only
            if (scale, variant) in skip and suite == "commonsense":
                continue
            offset = {"dense": 0.0}.get(named, 1.0)
            (d / "eval" / f"{suite}.json").write_text(json.dumps(eval_json(cfg, scale, variant, stage, suite, offset)))


@pytest.fixture(scope="module")
def tiny_cfg():
    return experiment.load(C.REPO / "config" / "tiny.yaml")


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory, tiny_cfg):
    root = tmp_path_factory.mktemp("results")
    write_results(root, tiny_cfg)
    return Results("tiny", root)


@pytest.fixture(scope="module")
def tiny_tables(tiny_cfg, tiny_results):
    return T.build_all(tiny_cfg, tiny_results)


def paper_as_ours():
    return {t: P.load_table(t) for t in registry.compared()}


def value(df, scale, variant, column):
    hit = df[(df["scale"] == scale) & (df["variant"] == variant) & (df["column"] == column)]["value"]
    assert len(hit) == 1, (scale, variant, column)
    return hit.iloc[0]


# ---- golden: the paper's own numbers through the aggregation ---------------------------------------
@pytest.mark.parametrize("table", ["table3", "table4"])
def test_golden_paper_numbers_reproduce_avg_and_roi(table):
    df = P.load_table(table)
    rows = []
    for (scale, variant), g in df.groupby(["scale", "variant"], sort=False):
        v = dict(zip(g["column"], g["value"]))
        acct = {"paper_total_params": v.get("total_params_b", 0) * 1e9, "total_params": 0,
                "active_params": v.get("active_params_b", 0) * 1e9, "gflops_per_token": v.get("gflops_per_token")}
        rows.append((scale, variant, v, acct if table == "table3" else None, "paper"))
    ours = T.accuracy_table(table, rows)
    for (scale, variant), g in df.groupby(["scale", "variant"]):
        printed = dict(zip(g["column"], g["value"]))
        assert value(ours, scale, variant, "avg") == pytest.approx(printed["avg"], abs=0.005)
        if table == "table3":
            assert round(value(ours, scale, variant, "roi"), 2) == pytest.approx(printed["roi"], abs=1e-9)


def test_average_and_roi_leave_gaps_not_zeros():
    scores = dict.fromkeys(P.COMMONSENSE_TASKS, 50.0)
    assert T.average(scores) == 50.0
    del scores["boolq"]
    assert math.isnan(T.average(scores))
    assert math.isnan(T.roi(math.nan, 0.7, 49.72, 0.74))
    assert T.roi(50.90, 0.70, 49.72, 0.74) == pytest.approx(1.0822, abs=1e-4)


# ---- tables from results -------------------------------------------------------------------------
def test_tables_from_results(tiny_tables):
    t3 = tiny_tables["table3"]
    assert value(t3, "350m", "dense", "arc_easy") == pytest.approx(57.66)
    assert value(t3, "350m", "stem", "avg") == pytest.approx(50.90 + 1.0, abs=0.006)
    assert value(t3, "350m", "dense", "roi") == pytest.approx(1.0)
    assert math.isnan(value(t3, *MISSING, "arc_easy"))  # missing eval: a gap ...
    assert math.isnan(value(t3, *MISSING, "roi"))
    assert value(t3, *MISSING, "active_params_b") > 0  # ... while the accounting is still there
    assert T.wide(t3).set_index("Model").loc["STEM (gate-proj)", "ARC-E"] == "—"
    t4, t5, t6 = tiny_tables["table4"], tiny_tables["table5"], tiny_tables["table6"]
    assert value(t4, "1b", "stem", "gsm8k") == 41.0 and value(t4, "1b", "dense", "mmlu") == 30.0
    assert value(t5, "1b", "stem", "musr") == pytest.approx(37.38)
    assert value(t5, "1b", "dense", "lb_code_4_8k") == pytest.approx(44.64)
    assert value(t6, "1b", "stem", "lb_12k_plus") == pytest.approx(25.2)
    fig1b = tiny_tables["figure1b"]
    assert value(fig1b, "1b", "stem", "niah_gap_shortest") == pytest.approx(1.0)
    assert set(T.table1(None)["variant"]) >= {"qwen2.5-3b"}


def test_table_writers_show_gaps(tiny_tables):
    w = T.wide(tiny_tables["table3"])
    md, tex = T.to_markdown(w), T.to_latex(w, "Table 3")
    assert "STEM (gate-proj) | " in md and "—" in md
    assert r"\begin{tabular}" in tex and "--" in tex and r"$^\dagger$" in tex
    assert " 0.00 " not in md.split("STEM (gate-proj)")[1].split("\n")[0]


def test_table2_from_config(tiny_cfg):
    t2 = T.table2(experiment.load(C.REPO / "config" / "paper.yaml"))
    assert value(t2, "350m", "pretrain", "peak_lr") == 2e-3
    assert value(t2, "1b", "context_extend", "cross_doc_masking") == "Yes"
    cells = diff.compare({"table2": t2}, T.settings(tiny_cfg).tolerance)
    t2c = cells[cells["table"] == "table2"].set_index(["scale", "variant", "column"])
    assert t2c.loc[("350m", "pretrain", "peak_lr"), "status"] == "ok"
    assert t2c.loc[("1b", "context_extend", "train_steps"), "status"] == "ok"


@pytest.mark.parametrize("text,expected", [
    ("<4k", (0, 4)), ("4–8k", (4, 8)), ("≥8k", (8, math.inf)), ("12k+", (12, math.inf)), ("lb_multi_lt4k", (0, 4)),
    ("lb_10_12k", (10, 12)), ("0-2000", (0, 2)), ("ge8k", (8, math.inf)), ("whatever", None)])
def test_parse_range(text, expected):
    assert parse_range(text) == expected


def test_readers_are_defensive():
    ev = {"suite": "gsm8k", "tasks": {"gsm8k_cot": {"value": 12.5}}, "groups": {},
          "by_length": {"multi": {"<4k": {"value": 3.0}, "4-8k": 4}, "code": {"≥8k": 5}}}
    assert task_score(ev, "gsm8k") == 12.5
    assert task_score({"tasks": {"x": {"value": None}}}, "x") is None
    assert task_score(None, "x") is None
    assert by_length(ev) == {("multi", 0, 4): 3.0, ("multi", 4, 8): 4.0, ("code", 8, math.inf): 5.0}


# ---- the diff ------------------------------------------------------------------------------------
def test_diff_flags_changed_and_missing_cells(tiny_cfg):
    ours = paper_as_ours()
    t3 = ours["table3"]
    t3.loc[(t3["scale"] == "350m") & (t3["variant"] == "stem") & (t3["column"] == "arc_easy"), "value"] += 5.0
    ours["table3"] = t3[~((t3["scale"] == "1b") & (t3["variant"] == "stem") & (t3["column"] == "boolq"))]
    cells = diff.compare(ours, T.settings(tiny_cfg).tolerance).set_index(["table", "scale", "variant", "column"])
    changed = cells.loc[("table3", "350m", "stem", "arc_easy")]
    assert changed["status"] == "drift" and changed["delta"] == pytest.approx(5.0)
    assert cells.loc[("table3", "1b", "stem", "boolq"), "status"] == "missing"
    others = cells.drop([("table3", "350m", "stem", "arc_easy"), ("table3", "1b", "stem", "boolq")])
    assert (others.loc[["table3", "table4", "table5", "table6", "figure1b"], "status"] == "ok").all()
    s = diff.summary("paper", cells.reset_index(), diff.directions(ours, "dense"), diff.paper_consistency())
    assert s["largest_gaps"][0]["cell"] == "table3/350m/stem/arc_easy" and s["missing"] == 1
    failures = diff.gate(cells.reset_index(), ["table3/*/stem/arc_*", "table3/1b/stem/boolq"])
    assert {f"{r.variant}/{r.column}" for r in failures.itertuples()} == {"stem/arc_easy", "stem/boolq"}
    assert diff.gate(cells.reset_index(), ["table4/*/*/*"]).empty


def test_directions():
    ours = paper_as_ours()
    t3 = ours["table3"]
    t3.loc[(t3["scale"] == "350m") & (t3["variant"] == "stem") & (t3["column"] == "avg"), "value"] = 40.0
    dirs = diff.point_directions(ours, "dense").set_index(["table", "scale", "variant", "column"])
    assert not dirs.loc[("table3", "350m", "stem", "avg"), "agree"]
    assert dirs.loc[("table3", "350m", "stem_gate", "avg"), "agree"]  # the paper: gate-proj trails baseline
    assert dirs.drop(("table3", "350m", "stem", "avg"))["agree"].all()


def test_paper_consistency_surfaces_known_disagreements():
    cons = diff.paper_consistency()
    bad = set(zip(cons[~cons["consistent"]]["variant"], cons[~cons["consistent"]]["column"]))
    assert ("qwen2.5-3b", "saving_fraction") in bad  # 22.3% by the formula, 22.8% printed
    assert ("common", "warmup_ratio") in bad  # Table 2: 0.01, Sec. 4.1: 10%
    assert ("stem_dagger", "gflops_per_token") in bad  # #Active 0.35 but 0.74 GFLOPs
    assert cons[cons["column"] == "avg"]["consistent"].all()
    assert cons[(cons["column"] == "roi") & cons["check"].str.contains("printed Avg and #GFLOPs")]["consistent"].all()


def test_paper_consistency_with_architectures():
    cons = diff.paper_consistency(B.paper_accounting())
    arch = cons[cons["check"].str.contains("architectures")].set_index(["scale", "variant", "column"])
    assert arch.loc[("1b", "stem", "total_params_b"), "consistent"]  # 1B row reproduces exactly
    assert not arch.loc[("350m", "stem_half", "total_params_b"), "consistent"]  # research notes A
    assert "no consistent table shape" in arch.loc[("350m", "stem", "total_params_b"), "note"]


# ---- figures and the report ----------------------------------------------------------------------
def test_loss_spikes():
    loss = 3 + 0.01 * np.random.default_rng(1).standard_normal(300)
    loss[[100, 250]] += 1.0
    assert list(np.flatnonzero(F.loss_spikes(loss, window=50, k=6))) == [100, 250]
    assert not F.loss_spikes(np.linspace(8, 3, 300)).any()  # a falling curve has no spikes


@pytest.mark.parametrize("name", list(F.FIGURES))
def test_every_figure_draws_a_non_empty_image(name, tmp_path, tiny_cfg, tiny_results, tiny_tables):
    png, pdf = tmp_path / f"{name}.png", tmp_path / f"{name}.pdf"
    F.save(F.draw(name, tiny_cfg, tiny_results, tiny_tables), png, pdf)
    assert png.stat().st_size > 10_000 and pdf.stat().st_size > 1_000


def test_figures_tolerate_missing_results(tmp_path, tiny_cfg):
    empty = Results("tiny", tmp_path)
    ours = T.build_all(tiny_cfg, empty)
    for name in F.FIGURES:
        F.save(F.draw(name, tiny_cfg, empty, ours), tmp_path / f"{name}.png")
        assert (tmp_path / f"{name}.png").stat().st_size > 5_000


def test_report_builds(tmp_path, tiny_cfg, tiny_results):
    rd = tmp_path / "reports" / "tiny"
    ours = B.write_tables(tiny_cfg, tiny_results, rd / "tables")
    reread = B.load_reproduced(rd / "tables" / "reproduced.csv")
    assert value(reread["table3"], "350m", "stem", "avg") == pytest.approx(value(ours["table3"], "350m", "stem", "avg"))
    assert value(reread["table2"], "350m", "pretrain", "lr_schedule") == "cosine"
    B.write_diff(tiny_cfg, rd / "diff", *B.run_diff(tiny_cfg, reread, ["table3/*/*/avg"]))
    summary = json.loads((rd / "diff" / "summary.json").read_text())
    assert summary["label"] == "experiment: tiny (embedded default, not paper scale)" and not summary["paper_scale"]
    assert summary["directions"]["point_only"]["point estimate: agree"] > 0 and summary["gate"]["failed"]
    for name in ("fig5a_loss_vs_tokens", "roi_by_scale"):
        F.save(F.draw(name, tiny_cfg, tiny_results, reread), rd / "figures" / f"{name}.png")
    text = B.readme(tiny_cfg, rd, ["fig5a_loss_vs_tokens", "roi_by_scale"])
    assert "experiment: tiny (embedded default, not paper scale)" in text and "not a paper-scale result" in text
    assert "![fig5a_loss_vs_tokens](figures/fig5a_loss_vs_tokens.png)" in text
    assert all(registry.table(t).title in text for t in B.TABLES) and "Tiny-scale comparison" in text
    diff_md = (rd / "diff" / "diff.md").read_text()
    assert "Directions" in diff_md and "Where the paper disagrees with itself" in diff_md
    assert pd.read_csv(rd / "tables" / "table3.csv")["Model"].tolist()[:2] == ["Baseline", "Hash-MoE"]


def test_readme_and_html_are_built_from_data_not_from_written_markdown(tmp_path, tiny_cfg, tiny_results):
    """Issue 12.3: the pages come from reproduced.csv and the diff's data; the Markdown the report wrote
    (tables/*.md, diff/diff.md) is not read back (the old README cut diff.md at a heading)."""
    import base64
    import re
    from stem.report import page
    rd = tmp_path / "reports" / "tiny"
    ours = B.write_tables(tiny_cfg, tiny_results, rd / "tables")
    s, cells, dirs, cons, _ = B.run_diff(tiny_cfg, B.load_reproduced(rd / "tables" / "reproduced.csv"))
    B.write_diff(tiny_cfg, rd / "diff", s, cells, dirs, cons)
    F.save(F.draw("roi_by_scale", tiny_cfg, tiny_results, ours), rd / "figures" / "roi_by_scale.png")
    readme, html = B.readme(tiny_cfg, rd, ["roi_by_scale"]), B.html_report(tiny_cfg, rd, ["roi_by_scale"])
    for p in [*(rd / "tables").glob("*.md"), rd / "diff" / "diff.md"]:
        p.write_text("# overwritten\n## Side by side\n")
    assert B.readme(tiny_cfg, rd, ["roi_by_scale"]) == readme and B.html_report(tiny_cfg, rd, ["roi_by_scale"]) == html
    # the diff summary in the README is diff.md's, one heading level down, from directions.csv read back
    assert page.markdown(diff.summary_blocks(s, dirs, C.variant_labels(tiny_cfg), level=3)) in readme
    assert B.load_directions(rd / "diff" / "directions.csv")["verdict"].tolist() == dirs["verdict"].tolist()
    for name in B.TABLES:   # every row of every table's CSV, in both pages
        for r in pd.read_csv(rd / "tables" / f"{name}.csv", dtype=str, keep_default_na=False).itertuples(index=False):
            assert "| " + " | ".join(r) + " |" in readme
            tds = "".join(f"<td>{x.replace('<', '&lt;').replace('>', '&gt;')}</td>" for x in r)
            assert f"<tr>{tds}</tr>" in html
    img = re.search(r'<img alt="roi_by_scale" src="data:image/png;base64,([^"]+)">', html).group(1)
    assert base64.b64decode(img) == (rd / "figures" / "roi_by_scale.png").read_bytes()
    assert "<script" not in html and 'href="diff/diff.md"' in html and "<em>paper</em>" in html


# ---- every result file read is checked: what its path says, schema, types, ranges -----------------------
@pytest.fixture
def fresh_results(tmp_path, tiny_cfg):
    write_results(tmp_path, tiny_cfg)
    return tmp_path


def test_real_training_summary_passes_the_check(spec_factory, tmp_path):
    """The check accepts what stem.train.loop really writes (and rejects it under another path)."""
    from stem.train.loop import train
    from stem.report.results import ResultError, check_summary
    spec = spec_factory(tmp_path / "tiny" / "350m" / "stem" / "pretrain", steps=6, eval_interval=3)
    train(spec)
    res = Results("tiny", tmp_path)
    s = res.summary("350m", "stem", "pretrain")
    assert s["final_val_loss"] > 0 and s["steps"] == 6
    from stem import provenance   # issue 24: where the summary came from, the job spec itself untouched
    saved_spec = json.loads((tmp_path / "tiny/350m/stem/pretrain/checkpoint/config.json").read_text())
    assert "provenance" not in saved_spec and s["provenance"]["spec_sha256"] == provenance.spec_hash(saved_spec)
    assert len(s["provenance"]["commit"]) == 40 and isinstance(s["provenance"]["dirty"], bool)
    assert set(s["provenance"]["versions"]) == {"torch", "lm_eval", "snakemake", "transformers"}
    assert s["provenance"]["versions"]["torch"] and s["provenance"]["versions"]["snakemake"]
    assert s["provenance"]["manifests"] and all(len(h) == 64 for h in s["provenance"]["manifests"].values())
    with pytest.raises(ResultError, match="key 'variant': the file is of variant 'stem' but its path says 'dense'"):
        check_summary(tmp_path / "x.json", s, {"experiment": "tiny", "scale": "350m", "variant": "dense",
                                               "stage": "pretrain"})
    # Table 3's parameter columns are the accounting written with the checkpoint, not recomputed from the
    # experiment's config (whose 350M architecture is another one): the exact total is the number of values
    # in the checkpoint's weights, counted here from the safetensors file alone.
    from safetensors import safe_open
    ckpt = tmp_path / "tiny" / "350m" / "stem" / "pretrain" / "checkpoint"
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        n_weights = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    cfg = experiment.parse({**C.read_yaml(C.REPO / "config" / "tiny.yaml"), "matrix": {"350m": {
        "variants": ["stem"], "stages": ["pretrain"]}}})
    t3 = T.build_all(cfg, res)["table3"]
    saved = json.loads((ckpt / "accounting.json").read_text())
    assert value(t3, "350m", "stem", "total_params_exact_b") * 1e9 == pytest.approx(n_weights, abs=0.5)
    assert value(t3, "350m", "stem", "active_params_b") * 1e9 == pytest.approx(saved["active_params"], abs=0.5)
    assert value(t3, "350m", "stem", "gflops_per_token") == saved["gflops_per_token"]
    assert T.accounting(cfg, "350m", "stem")["total_params"] != n_weights   # what recomputing would have said
    assert set(t3[t3["column"] == "total_params_b"]["source"]) == {"350m/stem/pretrain/checkpoint/accounting.json"}
    shutil.rmtree(ckpt)   # before the model has a checkpoint: the configured architecture's, marked as such
    t3 = T.build_all(cfg, res)["table3"]
    assert value(t3, "350m", "stem", "total_params_exact_b") * 1e9 == T.accounting(cfg, "350m", "stem")["total_params"]
    assert t3[t3["column"] == "active_params_b"]["source"].iloc[0].endswith("(no checkpoint yet)")


@pytest.mark.parametrize("what, src, dst, key", [
    ("eval", ("350m", "stem", "pretrain"), ("350m", "dense", "pretrain"), "variant"),
    ("eval", ("1b", "stem", "pretrain"), ("350m", "stem", "pretrain"), "scale"),
    ("eval", ("1b", "stem", "midtrain"), ("1b", "stem", "pretrain"), "stage"),
    ("summary", ("1b", "dense", "pretrain"), ("350m", "dense", "pretrain"), "scale"),
])
def test_a_result_of_another_run_in_a_folder_is_refused(fresh_results, tiny_cfg, what, src, dst, key):
    """Issue 16.1: a file copied from another variant/scale/stage must not fill the wrong row."""
    from stem.report.results import ResultError
    name = "eval/commonsense.json" if what == "eval" else "summary.json"
    target = fresh_results / "tiny" / "/".join(dst) / name
    target.write_text((fresh_results / "tiny" / "/".join(src) / name).read_text())
    with pytest.raises(ResultError) as e:
        T.build_all(tiny_cfg, Results("tiny", fresh_results))
    msg = str(e.value)
    assert msg.startswith(f"{target}: key '{key}'") and "\n" not in msg
    assert f"its path says {dict(zip(('scale', 'variant', 'stage'), dst))[key]!r}" in msg


def _edit_json(path, edit):
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


@pytest.mark.parametrize("file, edit, message", [
    ("350m/stem/pretrain/summary.json", "garbage", "not readable as JSON"),
    ("350m/stem/pretrain/summary.json", lambda d: d.pop("final_train_loss"), "key 'final_train_loss' is missing"),
    ("350m/stem/pretrain/summary.json", lambda d: d.update(final_val_loss="3.2"),
     "key 'final_val_loss': expected a finite number >= 0 or null or NaN, got '3.2'"),
    ("350m/stem/pretrain/summary.json", lambda d: d.update(final_train_loss=float("inf")),
     "key 'final_train_loss': expected a finite number >= 0, got inf"),
    ("350m/stem/pretrain/summary.json", lambda d: d.update(steps=6.5), "key 'steps': expected a finite integer"),
    ("350m/dense/pretrain/eval/commonsense.json", lambda d: d["tasks"]["boolq"].update(value=4500.0),
     "key 'tasks.boolq.value': expected a number in [0, 100] or null, got 4500.0"),
    ("350m/dense/pretrain/eval/commonsense.json", lambda d: d["tasks"]["piqa"].update(value="45.0"),
     "key 'tasks.piqa.value': expected a number in [0, 100] or null, got '45.0'"),
    ("350m/dense/pretrain/eval/commonsense.json", lambda d: d["tasks"]["piqa"].update(stderr=-1),
     "key 'tasks.piqa.stderr'"),
    ("350m/dense/pretrain/eval/commonsense.json", lambda d: d.update(tasks=[1, 2]), "key 'tasks'"),
    ("350m/dense/pretrain/eval/commonsense.json", lambda d: d.update(suite="mmlu"),
     "key 'suite': the file is of suite 'mmlu' but its path says 'commonsense'"),
    ("1b/stem/extend/eval/niah.json", lambda d: d["cells"][0].update(accuracy=101.0), "key 'cells[0].accuracy'"),
    ("1b/stem/extend/eval/bbh.json", lambda d: d["truncation"]["tasks"]["bbh_sub"].update(truncated=-3),
     "key 'truncation.tasks.bbh_sub.truncated': expected a finite integer >= 0, got -3"),
    ("1b/stem/extend/eval/longbench.json", lambda d: d["by_length"]["table5"][0]["groups"].update(longbench_code=True),
     "key 'by_length.table5[0].groups.longbench_code'"),
    ("1b/dense/pretrain/metrics.jsonl", "not json\n{}\n", "1b/dense/pretrain/metrics.jsonl:1: not a JSON line"),
    ("350m/stem/pretrain/checkpoint/accounting.json", lambda d: d.update(active_params=-5),
     "key 'active_params': expected a finite integer >= 1, got -5"),
    ("350m/stem/pretrain/checkpoint/config.json", lambda d: d.update(variant="dense"),
     "key 'variant': the file is of variant 'dense' but its path says 'stem'"),
])
def test_bad_result_files_fail_with_one_line(fresh_results, tiny_cfg, file, edit, message):
    """Issue 16.2: garbage, wrong types and out-of-range values stop the aggregate with one line."""
    from stem.report.results import ResultError
    path = fresh_results / "tiny" / file
    if isinstance(edit, str):
        path.write_text(edit)
    else:
        _edit_json(path, edit)
    res = Results("tiny", fresh_results)
    with pytest.raises(ResultError) as e:
        T.build_all(tiny_cfg, res)
        for name in F.FIGURES:
            F.draw(name, tiny_cfg, res, {})
    assert str(e.value).startswith(str(path)) and message in str(e.value) and "\n" not in str(e.value)


def test_torn_last_metrics_line_is_tolerated(fresh_results):
    path = fresh_results / "tiny" / "1b" / "dense" / "pretrain" / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 201, "lo')
    assert len(Results("tiny", fresh_results).metrics("1b", "dense", "pretrain")) == 200


@pytest.mark.parametrize("args, message", [
    (["--results", "/nonexistent"], "--results /nonexistent: no tiny/ folder in it"),
    (["--gate", "table3/350m/*/acc"], "gate pattern 'table3/350m/*/acc' matches no published cell"),
])
def test_diff_cli_fails_on_no_results_and_on_a_gate_matching_nothing(fresh_results, capsys, args, message):
    """Issue 16.3: neither reports 'missing' / 'passed' with exit 0."""
    from stem.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["diff", "--experiment", "tiny", "--results", str(fresh_results), *args])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith(f"error: {message}") and err.strip().count("\n") == 0


def test_diff_cli_gate_passes_and_fails(fresh_results, capsys):
    from stem.__main__ import main
    main(["diff", "--experiment", "tiny", "--results", str(fresh_results),
          "--gate", "table2/350m/pretrain/lr_schedule"])
    assert "Gate: **passed** (0 chosen cells" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["diff", "--experiment", "tiny", "--results", str(fresh_results), "--gate", "table3/350m/*/avg"])
    assert e.value.code == 2 and "gate failed" in capsys.readouterr().err


# ---- the report's files are all requested: a missing one (a report killed half-way) is rebuilt --------------
def test_every_file_the_report_writes_is_requested(tmp_path, tiny_cfg, tiny_results):
    from stem.report.workflow import report_outputs
    B.write_tables(tiny_cfg, tiny_results, tmp_path / "reports/tiny/tables")
    ours = B.load_reproduced(tmp_path / "reports/tiny/tables/reproduced.csv")
    B.write_diff(tiny_cfg, tmp_path / "reports/tiny/diff", *B.run_diff(tiny_cfg, ours))
    written = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    wanted = set(report_outputs("tiny"))
    assert written <= wanted
    figures = {f"reports/tiny/figures/{f}.{ext}" for f in F.FIGURES if not F.FIGURES[f].experiments
               or "tiny" in F.FIGURES[f].experiments for ext in ("png", "pdf")}   # real_loss_curves: real's only
    assert wanted == written | figures | {"reports/tiny/README.md", "reports/tiny/report.html"}


def test_a_missing_report_file_is_rebuilt_then_the_readme(tmp_path, tiny_cfg):
    """Issue 16.5: today a deleted (or half-written, killed) figure PDF or diff file leaves 'Nothing to be done'."""
    import os
    import subprocess
    import sys
    write_results(tmp_path / "results", tiny_cfg, skip=())
    # the report as a finished run leaves it (contents do not matter to the DAG; the order of mtimes does)
    files = ["reports/tiny/params.csv", "reports/tiny/params.md", "reports/tiny/README.md", "reports/tiny/report.html",
             *(f"reports/tiny/tables/{t}.{ext}" for t in B.TABLES for ext in ("csv", "md", "tex")),
             "reports/tiny/tables/reproduced.csv", *(f"reports/tiny/diff/{f}" for f in B.DIFF_FILES),
             *(f"reports/tiny/figures/{f}.{ext}" for f in F.FIGURES for ext in ("png", "pdf"))]
    from stem.analysis import workflow as AW  # the analyze stage's outputs, as a finished run leaves them
    from stem import sweeps as SW   # and the sweeps' (in `rule all` when sweeps.in_all)
    from stem import knowledge as KN   # and the knowledge section's points (summaries, analyses)
    analyses = AW.targets(tiny_cfg) + SW.targets(tiny_cfg) + KN.targets(tiny_cfg)
    files += analyses
    for i, f in enumerate(files):
        p = tmp_path / f
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x")
        t = 2e9 + (0 if "/params." in f or f in analyses else 10 if "/tables/" in f else 30 if f.endswith(("README.md", ".html")) else 20)
        os.utime(p, (t, t))
    smk = [sys.executable, "-m", "snakemake", "-s", str(C.REPO / "Snakefile"), "-d", str(tmp_path), "-n",
           "--allowed-rules", "report_tables", "report_diff", "report_figure", "report_readme", "report_html", "params"]
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    (tmp_path / "reports/tiny/figures/roi_by_scale.pdf").unlink()
    (tmp_path / "reports/tiny/diff/cells.csv").unlink()
    r = subprocess.run(smk, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Job stats:" in r.stdout, (r.stdout + r.stderr)[-2000:]
    jobs = r.stdout.split("Job stats:")[1].split("total")[0]
    counts = dict((w[0], int(w[1])) for w in (line.split() for line in jobs.splitlines()) if len(w) == 2
                  and w[1].isdigit())
    assert counts == {"report_figure": 1, "report_diff": 1, "report_readme": 1, "report_html": 1, "all": 1}
    assert "Missing output files: reports/tiny/figures/roi_by_scale.pdf" in r.stdout


def test_real_eval_outputs_pass_the_check(tmp_path, tiny_cfg):
    """The eval check accepts what stem.eval.run really writes (lm-eval suites with by_length, and NIAH)."""
    pytest.importorskip("lm_eval")
    import torch
    from stem.data import synth
    from stem.data.tokenizer import train_bpe
    from stem.eval import fixtures, run
    from stem.eval import spec as ES
    from stem.models.spec import ModelConfig
    from stem.models.model import build_model
    from stem.checkpoint import save_checkpoint
    world = {"seed": 3, "n_countries": 8, "n_people": 20, "n_filler": 100}
    docs = [doc for doc, _ in zip(synth.web_documents(synth.make_world(**world)), range(200))]
    train_bpe(docs, 320, tmp_path / "tok.json")
    m = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    m["archs"]["1b"].update(vocab_size=320, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64)
    m["tokenizer"]["1b"]["vocab_size"] = 320
    cfg = experiment.parse(m)
    mc = C.model_config_for(cfg, "1b", "stem", "extend").to_dict()
    torch.manual_seed(0)
    ident = {"experiment": "tiny", "scale": "1b", "variant": "stem", "stage": "extend"}
    save_checkpoint(tmp_path / "ckpt", build_model(ModelConfig.from_dict(mc), "cpu"), {**ident, "model": mc},
                    tmp_path / "tok.json", {})
    tasks = ["arc_easy", "boolq", "longbench_hotpotqa", "longbench_lcc"]
    fixtures.write_fixtures({**cfg.eval["fixtures"], "world": world, "seed": 0, "items": 4, "train_items": 2,
                             "tasks": tasks, "groups": {"longbench_multi": ["longbench_hotpotqa"],
                                                        "longbench_code": ["longbench_lcc"],
                                                        "longbench": ["longbench_multi", "longbench_code"]}},
                            tmp_path / "fx")
    out = tmp_path / "results/tiny/1b/stem/extend/eval"
    for suite, limit in (("commonsense", 2), ("longbench", 2)):
        spec = ES.suite_spec(cfg, suite)
        spec.update(fixtures=str(tmp_path / "fx"), **({"tasks": tasks[:2]} if suite == "commonsense" else {}))
        run.evaluate(tmp_path / "ckpt", spec, out / f"{suite}.json", limit=limit)
    spec = {**ES.suite_spec(cfg, "niah"), "lengths": [224, 256], "depths": [0, 100], "samples": 1,
            "documents": {"kind": "files", "paths": [str(tmp_path / "long.jsonl")], "format": "jsonl"}}
    (tmp_path / "long.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    run.evaluate(tmp_path / "ckpt", spec, out / "niah.json")
    res = Results("tiny", tmp_path / "results")
    assert res.eval("1b", "stem", "extend", "commonsense")["tasks"].keys() == {"arc_easy", "boolq"}
    assert res.eval("1b", "stem", "extend", "longbench")["by_length"]["table5"]
    assert len(res.eval("1b", "stem", "extend", "niah")["cells"]) == 4
    from stem import provenance   # issue 24: each eval JSON names the checkpoint's job spec it evaluated
    train_spec = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    for suite in ("commonsense", "longbench", "niah"):
        p = res.eval("1b", "stem", "extend", suite)["provenance"]
        assert p["train_spec_sha256"] == provenance.spec_hash(train_spec) and p["versions"]["lm_eval"]
        assert p["tokenizer_sha256"] == provenance.file_hash(tmp_path / "ckpt" / "tokenizer.json")
    # issue 32: the evaluation data hashed (the fixture folder; each task's items as lm-eval read them; documents)
    data = res.eval("1b", "stem", "extend", "commonsense")["provenance"]["data"]
    assert data["fixtures"]["sha256"] == provenance.tree_hash(tmp_path / "fx") and len(data["fixtures"]["sha256"]) == 64
    assert set(data["items_sha256"]) == {"arc_easy", "boolq"} and "datasets" not in data   # fixtures: no hub dataset
    assert data["items_sha256"]["arc_easy"] != data["items_sha256"]["boolq"]
    niah = res.eval("1b", "stem", "extend", "niah")["provenance"]["data"]
    assert niah["documents"] == {str(tmp_path / "long.jsonl"): provenance.file_hash(tmp_path / "long.jsonl")}


def test_truncation_table_and_summary_line(tiny_cfg, tiny_tables):
    """Issue 33: each task whose requests were cut, its score beside the counts; eval JSONs without counts named."""
    from stem.report.truncation import truncation_lines, truncation_summary
    t = tiny_tables["truncation"]
    extend = [v for v in tiny_cfg.matrix["1b"].variants if "extend" in C.variant_stages(
        tiny_cfg, v, tiny_cfg.matrix["1b"].stages)]
    bbh = t[t["row"].str.endswith("extend: bbh bbh_sub")]
    assert sorted(set(bbh["variant"])) == sorted(extend) and len(bbh) == 5 * len(extend)
    one = bbh[bbh["variant"] == extend[0]].set_index("column")["value"]
    assert one.to_dict() == {"score": 1.0, "policy": "left", "truncated": 3, "requests": 40, "tokens_dropped": 120}
    mmlu = t[t["row"].str.endswith("midtrain: mmlu (all)") & (t["column"] == "policy")]
    assert len(mmlu) and set(mmlu["value"]) == {"not recorded"}
    s = truncation_summary(t)
    assert s == {"tasks": len(extend), "truncated": 3 * len(extend), "requests": 40 * len(extend),
                 "tokens_dropped": 120 * len(extend), "not_recorded": len(mmlu)}
    assert truncation_lines(s)[0].startswith(f"⚠ **Truncation: {3 * len(extend)} of {40 * len(extend)} requests cut")


def test_dse_table_and_its_direction_check(tiny_cfg, tiny_tables):
    """The DSE paper's comparison at our scales: dense vs DSE rows, parameters in the DSE paper's convention
    (embedding and head excluded), the pretrain evals; directions in the sign of DSE-27B - Dense-4B (Table 1),
    a lower loss counting as beating the baseline; nothing compared in absolute terms."""
    t = tiny_tables["dse"]
    assert set(zip(t["scale"], t["variant"])) == {(s, v) for s in ("350m", "1b") for v in ("dense", "dse")}
    for scale in ("350m", "1b"):
        V, d = tiny_cfg.archs[scale].vocab_size, tiny_cfg.archs[scale].d_model
        for v in ("dense", "dse"):
            a = T.accounting(tiny_cfg, scale, v)
            assert value(t, scale, v, "p_tot_b") * 1e9 == pytest.approx(a["total_params"] - 2 * V * d, abs=1e-3)
            assert value(t, scale, v, "p_act_b") * 1e9 == pytest.approx(a["active_params"] - 2 * V * d, abs=1e-3)
        tables = value(t, scale, "dse", "p_tot_b") - value(t, scale, "dse", "p_act_b")
        assert value(t, scale, "dse", "dse_params_b") == pytest.approx(tables) and tables > 0
        assert value(t, scale, "dense", "dse_params_b") == 0
        # the fixture gives DSE the paper's dense scores + 1 (tests/test_report.py eval_json)
        assert value(t, scale, "dse", "arc_easy") == pytest.approx(value(t, scale, "dense", "arc_easy") + 1)
    assert "DSE (Cheng et al.)" in T.wide(t)["Model"].tolist()
    assert "dse" not in registry.compared()
    dirs = diff.point_directions(tiny_tables, "dense")
    dirs = dirs[dirs["table"] == "dse"].set_index(["scale", "variant", "column"])
    assert set(dirs.index) == {(s, "dse", c) for s in ("350m", "1b")
                               for c in ("val_loss", "arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande")}
    assert dirs.loc[("1b", "dse", "arc_easy"), "paper_delta"] == pytest.approx(89.0 - 76.8)   # DSE-27B - Dense-4B
    assert dirs.loc[("1b", "dse", "arc_easy"), "agree"]
    assert dirs.loc[("1b", "dse", "val_loss"), "paper_delta"] == pytest.approx(1.622 - 1.768)
    assert dirs.loc[("1b", "dse", "val_loss"), "paper_says"] == "beats baseline"   # lower loss
    for shift, agree in ((-0.1, True), (0.1, False)):
        ours = {**tiny_tables, "dse": t.copy()}
        dse = ours["dse"]
        base = value(t, "1b", "dense", "val_loss")
        dse.loc[(dse["scale"] == "1b") & (dse["variant"] == "dse") & (dse["column"] == "val_loss"), "value"] = base + shift
        row = diff.point_directions(ours, "dense").set_index(["table", "scale", "variant", "column"]).loc[("dse", "1b", "dse", "val_loss")]
        assert row["agree"] == agree and row["ours"] == ("beats baseline" if agree else "trails baseline")


def test_dse_table_reads_older_checkpoint_accounting(tmp_path, tiny_cfg):
    """A checkpoint accounting.json written before the DSE-convention keys: P_tot / P_act / DSE params come
    from the configured architecture when its exact total is the checkpoint's, and are a gap otherwise."""
    write_results(tmp_path, tiny_cfg)
    for variant, total in (("dense", None), ("dse", 123)):
        path = tmp_path / "tiny/350m" / variant / "pretrain/checkpoint/accounting.json"
        acct = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("p_tot", "p_act", "p_free", "dse_params")}
        path.write_text(json.dumps({**acct, **({"total_params": total} if total else {})}))
    t = T.dse_table(tiny_cfg, Results("tiny", tmp_path)).set_index(["scale", "variant", "column"])
    a = T.accounting(tiny_cfg, "350m", "dense")
    assert t.loc[("350m", "dense", "p_tot_b"), "value"] * 1e9 == pytest.approx(a["p_tot"])
    assert "from the configured architecture (same total_params)" in t.loc[("350m", "dense", "p_tot_b"), "source"]
    assert math.isnan(t.loc[("350m", "dse", "p_act_b"), "value"])
    assert "the configured architecture differs" in t.loc[("350m", "dse", "p_act_b"), "source"]
