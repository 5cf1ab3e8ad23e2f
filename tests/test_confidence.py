"""Issue 24: one source for a direction's verdict (the paired bootstrap of tables/directions.csv) in the diff
summary, the README/HTML direction table and ``python -m stem diff``; the directions gate; provenance.

Results are synthetic (tests/test_report.py's ``write_results``) plus per-item lm-eval samples written here
for the 350m dense and STEM models, chosen so that the bootstrap gives each kind of verdict.
"""
import json
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from stem import config as C
from stem.report import verdict as V
from stem.report import build as B
from stem.report import diff
from stem.report import paper_data as P
from stem.report.results import Results
from conftest import checked_yaml, reshaped
from test_report import write_results

# per commonsense task of the 350m STEM model vs dense: how its items relate to the paper's sign
PLAN = {"arc_easy": "with", "arc_challenge": "against"}   # every other task: the same answers (a tie)


def write_samples(root, cfg):
    """eval/raw/commonsense.json (lm-eval's per-item samples) for 350m dense and stem at pretrain."""
    paper = P.load_table("table3").set_index(["scale", "variant", "column"])["value"]
    rng = np.random.default_rng(3)
    base = {t: rng.integers(0, 2, 40).astype(float) for t in P.COMMONSENSE_TASKS}
    for variant in ("dense", "stem"):
        samples = {}
        for t in P.COMMONSENSE_TASKS:
            sign = np.sign(paper[("350m", "stem", t)] - paper[("350m", "dense", t)])
            x = base[t]
            if variant == "stem" and t in PLAN:
                x = np.full(40, 1.0 if (sign > 0) == (PLAN[t] == "with") else 0.0)
            samples[t] = [{"doc_id": i, "acc": float(v), "filter": "none"} for i, v in enumerate(x)]
        d = root / cfg.experiment / "350m" / variant / "pretrain" / "eval"
        (d / "raw").mkdir(exist_ok=True)
        (d / "raw" / "commonsense.json").write_text(json.dumps({"samples": samples}))


@pytest.fixture(scope="module")
def cfg():
    return checked_yaml(C.REPO / "config" / "tiny.yaml")


@pytest.fixture(scope="module")
def exp(cfg):
    return C.experiment.parse(cfg)


@pytest.fixture(scope="module")
def report(tmp_path_factory, exp):
    root = tmp_path_factory.mktemp("confidence")
    write_results(root / "results", exp)
    write_samples(root / "results", exp)
    rd = root / "reports" / "tiny"
    B.write_tables(exp, Results("tiny", root / "results"), rd / "tables")
    out = B.run_diff(exp, B.load_reproduced(rd / "tables" / "reproduced.csv"))
    B.write_diff(exp, rd / "diff", *out)
    return root, rd, out


def test_verdict_categories():
    assert V.category("agree") == "agree" and V.category("inconclusive") == "inconclusive"
    assert V.category("disagree (point estimate)") == "point estimate: disagree"
    assert V.category("missing (the full model scores 0 on a category)") == "missing"
    assert V.category(None) == "missing" and V.category(float("nan")) == "missing"
    with pytest.raises(ValueError, match="'better': expected one of agree"):
        V.category("better")
    assert V.count(["agree", "agree", "missing"]) == {**dict.fromkeys(V.CATEGORIES, 0), "agree": 2, "missing": 1,
                                                       "total": 3}


def test_summary_counts_are_the_bootstrap_tables_verdicts(report):
    root, rd, (s, cells, dirs, cons, _) = report
    table = pd.read_csv(rd / "tables" / "directions.csv", dtype=str, keep_default_na=False)
    expected = V.count(V.category(v) for v in table["verdict"])
    assert s["directions"]["checked"] == expected
    saved = json.loads((rd / "diff" / "summary.json").read_text())["directions"]
    assert saved["checked"] == expected and saved["checked"]["total"] == len(table)
    boot = dirs[dirs["origin"] == diff.BOOTSTRAP].set_index(["table", "scale", "variant", "column"])
    assert boot.loc[("table3", "350m", "stem", "arc_easy"), "category"] == "agree"
    assert boot.loc[("table3", "350m", "stem", "arc_challenge"), "category"] == "disagree"
    assert boot.loc[("table3", "350m", "stem", "boolq"), "category"] == "inconclusive"
    assert boot.loc[("table3", "350m", "hashmoe", "boolq"), "category"] == "missing"   # no per-item samples
    # the point estimates fill only what the bootstrap table has no row for (ROI, Tables 5-6, DSE Table 1)
    point = dirs[dirs["origin"] == diff.POINT]
    assert set(point["table"]) <= {"table3", "table5", "table6", "dse", "dse_long"} and len(point)
    assert set(point[point["table"] == "table3"]["column"]) == {"roi"}
    assert s["directions"]["point_only"] == V.count(point["category"])
    # resolvable: sized (Tables 3/4 with an interval); a 0-or-1 item difference resolves the paper's effect
    sized = boot["paper_effect_resolvable"].dropna()
    assert s["directions"]["paper_effect_sized"] == len(sized) > 0
    assert s["directions"]["paper_effect_resolvable"] == int(sized.astype(bool).sum()) >= 2


def test_readme_html_and_diff_say_the_same_counts(report, exp):
    root, rd, (s, cells, dirs, cons, _) = report
    k = s["directions"]["checked"]
    line = (f"agree **{k['agree']}**, disagree **{k['disagree']}**, inconclusive **{k['inconclusive']}**")
    readme, html = B.readme(exp, rd, []), B.html_report(exp, rd, [])
    md = (rd / "diff" / "diff.md").read_text()
    assert line in readme and line in md
    assert line.replace("**", "") in html.replace("<strong>", "").replace("</strong>", "")
    assert "agree **42**" not in readme and "Cells agreeing" not in readme   # the old point-estimate count is gone
    row = diff.direction_table(B.load_directions(rd / "diff" / "directions.csv"), C.variant_labels(exp))
    stem = row[(row["Table"] == "table3") & (row["Scale"] == "350m") & (row["Variant"] == C.variant_labels(exp)["stem"])]
    assert "agree 1" in stem["Verdicts"].iloc[0] and "disagree 1" in stem["Verdicts"].iloc[0]
    # read back from diff/directions.csv: the same verdicts as in memory
    back = B.load_directions(rd / "diff" / "directions.csv")
    assert back["category"].tolist() == dirs["category"].tolist() and back["stage"].tolist() == dirs["stage"].tolist()


def test_directions_gate(report, tmp_path, capsys):
    root, rd, (s, cells, dirs, cons, _) = report
    failed = diff.gate_directions(dirs)
    assert failed == [next(f for f in failed if f.startswith("table3/350m/stem/arc_challenge (pretrain): disagrees"))]
    base = B.load_directions(rd / "diff" / "directions.csv")
    assert diff.gate_directions(dirs, base) == failed   # same verdicts as the baseline: only the disagreement
    edited = base.copy()
    i = edited.index[(edited["variant"] == "stem") & (edited["column"] == "boolq") & (edited["scale"] == "350m")][0]
    edited.loc[i, "verdict"] = "agree"
    edited.to_csv(tmp_path / "baseline.csv", index=False)
    from stem.__main__ import main
    args = ["diff", "--experiment", "tiny", "--results", str(root / "results")]
    with pytest.raises(SystemExit) as e:
        main(args + ["--baseline", str(tmp_path / "baseline.csv")])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2
    assert "direction gate: table3/350m/stem/boolq (pretrain): verdict changed against the baseline: agree -> " \
           "inconclusive (ours +0 [+0, +0])" in err
    assert any(x.startswith("direction gate: table3/350m/stem/arc_challenge (pretrain): disagrees") for x in err)
    assert err[-1] == "direction gate failed: 2 direction(s)"
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit) as e:
        main(args + ["--baseline", str(tmp_path / "bad.csv")])
    assert e.value.code == 1 and "bad.csv: not a diff/directions.csv (no column table" in capsys.readouterr().err


def test_accepted_disagreements(report, tmp_path, cfg, exp):
    """Issue 32: an accepted disagreement passes the gate (also against a baseline) and is listed in the report
    with its interval then and now; a bad file or config key stops with one line."""
    import yaml
    from stem.specs import ReportSpec, SpecError
    root, rd, (s, cells, dirs, cons, _) = report
    r = dirs[(dirs["table"] == "table3") & (dirs["variant"] == "stem") & (dirs["column"] == "arc_challenge")
             & (dirs["scale"] == "350m")].iloc[0]
    entry = {"cell": "table3/350m/stem/arc_challenge", "stage": "pretrain", "verdict": "disagree",
             "interval": [float(r["lo"]), float(r["hi"])], "reason": "the fixture's items are written against the paper"}
    path = tmp_path / "accepted.yaml"
    path.write_text(yaml.safe_dump([entry]))
    acc = diff.load_accepted(path)
    assert diff.gate_directions(dirs) and diff.gate_directions(dirs, accepted=acc) == []
    base = B.load_directions(rd / "diff" / "directions.csv")
    assert diff.gate_directions(dirs, base, acc) == []
    out = B.run_diff(C.experiment.parse({**cfg, "report": {**cfg["report"], "accepted": str(path)}}),
                     B.load_reproduced(rd / "tables" / "reproduced.csv"))
    cell = out[0]["accepted"]["cells"][0]
    assert cell["now"] == "disagree" and cell["now_interval"] == pytest.approx(entry["interval"])
    md = diff.render(exp, *out[:4])
    assert f"Accepted disagreements (`{path}`" in md and "`table3/350m/stem/arc_challenge` (pretrain): accepted " \
        "disagree [" in md and "now **disagree** [" in md and entry["reason"] in md
    for edit, message in [({"verdict": "agree"}, "entry 1: key 'verdict': 'agree'; expected disagree"),
                          ({"interval": [1, 0]}, "entry 1: key 'interval': [1, 0]; expected [lo, hi]"),
                          ({"reason": ""}, "entry 1: key 'reason': ''; expected a sentence"),
                          ({"cell": "table3/stem"}, "entry 1: key 'cell': 'table3/stem'; expected table/scale/")]:
        path.write_text(yaml.safe_dump([{**entry, **edit}]))
        with pytest.raises(ValueError, match=re.escape(f"{path}: {message}")):
            diff.load_accepted(path)
    with pytest.raises(SpecError, match=r"config: key 'report.accepted'.*accepted-disagreements YAML file"):
        ReportSpec.from_config(exp.experiment, {"accepted": "config/nope.yaml"})
    with pytest.raises(ValueError, match=r"--accept table3/350m/stem/boolq: its verdict is 'inconclusive'; only a "):
        diff.accept(dirs, ["table3/350m/stem/boolq"], "why", tmp_path / "new.yaml")
    # the command line: --accept records the cell with its interval now, and the gate then passes
    from stem.__main__ import main
    main(["diff", "--experiment", "tiny", "--results", str(root / "results"), "--gate-directions", "--accepted",
          str(tmp_path / "new.yaml"), "--accept", "table3/350m/stem/arc_challenge", "--reason", entry["reason"]])
    written = diff.load_accepted(tmp_path / "new.yaml")
    assert written == [entry] and (tmp_path / "new.yaml").read_text().startswith("# Accepted disagreements")


def test_accepted_cell_that_cannot_exist(report, tmp_path, cfg):
    """Issue 43 item 3: an accepted disagreement whose variant (or table, or scale) cannot exist is refused in one
    line naming the file, the entry and the cell; one that exists but has no result yet is listed as missing."""
    import yaml
    root, rd, _ = report
    path = tmp_path / "accepted.yaml"
    entry = {"stage": "pretrain", "verdict": "disagree", "interval": [0.01, 0.02], "reason": "a reason"}
    run = lambda: B.run_diff(C.experiment.parse({**cfg, "report": {**cfg["report"], "accepted": str(path)}}),  # noqa: E731
                             B.load_reproduced(rd / "tables" / "reproduced.csv"))
    for cell, message in [("table3/350m/stemm/boolq", "no such variant (variant 'stemm': expected one of"),
                          ("table9/350m/stem/boolq", "no table 'table9'; expected one of"),
                          ("table3/2b/stem/boolq", "no scale '2b'; expected one of 350m, 1b")]:
        path.write_text(yaml.safe_dump([{"cell": cell, **entry}]))
        with pytest.raises(ValueError, match=re.escape(f"{path}: entry 1: key 'cell': {cell!r}: {message}")):
            run()
    path.write_text(yaml.safe_dump([{"cell": "table4/1b/stem_half/boolq", **entry}]))   # can exist: no result
    assert run()[0]["accepted"]["cells"][0]["now"] == "missing"


def test_directions_gate_passes_without_resolved_disagreements(report):
    root, rd, (s, cells, dirs, cons, _) = report
    ok = dirs[dirs["category"] != "disagree"]
    assert diff.gate_directions(ok) == [] and diff.gate_directions(ok, ok) == []


def test_provenance_table_and_diff_say_when_results_differ(tmp_path, exp, capsys):
    from stem import provenance
    from stem.__main__ import main
    write_results(tmp_path / "results", exp)
    run = tmp_path / "results" / "tiny" / "350m"
    rec = {**provenance.record({"a": 1}, [run / "dense" / "pretrain" / "summary.json"]), "commit": "a" * 40,
           "dirty": False}
    for variant, commit in (("dense", "a" * 40), ("stem", "b" * 40)):
        path = run / variant / "pretrain" / "summary.json"
        s = json.loads(path.read_text())
        path.write_text(json.dumps({**s, "provenance": {**rec, "commit": commit}}))
    ev = run / "stem" / "pretrain" / "eval" / "commonsense.json"   # evaluated a checkpoint of another spec
    ev.write_text(json.dumps({**json.loads(ev.read_text()),
                              "provenance": {**rec, "train_spec_sha256": provenance.spec_hash({"a": 2})}}))
    rd = tmp_path / "reports" / "tiny"
    ours = B.write_tables(exp, Results("tiny", tmp_path / "results"), rd / "tables")
    prov = ours["provenance"][ours["provenance"]["scale"] == "350m"]
    commits = prov[prov["column"] == "commit"].set_index("row")["value"]
    assert commits["dense pretrain: summary"] == "aaaaaaaaaaaa clean" and commits["stem pretrain: summary"] == \
        "bbbbbbbbbbbb clean"
    assert pd.isna(commits["hashmoe pretrain: summary"])   # a result without provenance: a gap, not a guess
    same = prov[prov["column"] == "same_spec"].set_index("row")["value"]
    assert same["stem pretrain: eval commonsense"] == "NO"
    s = B.run_diff(exp, B.load_reproduced(rd / "tables" / "reproduced.csv"))[0]
    r = s["provenance"]["results"]
    assert r["commits"] == {"aaaaaaaaaaaa clean": 2, "bbbbbbbbbbbb clean": 1} and r["without"] > 0
    assert r["spec_mismatch"] == [str(ev)]
    assert s["provenance"]["report"]["commit"] == provenance.git_state()["commit"]
    text = "\n".join(diff.provenance_lines(s["provenance"]))
    assert "the compared results come from different commits" in text and str(ev) in text
    # issue 32: a result written from a dirty tree is refused, naming it and the changed files, unless allowed
    path = run / "dense" / "pretrain" / "summary.json"
    s = json.loads(path.read_text())
    s["provenance"].update(dirty=True, dirty_files=["stem/train/loop.py"])
    path.write_text(json.dumps(s))
    with pytest.raises(SystemExit) as e:
        main(["diff", "--experiment", "tiny", "--results", str(tmp_path / "results")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and (
        f"1 result file(s) written from a dirty tree (uncommitted changes to stem/train/loop.py): {path}; rerun them "
        "from a commit, or pass --allow-dirty") in err
    main(["diff", "--experiment", "tiny", "--results", str(tmp_path / "results"), "--allow-dirty"])
    err = capsys.readouterr().err
    assert "warning: the compared results come from 3 commits (aaaaaaaaaaaa dirty, " in err and "1 evaluation(s)" in err


def test_the_environment_is_pinned():
    """constraints.txt pins every package but torch (pinned by the Makefile, its build depends on the machine)
    and the project; make and environment.yml install with it; the running environment is the pinned one."""
    from importlib import metadata
    lines = [x for x in (C.REPO / "constraints.txt").read_text().splitlines() if x and not x.startswith("#")]
    pins = dict(x.split("==") for x in lines)
    assert all(len(x.split("==")) == 2 for x in lines) and "torch" not in pins and "stem-repro" not in pins
    for name in ("lm_eval", "snakemake", "transformers", "numpy", "pandas"):
        assert metadata.version(name) == pins[name], name
    make = (C.REPO / "Makefile").read_text()
    assert "pip install -q -c $(CONSTRAINTS) -e '.[test]'" in make and "torch==$(TORCH_VERSION)" in make
    torch_dir = Path(metadata.distribution("torch").locate_file(""))
    if Path(sys.prefix) in [torch_dir, *torch_dir.parents]:   # the venv's own torch: the Makefile's version
        assert metadata.version("torch").split("+")[0] == next(
            x.split("?=")[1].strip() for x in make.splitlines() if x.startswith("TORCH_VERSION"))
    else:   # the machine's torch (make TORCH=system): any release with the GPU path's features (docs/gpu.md)
        from stem.train import torchfloor
        assert torchfloor.missing() == []
    env = (C.REPO / "environment.yml").read_text()
    assert "- -c constraints.txt" in env
    floor = re.search(r'"(torch>=[0-9.]+)"', (C.REPO / "pyproject.toml").read_text()).group(1)
    assert re.findall(r"(?:pytorch|torch)\b[^\n]*", env.split("dependencies:")[1]) == [floor], \
        "environment.yml asks for another torch than pyproject.toml's floor"


def test_compare_two_checkpoints_item_by_item(tmp_path, cfg, capsys):
    """Two real (untrained, differently seeded) checkpoints evaluated by lm-eval on fixture tasks; the comparison
    reads the per-sample logs: answers are each model's highest-likelihood choice, gold the target's choice."""
    import torch

    from stem.__main__ import main
    from stem.data import synth
    from stem.data.tokenizer import train_bpe
    from stem.eval import compare as K
    from stem.eval import fixtures, run
    from stem.eval import spec as ES
    from stem.models.spec import ModelConfig
    from stem.models.model import build_model
    from stem.checkpoint import save_checkpoint
    world = {"seed": 3, "n_countries": 8, "n_people": 20, "n_filler": 100}
    docs = [doc for doc, _ in zip(synth.web_documents(synth.make_world(**world)), range(200))]
    train_bpe(docs, 320, tmp_path / "tok.json")
    c = json.loads(json.dumps(cfg))
    c["archs"]["350m"].update(vocab_size=320, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64)
    exp = reshaped(c)
    tasks = ["arc_easy", "boolq"]
    fixtures.write_fixtures({**c["eval"]["fixtures"], "world": world, "seed": 0, "items": 6, "train_items": 2,
                             "tasks": tasks, "groups": {}}, tmp_path / "fx")
    spec = {**ES.suite_spec(exp, "commonsense"), "fixtures": str(tmp_path / "fx"), "tasks": tasks}
    for seed, variant in ((0, "dense"), (1, "stem")):
        mc = C.model_config_for(exp, "350m", variant, "pretrain").to_dict()
        torch.manual_seed(seed)
        ident = {"experiment": "tiny", "scale": "350m", "variant": variant, "stage": "pretrain"}
        save_checkpoint(tmp_path / variant, build_model(ModelConfig.from_dict(mc), "cpu"), {**ident, "model": mc},
                        tmp_path / "tok.json", {})
        d = tmp_path / "results/tiny/350m" / variant / "pretrain/eval"
        run.evaluate(tmp_path / variant, spec, d / "commonsense.json", d / "raw" / "commonsense.json", limit=6)
    a = K.raw_path("350m/dense", "commonsense", "tiny", tmp_path / "results")
    b = K.raw_path(str(tmp_path / "results/tiny/350m/stem/pretrain"), "commonsense", "tiny")
    rows = K.compare(a, b)
    raw_a = K.load_samples(a)
    assert {r["task"] for r in rows} == set(tasks) and len(rows) == sum(len(raw_a[t]) for t in tasks)
    metrics = json.loads(a.parent.parent.joinpath("commonsense.json").read_text())["tasks"]
    assert {r["metric"] for r in rows if r["task"] == "arc_easy"} == {metrics["arc_easy"]["metric"].split(",")[0]}
    for r in rows:   # the answer is the choice the metric scores: the item scores 1 exactly when it is the gold one
        s = next(x for x in raw_a[r["task"]] if x["doc_id"] == r["doc_id"])
        assert (r["a"] == r["gold"]) == bool(s[r["metric"]]) and r["a"] in [x.strip() for x in K._choices(s)]
        assert (r["a"] == r["gold"]) == bool(K.answer(s, "acc") == r["gold"]) or r["metric"] == "acc_norm"
    # untrained models: acc_norm's per-character likelihood picks the same choices; raw likelihoods differ
    rows = K.compare(a, b, metric="acc")
    differ = [r for r in rows if not r["same"]]
    assert differ, "two differently initialised models answered every item alike"
    main(["compare", "350m/dense", "350m/stem", "--suite", "commonsense", "--metric", "acc",
          "--results", str(tmp_path / "results")])
    out = capsys.readouterr().out
    assert f"## Items where the answers differ ({len(differ)};" in out
    r = differ[0]
    assert f"| {r['task']} | {r['doc_id']} | " in out
    with pytest.raises(SystemExit) as e:
        main(["compare", "350m/dense", "350m/hashmoe", "--suite", "commonsense", "--results", str(tmp_path / "results")])
    assert e.value.code == 1 and "model '350m/hashmoe':" in capsys.readouterr().err


# ---- seeds (stem.seeds) -------------------------------------------------------------------------------------
def test_seeds_are_jobs_of_their_own_and_the_default_is_unchanged(cfg):
    from stem import seeds
    exp = C.experiment.parse(cfg, "tiny.yaml")
    assert seeds.seeds_of(exp, "350m", "stem") == [0, 1, 2] and seeds.seeds_of(exp, "350m", "hashmoe") == [0]
    assert C.seed_targets(exp) == [("350m", v, "pretrain") for v in ("dense_seed1", "dense_seed2", "stem_seed1",
                                                                      "stem_seed2")]
    base, two = C.train_spec(exp, "350m", "stem", "pretrain"), C.train_spec(exp, "350m", "stem_seed2", "pretrain")
    assert {k for k in base if base[k] != two[k]} == {"variant", "seed", "out_dir"}
    assert two["seed"] == cfg["seed"] + 2 and two["out_dir"] == "results/tiny/350m/stem_seed2/pretrain"
    assert base["out_dir"] == "results/tiny/350m/stem/pretrain" and base["seed"] == cfg["seed"]
    with pytest.raises(C.ConfigError, match="seed 3 of 'stem' at 350m is not asked for by the tiny config"):
        C.train_spec(exp, "350m", "stem_seed3", "pretrain")
    bad = json.loads(json.dumps(cfg))
    bad["matrix"]["350m"]["seeds"] = {"moe": [0, 1]}
    with pytest.raises(C.ConfigError, match=r"key 'matrix.350m.seeds.moe': 'moe' is not one of matrix.350m.variants"):
        C.experiment.parse(bad, "x.yaml")
    whole = json.loads(json.dumps(cfg))
    del whole["matrix"]["350m"]["seeds"]
    whole["seeds"] = [0, 1]
    # every variant, every stage it trains (stem_insert starts at midtrain)
    whole = C.experiment.parse(whole, "tiny.yaml (seeds: [0, 1])")
    assert len(C.seed_targets(whole)) == 9 + 3 * 3 + 2
    mid = C.train_spec(whole, "1b", "stem_seed1", "midtrain")   # a later stage starts from the same seed's
    assert mid["init_from"] == "results/tiny/1b/stem_seed1/pretrain/checkpoint" and mid["seed"] == cfg["seed"] + 1
    from stem.eval.spec import eval_targets
    assert "results/tiny/350m/stem_seed1/pretrain/eval/commonsense.json" in eval_targets(exp)


def test_seeded_bootstrap_folds_the_seed_variance():
    rng = np.random.default_rng(0)
    a = [rng.integers(0, 2, 400).astype(float) for _ in range(3)]
    shift = [0.15, -0.15, 0.15]   # each seed alone: a clear effect, in disagreeing directions
    per_seed = [[(x, np.clip(x + (rng.random(400) < abs(s)) * np.sign(s), 0, 1))] for x, s in zip(a, shift)]
    alone = [V.grouped_bootstrap(g) for g in per_seed]
    assert all(c["lo"] > 0 or c["hi"] < 0 for c in alone)
    folded = V.seeded_bootstrap(per_seed)
    assert folded["lo"] < 0 < folded["hi"] and folded["seeds"] == 3 and folded["n"] == 1200
    assert folded["delta"] == pytest.approx(np.mean([c["delta"] for c in alone]))
    assert V.seeded_bootstrap(per_seed[:1])["lo"] == alone[0]["lo"]


def two_level_bootstrap(per_seed, n_boot, rng):
    """Written apart from stem.report.verdict, one draw at a time: pick the seeds with replacement, then for
    every pick resample each group's items afresh; the draw is the mean over picks of the mean over groups."""
    draws = []
    for _ in range(n_boot):
        picks = rng.choice(len(per_seed), size=len(per_seed), replace=True)
        draws.append(np.mean([np.mean([(b - a)[rng.choice(len(a), size=len(a))].mean() for a, b in per_seed[k]])
                              for k in picks]))
    return np.quantile(draws, [0.025, 0.975])


def test_seeded_bootstrap_is_a_two_level_bootstrap():
    """Three seeds with nearly the same items: the item variance dominates. Sharing one item resample between
    two picks of the same seed (the bug of issue 32) widens the interval by ~sqrt(5/3), each end ~15 % of the
    width out; the Monte-Carlo tolerance is 6 % of the width at each end (~3 sd of the two estimates' gap,
    measured over 8 seed pairs: sd 0.015)."""
    rng = np.random.default_rng(7)
    base = [(x, x + 0.2 + rng.normal(size=x.size)) for x in (rng.normal(size=60), rng.normal(size=30))]
    per_seed = [[(a, b + 0.05 * rng.normal(size=b.size)) for a, b in base] for _ in range(3)]
    ours = V.seeded_bootstrap(per_seed, n_boot=4000, seed=1)
    lo, hi = two_level_bootstrap(per_seed, 4000, np.random.default_rng(12345))
    tol = 0.06 * (hi - lo)
    assert ours["lo"] == pytest.approx(lo, abs=tol) and ours["hi"] == pytest.approx(hi, abs=tol)


def test_seed_rows_in_table3_and_directions(tmp_path, cfg):
    from stem.report import tables as T
    from test_report import eval_json
    cfg = C.experiment.parse({**cfg, "matrix": {
        "350m": {**cfg["matrix"]["350m"], "variants": ["dense", "hashmoe", "stem"]},
        "1b": {**cfg["matrix"]["1b"], "seeds": {"dense": [0, 1], "stem": [0, 1]}}}})
    write_results(tmp_path, cfg)
    write_samples(tmp_path, cfg)
    # Table 4 (1b at midtrain): seed 1 of STEM scores 2 points above seed 0 on every task
    d = tmp_path / "tiny" / "1b" / "stem_seed1" / "midtrain" / "eval"
    (d / "commonsense.json").write_text(json.dumps(eval_json(cfg, "1b", "stem_seed1", "midtrain", "commonsense", 3.0)))
    t4 = T.table4(cfg, Results("tiny", tmp_path)).set_index(["scale", "variant", "column"])["value"]
    one = P.load_table("table3").set_index(["scale", "variant", "column"])["value"]
    avg0 = np.mean([one[("1b", "stem", t)] + 1.0 for t in P.COMMONSENSE_TASKS])
    assert t4[("1b", "stem", "avg")] == pytest.approx(avg0 + 1.0) and t4[("1b", "stem", "seeds")] == 2
    assert t4[("1b", "stem", "avg_sd")] == pytest.approx(np.sqrt(2)) and t4[("1b", "stem", "avg_max")] == pytest.approx(avg0 + 2)
    assert ("1b", "stem_insert", "seeds") not in t4
    for k, offset in ((1, 2.0), (2, -1.0)):
        for variant in ("dense", "stem"):
            d = tmp_path / "tiny" / "350m" / f"{variant}_seed{k}" / "pretrain"
            (d / "eval" / "raw").mkdir(parents=True, exist_ok=True)
            e = {**eval_json(cfg, "350m", variant, "pretrain", "commonsense", {"dense": 0.0}.get(variant, 1.0) + offset),
                 "variant": f"{variant}_seed{k}"}
            (d / "eval" / "commonsense.json").write_text(json.dumps(e))
            src = tmp_path / "tiny" / "350m" / variant / "pretrain" / "eval" / "raw" / "commonsense.json"
            (d / "eval" / "raw" / "commonsense.json").write_text(src.read_text())
    t3 = T.table3(cfg, Results("tiny", tmp_path)).set_index(["scale", "variant", "column"])["value"]
    losses = [json.loads((tmp_path / "tiny" / "350m" / v / "pretrain" / "summary.json").read_text())["final_val_loss"]
              for v in ("stem", "stem_seed1", "stem_seed2")]
    assert t3[("350m", "stem", "val_loss")] == pytest.approx(np.mean(losses))
    assert t3[("350m", "stem", "val_loss_sd")] == pytest.approx(np.std(losses, ddof=1))
    avgs = [np.mean([one[("350m", "stem", t)] + 1.0 + o for t in P.COMMONSENSE_TASKS]) for o in (0.0, 2.0, -1.0)]
    assert t3[("350m", "stem", "avg")] == pytest.approx(np.mean(avgs))
    assert t3[("350m", "stem", "seeds")] == 3 and t3[("350m", "stem", "avg_sd")] == pytest.approx(np.std(avgs, ddof=1))
    assert t3[("350m", "stem", "avg_min")] == pytest.approx(min(avgs)) and ("350m", "hashmoe", "seeds") not in t3
    rows = {(r["table"], r["variant"], r["column"]): r for r in V.table_directions(cfg, results=tmp_path)
            if r["scale"] == "350m"}
    assert rows[("table3", "stem", "arc_easy")]["seeds"] == 3 and rows[("table3", "stem", "arc_easy")]["verdict"] == "agree"
    assert rows[("table3", "hashmoe", "arc_easy")]["seeds"] == 0


def test_compare_names_choices_that_share_their_text(tmp_path):
    """WinoGrande's options are in the contexts, its choices one shared continuation: answers are 'choice i' and
    the gold one is the choice that scored 1 (its target is the continuation, not an index)."""
    from stem.eval import compare as K

    def sample(doc_id, lls, acc):
        return {"doc_id": doc_id, "target": "went home.", "filter": "none", "acc": acc,
                "arguments": [["Anna asked Bea because Anna", " went home."], ["Anna asked Bea because Bea", " went home."]],
                "filtered_resps": [[ll, False] for ll in lls]}
    for name, items in (("a", [sample(0, [-1, -2], 1.0), sample(1, [-1, -2], 0.0)]),
                        ("b", [sample(0, [-2, -1], 0.0), sample(1, [-2, -1], 1.0)])):
        (tmp_path / f"{name}.json").write_text(json.dumps({"samples": {"winogrande": items}}))
    rows = K.compare(tmp_path / "a.json", tmp_path / "b.json")
    assert [(r["a"], r["b"], r["gold"]) for r in rows] == [("choice 0", "choice 1", "choice 0"),
                                                           ("choice 0", "choice 1", "choice 1")]
    (tmp_path / "c.json").write_text(json.dumps({"results": {}}))
    with pytest.raises(K.CompareError, match="c.json: no per-sample logs"):
        K.compare(tmp_path / "a.json", tmp_path / "c.json")


# ---- issue 39: the directions of one report are one family (multiple comparisons) ------------------------------
def holm_rejections(p, alpha):
    """Holm's step-down procedure as he wrote it, apart from stem.report.verdict.adjust: order the p-values,
    reject H_(1), H_(2), ... while p_(k) <= alpha / (m - k + 1); stop at the first that is not."""
    m, out = len(p), set()
    for k, i in enumerate(sorted(range(m), key=lambda j: p[j]), start=1):
        if p[i] > alpha / (m - k + 1):
            break
        out.add(i)
    return out


def test_adjusted_p_values_against_independent_implementations():
    from scipy.stats import false_discovery_control
    rng = np.random.default_rng(39)
    for _ in range(20):
        p = np.concatenate([rng.uniform(0, 1, 30), rng.uniform(0, 0.002, 5), [0.01, 0.01]])   # ties included
        assert V.adjust(p, "bh") == pytest.approx(false_discovery_control(p, method="bh"), abs=1e-12)
        holm = V.adjust(p, "holm")
        for alpha in (0.001, 0.01, 0.05, 0.2):
            assert set(np.flatnonzero(holm <= alpha)) == holm_rejections(list(p), alpha)
    assert V.adjust([0.3, 0.01], "none").tolist() == [0.3, 0.01] and V.adjust([], "holm").size == 0
    with pytest.raises(ValueError, match="procedure 'bonferroni': expected holm, bh or none"):
        V.adjust([0.1], "bonferroni")


def test_p_value_is_the_bootstraps_and_matches_its_interval():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 2, 200).astype(float)
    b = np.where(rng.uniform(size=200) < 0.3, 1.0, a)   # b answers more items right: a real effect
    ci = V.paired_bootstrap(a, b)
    assert ci["lo"] > 0 and V.p_value(ci) < 0.05 and ci["se"] > 0
    same = V.paired_bootstrap(a, a)
    assert V.p_value(same) == 1.0 and V.classify(same, 1) == "inconclusive"
    assert V.p_value({"delta": 0.5, "se": 0.0}) == 0.0   # every draw the same non-zero difference
    cols = V.ci_cols(ci, 1.0)
    assert cols["p"] == V.p_value(ci) and V.ci_cols(None, 1.0)["p"] is None


def null_family(m=120, items=40, seed=0):
    """``m`` directions where nothing differs: both models' items drawn from the same distribution."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(m):
        a, b = rng.integers(0, 2, items).astype(float), rng.integers(0, 2, items).astype(float)
        rows.append(V.ci_cols(V.paired_bootstrap(a, b, seed=int(rng.integers(1 << 30))), 1.0))
    return rows


def test_controlled_verdicts_hold_the_family_error_where_raw_ones_do_not():
    """Under no difference at all, per-cell 95% intervals resolve about 5% of a family (the issue's ~6 of 127);
    Holm and BH resolve none; a real effect in the family survives. The raw verdict stays beside the controlled."""
    rows = null_family()
    raw = sum(V.category(r["verdict"]) in ("agree", "disagree") for r in rows)
    assert 1 <= raw <= 15   # expected 120 x 0.05 = 6
    a = np.zeros(60)
    effect = V.ci_cols(V.paired_bootstrap(a, np.ones(60) * (np.arange(60) % 3 > 0)), 1.0)   # +0.67, 60 items
    point = {"ours_delta": 0.1, "lo": None, "hi": None, "n": 3, "verdict": "agree (point estimate)"}
    for procedure in ("holm", "bh"):
        out = V.control(rows + [effect, point], procedure, 0.05)
        assert [r["raw_verdict"] for r in out[:-1]] == [r["verdict"] for r in rows + [effect]]
        assert sum(V.category(r["verdict"]) in ("agree", "disagree") for r in out[:-2]) == 0
        assert out[-2]["verdict"] == "agree" and out[-2]["p_adjusted"] <= 0.05
        assert out[-1]["verdict"] == "agree (point estimate)" and out[-1]["p_adjusted"] is None   # not tested
    none = V.control(rows, "none", 0.05)
    assert [r["verdict"] for r in none] == [r["verdict"] for r in rows]


def test_summary_says_what_chance_alone_gives_and_the_gate_uses_controlled_verdicts(report):
    root, rd, (s, cells, dirs, cons, _) = report
    d = s["directions"]
    boot = dirs[dirs["origin"] == diff.BOOTSTRAP]
    assert d["procedure"] == "holm" and d["alpha"] == 0.05 and d["tested"] == int(boot["p"].notna().sum()) > 0
    assert d["chance_raw"] == pytest.approx(d["tested"] * 0.05) and d["raw"] == V.count(boot["raw_category"])
    md = (rd / "diff" / "diff.md").read_text()
    assert f"Multiple comparisons: **{d['tested']}** directions are tested" in md
    assert f"would resolve about **{d['chance_raw']:.1f}**" in md and "Holm, family-wise error" in md
    saved = B.load_directions(rd / "diff" / "directions.csv")
    assert {"p", "p_adjusted", "raw_verdict"} <= set(saved.columns)
    # a raw disagreement the control makes inconclusive does not fail the gate; one it keeps does
    weak = dirs.copy()
    i = weak.index[(weak["variant"] == "stem") & (weak["column"] == "arc_challenge") & (weak["scale"] == "350m")][0]
    assert weak.loc[i, "raw_category"] == "disagree" and diff.gate_directions(weak)
    weak.loc[i, ["verdict", "category"]] = "inconclusive"
    assert diff.gate_directions(weak) == []


@pytest.mark.parametrize("key, value, message", [
    ("procedure", "bonferroni", "key 'report.directions.procedure': expected one of holm, bh, none, got 'bonferroni'"),
    ("alpha", 1.0, "key 'report.directions.alpha': expected a number in (0, 1), got 1.0"),
    ("alpha", 0, "key 'report.directions.alpha': expected a number in (0, 1), got 0")])
def test_bad_direction_control_is_one_line(exp, key, value, message):
    from stem.specs import ReportSpec, SpecError
    with pytest.raises(SpecError, match=re.escape(message)):
        ReportSpec.from_config(exp.experiment, {"directions": {key: value}})


@pytest.mark.parametrize("args, message", [
    (["--procedure", "fdr"], "argument --procedure: procedure 'fdr': expected one of holm, bh, none"),
    (["--alpha", "1.5"], "argument --alpha: 1.5: expected a number in (0, 1)"),
    (["--alpha", "0"], "argument --alpha: 0: expected a number in (0, 1)")])
def test_bad_direction_options_write_nothing(report, tmp_path, capsys, monkeypatch, args, message):
    from stem.__main__ import main
    root, _, _ = report
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["diff", "--experiment", "tiny", "--results", str(root / "results"), "--write", *args])
    err = capsys.readouterr().err
    assert e.value.code == 1 and message in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_procedure_option_changes_the_verdicts_it_controls(report, capsys):
    from stem.__main__ import main
    root, _, _ = report
    base = ["diff", "--experiment", "tiny", "--results", str(root / "results"), "--json"]
    main(base + ["--procedure", "none"])
    raw = json.loads(capsys.readouterr().out)["directions"]
    main(base + ["--procedure", "bh", "--alpha", "0.1"])
    bh = json.loads(capsys.readouterr().out)["directions"]
    assert raw["procedure"] == "none" and raw["checked"] == raw["raw"]
    assert bh["procedure"] == "bh" and bh["alpha"] == 0.1 and bh["raw"] == raw["raw"]


def test_the_report_says_what_the_numbers_were_computed_with():
    """Issue 39: each result's runtime (device, dtype, threads, CPU kernels) is in the provenance table, and the
    diff summary warns when the compared results were computed on different ones."""
    from stem.report import provenance as RP
    from stem.report import tables as T
    cpu = {"device": "cpu", "dtype": "float32", "threads": 1, "cpu_capability": "AVX2", "deterministic": True,
           "env": {}, "requested_device": "cpu"}
    assert RP.runtime_label(cpu) == "cpu float32 1t AVX2 det" and RP.runtime_label(None) is None
    assert RP.runtime_label({**cpu, "cpu_capability": "AVX512", "env": {"MKL_CBWR": "COMPATIBLE"},
                             "requested_device": "cuda"}) == "cpu float32 1t AVX512 det MKL_CBWR=COMPATIBLE (requested cuda)"
    rows = [T.cell("provenance", "350m", v, c, x, f"{v}.json", row=f"{v} pretrain: summary", unit="")
            for v, label in (("dense", "cpu float32 1t AVX2 det"), ("stem", "cpu float32 1t AVX512 det"))
            for c, x in (("commit", "abc clean"), ("torch", "2.13"), ("runtime", label))]
    s = RP.results_summary(T.frame(rows))
    assert s["runtimes"] == {"cpu float32 1t AVX2 det": 1, "cpu float32 1t AVX512 det": 1}
    line = diff.provenance_lines({"results": s, "report": {}})[0]
    assert "computed with cpu float32 1t AVX2 det (1); cpu float32 1t AVX512 det (1)" in line
    assert "⚠ **on different devices, kernels or threads**" in line
