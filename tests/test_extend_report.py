"""Extending the project (docs/extending.md): a toy FFN kind (tests/toy_ffn.py), a toy suite kind and a toy
report table and figure, all registered from the tests alone, run through the config check, accounting,
optimizer groups, the real training loop on 2 gloo ranks (the toy table sharded), the eval job, and the report
(tables, diff, figure, README, HTML, the workflow's file lists). (Registered in this process; tests/test_plugins.py
loads such entries from a config's ``plugins:`` in a fresh process, as Snakemake does.)"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import toy_ffn  # noqa: E402
from conftest import make_spec  # noqa: E402
from stem import config as C  # noqa: E402
from stem.config import experiment  # noqa: E402
from stem.report import registry  # noqa: E402
from stem.report import tables as T  # noqa: E402
from stem.report.results import Results, task_score  # noqa: E402

pytest.importorskip("lm_eval")
from stem.eval import run  # noqa: E402
from stem.eval import spec as ES  # noqa: E402

V, D, L, H, KV, F = 512, 32, 3, 2, 1, 48   # conftest.make_spec's 350m model
PAIRS = [["The capital of Sarland is", " Bondo."], ["One two three", " four five"]]
TABLE, FIGURE, SUITE = "toy_lookup", "toy_nll", "toy"


# ---- the toy suite kind: mean negative log-likelihood (nats) of each pair's continuation -----------------
def _resolve(exp, spec: dict) -> None:
    spec.setdefault("pairs_file", f"data/{exp.experiment}/toy_pairs.json")


def continuation_nll(lm, spec: dict, limit=None):
    from lm_eval.api.instance import Instance
    pairs = json.loads(Path(spec["pairs_file"]).read_text())[:limit]
    nll = [-lp for lp, _ in lm.loglikelihood([Instance("loglikelihood", {}, tuple(p), i) for i, p in enumerate(pairs)])]
    entry = {"metric": "nll", "value": sum(nll) / len(nll), "stderr": None, "n": len(pairs), "version": "toy-1"}
    return {"tasks": {SUITE: entry}, "groups": {}}, {"nll": nll}, "tests.toy"


# ---- the toy table (reported only: no paper CSV, not compared) and figure (reads files it names) ----------
def toy_table(exp: experiment.Experiment, res: Results) -> pd.DataFrame:
    stages = T.settings(exp).stages[TABLE]
    cells = []
    for scale in T.scales_with(exp, stages[0]):
        for v in T.ordered_variants(exp, exp.matrix[scale].variants):
            ev, stage = res.first_eval(scale, v, stages, SUITE)
            acct, _ = res.first_accounting(scale, v, stages)
            cells += [T.cell(TABLE, scale, v, "nll", task_score(ev, SUITE), f"{stage}/eval/toy.json", unit="nats"),
                      T.cell(TABLE, scale, v, "lookup_params", acct and acct["total_params"] - acct["active_params"],
                             "checkpoint accounting", unit="")]
    return T.frame(cells)


def toy_figure(cfg, res, ours, files):
    values = [json.loads(Path(p).read_text())["tasks"][SUITE]["value"] for p in files["toy_evals"]]
    fig, ax = plt.subplots()
    ax.bar(range(len(values)), values)
    return fig


@pytest.fixture
def toys():
    toy_ffn.register()
    ES.suite_kind("toy_nll", resolve=_resolve)(continuation_nll)
    registry.paper_table(TABLE, "Toy: continuation NLL and lookup parameters", stages=("pretrain",),
                         labels={"nll": "NLL (nats)", "lookup_params": "Lookup params"},
                         inputs=T.checkpoints_of(TABLE))(toy_table)
    registry.report_figure(FIGURE, "Toy: NLL per model", inputs=lambda cfg, evals: {
        "toy_evals": [p for p in evals if p.endswith(f"eval/{SUITE}.json")]})(toy_figure)
    yield
    toy_ffn.unregister()
    ES.SUITE_KINDS.remove("toy_nll")
    registry.TABLES.remove(TABLE)
    registry.FIGURES.remove(FIGURE)


WORKER = r'''
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import torch
from torch.distributed.tensor import DTensor
import toy_ffn
toy_ffn.register()   # every rank registers the kind, from the test's module
from stem.models.spec import ModelConfig
from stem.models.model import build_model
from stem.train import distributed
from stem.train.loop import train
spec = json.loads(open(sys.argv[2]).read())
ctx = distributed.setup(torch.device("cpu"))
model = build_model(ModelConfig.from_dict(spec["model"]), "cpu")
from stem.train.plan import ParallelPlan
distributed.parallelize(model, ctx, ParallelPlan(ctx.world, "fsdp", 1, ctx.world, 16))
bias = model.layers[2].ffn.bias.weight
shard = {"sharded": isinstance(bias, DTensor), "local_rows": bias.to_local().shape[0]}
train(spec, threads=1)
if ctx.rank == 0:
    json.dump(shard, open(sys.argv[3], "w"))
distributed.teardown(ctx)
'''


def _cfg() -> experiment.Experiment:
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg["archs"]["350m"].update(vocab_size=V, d_model=D, n_layers=L, n_heads=H, n_kv_heads=KV, d_ff=F, max_seq_len=256)
    cfg["tokenizer"]["350m"]["vocab_size"] = V
    cfg["matrix"] = {"350m": {"variants": ["stem"], "stages": ["pretrain"]}}
    cfg["variant_overrides"] = {"stem": {"ffn": toy_ffn.KIND}}   # STEM's placement (layer 2 of 3), the toy FFN
    cfg["eval"]["suites"][SUITE] = {"kind": "toy_nll"}
    cfg["eval"]["stages"] = {"pretrain": [SUITE]}
    del cfg["analysis"]   # no analyze stage: its report tables are empty, its figures say so
    del cfg["knowledge"]  # nor the reduced knowledge world (its points are training jobs of their own)
    return experiment.parse(cfg)


@torch.no_grad()
def _reference_nll(ckpt: Path, ctx: str, cont: str) -> float:
    """-log P(cont | ctx) from the checkpoint's weights and tokenizer directly (no lm-eval adapter)."""
    from stem.eval.lm import load_for_eval
    model, tok, _ = load_for_eval(str(ckpt), "cpu")
    c, whole = tok.encode_batch([ctx, ctx + cont])
    logp = torch.log_softmax(model(torch.tensor([whole[:-1]]))[0].float(), -1)
    return -sum(float(logp[i - 1, whole[i]]) for i in range(len(c), len(whole)))


def test_toy_kinds_and_table_from_training_to_the_report(toys, tiny_data, tmp_path, monkeypatch):
    from stem.models.accounting import accounting
    from stem.models.spec import ModelConfig
    from stem.models.model import build_model
    from stem.report import build as B
    from stem.report import figures
    from stem.report import workflow as RW
    from stem.optim import build_optimizer

    monkeypatch.chdir(tmp_path)   # the workflow's relative layout: results/, data/, reports/
    cfg = _cfg()                  # the config check accepts the registered FFN kind and suite kind
    stage_dir = Path(C.stage_dir("tiny", "350m", "stem", "pretrain"))
    spec = make_spec(tiny_data, stage_dir, variant="stem", steps=2, eval_interval=2, eval_batches=1,
                     checkpoint_interval=100)
    spec["model"] = json.loads(json.dumps(C.model_config_for(cfg, "350m", "stem").to_dict()))
    assert spec["model"]["ffn"] == ["dense", "dense", toy_ffn.KIND]

    # accounting and optimizer groups, by hand: the toy layer adds a V x D lookup table (not active)
    dense = 2 * V * D + D + L * (2 * D + 2 * D * D + 2 * D * (KV * D // H) + 3 * D * F)
    assert dense == 56032
    model = build_model(ModelConfig.from_dict(spec["model"]), "cpu")
    a = accounting(model)
    assert (a["total_params"], a["active_params"], a["sparse_layers"]) == (dense + V * D, dense, [2])
    groups = {g["name"]: g for g in build_optimizer(model, spec["optim"], lr=1e-3).param_groups}
    assert [id(p) for p in groups[toy_ffn.GROUP]["params"]] == [id(model.layers[2].ffn.bias.weight)]

    # the real training loop on 2 gloo ranks, the toy table its own shard unit
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "worker.py").write_text(WORKER)
    with socket.socket() as sock:   # two plain processes (torchrun's own start-up costs seconds on a busy machine)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, "worker.py", str(REPO), "spec.json", "shard.json"],
                              env={**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "RANK": str(r),
                                   "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(2)]
    out = [p.communicate(timeout=300)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(o[-4000:] for o in out)
    assert json.loads((tmp_path / "shard.json").read_text()) == {"sharded": True, "local_rows": V // 2}
    ckpt = stage_dir / "checkpoint"
    assert json.loads((ckpt / "accounting.json").read_text())["total_params"] == dense + V * D
    assert json.loads((stage_dir / "summary.json").read_text())["steps"] == 2
    from safetensors.torch import load_file
    bias = load_file(ckpt / "model.safetensors")["layers.2.ffn.bias.weight"]
    assert bias.shape == (V, D) and bias.abs().sum() > 0   # zero-initialised, then trained in its own group

    # the eval job through the toy suite kind
    (tmp_path / "data" / "tiny").mkdir(parents=True)
    (tmp_path / "data" / "tiny" / "toy_pairs.json").write_text(json.dumps(PAIRS))
    evals = ES.eval_targets(cfg)
    assert evals == [f"{stage_dir}/eval/toy.json"]
    run.evaluate(ckpt, ES.job_spec(cfg, "tiny", "350m", "stem", "pretrain", SUITE), out_json=evals[0])
    nll = sum(_reference_nll(ckpt, *p) for p in PAIRS) / len(PAIRS)
    assert json.loads(Path(evals[0]).read_text())["tasks"][SUITE]["value"] == pytest.approx(nll, abs=1e-4)

    # the report: the toy table beside the paper's (reported, not compared), its figure, the pages
    ours = B.write_tables(cfg, Results("tiny", "results"), "reports/tiny/tables")
    toy = T.wide(ours[TABLE])
    assert toy.to_dict("records") == [{"Scale": "350m", "Model": "STEM", "NLL (nats)": f"{nll:.2f}",
                                       "Lookup params": f"{V * D:,}"}]
    assert (pd.read_csv("reports/tiny/tables/toy_lookup.csv", dtype=str) == toy).all().all()
    assert "Toy: continuation NLL" in Path("reports/tiny/tables/toy_lookup.md").read_text()
    s, cells, dirs, cons, _ = B.run_diff(cfg, B.load_reproduced("reports/tiny/tables/reproduced.csv"))
    assert TABLE not in set(cells["table"]) and s["cells"] > 0
    B.write_diff(cfg, "reports/tiny/diff", s, cells, dirs, cons)
    files = RW.figure_inputs(cfg, evals, FIGURE)
    assert files == {"tables": "reports/tiny/tables/reproduced.csv", "toy_evals": evals}
    figures.save(figures.draw(FIGURE, cfg, None, ours, files), "reports/tiny/figures/toy_nll.png")
    readme, html = B.readme(cfg, "reports/tiny", [FIGURE]), B.html_report(cfg, "reports/tiny", [FIGURE])
    assert "### Toy: continuation NLL and lookup parameters" in readme
    assert f"| 350m | STEM | {nll:.2f} | 16,384 |" in readme
    assert "![toy_nll](figures/toy_nll.png)" in readme
    assert "### Angular spread" in readme and "no analysis results for this table yet" in readme
    assert f"<td>{nll:.2f}</td><td>16,384</td>" in html and 'src="data:image/png;base64,' in html
    outputs = RW.report_outputs("tiny")
    assert {"reports/tiny/tables/toy_lookup.tex", "reports/tiny/figures/toy_nll.pdf"} <= set(outputs)
    assert RW.table_inputs(cfg) == [str(ckpt)]   # the toy table's and Table 3's (the same checkpoint)


def test_report_stages_of_an_unknown_table_is_a_one_line_error():
    tiny = C.read_yaml(C.REPO / "config" / "tiny.yaml")

    def settings(report):   # the tiny config with this report: section (an untyped section, checked by settings)
        return T.settings(experiment.parse({**tiny, "report": report}))
    for name in ("tabel3", "table1"):
        with pytest.raises(ValueError, match=rf"^config: key 'report.stages.{name}': expected a table fed by training "
                                             rf"stages \(table3, table4, table5, table6, figure1b, dse, dse_long\), got '{name}'$"):
            settings({"stages": {name: ["pretrain"]}})
    bad = [({"tolerance": {"accuracy": -1}}, r"^config: key 'report.tolerance.accuracy': expected a number >= 0"),
           ({"spikes": {"window": "50"}}, r"^config: key 'report.spikes.window': expected an integer, got '50'$"),
           ({"stages": {"table3": "pretrain"}}, r"^config: key 'report.stages.table3': expected a non-empty list of "
                                                r"strings, got 'pretrain'$"),
           ({"stages": {"table3": []}}, r"^config: key 'report.stages.table3': expected a non-empty list of "
                                        r"strings, got \[\]$"),
           ({"stages": {"table3": ["pretrian"]}}, r"^config: key 'report.stages.table3': expected stages among")]
    for rep, message in bad:
        with pytest.raises(ValueError, match=message):
            settings(rep)
    spec = settings({"tolerance": {"roi": 0.5}, "stages": {"table5": ["extend"]}})
    assert spec.tolerance == {"accuracy": 1.0, "params": 0.01, "gflops": 0.01, "roi": 0.5, "other": 0.0}
    assert spec.stages["table5"] == ("extend",) and spec.stages["table3"] == ("pretrain",)
    assert (spec.spikes.window, spec.spikes.k) == (50, 6.0)


def test_a_table_or_figure_registers_once():
    with pytest.raises(ValueError, match="report table 'table3': already registered"):
        registry.paper_table("table3", "again")(toy_table)
    with pytest.raises(ValueError, match="report figure 'roi_by_scale': already registered"):
        registry.report_figure("roi_by_scale", "again")(toy_figure)
    with pytest.raises(ValueError, match="table 'x': compared / direction_checked needs the paper's cells"):
        registry.PaperTable("x", "X", toy_table, compared=True)
    for bad in ("reproduced", "Table 7", "t/7"):
        with pytest.raises(ValueError, match=f"^report table {bad!r}: expected a name of lower-case letters"):
            registry.paper_table(bad, "X")(toy_table)
    assert TABLE not in registry.tables() and FIGURE not in registry.figures()   # the toys did not leak
