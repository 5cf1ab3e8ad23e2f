"""Every training job of the tiny, paper, rehearsal, real and sweep DAGs carries the values of the experiment tree
it came from (issue 38 item 4): Snakemake builds each DAG (scripts/dagdump.py's machinery, the real Snakefile),
and each train job's spec JSON (its rerun trigger) is checked against the typed tree's nodes, independently of
the resolver that wrote it: the stage's settings after the variant's ``stage:`` overrides and the sweep's
``sweeps.train``, the config's optimizer after the variant's ``optim:``, the cluster's table layout."""
import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from stem import knowledge as K
from stem import seeds
from stem.config import experiment
from stem.config import REPO
from stem.config import train_job
from stem import config as C
from stem.models.spec import ModelConfig
from stem.specs import Layout, StageOptions, TrainSettings, TrainSpec, Variant

_spec = importlib.util.spec_from_file_location("dagdump", REPO / "scripts" / "dagdump.py")
dagdump = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dagdump)

STAGE_KEYS = ("lr", "steps", "schedule", "warmup", "min_lr_ratio", "batch_size", "micro_batch", "seq_len")
LAYOUT = [f.name for f in dataclasses.fields(Layout)]         # the cluster's, in every train job's spec
OPTIONS = [f.name for f in dataclasses.fields(StageOptions)]  # the stage's, likewise
SWEEPS = ["all", "sweep_rho", "sweep_slots"]
DAGS = {"tiny": ([], SWEEPS), "paper": (["config/paper.yaml"], SWEEPS),
        "rehearsal": (["config/rehearsal.yaml"], ["all"]), "real": (["config/real.yaml"], ["all"])}


def _expected(exp, scale: str, variant: str, stage: str) -> dict:
    """The tree's values for one job: the stage node, then the variant's stage overrides (or the sweep's)."""
    node = exp.stages[stage][scale]
    want = {k: getattr(node, k) for k in STAGE_KEYS}
    base = seeds.JobId.parse(scale, variant, stage).variant
    if seeds.JobId.parse(scale, variant, stage).sweep:
        over = {k: v for k, v in vars(exp.sweeps.train or experiment.SweepTrain()).items() if v is not None}
        want.update({k: v for k, v in over.items() if k in want})
        return {**want, "eval_batches": over.get("eval_batches", exp.train.eval_batches), "optim": {}, "stage": {}}
    vspec = C.variant_spec(exp, variant)   # a seed's: its base variant's node; a knowledge point's: generated
    assert vspec == exp.variant(base) or (exp.knowledge and K.is_point(variant))
    want.update({k: v for k, v in (vspec.stage or {}).items() if k in want})
    return {**want, "eval_batches": exp.train.eval_batches, "optim": vspec.optim or {}, "stage": vspec.stage or {}}


def _one_part_each(configfiles: list, tmp_path) -> list:
    """The config with every source in one tokenize part (config/paper.yaml: 832 tokenize jobs -> 7). A train
    job's spec names a source's gathered manifest, never its parts: the same train jobs, in a smaller DAG (this
    file's paper and rehearsal cases: 9.8 -> 6.7 s of CPU, loaded machine; tests/test_slurm.py dry-runs the paper
    DAG as it is)."""
    if not configfiles:
        return configfiles
    cfg = yaml.safe_load((REPO / configfiles[0]).read_text())
    if not any("parts" in s for s in cfg.get("sources", {}).values()):
        return configfiles
    for src in cfg["sources"].values():
        src.pop("parts", None)
    path = tmp_path / Path(configfiles[0]).name
    path.write_text(yaml.safe_dump(cfg))
    return [str(path)]


@pytest.mark.parametrize("name", list(DAGS))
def test_every_train_jobs_spec_is_its_trees_values(name, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    configfiles, targets = DAGS[name]
    configfiles = _one_part_each(configfiles, tmp_path)
    exp = experiment.load(configfiles[0] if configfiles else REPO / "config/tiny.yaml")
    train = [j for j in dagdump.jobs(configfiles, targets) if j.rule.name.startswith("train")]
    assert train, f"{name}: no training job in the DAG"
    seen_sweep = False
    for job in train:
        spec = json.loads(job.params.spec)
        w = job.wildcards_dict
        scale, variant, stage = w["scale"], w["variant"], w["stage"]
        assert (spec["scale"], spec["variant"], spec["stage"]) == (scale, variant, stage)
        want, t = _expected(exp, scale, variant, stage), spec["train"]
        where = f"{name} {scale}/{variant}/{stage}"
        for key in (*STAGE_KEYS, "eval_batches"):
            assert t[key] == want[key], f"{where}: train.{key} {t[key]!r}, the tree says {want[key]!r}"
        # written only where not the job spec's default (stem.specs.TrainSettings): the cluster's Layout and the
        # stage's StageOptions, the same fields
        for key in LAYOUT:
            assert t.get(key, getattr(TrainSettings, key)) == getattr(exp.cluster, key), f"{where}: train.{key}"
        node = exp.stages[stage][scale]
        for key in OPTIONS:
            over = want["stage"]
            assert t.get(key, getattr(TrainSettings, key)) == over.get(key, getattr(node, key)), f"{where}: {key}"
        job_id = seeds.JobId.parse(scale, variant, stage)
        vnode = C.variant_spec(exp, variant)   # the variant's node (a sweep or knowledge point's, a seed's base's)
        assert isinstance(vnode, Variant) and spec["seed"] == exp.seed + job_id.seed + vnode.seed_index, where
        ffn = [k for k in spec["model"]["ffn"] if k != "dense"]
        assert set(ffn) <= {vnode.ffn} and bool(ffn) == (vnode.ffn != "dense"), where
        assert bool(spec["model"].get("dse")) == (vnode.dse is not None), where
        model = ModelConfig.from_dict(spec["model"])
        for key, value in vnode.model.items():
            assert getattr(model, key) == value, f"{where}: model.{key}"
        ins = spec.get("insert")
        assert (ins is not None) == (vnode.insert is not None and vnode.insert.stage == stage and not job_id.sweep), where
        if ins is not None:
            assert (ins["from"], ins["init"]) == (vnode.insert.from_, vnode.insert.init), where
        assert job_id.slot == variant and (job_id.seed > 0) == ("_seed" in variant), where   # one string form
        if "data" not in (vnode.stage or {}):
            assert {s: d["weight"] for s, d in spec["data"].items()} == node.data, where
        wd = want["optim"].get("weight_decay", exp.optim.weight_decay)
        assert spec["optim"]["weight_decay"] == wd and tuple(spec["optim"]["betas"]) == exp.optim.betas, where
        if node.table_group is not None and node.table_group.lr_mult is not None:
            assert spec["optim"]["groups"]["table"]["lr_mult"] == node.table_group.lr_mult, where
        table_update = want["optim"].get("table_update", exp.optim.table_update)
        assert spec["optim"].get("table_update", "dense") == table_update, where
        # the JSON at the rule boundary round-trips the tree's own types (one schema: the stage's fields, the
        # config's OptimSpec), and is the spec the resolver built
        typed = TrainSpec.from_dict(spec)
        assert typed.to_dict() == spec and typed == train_job(exp, scale, variant, stage), where
        for key in STAGE_KEYS:
            assert type(getattr(typed.train, key)) is type(want[key]), f"{where}: train.{key}'s type"
        assert (type(typed.optim), type(typed.train.tables)) == (type(exp.optim), type(exp.cluster.tables)), where
        seen_sweep |= job_id.sweep is not None
    assert seen_sweep == (name in ("tiny", "paper"))   # the sweeps' points were built too


@pytest.mark.parametrize("slot, job", [
    ("stem", seeds.JobId("350m", "stem", "pretrain")),
    ("stem_seed2", seeds.JobId("350m", "stem", "pretrain", seed=2)),
    ("dense_seed10", seeds.JobId("350m", "dense", "pretrain", seed=10)),
    ("rho_0p833", seeds.JobId("350m", "rho_0p833", "pretrain", sweep="rho")),
    ("slots_4096", seeds.JobId("350m", "slots_4096", "pretrain", sweep="slots")),
    ("stem_seed0", seeds.JobId("350m", "stem_seed0", "pretrain")),   # seed 0 is the variant itself: no suffix
])
def test_a_job_id_has_one_string_form_and_one_parser(slot, job):
    assert seeds.JobId.parse("350m", slot, "pretrain") == job and job.slot == slot
    assert seeds.JobId(job.scale, job.variant, job.stage, job.seed, job.sweep).slot == slot   # the one string form


def test_rules_read_the_typed_tree_not_snakemakes_config():
    """rules/common.smk parses Snakemake's ``config`` into the tree once; no other rule reads the raw mapping
    (issue 38 item 5: report.smk's params and sweep.smk's sweep specs come from ``C.config_part``)."""
    raw = re.compile(r"\bconfig\s*(\[|\.get\b|\.items\b|\.keys\b)|\bin config\b")
    for path in [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]:
        hits = [n for n, line in enumerate(path.read_text().splitlines(), 1)
                if raw.search(line.split("#")[0])]
        assert not hits, f"{path.name} lines {hits} read Snakemake's config mapping"


def test_no_key_is_declared_twice():
    """Every key a training job's ``train`` section shares with the experiment tree is the tree node's own field
    (the same ``dataclasses.Field``: one type, default and range from the YAML to the loop), and the config's nodes
    declare no key of the job spec a second time (issue 38 item 1)."""
    job = {f.name: f for f in dataclasses.fields(TrainSettings)}
    for cls in (experiment.StageSettings, experiment.Cluster, experiment.Train):
        shared = [f for f in dataclasses.fields(cls) if f.name in job]
        assert shared, cls
        for f in shared:
            assert f is job[f.name], f"{cls.__name__}.{f.name} is declared apart from the job spec's"
    assert {f.name for f in dataclasses.fields(experiment.Cluster)} >= set(LAYOUT)
    assert experiment.Cluster.KEYS == {"parallel": "strategy"}   # written cluster.strategy, the job's train.parallel


def test_the_cluster_host_bandwidth_reaches_the_job(tmp_path):
    """cluster.host_mem_gbs / host_core_gbs travel in the job's spec (left out at their defaults, so no other
    job's JSON changes) and set the host tables' modelled host side the job logs (issue 42's hard 100 GB/s)."""
    from stem.train import comms   # torch: only this test needs it
    raw = C.read_yaml(REPO / "config" / "rehearsal.yaml")
    spec = train_job(experiment.parse(raw, "rehearsal"), "1b", "stem", "pretrain")
    assert "host_mem_gbs" not in spec.to_dict()["train"] and spec.train.host_mem_gbs == 100
    raw["cluster"] = {**raw["cluster"], "host_mem_gbs": 40, "host_core_gbs": 3}
    spec = train_job(experiment.parse(raw, "rehearsal"), "1b", "stem", "pretrain")
    t = spec.to_dict()["train"]
    assert (t["host_mem_gbs"], t["host_core_gbs"]) == (40, 3) and TrainSpec.from_dict(spec.to_dict()) == spec
    assert comms.host_bandwidth(spec.train, cores=4) == 12 and comms.host_bandwidth(spec.train, cores=64) == 40


def test_variants_are_typed_nodes_and_points_emit_them():
    """config/variants.yaml + variant_overrides are parsed into ``Variant`` nodes in the experiment parse; sweep
    points, knowledge points and seeds resolve to nodes too; a node's model keys are the model's."""
    exp = experiment.load(REPO / "config" / "tiny.yaml")
    assert all(isinstance(v, Variant) for v in exp.variants().values())
    ins = exp.variant("stem_insert").insert
    assert (ins.from_, ins.stage, ins.init) == ("dense", "midtrain", "projected")
    n = exp.variant_overrides["hashmoe"]["n_experts"]   # tiny's override over config/variants.yaml's 12
    assert exp.variant("hashmoe").model == {"n_experts": n} and n != 12
    assert C.model_config_for(exp, "350m", "hashmoe").n_experts == n
    assert C.variant_spec(exp, "stem_seed2") is exp.variant("stem")
    point = C.variant_spec(exp, "rho_1")
    assert isinstance(point, Variant) and point.ffn == "moe" and point.stage == C.sweeps.train_settings(
        C.sweeps.spec(exp))
    kn = experiment.load(REPO / "config" / "knowledge.yaml")
    name = C.knowledge.points(kn)[-1]
    p = C.variant_spec(kn, name)
    assert isinstance(p, Variant) and p.seed_index == C.knowledge.split(name)[2] and list(p.stage["data"]) == [
        C.knowledge.split(name)[0]]
