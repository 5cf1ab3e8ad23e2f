"""Typed job specs (stem/specs.py), the results layout (stem/layout.py) and the parallel strategy in the spec."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from stem import config as C
from stem.config import experiment as E
from stem import layout as L
from stem.options import Device
from stem.specs import EvalSpec, SpecError, TrainSpec

TINY = E.load(C.REPO / "config" / "tiny.yaml")
PAPER = E.load(C.REPO / "config" / "paper.yaml")


def test_train_spec_json_is_what_the_config_says():
    """The JSON a train rule passes (its --spec, hence Snakemake's rerun trigger), written out by hand from
    config/tiny.yaml for 1b/stem/midtrain; optional keys at their default (parallel fsdp) are not written."""
    spec = C.train_spec(TINY, "1b", "stem", "midtrain")
    assert spec["train"] == {"log_interval": 10, "eval_interval": 50, "eval_batches": 4, "checkpoint_interval": 50,
                             "tensorboard": False, "lr": 1.0e-3, "schedule": "linear", "warmup": 0.05,
                             "min_lr_ratio": 0.0, "batch_size": 16, "micro_batch": 16, "seq_len": 128, "steps": 40,
                             "cross_doc_mask": False, "reset_optimizer": True, "save_optimizer": False}
    assert spec["optim"] == {"betas": [0.9, 0.95], "weight_decay": 0.1, "eps": 1.0e-8, "grad_clip": 1.0,
                             "groups": {"table": {"lr_mult": 1.0, "weight_decay": 0.1},
                                        "dse_table": {"lr_mult": 5.0, "weight_decay": 0.0}}}
    assert spec["data"] == {s: {"weight": w, "manifest": f"data/tiny/1b/tokens/{s}/manifest.json"}
                            for s, w in (("web", 0.65), ("math", 0.05), ("code", 0.30))}
    assert (spec["tokenizer"], spec["init_from"], spec["init_stage"], spec["out_dir"]) == (
        "data/tiny/1b/tokenizer/tokenizer.json", "results/tiny/1b/stem/pretrain/checkpoint", "pretrain",
        "results/tiny/1b/stem/midtrain")
    assert spec["model"]["ffn"] == ["dense", "dense", "stem", "dense", "dense", "stem"]
    for cfg in (TINY, PAPER):   # every job: the typed spec gives its JSON back unchanged
        for job in C.train_targets(cfg):
            d = C.train_spec(cfg, *job)
            assert TrainSpec.from_dict(d).to_dict() == d == json.loads(json.dumps(d))


def test_the_parallel_strategy_travels_in_the_train_spec():
    raw = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    spec = C.train_spec(E.parse(C.deep_merge(raw, {"cluster": {"strategy": "ddp"}}), "tiny"), "350m", "stem", "pretrain")
    assert spec["train"]["parallel"] == "ddp" and TrainSpec.from_dict(spec).train.parallel == "ddp"
    assert "parallel" not in C.train_spec(TINY, "350m", "stem", "pretrain")["train"]     # fsdp, the default
    assert C.train_job(TINY, "350m", "stem", "pretrain").train.parallel == "fsdp"
    assert C.train_job(PAPER, "1b", "stem", "pretrain").train.tables == "rows"    # cluster.tables likewise
    assert "tables" not in C.train_spec(TINY, "350m", "stem", "pretrain")["train"]       # fsdp, the default
    with pytest.raises(C.ConfigError, match="key 'cluster.tables'"):
        C.experiment.parse(C.deep_merge(raw, {"cluster": {"tables": "cols"}}), "tiny")
    # no environment variable carries it any more: neither the train rule nor the package mentions one
    sources = [C.REPO / "rules" / "train.smk", *sorted((C.REPO / "stem").rglob("*.py"))]
    assert not [p for p in sources if "STEM_PARALLEL" in p.read_text()]


def _bad(path: str, value):
    spec = C.train_spec(TINY, "1b", "stem", "midtrain")
    *parents, key = path.split(".")
    d = spec
    for p in parents:
        d = d[p]
    if value is KeyError:
        del d[key]
    else:
        d[key] = value
    return spec


@pytest.mark.parametrize("path, value, message", [
    ("train.schedule", "cosin", "key 'train.schedule': expected one of cosine, linear, constant, got 'cosin'"),
    ("train.batch_size", "16", "key 'train.batch_size': expected an integer, got '16'"),
    ("train.steps", -1, "key 'train.steps': expected an integer >= 0 (0: a stage that only imports), got -1"),
    ("train.lr", KeyError, "key 'train.lr' missing (expected a number)"),
    ("train.parallel", "tp", "key 'train.parallel': expected one of fsdp, ddp, got 'tp'"),
    ("train.tables", "cols", "key 'train.tables': expected one of fsdp, rows, host, got 'cols'"),
    ("train.lrr", 1.0, "key 'train.lrr': unknown (expected one of lr, schedule, "),
    ("optim.betas", [0.9], "key 'optim.betas': expected a list of 2 numbers, got [0.9]"),
    ("data.web.weight", -1, "key 'data.web.weight': expected a number > 0, got -1"),
    ("model.n_heads", 5, "key 'model': d_model=96, n_heads=5, n_kv_heads=2: need d_model % n_heads == 0"),
    ("device", "tpu", "key 'device': expected one of auto, cpu, cuda, got 'tpu'"),
    ("init_from", 3, "key 'init_from': expected a string or null, got 3"),
])
def test_a_bad_train_spec_is_one_line_naming_the_key(path, value, message):
    with pytest.raises(SpecError) as e:
        TrainSpec.from_dict(_bad(path, value))
    assert str(e.value).startswith("train spec: " + message) and "\n" not in str(e.value)


def test_train_refuses_a_bad_spec_before_writing_anything(tmp_path):
    from stem.train.loop import TrainingError, train
    spec = {**_bad("train.schedule", "cosin"), "out_dir": str(tmp_path / "job")}
    with pytest.raises(TrainingError, match=r"^train spec: key 'train.schedule'"):
        train(spec)
    assert not (tmp_path / "job").exists()


def test_eval_spec_round_trips_and_checks_its_keys():
    from stem.eval import spec as ES
    for stage in ("pretrain", "midtrain", "extend"):
        for suite in ES.suites_for(TINY, stage):
            d = ES.job_spec(TINY, "tiny", "1b", "stem", stage, suite)
            spec = EvalSpec.from_dict(d)
            assert spec.to_dict() == d and spec.job.stage == stage and spec.kind == d["kind"]
    d = ES.job_spec(TINY, "tiny", "1b", "stem", "pretrain", "commonsense")
    with pytest.raises(SpecError, match=r"^eval spec: key 'batch_size': expected an integer >= 1, got 0$"):
        EvalSpec.from_dict({**d, "batch_size": 0})
    with pytest.raises(SpecError, match=r"^eval spec: key 'job.stage' missing \(expected a string\)$"):
        EvalSpec.from_dict({**d, "job": {"experiment": "tiny", "scale": "1b", "variant": "stem"}})


def test_layout_paths_and_rule_patterns():
    job = ("tiny", "1b", "stem", "extend")
    assert L.summary(*job) == "results/tiny/1b/stem/extend/summary.json"
    assert L.metrics(*job) == "results/tiny/1b/stem/extend/metrics.jsonl"
    assert L.checkpoint(*job) == "results/tiny/1b/stem/extend/checkpoint"
    assert L.eval_json(*job, "niah") == "results/tiny/1b/stem/extend/eval/niah.json"
    assert L.eval_raw(*job, "niah") == "results/tiny/1b/stem/extend/eval/raw/niah.json"
    assert L.train_log(*job) == "logs/tiny/1b/stem/extend/train.log"
    assert str(L.state_dir(L.stage_dir(*job))) == "results/tiny/1b/stem/extend/_state"
    assert L.summary(*L.STAGE) == "results/{experiment}/{scale}/{variant}/{stage}/summary.json"
    assert L.eval_identity("/x/" + L.eval_json(*job, "bbh")) == dict(zip(L.IDENTITY, job))
    assert L.eval_identity("/x/results/tiny/1b/stem/extend/other/bbh.json") is None


def test_memory_trace_runs_the_loops_training_step(monkeypatch):
    """The FSDP memory trace calls stem.train.step.train_step, the step the loop runs, not a copy."""
    from stem.train import memtrace, step
    calls = []
    real = step.train_step

    def counted(*args, **kw):
        calls.append(kw)
        return real(*args, **kw)
    monkeypatch.setattr(step, "train_step", counted)
    spec = C.train_spec(TINY, "350m", "stem", "pretrain")
    spec["model"].update(n_layers=3, ffn=["dense", "dense", "stem"])
    r = memtrace.trace(*memtrace.job(spec, 2, "fsdp"))
    assert len(calls) == 1 and calls[0]["on_backward"] is not None and r["micro_batches_traced"] == 1
    assert r["peak_gib"] > 0
    from stem.train import loop
    assert loop.train_step is real


def test_the_model_sets_its_dse_vocabulary_from_the_tokenizer():
    """Ids whose texts share a normal form (NFKC, accents stripped, lowercase, whitespace collapsed) share the
    smallest such id; ids past the tokenizer's vocabulary are their own (map written by hand)."""
    from stem.models.spec import ModelConfig
    from stem.models.model import build_model

    class Tok:
        texts = ["a", "A", "\u00e9", " e", "b"]
        vocab_size = len(texts)

        def decode(self, ids):
            return "".join(self.texts[i] for i in ids)
    cfg = ModelConfig.from_dict({"vocab_size": 7, "d_model": 16, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1,
                                 "d_ff": 32, "max_seq_len": 16,
                                 "dse": {"layers": [1], "rows_per_head": 7, "d_mem": 8, "heads": 2}})
    model = build_model(cfg)
    model.set_dse_vocabulary(Tok())
    assert model.dse_compress.tolist() == [0, 0, 2, 2, 4, 5, 6]


def test_specs_optim_and_the_plan_import_no_torch():
    """The DAG build imports stem.specs (through stem.config) and the Snakefile stem.train.plan: torch-free;
    OptimSpec.build imports the torch-level stem.optim.adamw only when it runs."""
    code = ("import sys; import stem.specs, stem.optim, stem.train.plan, stem.train.memory; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "from stem.specs import OptimSpec; import stem.optim as o; assert OptimSpec is o.OptimSpec")
    r = subprocess.run([sys.executable, "-c", code], cwd=C.REPO, env={**os.environ, "PYTHONPATH": str(C.REPO)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_parallel_plan_is_the_jobs_layout():
    from stem.train.plan import ParallelPlan, cluster_train, job_layout
    spec = TrainSpec.from_dict(C.train_spec(TINY, "350m", "stem", "pretrain"))
    plan = ParallelPlan.of(spec.train, 2)
    assert (plan.world, plan.strategy, plan.seq_len) == (2, spec.train.parallel, spec.train.seq_len)
    assert plan.micro_batch * plan.accum == spec.train.batch_size and plan.accum % plan.world == 0
    assert ParallelPlan.of(spec.train, 2, "ddp").strategy == "ddp"
    with pytest.raises(ValueError, match="parallel strategy 'tp'"):
        ParallelPlan(1, "tp", 1, 1, 8)
    # the world size a job gets is what rules/common.smk requests (both read cluster_train)
    cfg = dataclasses.replace(TINY, device=Device.AUTO, cluster=E.Cluster(train={"1b": E.TrainJob(4, 8, 60)}))
    assert job_layout(cfg, "1b") == (32, 8) and job_layout(cfg, "350m") == (1, 1)
    cpu = dataclasses.replace(TINY, device=Device.CPU, cluster=E.Cluster())
    assert job_layout(cpu, "350m") == (1, 0) and cluster_train(cpu, "1b").nodes == 1
