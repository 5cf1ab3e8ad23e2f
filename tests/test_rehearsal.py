"""The one-node rehearsal (issue 22, item 3): its offline inputs in the paper's formats, its DAG (dry run with
the command a cluster user types), and its smallest job: one training step at the 350M shapes."""
import copy
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import checked_yaml, job_counts
from stem import config as C
from stem.data.sources import iter_documents
from stem.data.synth import GENERATORS, make_world
from stem.data.tokenizer import load_tokenizer
from stem.models.model import build_model
from stem.rehearsal import ROW, padded_tokenizer, write_mds
from stem.train import memory, memtrace
from stem.train.loop import train

REPO = Path(__file__).resolve().parents[1]
CFG = checked_yaml(REPO / "config" / "rehearsal.yaml")
PAPER = checked_yaml(REPO / "config" / "paper.yaml")


def test_rehearsal_has_the_papers_shapes_stages_lengths_and_suites():
    assert CFG["archs"] == PAPER["archs"] and CFG["matrix"] == PAPER["matrix"]
    assert CFG["eval"]["stages"] == PAPER["eval"]["stages"] and CFG["device"] == "cuda"
    for stage, scales in PAPER["stages"].items():
        for scale, st in scales.items():
            ours = CFG["stages"][stage][scale]
            for key in ("seq_len", "micro_batch", "cross_doc_mask", "schedule", "lr", "max_seq_len", "rope_scaling",
                        "activation_checkpointing"):
                assert ours.get(key) == st.get(key), (stage, scale, key)
            assert 50 <= ours["steps"] <= 500
    assert {s["vocab_size"] for s in CFG["sources"].values() if s["kind"] == "mds"} == {128256}


def test_paper_vocabulary_tokenizer_and_mds_folder(tmp_path):
    world = make_world(seed=3, n_countries=8, n_people=20, n_filler=100)
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    padded_tokenizer(itertools.islice(GENERATORS["web"](world, 1), 200), 128256, path)
    tok = load_tokenizer(path)
    assert tok.vocab_size == 128256
    write_mds(tmp_path / "prolong-data-64K" / "long" / "proc00-64", tok, GENERATORS["web"](world, 2), 1, "long")
    spec = {**{k: v for k, v in CFG["sources"]["prolong_long"].items() if k not in ("doc_keys",)},
            "paths": [str(tmp_path / "prolong-data-64K" / "long" / "*")]}
    docs = list(iter_documents(spec))          # the reader the paper's ProLong sources go through
    assert sum(len(d) for d in docs) == ROW and all(d.dtype == np.uint32 for d in docs)
    assert tok.decode(docs[0].tolist()) == next(GENERATORS["web"](world, 2))[:len(tok.decode(docs[0].tolist()))]


def test_rehearsal_dag_dry_runs(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--profile",
                        str(REPO / "profiles" / "local"), "--configfile", str(REPO / "config" / "rehearsal.yaml"),
                        "-d", str(tmp_path), "-n"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    counts = job_counts(r.stdout)
    assert counts["train"] == 15 and counts["tokenizer"] == 2 and counts["eval"] == 32   # stem_insert: 2 + 7; dense: LongPPL, RULER
    assert counts["report_html"] == 1 and "tiny.yaml" not in r.stdout + r.stderr


def test_smallest_job_one_step_at_the_350m_widths(tiny_data, tmp_path, capsys):
    spec = C.train_spec(C.experiment.parse(CFG, "rehearsal.yaml"), "350m", "dense", "pretrain")
    assert spec["model"]["d_model"] == 960 and spec["model"]["n_layers"] == 32 and spec["train"]["compile"] is True
    # the CPU: the job cut to one step of one 128-token row, eager, 2 of its 32 layers (every width, head and
    # the 32,000-token vocabulary as they are; the full depth takes minutes on two CPU cores, and gpucheck
    # item a trains it on a GPU); the GPU runs the spec as it is
    spec["model"].update(n_layers=2, ffn=spec["model"]["ffn"][:2])
    spec.update(device="cpu", out_dir=str(tmp_path / "run"), tokenizer=tiny_data["tokenizer"],
                data={"web": {"weight": 1.0, "manifest": tiny_data["manifests"]["web"]}})
    # a limit no layout meets: the job runs the leanest, micro-batches of 1 with activation checkpointing, and
    # says so (cluster.fit_memory; the workflow's gate would have refused it)
    spec["train"].update(batch_size=2, micro_batch=2, seq_len=128, steps=1, compile=False, eval_batches=1,
                         tensorboard=False, fit_gib=1e-3)
    out = train(spec, threads=2)
    assert ("memory fit (train.fit_gib): micro-batch 2 -> 1 per GPU, activation checkpointing on; the same global "
            "batch of 2 sequences an optimizer step, its gradients accumulated over 2 micro-batches instead of 1"
            in capsys.readouterr().err)
    layer = 2 * 960 * 960 + 2 * 960 * 320 + 3 * 960 * 2560 + 2 * 960   # wq, wo; wk, wv (5 KV heads); SwiGLU; norms
    assert out["steps"] == 1 and np.isfinite(out["final_train_loss"])
    assert out["total_params"] == 2 * 32000 * 960 + 2 * layer + 960
    assert out["tokens_per_s_per_gpu"] > 0 and out["mfu"] is None
    assert (tmp_path / "run" / "checkpoint" / "model.safetensors").is_file()


@pytest.mark.parametrize("gpus", [1, 8])
def test_every_rehearsal_job_is_fitted_to_one_gpu_and_to_one_node(gpus):
    """Issue 29, item 4: with cluster.fit_memory each of the 15 training jobs' plans (as the onstart gate and the
    job compute them, memtrace.job) keeps the spec's global batch and fits cluster.gpu_mem_gib by the closed
    form, on one GPU a job and on 8 GPUs of one node; the 1B STEM-family jobs keep their tables in host memory
    on one GPU (row-sharded tables are not needed on 8). The traced peaks of these plans (minutes a trace):
    python -m stem memory --experiment rehearsal [--gpus 8], docs/gpu.md; the gate on a real trace:
    tests/test_memory.py::test_the_gate_fits_a_job_by_its_plan_and_names_the_option_that_fits."""
    cfg = copy.deepcopy(CFG)
    for t in cfg["cluster"]["train"].values():
        t["gpus_per_node"] = gpus
    limit, models = cfg["cluster"]["gpu_mem_gib"], {}
    cfg = C.experiment.parse(cfg, f"rehearsal.yaml ({gpus} GPUs a node)")
    for job in C.train_targets(cfg):
        spec, plan = memtrace.job(C.train_spec(cfg, *job), gpus)
        assert spec.train.fit_gib == limit and plan.micro_batch * plan.accum == spec.train.batch_size, job
        key = json.dumps(spec.model.to_dict(), sort_keys=True)   # pretrain and midtrain share a model
        if key not in models:
            models[key] = build_model(spec.model, "meta")
        gib = memory.estimate(models[key], plan)["total_gib"]
        assert gib <= limit, (job, gib)
        assert bool(plan.host_tables) == (gpus == 1 and job[0] == "1b" and job[1] != "dense"), job
