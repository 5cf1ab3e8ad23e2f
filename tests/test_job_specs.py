"""Every training job of the tiny, paper, rehearsal, real and sweep DAGs carries the values of the experiment tree
it came from (issue 38 item 4): Snakemake builds each DAG (scripts/dagdump.py's machinery, the real Snakefile),
and each train job's spec JSON (its rerun trigger) is checked against the typed tree's nodes, independently of
the resolver that wrote it: the stage's settings after the variant's ``stage:`` overrides and the sweep's
``sweeps.train``, the config's optimizer after the variant's ``optim:``, the cluster's table layout."""
import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from stem import seeds
from stem.config import experiment
from stem.config import REPO
from stem.config import train_job
from stem.specs import TrainSettings, TrainSpec

_spec = importlib.util.spec_from_file_location("dagdump", REPO / "scripts" / "dagdump.py")
dagdump = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dagdump)

STAGE_KEYS = ("lr", "steps", "schedule", "warmup", "min_lr_ratio", "batch_size", "micro_batch", "seq_len")
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
        return {**want, "eval_batches": over.get("eval_batches", exp.train.eval_batches), "optim": {}}
    vspec = exp.variant(base) or {}
    want.update({k: v for k, v in (vspec.get("stage") or {}).items() if k in want})
    return {**want, "eval_batches": exp.train.eval_batches, "optim": vspec.get("optim") or {}}


def _one_part_each(configfiles: list, tmp_path) -> list:
    """The config with every source in one tokenize part (config/paper.yaml: 2,560 tokenize jobs -> 7). A train
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
        # written only where not the job spec's default (stem.specs.TrainSettings)
        got = (t.get("tables", TrainSettings.tables), t.get("parallel", TrainSettings.parallel))
        assert got == (exp.cluster.tables, exp.cluster.strategy), where
        assert t.get("host_workers", TrainSettings.host_workers) == exp.cluster.host_workers, where
        node = exp.stages[stage][scale]
        job_id = seeds.JobId.parse(scale, variant, stage)
        assert job_id.slot == variant and (job_id.seed > 0) == ("_seed" in variant), where   # one string form
        if "data" not in (((exp.variant(job_id.variant) or {}).get("stage")) or {}):
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
