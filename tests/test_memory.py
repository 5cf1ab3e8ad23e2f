"""Per-GPU memory: the trace of the real training step (fake world 8, paper 1B shapes with fewer layers)
against a hand count, the closed form against the trace, and the workflow refusing an oversize job."""
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from stem import config as C
from stem.models.model import build_model
from stem.train import comms, gate, memory, memtrace
from stem.train.plan import ParallelPlan
from conftest import reshaped

REPO = Path(__file__).resolve().parents[1]
GIB = 1024 ** 3
V, D, F, KV = 128256, 2048, 8192, 8 * 64          # Llama-3.2-1B: vocab, d_model, d_ff, kv heads x head dim
WORLD, MICRO, SEQ = 8, 4, 4096


def _small_paper_config(n_layers: int, gpu_mem_gib: float) -> dict:
    """config/paper.yaml with only 1B STEM pretraining, ``n_layers`` layers, on one node of 8 GPUs, its tables as
    FSDP units (the hand counts below; row-sharded tables: tests/test_tables.py)."""
    cfg = yaml.safe_load((REPO / "config" / "paper.yaml").read_text())
    cfg["cluster"]["tables"] = "fsdp"
    cfg["matrix"] = {"1b": {"variants": ["stem"], "stages": ["pretrain"]}}
    cfg["archs"]["1b"]["n_layers"] = n_layers
    cfg["cluster"]["train"]["1b"].update(nodes=1, gpus_per_node=WORLD)
    cfg["cluster"]["gpu_mem_gib"] = gpu_mem_gib
    return cfg


def _params(n_layers: int) -> int:
    """Parameters by hand: embedding + head + final norm; per block 2 norms + q/k/v/o; a dense SwiGLU
    (3 d d_ff), or on every third layer from 2 a STEM FFN (gate and down d d_ff, table V d_ff)."""
    blocks = 0
    for i in range(n_layers):
        blocks += 2 * D + 2 * D * D + 2 * D * KV + (2 * D * F + V * F if i % 3 == 2 else 3 * D * F)
    return 2 * V * D + D + blocks


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Traces (cached where the workflow test's Snakemake run looks for them) at 3 and 6 layers."""
    cache = tmp_path_factory.mktemp("wf") / "results" / "memory_traces"
    cfgs = {n: _small_paper_config(n, 1.0) for n in (3, 6)}
    cfgs["sparse"] = _small_paper_config(3, 1.0)     # 3 layers, optim.table_update: sparse
    cfgs["sparse"]["optim"]["table_update"] = "sparse"
    specs = {n: C.train_spec(reshaped(cfg), "1b", "stem", "pretrain") for n, cfg in cfgs.items()}
    out = dict(zip(specs, memtrace.traced([memtrace.job(s, WORLD, "fsdp") for s in specs.values()], cache,
                                                     workers=2)))
    for n in specs:
        out[n]["cfg"], out[n]["spec"] = cfgs[n], specs[n]
    out["cache"] = cache
    return out


def test_traced_model_state_is_the_hand_count(traces):
    for n in (3, 6):
        t = traces[n]
        assert (t["world"], t["micro_batch"], t["seq_len"], t["micro_batches_traced"]) == (WORLD, MICRO, SEQ, 2)
        p = _params(n) / WORLD     # every dimension divides by 8: no FSDP padding
        parts = {k: v * GIB for k, v in t["parts_gib"].items()}
        assert parts["Sharded Param"] == pytest.approx(4 * p, rel=1e-6)       # fp32 master weights
        assert parts["Sharded Grad"] == pytest.approx(4 * p, rel=1e-6)        # fp32, sharded: reduced every micro-batch
        assert parts["OptState"] == pytest.approx(8 * p, rel=1e-3)            # two fp32 moments (+ step counters)
        assert "Unsharded Grad" not in parts
        assert parts["Unsharded Param"] == pytest.approx(2 * (2 * V * D + D), rel=1e-6)   # the root, bf16
        # the peak is at the loss's backward: all activations + fp32 log-softmax, its gradient and result
        assert t["peak_gib"] * GIB > 16 * p + 12 * V * MICRO * SEQ


def test_peak_grows_by_three_blocks_as_counted(traces):
    """3 -> 6 layers adds two dense blocks and one STEM block: their sharded state (16 B / param / 8) and
    their saved activations per token: two RMSNorms (fp32 input + bf16 output, 6 d each), attention (fp32 q
    and k in RoPE 4 d + 4 kv, rotated q 2 d, keys and values expanded to all heads 4 d, output and its
    copy 4 d) and the FFN (four d_ff tensors in bf16, 8 d_ff), all bytes."""
    extra_params = _params(6) - _params(3)
    per_block = 2 * 6 * D + (4 * D + 4 * KV + 2 * D + 4 * D + 4 * D) + 8 * F
    expected = 16 * extra_params / WORLD + 3 * per_block * MICRO * SEQ
    grown = (traces[6]["peak_gib"] - traces[3]["peak_gib"]) * GIB
    assert grown == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize("n", [3, 6])
def test_closed_form_within_ten_percent_of_the_trace(traces, n):
    t = traces[n]
    model = build_model(C.model_config_for(reshaped(t["cfg"]), "1b", "stem", "pretrain"), "meta")
    est = memory.estimate(model, memtrace.job(t["spec"], WORLD, "fsdp")[1])   # the plan the trace had
    assert est["total_gib"] == pytest.approx(t["peak_gib"], rel=0.10)


def test_check_names_the_job_peak_and_limit(traces):
    cfg = traces[3]["cfg"]
    (line,) = gate.check(reshaped(cfg), traces["cache"])       # cached: no second trace
    assert line == (f"training job 1b/stem/pretrain: traced peak {traces[3]['peak_gib']:.1f} GiB per GPU exceeds "
                    f"cluster.gpu_mem_gib = 1.0 GiB (world 8, micro-batch 4 x 4096); no smaller micro-batch, activation "
                    "checkpointing or host tables fit it: give it more GPUs (cluster.train.1b)")
    assert gate.check(reshaped({**cfg, "cluster": {**cfg["cluster"], "gpu_mem_gib": 72}}), traces["cache"]) == []
    assert gate.check(reshaped({**cfg, "device": "cpu"}), traces["cache"]) == []      # CPU jobs: nothing to check


def test_workflow_refuses_an_oversize_job_before_running_anything(traces):
    work = traces["cache"].parents[1]
    path = work / "small.yaml"
    # olmo_mix in one tokenize part, not the paper's 1,024: the same training job (its spec names the gathered
    # manifest only, so the trace cached above is its trace) in a DAG of 4 jobs instead of 1,028 to build
    cfg = traces[3]["cfg"]
    path.write_text(yaml.safe_dump({**cfg, "sources": {**cfg["sources"], "olmo_mix": {**cfg["sources"]["olmo_mix"],
                                                                                      "parts": 1}}}))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--configfile", str(path),
                        "--replace-workflow-config", "-d", str(work), "--cores", "1",
                        "results/paper/1b/stem/pretrain/summary.json"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert f"training job 1b/stem/pretrain: traced peak {traces[3]['peak_gib']:.1f} GiB per GPU exceeds " \
           "cluster.gpu_mem_gib = 1.0 GiB" in out
    assert not (work / "data").exists() and not (work / "results" / "paper").exists()   # nothing ran


def test_memory_command_prints_trace_closed_form_and_limit(traces, monkeypatch, capsys):
    import stem.__main__ as M
    monkeypatch.setattr(M, "experiment_config", lambda name: reshaped(traces[3]["cfg"]))
    with pytest.raises(SystemExit) as e:
        M.main(["memory", "--experiment", "paper", "--cache", str(traces["cache"])])
    assert e.value.code == 2                           # the job exceeds the (tiny) limit
    out = capsys.readouterr()
    line = [x for x in out.out.splitlines() if x.startswith("1b/stem/pretrain:")]
    assert len(line) == 1 and f"traced {traces[3]['peak_gib']:5.1f} GiB, closed form " in line[0]
    assert line[0].endswith("limit 1.0 GiB  EXCEEDS THE LIMIT") and "1 job(s) exceed" in out.err


def test_hashmoe_traces_with_balanced_experts(tmp_path):
    """Hash-MoE's per-expert token counts are data (bincount + tolist): the tracer gives each expert its
    balanced share. The traced step holds at least the sharded fp32 weights, gradients and AdamW moments."""
    cfg = yaml.safe_load((REPO / "config" / "paper.yaml").read_text())
    cfg["archs"]["350m"]["n_layers"] = 3
    spec = C.train_spec(reshaped(cfg), "350m", "hashmoe", "pretrain")
    r = memtrace.traced([memtrace.job(spec, WORLD, "fsdp")], tmp_path, workers=1)[0]
    from stem.models.spec import ModelConfig
    n = sum(p.numel() for p in build_model(ModelConfig.from_dict(spec["model"]), "meta").parameters())
    assert r["peak_gib"] * GIB > 16 * n / WORLD


def test_sparse_table_update_traces_replicated_tables_and_their_moments(traces):
    """With table_update sparse the table (layer 2, V x d_ff) is replicated: this rank holds all of its weights,
    both moments and (added by the trace: outside FSDP the tracker does not see it) its gradient, not 1/8."""
    table = V * F / GIB                    # the table, in GiB per byte of each entry
    d, s = traces[3]["parts_gib"], traces["sparse"]["parts_gib"]
    assert s["OptState"] - d["OptState"] == pytest.approx(8 * table * 7 / 8, rel=1e-3)
    assert d["Sharded Param"] - s["Sharded Param"] == pytest.approx(4 * table / 8, rel=1e-6)   # not sharded now...
    assert s["Temp"] - d["Temp"] == pytest.approx(4 * table, rel=1e-3)    # ...but whole (outside FSDP's categories)
    assert s["Replicated table grad"] == pytest.approx(4 * table, rel=1e-6) and "Replicated table grad" not in d
    # the peak grows by the 7/8 of the weights, of both moments and of the gradient FSDP no longer shards away
    assert traces["sparse"]["peak_gib"] - traces[3]["peak_gib"] >= 4 * table * (7 / 8) * 4 * 0.999


def test_routed_moe_traces_and_the_closed_form_follows():
    """The routed MoE's assignments per expert are data too (top-k, bincount + tolist): traced with each expert's
    balanced share, 350M shapes with 3 layers (2 MoE layers of 1 shared + top-2 of 16 experts, 640 wide). The
    closed form counts its saved activations by hand (stem.train.memory's docstring): within 10 % of the trace."""
    cfg = yaml.safe_load((REPO / "config" / "paper.yaml").read_text())
    cfg["archs"]["350m"]["n_layers"] = 3
    cfg["variant_overrides"] = {"moe": {"moe_experts": 16, "moe_shared": 1, "moe_top_k": 2, "moe_d_ff": 640}}
    stage = cfg["stages"]["pretrain"]["350m"]
    stage["batch_size"] = stage["micro_batch"] * WORLD      # one micro-batch a rank: half the trace's time
    cfg = reshaped(cfg)
    spec = C.train_spec(cfg, "350m", "moe", "pretrain")
    spec, plan = memtrace.job(spec, WORLD)
    r = memtrace.trace(spec, plan)     # in this process (it holds no process group): no worker's start-up
    model = build_model(C.model_config_for(cfg, "350m", "moe", "pretrain"), "meta")
    n = sum(p.numel() for p in model.parameters())
    assert r["peak_gib"] * GIB > 16 * n / WORLD
    est = memory.estimate(model, plan)
    assert est["total_gib"] == pytest.approx(r["peak_gib"], rel=0.10)


def test_the_pre_run_check_covers_the_dags_sweep_points():
    """The onstart check (rules/train.smk) traces what the DAG trains, the sweeps' generated variants included,
    not only the experiment's matrix."""
    cfg = C.experiment.load(REPO / "config" / "paper.yaml")
    point = ("350m", "rho_0p9", "pretrain")
    assert gate.gpu_jobs(cfg, {point, ("1b", "stem", "pretrain")}) == [("1b", "stem", "pretrain"), point]
    assert point not in gate.gpu_jobs(cfg)                        # the matrix alone
    assert C.train_spec(cfg, *point)["model"]["dse"]["rows_per_head"] > 0   # a job spec the tracer takes


def test_the_trace_cache_is_keyed_on_the_code_the_trace_imports():
    """The cache key hashes every stem module the trace imports (found from the import statements, lazy ones
    included), so an edit on that path retraces without a hand-kept list."""
    files = {str(p.relative_to(REPO)) for p in memtrace._imported_sources()}
    assert {"stem/train/memtrace.py", "stem/train/step.py", "stem/train/distributed.py", "stem/train/plan.py",
            "stem/optim/adamw.py", "stem/optim/__init__.py", "stem/models/model.py", "stem/models/ffn.py",
            "stem/specs.py"} <= files
    assert "stem/train/loop.py" not in files and "stem/eval/run.py" not in files   # not on the trace's path
    spec, plan = memtrace.job(C.train_spec(reshaped(_small_paper_config(3, 1.0)), "1b", "stem", "pretrain"), WORLD)
    key = memtrace._trace_key(spec, plan, "code")
    assert memtrace._trace_key(spec, plan, "edited code") != key
    assert memtrace._trace_key(spec, ParallelPlan.of(spec.train, WORLD, "ddp"), "code") != key


def test_the_gate_fits_a_job_by_its_plan_and_names_the_option_that_fits(tmp_path):
    """cluster.fit_memory (issue 29, item 4): the plan picks a per-GPU micro-batch that fits the limit (the same
    global batch), the workflow's gate (memory.check) traces that one and passes; without it the gate refuses
    the job in one line naming its traced peak and the option that fits; with a limit nothing fits, the line
    says so. A tiny 3-layer STEM job on one GPU, traced for real (config/rehearsal.yaml's own jobs take minutes
    a trace: their fitted plans' closed forms are in tests/test_rehearsal.py)."""
    cfg = C.read_yaml(REPO / "config" / "tiny.yaml")
    cfg = {**cfg, "device": "cuda", "matrix": {"350m": {"variants": ["stem"], "stages": ["pretrain"]}},
           "archs": {"350m": {**cfg["archs"]["350m"], "n_layers": 3}},   # one STEM layer (layer 2)
           "cluster": {**cfg["cluster"], "train": {"350m": {"nodes": 1, "gpus_per_node": 1, "runtime": 30}}}}
    exp = reshaped(cfg)
    model = build_model(C.model_config_for(exp, "350m", "stem", "pretrain"), "meta")
    spec, plan = memtrace.job(C.train_spec(exp, "350m", "stem", "pretrain"), 1)
    by_micro = {m: memory.estimate(model, replace(plan, micro_batch=m, accum=16 // m))["total_gib"] for m in (16, 4)}
    limit = by_micro[4] * memory.FIT_MARGIN * 1.01          # micro-batch 4 fits, 8 and 16 do not
    assert by_micro[16] > limit and memory.estimate(model, replace(plan, micro_batch=8, accum=2))["total_gib"] * memory.FIT_MARGIN > limit
    fitted = {**cfg, "cluster": {**cfg["cluster"], "gpu_mem_gib": limit, "fit_memory": True}}
    spec_fit, run = memtrace.job(C.train_spec(reshaped(fitted), "350m", "stem", "pretrain"), 1)
    assert (run.micro_batch, run.accum, spec_fit.train.batch_size, spec_fit.train.fit_gib) == (4, 4, 16, limit)
    assert "the same global batch of 16 sequences" in memory.describe_fit(plan, run, 16)
    cache = tmp_path / "traces"   # traced in this process (one rank): no worker's start-up
    assert gate.check(reshaped(fitted), cache, workers=0) == []
    (t4,) = memtrace.traced([(spec_fit, run)], cache, workers=0)
    (line,) = gate.check(reshaped({**fitted, "cluster": {**fitted["cluster"], "fit_memory": False}}), cache, workers=0)
    (t16,) = memtrace.traced([(spec, plan)], cache, workers=0)
    assert line == (f"training job 350m/stem/pretrain: traced peak {t16['peak_gib']:.1f} GiB per GPU exceeds "
                    f"cluster.gpu_mem_gib = {limit} GiB (world 1, micro-batch 16 x 128); it fits with "
                    f"stages.pretrain.350m.micro_batch: 4 ({t4['peak_gib']:.1f} GiB traced)")
    (line,) = gate.check(reshaped({**fitted, "cluster": {**fitted["cluster"], "gpu_mem_gib": 1e-3}}), cache, workers=0)
    assert line.endswith("no smaller micro-batch, activation checkpointing or host tables fit it: give it more GPUs "
                         "(cluster.train.350m)")


def test_the_fit_takes_the_fastest_layout_that_fits():
    """Issue 42 goal 2: with a step-time model (stem.train.comms.fit_step_s) ``memory.fit`` takes, of the layouts
    within the limit, the fastest (the first of equals: least change), and the log line prints its modelled step
    and the least-change one's; a made-up model preferring activation checkpointing is followed (the check can
    fail)."""
    cfg = C.read_yaml(REPO / "config" / "tiny.yaml")
    cfg = {**cfg, "device": "cuda", "matrix": {"350m": {"variants": ["stem"], "stages": ["pretrain"]}},
           "archs": {"350m": {**cfg["archs"]["350m"], "n_layers": 3}},
           "cluster": {**cfg["cluster"], "train": {"350m": {"nodes": 1, "gpus_per_node": 1, "runtime": 30}}}}
    exp = reshaped(cfg)
    model = build_model(C.model_config_for(exp, "350m", "stem", "pretrain"), "meta")
    spec, plan = memtrace.job(C.train_spec(exp, "350m", "stem", "pretrain"), 1)
    tables = memtrace.row_shardable(model)
    step_s = comms.fit_step_s(model, plan.seq_len, 1, True)
    first = memory.fit(model, plan, 16, 1e9, tables)
    assert first == plan and memory.fit(model, plan, 16, 1e9, tables, step_s) == plan   # equals: least change
    ckpt = replace(plan, activation_checkpointing=True)
    assert step_s(ckpt) == pytest.approx(step_s(plan) * (1 + comms.CKPT_RECOMPUTE))
    likes_ckpt = memory.fit(model, plan, 16, 1e9, tables, lambda p: -p.activation_checkpointing - p.micro_batch)
    assert likes_ckpt.activation_checkpointing and likes_ckpt.micro_batch == 16
    line = memory.describe_fit(plan, likes_ckpt, 16, step_s, first)
    assert line.endswith(f"modelled step {step_s(likes_ckpt):.3g} s (the least change that fits: {step_s(plan):.3g} s)")
