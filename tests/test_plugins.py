"""Extending through a config's ``plugins:`` (docs/extending.md), in fresh processes as Snakemake loads the
workflow: a suite kind, an FFN kind, a report table and an analysis, each one module of tests/plugins/ plus
lines of the experiment config (its ``plugins:`` entry and the config keys that use it), nothing else.
The config check sees them (it once rejected a suite kind registered where rules/eval.smk imports it), the
job specs carry the plugin list to the jobs, a real ``snakemake --dry-run`` plans their jobs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stem import registry

REPO = Path(__file__).resolve().parents[1]
PLUGINS = ["toy_suite_kind", "toy_ffn_kind", "toy_report_table", "toy_analysis"]
ENV = {**os.environ, "PYTHONPATH": str(REPO / "tests" / "plugins"),
       "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def _config(tmp_path, plugins=PLUGINS) -> Path:
    """config/tiny.yaml, reduced to one scale, with the four toys: one ``plugins:`` line and the keys that use
    them (a suite, a variant override, an analysis key; a report table needs no key)."""
    cfg = yaml.safe_load((REPO / "config/tiny.yaml").read_text())
    cfg["matrix"] = {"350m": {"variants": ["dense", "hashmoe", "stem"], "stages": ["pretrain"]}}
    cfg["plugins"] = plugins
    cfg["eval"]["suites"]["toy"] = {"kind": "toy_logprob"}
    cfg["eval"]["stages"]["pretrain"] = ["toy"]
    cfg["variant_overrides"]["hashmoe"] = {"ffn": "relu2"}   # at Hash-MoE's placement (layers 2 and 5 of 6)
    cfg["analysis"]["toy_norms"] = {"top": 3}
    del cfg["knowledge"]   # no reduced knowledge world: its points are train jobs of their own (make smoke has it)
    cfg["analysis"] = {k: v for k, v in cfg["analysis"].items() if not k.startswith("knowledge")}
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "toys.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


CHECK = r'''
import json, sys
from stem import config as C
errors = []
for path in sys.argv[2:]:   # configs whose plugin lists lack a toy the config uses: each refused in one line
    try:
        C.experiment.load(path)
        errors.append(None)
    except C.ConfigError as e:
        errors.append(str(e))
from stem.eval import spec as EV
from stem.analysis import workflow as AW
from stem.report import workflow as RW
from stem.models.model import meta_model
cfg = C.experiment.load(sys.argv[1])                    # the config check of the full list
train = C.train_spec(cfg, "350m", "hashmoe", "pretrain")
model = meta_model(json.dumps(train["model"], sort_keys=True))
print(json.dumps({
    "errors": errors,
    "ffn": sorted({type(layer.ffn).__name__ for layer in model.layers}),
    "train_plugins": train.get("plugins"),
    "eval": [p for p in EV.eval_targets(cfg) if p.endswith("/toy.json")],
    "eval_spec": EV.job_spec(cfg, "tiny", "350m", "stem", "pretrain", "toy"),
    "eval_inputs": EV.rule_inputs(cfg, "tiny", "350m", "stem", "pretrain", "toy"),
    "analysis": [p for p in AW.targets(cfg) if p.endswith("/toy_norms.json")],
    "analysis_spec": AW.job_spec(cfg, "350m", "stem", "pretrain", "toy_norms"),
    "report": [p for p in RW.report_outputs("tiny") if "toy_lookup" in p],
}))
'''


def test_the_config_check_in_a_fresh_process_sees_the_plugins(tmp_path):
    """One process, as the Snakefile's: the plugins named so far are imported by each check (a module stays
    imported), so each config below lacks the next toy's plugin line and is refused naming its key."""
    lacking = [[], ["toy_suite_kind"], ["toy_suite_kind", "toy_analysis"], [*PLUGINS, "no_such_plugin"]]
    paths = [_config(tmp_path / str(i), plugins) for i, plugins in enumerate(lacking)]
    r = subprocess.run([sys.executable, "-c", CHECK, str(_config(tmp_path)), *map(str, paths)], cwd=REPO, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert [e.split(": ", 1)[1] for e in got["errors"]] == [
        "key 'eval.suites.toy.kind': unknown suite kind 'toy_logprob'; expected one of ['lm_eval', 'longppl', 'niah', 'ppl']",
        "key 'analysis.toy_norms': unknown analysis; expected stages or one of editing, heaps, spread, capacity, "
        "heldout, hf_parity, insertion_step0, logitlens, cka, dse_disabled, knowledge, knowledge_edit",
        "variant 'hashmoe' (config/variants.yaml + variant_overrides): key 'ffn': 'relu2' is not a registered FFN "
        "kind; expected one of dense, stem, stem_gate, stem_dagger, hashmoe, moe",
        "key 'plugins': plugin module 'no_such_plugin' cannot be imported (No module named 'no_such_plugin'); "
        "expected a module importable from the repository root or PYTHONPATH"]
    assert got["ffn"] == ["DenseFFN", "Relu2FFN"] and got["train_plugins"] == PLUGINS
    assert got["eval"] == [f"results/tiny/350m/{v}/pretrain/eval/toy.json" for v in ("dense", "hashmoe", "stem")]
    assert (got["eval_spec"]["kind"], got["eval_spec"]["pairs_file"]) == ("toy_logprob", "data/tiny/toy_pairs.json")
    assert got["eval_spec"]["plugins"] == PLUGINS and got["eval_inputs"]["pairs"] == "data/tiny/toy_pairs.json"
    assert got["analysis"] == ["results/tiny/350m/stem/pretrain/analysis/toy_norms.json"]   # only_for: STEM tables
    assert got["analysis_spec"]["top"] == 3 and got["analysis_spec"]["plugins"] == PLUGINS
    assert {"reports/tiny/tables/toy_lookup.csv", "reports/tiny/tables/toy_lookup.md"} <= set(got["report"])


def test_snakemake_dry_run_plans_the_toys_jobs(tmp_path):
    (tmp_path / "data" / "tiny").mkdir(parents=True)
    (tmp_path / "data" / "tiny" / "toy_pairs.json").write_text("[]")   # the toy suite's input (its inputs hook)
    r = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--dry-run", "-p",
                        "--cores", "1", "--configfile", str(_config(tmp_path)), "--replace-workflow-config",
                        "results/tiny/350m/hashmoe/pretrain/eval/toy.json",
                        "results/tiny/350m/stem/pretrain/analysis/toy_norms.json",
                        "reports/tiny/tables/toy_lookup.csv"],
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    jobs = [line for line in r.stdout.splitlines() if "python -m workflow_scripts." in line]
    train = [j for j in jobs if "workflow_scripts.train " in j or "workflow_scripts.launch" in j]
    assert len(train) == 3   # the toy table reads every model's checkpoint (its inputs hook)
    assert [j for j in train if '"variant": "hashmoe"' in j and '"ffn": ["dense", "dense", "relu2", ' in j]
    assert all('"plugins": ["toy_suite_kind", "toy_ffn_kind", "toy_report_table", "toy_analysis"]' in j
               for j in jobs if any(f"workflow_scripts.{w} " in j for w in ("train", "eval_suite", "analyze")))
    assert any("workflow_scripts.eval_suite " in j and '"kind": "toy_logprob"' in j for j in jobs)
    assert any("workflow_scripts.analyze " in j and '"analysis": "toy_norms"' in j for j in jobs)
    assert "reports/tiny/tables/toy_lookup.csv" in r.stdout


def test_this_process_saw_none_of_them():
    assert not {"toy_logprob"} & set(registry.SUITE_KINDS) and "relu2" not in registry.FFN_KINDS
    assert "toy_norms" not in registry.ANALYSES and "toy_lookup" not in registry.REPORT_TABLES


def test_a_job_imports_the_plugins_its_spec_names(tmp_path):
    """workflow_scripts/_entry.spec_of imports the spec's plugins before the job looks anything up: the toy
    analysis is found (the job then stops at the missing checkpoint); without the list it is unknown."""
    spec = {"analysis": "toy_norms", "job": {"experiment": "tiny", "scale": "350m", "variant": "stem",
                                             "stage": "pretrain"}}
    out = []
    for s in (spec, {**spec, "plugins": ["toy_analysis"]}):
        r = subprocess.run([sys.executable, "-m", "workflow_scripts.analyze", "--spec", json.dumps(s), "--checkpoint",
                            str(tmp_path / "none"), "--out", str(tmp_path / "out.json")], cwd=REPO, env=ENV,
                           capture_output=True, text=True, timeout=300)
        out.append((r.returncode, r.stderr.strip().splitlines()[-1]))
    assert out[0] == (1, "error: analysis spec: key 'analysis' is 'toy_norms'; expected one of editing, heaps, "
                         "spread, capacity, heldout, hf_parity, insertion_step0, logitlens, cka, dse_disabled, knowledge, knowledge_edit")
    assert out[1][0] == 1 and str(tmp_path / "none") in out[1][1] and "toy_norms" not in out[1][1]
    assert not (tmp_path / "out.json").exists()


def test_the_registry_class():
    reg = registry.Registry("widget")
    reg.add("path", "pathlib:Path")                # "module:attr": imported on first use
    assert reg.register("one")(len) is len         # the decorator returns what it registers
    reg.add("one", len)                            # the same entry again: a no-op
    assert reg.names() == ["path", "one"] and "one" in reg and "two" not in reg
    assert reg["path"] is Path and reg.get("two") is None
    with pytest.raises(ValueError, match=r"^widget 'one': already registered \(len\)$"):
        reg.add("one", max)
    with pytest.raises(ValueError, match=r"^unknown widget 'two'; expected one of path, one$") as e:
        reg["two"]
    assert str(e.value) == "unknown widget 'two'; expected one of path, one"   # one plain line (not KeyError's repr)
    assert reg.remove("one") is len and reg.names() == ["path"]
