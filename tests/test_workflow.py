"""The Snakemake workflow: the paper DAG (dry run), a reduced tiny DAG run for real, one-target reruns,
and bad input stopping with one clear line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import job_counts

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile")]


def snakemake(*args, cwd, warm=False):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    warm_start = [sys.executable, "-m", "stem.warm", "--"] if warm else []   # as make smoke runs it (stem/warm.py)
    return subprocess.run([*warm_start, *SNAKEMAKE, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


GATE_TASKS = ["arc_easy", "boolq", "piqa"]
NULL_TWIN, PLANTED = "stem_gate", "stem_half"   # paper variants (so Table 3 / the loss claim read them), overridden


def _reduced_config(tmp_path) -> Path:
    cfg = yaml.safe_load((REPO / "config/tiny.yaml").read_text())
    cfg["matrix"] = {"350m": {"variants": ["dense", "stem", NULL_TWIN, PLANTED], "stages": ["pretrain"]},
                     "1b": {"variants": ["stem"], "stages": ["pretrain", "midtrain"]}}
    # the directions gate's controls (issue 39), through the config's own options: a null twin (the baseline
    # trained again under another id: it must not be flagged) and a planted effect (STEM with every matrix's
    # learning rate x1000: it diverges; the gate must catch its held-out loss)
    cfg["variant_overrides"] = {**cfg.get("variant_overrides", {}),
                                NULL_TWIN: {"ffn": "dense", "label": "null control: the baseline again"},
                                PLANTED: {"optim": {"groups": {"matrix": {"lr_mult": 1000.0}}},
                                          "label": "planted effect: STEM, matrix LR x1000"}}
    cfg["analysis"] = {"stages": {"350m": ["pretrain"]}, "heldout": {"source": "web", "windows": 24, "seq_len": 32}}
    del cfg["knowledge"]   # the reduced knowledge world: tests/test_knowledge.py (its specs) and make smoke
    cfg["sources"] = {"web": {"kind": "synth", "generator": "web", "bytes": 60000, "val_fraction": 0.1},
                      "math": {"kind": "synth", "generator": "math", "bytes": 15000},
                      "code": {"kind": "synth", "generator": "code", "bytes": 15000}}
    for scale in ("350m", "1b"):
        cfg["tokenizer"][scale]["vocab_size"] = 400
        cfg["archs"][scale].update(d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=48)
    cfg["stages"]["midtrain"]["1b"]["data"] = {"web": 0.6, "math": 0.2, "code": 0.2}
    for stage in ("pretrain", "midtrain"):
        for spec in cfg["stages"][stage].values():
            spec.update(steps=6, batch_size=4, micro_batch=2, seq_len=32)
    del cfg["stages"]["extend"]
    cfg["train"] = {"log_interval": 3, "eval_interval": 3, "eval_batches": 1, "checkpoint_interval": 3}
    # the 350m pair's Table 3 directions on three small fixture tasks: the direction gate's input
    cfg["eval"]["fixtures"].update(items=16, train_items=4, items_by_prefix={}, groups={}, tasks=GATE_TASKS)
    cfg["eval"]["suites"]["commonsense"]["tasks"] = GATE_TASKS
    path = tmp_path / "reduced.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


TARGETS = ["results/tiny/350m/dense/pretrain/summary.json", "results/tiny/350m/stem/pretrain/summary.json",
           "results/tiny/1b/stem/midtrain/summary.json", "reports/tiny/params.md",
           *[f"results/tiny/350m/{v}/pretrain/eval/commonsense.json" for v in ("dense", "stem", NULL_TWIN)],
           *[f"results/tiny/350m/{v}/pretrain/analysis/heldout.json" for v in ("dense", PLANTED)]]
# The direction gate's committed baseline: diff/directions.csv of the reduced DAG below (regenerate it, after a
# deliberate change, with `python -m stem diff --experiment <reduced.yaml> --results <its results> --write` and
# copy reports/tiny/diff/directions.csv here).
GATE_BASELINE = REPO / "tests" / "gate" / "reduced_directions.csv"


@pytest.fixture(scope="module")
def reduced_run(tmp_path_factory):
    """The reduced tiny DAG, run once for the tests below: (folder, config path, snakemake arguments)."""
    tmp_path = tmp_path_factory.mktemp("reduced")
    cfg = _reduced_config(tmp_path)
    args = ["--configfile", str(cfg), "--replace-workflow-config", "-d", str(tmp_path), "--cores", "2"]
    r = snakemake(*args, *TARGETS, cwd=tmp_path, warm=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp_path, cfg, args


def test_reduced_tiny_dag_runs_for_real_and_reruns_nothing(reduced_run):
    tmp_path, cfg, args = reduced_run
    for t in TARGETS:
        assert (tmp_path / t).is_file(), t
    mid = json.loads((tmp_path / TARGETS[2]).read_text())
    assert mid["stage"] == "midtrain" and mid["steps"] == 6 and set(mid["tokens_by_source"]) == {"web", "math", "code"}
    assert (tmp_path / "results/tiny/1b/stem/midtrain/checkpoint/model.safetensors").is_file()
    assert "| 350m | stem_full |" in (tmp_path / "reports/tiny/params.md").read_text()
    # nothing left to do for the targets, and one more target runs only its own job: one dry run of both (one
    # Snakemake start-up, not two)
    r = snakemake(*args, "-n", *TARGETS, "results/tiny/350m/stem_full/pretrain/summary.json", cwd=tmp_path)
    assert job_counts(r.stdout) == {"train": 1, "total": 1}, r.stdout[-3000:]
    assert "results/tiny/350m/stem_full/pretrain/summary.json" in r.stdout


# What carries no provenance, by design (docs/confidence.md): a checkpoint's own files (its job spec and
# accounting; the summary beside it has the provenance) and the resumable training state, lm-eval's raw output
# (the eval JSON beside it has it),
# the data stage's manifests and tokenizers (hashed by every job that reads them).
NO_PROVENANCE = ("/checkpoint/", "/_state/", "/eval/raw/", "data/")


def test_every_json_output_carries_provenance(reduced_run):
    tmp_path, _, _ = reduced_run
    from stem import provenance
    outputs = [p for p in tmp_path.rglob("*.json") if ".snakemake" not in p.parts and not any(
        x in f"{p.relative_to(tmp_path).as_posix()}" for x in NO_PROVENANCE)]
    kinds = {p.name if "/eval/" not in p.as_posix() else "eval" for p in outputs}
    assert kinds == {"summary.json", "eval", "heldout.json"}, kinds   # the other analyses: tests/test_analysis.py
    for p in outputs:
        prov = json.loads(p.read_text()).get("provenance")
        assert prov and set(prov) >= {"commit", "dirty", "versions", "spec_sha256", "manifests",
                                      "tokenizer_sha256"}, p
        assert prov["tokenizer_sha256"] and prov["spec_sha256"], p
        if "/eval/" in p.as_posix():   # computed from a checkpoint
            train = json.loads((p.parents[1] / "checkpoint" / "config.json").read_text())
            assert prov["train_spec_sha256"] == provenance.spec_hash(train), p
    ev = json.loads((tmp_path / TARGETS[4]).read_text())["provenance"]["data"]
    assert ev["fixtures"]["sha256"] == provenance.tree_hash(tmp_path / ev["fixtures"]["dir"])
    assert set(ev["items_sha256"]) == set(GATE_TASKS)


def test_direction_gate_on_the_reduced_dag(reduced_run, tmp_path, capsys, monkeypatch):
    """CI's direction gate (make test), issue 39: it catches the planted effect (exit 2, one line naming its cell
    and nothing else) and never flags the null twin; with the planted cell accepted (by cell and verdict: the
    interval recorded with it is deliberately not today's) it passes against the committed baseline; a flipped
    verdict fails with one line naming its cell."""
    from stem.__main__ import main
    from stem.report.diff import gate_directions, load_directions
    run_dir, cfg, _ = reduced_run
    monkeypatch.chdir(run_dir)   # --write: reports/tiny/diff/ under the run's folder
    args = ["diff", "--experiment", str(cfg), "--results", "results", "--allow-dirty", "--json", "--write"]
    planted = f"heldout_loss/350m/{PLANTED}/val_loss"
    with pytest.raises(SystemExit) as e:
        main(args + ["--gate-directions"])
    gate = [x for x in capsys.readouterr().err.splitlines() if x.startswith("direction gate: ")]
    assert e.value.code == 2 and len(gate) == 1, gate
    assert gate[0].startswith(f"direction gate: {planted} (pretrain): disagrees with the paper (ours +"), gate
    now = load_directions(run_dir / "reports/tiny/diff/directions.csv")
    twin = now[(now["variant"] == NULL_TWIN) & now["column"].isin(GATE_TASKS)]
    assert len(twin) == len(GATE_TASKS) and set(twin["category"]) == {"inconclusive"}
    assert set(twin["ours_delta"]) == {0.0} and set(twin["p"]) == {1.0}   # the same model: no difference at all
    accepted = tmp_path / "accepted.yaml"
    accepted.write_text(yaml.safe_dump([{"cell": planted, "stage": "pretrain", "verdict": "disagree",
                                         "interval": [1.0, 2.0], "reason": "the gate's positive control"}]))
    main(args + ["--baseline", str(GATE_BASELINE), "--accepted", str(accepted)])   # the gate passes: no SystemExit
    flipped = load_directions(GATE_BASELINE)
    i = flipped.index[(flipped["table"] == "table3") & (flipped["variant"] == "stem")
                      & (flipped["column"] == "arc_easy") & (flipped["scale"] == "350m")][0]
    was = "agree" if flipped.loc[i, "category"] != "agree" else "inconclusive"
    flipped.loc[i, "category"] = was
    assert gate_directions(now, flipped) == [gate[0].removeprefix("direction gate: "),
        f"table3/350m/stem/arc_easy (pretrain): verdict changed against the baseline: {was} -> "
        f"{now.loc[i, 'category']} (ours {now.loc[i, 'ours_delta']:+.3g} [{now.loc[i, 'lo']:+.3g}, "
        f"{now.loc[i, 'hi']:+.3g}])"]


def test_the_same_job_twice_is_bit_identical(reduced_run):
    """Issue 39 item 1: the null twin is the baseline's training job again under another id (another process,
    beside other jobs at --cores 2): the same weights byte for byte, the same losses, the same answers."""
    run_dir = reduced_run[0]
    a, b = (run_dir / f"results/tiny/350m/{v}/pretrain" for v in ("dense", NULL_TWIN))
    assert (a / "checkpoint/model.safetensors").read_bytes() == (b / "checkpoint/model.safetensors").read_bytes()
    losses = [[json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (a, b)]
    assert losses[0] == losses[1] and len(losses[0]) >= 2
    samples = [json.loads((d / "eval/raw/commonsense.json").read_text())["samples"] for d in (a, b)]
    assert {t: [x["acc"] for x in v] for t, v in samples[0].items()} == \
        {t: [x["acc"] for x in v] for t, v in samples[1].items()}


BAD_CONFIGS = [
    (lambda c: c["stages"]["pretrain"]["350m"].update(lrr=1.0), "key 'stages.pretrain.350m.lrr': unknown"),
    (lambda c: c["matrix"]["350m"].update(variants=["dense", "stem_quarter"]), "key 'matrix.350m.variants': 'stem_quarter' is not a variant of config/variants.yaml"),
    (lambda c: c["stages"]["pretrain"]["350m"].update(data={"web": 0.5}), "mixture weights sum to 0.5, expected 1"),
    (lambda c: c["stages"]["pretrain"]["350m"].update(data={"wikipedia": 1.0}), "unknown source 'wikipedia'"),
    (lambda c: c["stages"]["pretrain"]["350m"].update(seq_len=4096), "exceeds the model's max_seq_len 256"),
    (lambda c: c["tokenizer"]["350m"].update(vocab_size=100000), "exceeds archs.350m.vocab_size"),
    (lambda c: c["eval"]["suites"]["ppl"].update(kind="perplexity"),
     "key 'eval.suites.ppl.kind': unknown suite kind 'perplexity'; expected one of ['lm_eval', 'longppl', 'niah', 'ppl']"),
]


def _bad_config(edit) -> dict:
    cfg = yaml.safe_load((REPO / "config/tiny.yaml").read_text())
    edit(cfg)
    return cfg


@pytest.mark.parametrize("edit, message", BAD_CONFIGS)
def test_bad_config_stops_with_one_clear_line(edit, message):
    """The workflow's config check (rules/common.smk: the typed tree, parsed once as the Snakefile is read) names
    each bad key in one line; the test below runs one of them through Snakemake itself."""
    from stem import config as C
    with pytest.raises(C.ConfigError) as e:
        C.experiment.parse(_bad_config(edit), origin="workflow config")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_bad_config_stops_the_workflow_before_any_job(tmp_path):
    """Through Snakemake (one of the cases above, a process of its own): non-zero exit, the check's line, nothing
    written."""
    edit, message = BAD_CONFIGS[0]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_bad_config(edit)))
    r = snakemake("-n", "--configfile", str(path), "--replace-workflow-config", "-d", str(tmp_path), cwd=tmp_path)
    assert r.returncode != 0
    assert message in r.stdout + r.stderr
    assert not (tmp_path / "results").exists()


def test_unknown_variant_and_scale_on_the_command_line():
    for args, message in [(["--scale", "1b", "--variant", "stem_quarter"], "variant 'stem_quarter'"),
                          (["--scale", "7b", "--variant", "stem"], "scale '7b'")]:
        r = subprocess.run([sys.executable, "-m", "stem", "params", "--experiment", "paper", *args],
                           cwd=REPO, capture_output=True, text=True)
        assert r.returncode == 1
        assert r.stderr.strip().count("\n") == 0 and message in r.stderr


def test_missing_tokenizer_and_missing_corpus(tmp_path):
    from stem.pipeline import tokenize
    with pytest.raises(ValueError, match="nope/tokenizer.json"):
        tokenize({"documents": {"kind": "files", "paths": ["x.jsonl"], "format": "jsonl"}, "seed": 0,
                  "vocab_size": 512}, tmp_path / "nope" / "tokenizer.json", tmp_path / "out")
    from stem.data.sources import iter_documents
    with pytest.raises(ValueError, match="missing.jsonl"):
        list(iter_documents({"kind": "files", "paths": [str(tmp_path / "missing.jsonl")], "format": "jsonl"}))
